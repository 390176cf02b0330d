"""This module computes what an iteration and a held-out evaluation measured: the metrics rows'
numbers, from the scored groups and the train step's result (pure: no Flyte, no torch).
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

from grpo_flyte.config.run import RunConfig
from grpo_flyte.learning import grpo
from grpo_flyte.learning.update import advantages
from grpo_flyte.loop.answers import BestCompletion, CompletionSample, EvalAnswer, EvalCompletion
from grpo_flyte.records import POOLS, EvalMetrics, MemoryMetrics, StageCost, TrainMetrics
from grpo_flyte.reporting.cost import Accelerators, accelerator_hours, pool_dollars
from grpo_flyte.scoring.judging import SHOWN_CHARS, judge_metrics
from grpo_flyte.types import MemoryPeak, MetricsRow, Rollout, ScoredGroup, TrainStepResult


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """The mean and the half-width of its normal-approximation 95% interval (1.96 standard errors);
    None when one value gives no interval (an infinite one would not survive JSON)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, None
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(n)


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion `p` measured over `n` trials (95% with z = 1.96):

        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

    returned as (centre - half, centre + half), inside [0, 1] for every p in [0, 1] (the normal
    interval p +- z sqrt(p (1 - p) / n) is not: 1 of 4 correct gives -0.17..0.67), and not empty at
    p = 0 or 1 (0 of 10 gives 0..0.278). For the held-out accuracy with num_generations_eval, p is
    the mean over the questions of each question's share correct and n the number of questions:
    the share of a question varies less than a 0/1 answer, so the interval is wider than it need be,
    never narrower."""
    if n < 1:
        raise ValueError(f"a proportion's interval needs n >= 1 trials, got n={n}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a proportion's interval needs p in [0, 1], got p={p}")
    z2 = z * z
    denominator = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def reward_means(config: RunConfig, scored: list[ScoredGroup]) -> tuple[dict[str, float], int]:
    """Each weighted reward's mean (unweighted) score over the completions it applies to (a reward
    that returned None for all of them has none), and how many (completion, reward) scores failed
    and counted as 0 (on_reward_error='zero')."""
    parts = [p for sg in scored for p in sg.rewards]
    applied = {name: [p.scores[name] for p in parts if name in p.scores] for name in config.scoring.rewards}
    means = {name: statistics.fmean(values) for name, values in applied.items() if values}
    return means, sum(len(p.errors) for p in parts)


def informative_group(sg: ScoredGroup, truncated: str) -> bool:
    """Whether the group's training rewards (after the truncation policy) differ."""
    return grpo.informative(grpo.training_rewards(sg.reward_values, sg.truncated, truncated))


def iteration_metrics(
    config: RunConfig, scored: list[ScoredGroup], result: TrainStepResult, timings: dict[str, float], stale_dropped: int = 0
) -> TrainMetrics:
    """`timings`: the stage seconds (TrainMetrics' `*_s` fields); `stale_dropped`: groups left out as
    staler than max_staleness. A group's staleness counts the versions between the adapter that
    generated it and the one the step started from."""
    parts = [p for sg in scored for p in sg.rewards]
    staleness = [result.adapter.version - 1 - sg.group.adapter_version for sg in scored]
    rollouts = [r for sg in scored for r in sg.group.rollouts]
    lengths = [len(r.completion_ids) for r in rollouts]
    stats = result.stats
    means, errors = reward_means(config, scored)
    return TrainMetrics(
        mean_reward=statistics.fmean(p.reward for p in parts),
        accuracy=statistics.fmean(p.correct for p in parts),
        format_rate=statistics.fmean(p.format for p in parts),
        reward_means=means,
        reward_errors=errors,
        loss=stats.loss,
        num_rollouts=len(parts),
        num_groups=len(scored),
        topup_groups=len(scored) - config.prompts_per_iter,
        num_contributing=result.num_contributing,
        frac_zero_std_groups=sum(not informative_group(sg, config.train.truncated) for sg in scored) / len(scored),
        num_updates=stats.num_updates,
        num_tokens=stats.num_tokens,
        kl=stats.kl,
        clip_fraction=stats.clip_fraction,
        is_ratio_mean=stats.is_ratio_mean,
        is_ratio_max=stats.is_ratio_max,
        is_ess=stats.is_ess,
        is_clipped_fraction=stats.is_clipped_fraction,
        entropy=stats.entropy,
        # the options' metrics only where the option is on: other runs' rows stay as they were
        entropy_coef=stats.entropy_coef if config.train.entropy_bonus else None,
        off_policy_masked_fraction=stats.off_policy_masked_fraction if config.train.off_policy_mask_threshold is not None else None,
        vespo_phi_mean=stats.vespo_phi_mean,
        grad_norm=stats.grad_norm,
        lr=stats.lr,
        train_world_size=stats.world_size,
        train_restore_s=stats.restore_s,
        completion_len_mean=statistics.fmean(lengths),
        completion_len_max=max(lengths),
        truncated_fraction=statistics.fmean(r.finish_reason == "length" for r in rollouts),
        **{stage: seconds for stage, seconds in timings.items() if stage != "judge_s"},
        **judge_metrics(scored, timings.get("judge_s", 0.0)),
        generate_tokens_per_s=_per_second(sum(r.num_model_tokens for r in rollouts), timings["generate_s"]),
        score_tokens_per_s=_per_second(sum(lengths), sum(sg.score_s for sg in scored)),
        train_tokens_per_s=_per_second(stats.num_tokens, timings["train_s"]),
        **episode_metrics(rollouts),
        staleness_mean=statistics.fmean(staleness),
        staleness_max=max(staleness),
        stale_dropped=stale_dropped,
    )


def _largest(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def memory_metrics(driver: MemoryPeak, scored: list[ScoredGroup] = (), result: TrainStepResult | None = None) -> MemoryMetrics:
    """A row's peak memory: the driver's process tree over the row's stretch, and the largest peak
    each stage's tasks reported for their processes (over the generate calls, over the score_group
    calls, the train step); None where no task of the stage reported one."""
    generated = [sg.group.memory for sg in scored if sg.group.memory is not None]
    trained = result.memory if result is not None else None
    return MemoryMetrics(
        peak_rss_gb=driver.rss_gb,
        generate_peak_rss_gb=_largest([m.rss_gb for m in generated]),
        generate_peak_gpu_gb=_largest([m.gpu_gb for m in generated]),
        generate_peak_gpu_allocated_gb=_largest([m.gpu_allocated_gb for m in generated]),
        score_peak_rss_gb=_largest([sg.memory.rss_gb for sg in scored if sg.memory is not None]),
        train_peak_rss_gb=trained.rss_gb if trained else None,
        train_peak_gpu_gb=trained.gpu_gb if trained else None,
        train_peak_gpu_allocated_gb=trained.gpu_allocated_gb if trained else None,
    )


def episode_metrics(rollouts: list[Rollout]) -> dict[str, Any]:
    """The multi-turn metrics of a batch of episodes ({} for single-turn completions)."""
    episodes = [(r, r.episode) for r in rollouts if r.episode is not None]
    if not episodes:
        return {}
    return {
        "turns_mean": statistics.fmean(e.model_turns for _, e in episodes),
        "tool_calls_mean": statistics.fmean(e.tool_calls for _, e in episodes),
        "tool_call_rate": statistics.fmean(e.tool_calls > 0 for _, e in episodes),
        "tool_errors": sum(e.tool_errors for _, e in episodes),
        "tool_calls": sum(e.tool_calls for _, e in episodes),
        "tool_malformed": sum(e.tool_malformed for _, e in episodes),
        "model_tokens_mean": statistics.fmean(r.num_model_tokens for r, _ in episodes),
        "env_tokens_mean": statistics.fmean(len(r.completion_ids) - r.num_model_tokens for r, _ in episodes),
        "episode_ends": dict(collections.Counter(e.end for _, e in episodes)),
    }


def _episode_fields(rollout: Rollout) -> dict[str, Any]:
    episode = rollout.episode
    return {} if episode is None else {"tool_calls": episode.tool_calls, "turns": episode.turns}


def eval_episode_metrics(questions: list[list[Rollout]]) -> dict[str, Any]:
    """Multi-turn held-out metrics from each question's episodes: the share of episodes with a tool
    call (each question's share, then their mean and its 95% interval over the questions), the mean
    number of model turns per episode and the RL environment's steps that failed ({} for
    single-turn answers)."""
    per_question = [[r.episode for r in rollouts if r.episode is not None] for rollouts in questions]
    episodes = [e for question in per_question for e in question]
    if not episodes:
        return {}
    rate, ci = mean_ci95([statistics.fmean(e.tool_calls > 0 for e in question) for question in per_question if question])
    return {
        "eval_tool_call_rate": rate,
        "eval_tool_call_rate_ci95": ci,
        "eval_turns_mean": statistics.fmean(e.model_turns for e in episodes),
        "eval_tool_errors": sum(e.tool_errors for e in episodes),
    }


def best_completion(scored: list[ScoredGroup]) -> BestCompletion:
    sg, i = max(((sg, i) for sg in scored for i in range(len(sg.rewards))), key=lambda x: x[0].rewards[x[1]].reward)
    rollout = sg.group.rollouts[i]
    judged = sg.judge is not None
    return BestCompletion(
        question=sg.group.example.question,
        answer=sg.group.example.answer,
        completion=rollout.text,
        reward=sg.rewards[i].reward,
        turns=rollout.episode.turns if rollout.episode else None,
        judge_scores=list(sg.judge.scores) if judged else None,
        group_texts=[r.text[:SHOWN_CHARS] for r in sg.group.rollouts] if judged else None,
        index=i if judged else None,
    )


def completion_sample(config: RunConfig, scored: list[ScoredGroup], iteration: int) -> list[CompletionSample]:
    """The completions --log-completions keeps of an iteration: the groups in prompt order, each
    group's completions in order (its first only, with --log-unique-prompts), the first
    --num-completions-to-log of them (all when unset), each with its advantage in the train step."""
    sample = []
    ordered = sorted(scored, key=lambda s: s.group.index)
    for sg, group_advantages in zip(ordered, advantages(scored, config.train, dict(config.scoring.rewards)), strict=True):
        group = zip(sg.group.rollouts, sg.rewards, group_advantages, strict=True)
        for rollout, parts, advantage in list(group)[: 1 if config.log_unique_prompts else None]:
            sample.append(
                CompletionSample(
                    iteration=iteration,
                    group=sg.group.index,
                    question=sg.group.example.question,
                    answer=sg.group.example.answer,
                    completion=rollout.text,
                    reward=parts.reward,
                    advantage=advantage,
                    scores=parts.scores,
                    finish_reason=rollout.finish_reason,
                )
            )
    return sample[: config.num_completions_to_log]


def question_answer(sg: ScoredGroup, sampled: bool) -> EvalAnswer:
    """One held-out question's answer: its greedy completion and that completion's scores, or
    (`sampled`, num_generations_eval) its n completions, each with its scores, and the question's
    means over them: reward = (1/n) sum_j r_j, correct = (1/n) sum_j [completion j correct] (the
    share correct), format likewise, and each named score its mean over the completions it applies
    to. `completion` (and an episode's turns and tool calls) is the first completion's."""
    first, example = sg.group.rollouts[0], sg.group.example
    about: dict[str, Any] = {"question": example.question, "answer": example.answer, "completion": first.text, **_episode_fields(first)}
    if not sampled:
        parts = sg.rewards[0]
        return EvalAnswer(**about, reward=parts.reward, correct=parts.correct, format=parts.format, scores=parts.scores)
    completions = [
        EvalCompletion(completion=r.text, reward=p.reward, correct=p.correct, format=p.format, scores=p.scores, **_episode_fields(r))
        for r, p in zip(sg.group.rollouts, sg.rewards, strict=True)
    ]
    names = dict.fromkeys(name for p in sg.rewards for name in p.scores)
    return EvalAnswer(
        **about,
        reward=statistics.fmean(p.reward for p in sg.rewards),
        correct=statistics.fmean(float(p.correct) for p in sg.rewards),
        format=statistics.fmean(float(p.format) for p in sg.rewards),
        scores={name: statistics.fmean(p.scores[name] for p in sg.rewards if name in p.scores) for name in names},
        completions=completions,
    )


def eval_results(config: RunConfig, scored: list[ScoredGroup], eval_s: float) -> tuple[EvalMetrics, list[EvalAnswer]]:
    """A held-out evaluation's metrics and its answers, one per question (`question_answer`): the
    held-out reward and accuracy are the means over the questions of each question's value (its
    greedy answer's, or its mean over num_generations_eval completions), with 95% intervals over
    the questions."""
    answers = [question_answer(sg, config.evaluation.num_generations_eval is not None) for sg in scored]
    reward, reward_ci = mean_ci95([a.reward for a in answers])
    accuracy, accuracy_ci = mean_ci95([float(a.correct) for a in answers])
    accuracy_lo, accuracy_hi = wilson_interval(min(1.0, max(0.0, accuracy)), len(answers))
    means, errors = reward_means(config, scored)
    metrics = EvalMetrics(
        eval_reward=reward,
        eval_reward_ci95=reward_ci,
        eval_accuracy=accuracy,
        eval_accuracy_ci95=accuracy_ci,
        eval_accuracy_lo=accuracy_lo,
        eval_accuracy_hi=accuracy_hi,
        eval_format_rate=statistics.fmean(a.format for a in answers),
        eval_reward_means=means,
        eval_reward_errors=errors,
        eval_size=len(answers),
        eval_s=eval_s,
        **eval_episode_metrics([sg.group.rollouts for sg in scored]),
    )
    return metrics, answers


def stage_cost(
    row: MetricsRow, wall_s: float, accelerators: Accelerators | None = None, prices: dict[str, float] | None = None
) -> StageCost:
    """Where the row's `wall_s` went (records.StageCost).

    What the loop waited on: the batch (batch_wait_s), its last part counted as scoring (the scoring
    tail, score_s, at most the whole wait: generation ahead of training may have hidden the rest)
    and the rest as generation; the train step (train_s); the evaluation (eval_s); the driver, what
    is left: driver_s = wall_s - (generate + score + train + eval), at least 0. What each pool was
    busy: generate = generate_s + eval_s, score = score_busy_s, judge = judge_s, reward_model =
    reward_model_s, train = train_s, driver = driver_s. With `accelerators` (a cluster run):
    accelerator_hours = sum over pools of busy x accelerators / 3600, dollars = sum of each pool's
    hours x its type's price (None when a type has no price)."""
    t, e = row.train, row.eval
    wait = dict.fromkeys(("generate", "score", "train"), 0.0)
    busy = dict.fromkeys(POOLS, 0.0)
    eval_s = e.eval_s if e is not None else 0.0
    if t is not None:
        scoring = min(t.score_s, t.batch_wait_s)
        wait.update(generate=t.batch_wait_s - scoring, score=scoring, train=t.train_s)
        busy.update(generate=t.generate_s, score=t.score_busy_s or 0.0, judge=t.judge_s or 0.0, reward_model=t.reward_model_s or 0.0)
        busy["train"] = t.train_s
    busy["generate"] += eval_s
    busy["driver"] = driver_s = max(0.0, wall_s - sum(wait.values()) - eval_s)
    hours = dollars = None
    if accelerators is not None:
        per_pool = accelerator_hours(busy, accelerators)
        hours = sum(per_pool.values())
        priced = pool_dollars(per_pool, accelerators, prices or {})
        dollars = None if None in priced.values() else sum(v for v in priced.values() if v is not None)
    return StageCost(
        wall_s=wall_s,
        driver_s=driver_s,
        **{f"wait_{stage}_s": seconds for stage, seconds in wait.items()},
        wait_eval_s=eval_s,
        **{f"busy_{pool}_s": seconds for pool, seconds in busy.items()},
        accelerator_hours=hours,
        dollars=dollars,
    )
