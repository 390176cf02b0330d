"""Unit tests for the driver's pure helpers: metrics, intervals, the evaluation schedule, progress."""

from __future__ import annotations

import math

import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig, eval_due
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.metrics import (
    completion_sample,
    eval_results,
    iteration_metrics,
    mean_ci95,
    memory_metrics,
    reward_means,
    wilson_interval,
)
from grpo_flyte.records import EvalMetrics, TrainMetrics
from grpo_flyte.reporting.progress import progress_line
from grpo_flyte.types import (
    AdapterRef,
    Episode,
    EpisodeTurn,
    Example,
    MemoryPeak,
    MetricsRow,
    RewardParts,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    StepStats,
    TrainStepResult,
)


def test_mean_ci95_hand_computed():
    # [1, 0, 1, 0]: mean 0.5, sample std sqrt(1/3), half-width 1.96 * sqrt(1/3) / sqrt(4)
    mean, half = mean_ci95([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5
    assert half == pytest.approx(1.96 * math.sqrt(1 / 3) / 2)
    assert mean_ci95([0.3, 0.3, 0.3]) == (pytest.approx(0.3), 0.0)
    assert mean_ci95([0.7]) == (0.7, None)  # one value says nothing about the spread: no interval


@pytest.mark.parametrize(
    ("p", "n", "lo", "hi"),
    [
        # 2 of 4: centre (0.5 + 0.4802) / 1.9604 = 0.5, half 0.99980 * sqrt(0.0625 + 0.060025) = 0.34996
        (0.5, 4, 0.15004, 0.84996),
        # 1 of 4: centre 0.7302 / 1.9604 = 0.37247, half 0.99980 * sqrt(0.046875 + 0.060025) = 0.32689
        # (the normal interval would be 0.25 +- 0.424: -0.174..0.674)
        (0.25, 4, 0.04558, 0.69936),
        # 0 of 10: centre 0.19208 / 1.38416 = half 1.41602 * 0.098 = 0.13877: 0..0.2775, not 0..0
        (0.0, 10, 0.0, 0.27753),
        # 1 of 1: centre 2.9208 / 4.8416 = 0.60327, half 0.40482 * 0.98 = 0.39673
        (1.0, 1, 0.20654, 1.0),
    ],
)
def test_wilson_interval_hand_computed(p, n, lo, hi):
    assert wilson_interval(p, n) == (pytest.approx(lo, abs=1e-4), pytest.approx(hi, abs=1e-4))


def test_wilson_interval_refuses_what_is_not_a_proportion():
    with pytest.raises(ValueError, match="n=0"):
        wilson_interval(0.5, 0)
    with pytest.raises(ValueError, match=r"p=1\.5"):
        wilson_interval(1.5, 3)


@pytest.mark.parametrize(
    ("eval_every", "eval_size", "due"),
    [
        (10, 100, [0, 10, 20, 25]),
        (0, 100, [0, 25]),  # before and after only
        (7, 100, [0, 7, 14, 21, 25]),
        (10, 0, []),  # no evaluation at all
    ],
)
def test_eval_due(eval_every, eval_size, due):
    config = RunConfig(iterations=25, eval_every=eval_every, eval_size=eval_size)
    assert [i for i in range(26) if eval_due(config, i)] == due


def _scored(index: int, rewards: list[float], finishes: list[str], lengths: list[int]) -> ScoredGroup:
    rollouts = [
        Rollout(completion_ids=list(range(n)), sampling_logprobs=[-1.0] * n, finish_reason=f, text="t")
        for n, f in zip(lengths, finishes, strict=False)
    ]
    group = RolloutGroup(
        index=index, example=Example(question="q", answer="1"), adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=1.0
    )
    parts = [
        RewardParts(
            reward=r, correct=r >= 1.0, format=r in (0.2, 1.2), scores={"correct": float(r >= 1.0), "format": float(r in (0.2, 1.2))}
        )
        for r in rewards
    ]
    return ScoredGroup(group=group, rewards=parts, score_s=0.5)


def test_iteration_metrics_hand_computed():
    config = RunConfig(group_size=2, prompts_per_iter=2, rewards={"correct": 1.0, "format": 0.2})
    scored = [
        _scored(0, [1.2, 0.0], ["stop", "length"], [4, 8]),  # informative
        _scored(1, [0.0, 0.0], ["stop", "stop"], [2, 6]),  # every completion scored alike
    ]
    result = TrainStepResult(
        adapter=AdapterRef(version=3, dir=Dir(path="/tmp/none")),
        num_rollouts=4,
        num_contributing=2,
        stats=StepStats(
            loss=0.5,
            grad_norm=2.0,
            num_updates=1,
            num_tokens=12,
            kl=0.01,
            clip_fraction=0.25,
            entropy=1.5,
            is_ratio_mean=1.01,
            is_ratio_max=1.9,
        ),
        train_s=3.0,
    )
    timings = {"generate_s": 10.0, "score_s": 0.5, "train_s": 3.0, "iteration_s": 14.0}
    row = MetricsRow(iteration=5, adapter_version=result.adapter.version, train=iteration_metrics(config, scored, result, timings)).flat()
    assert row["mean_reward"] == pytest.approx(1.2 / 4)
    assert row["accuracy"] == 0.25 and row["format_rate"] == 0.25
    assert row["frac_zero_std_groups"] == 0.5
    assert row["truncated_fraction"] == 0.25
    assert row["completion_len_mean"] == 5.0 and row["completion_len_max"] == 8
    assert row["generate_tokens_per_s"] == pytest.approx(20 / 10.0)
    assert row["score_tokens_per_s"] == pytest.approx(20 / 1.0)  # two groups, 0.5 s each
    assert row["train_tokens_per_s"] == pytest.approx(12 / 3.0)
    assert (row["kl"], row["clip_fraction"], row["is_ratio_max"], row["adapter_version"]) == (0.01, 0.25, 1.9, 3)
    assert (row["reward/correct"], row["reward/format"], row["reward_errors"]) == (0.25, 0.25, 0)


def test_memory_metrics_take_each_stages_largest_peak_and_the_drivers():
    scored = [_scored(i, [0.0, 1.0], ["stop", "stop"], [1, 1]) for i in range(3)]
    generated = [MemoryPeak(rss_gb=2.5, gpu_gb=6.0, gpu_allocated_gb=4.0), MemoryPeak(rss_gb=2.75, gpu_gb=5.5, gpu_allocated_gb=4.5), None]
    scored = [
        sg.model_copy(update={"group": sg.group.model_copy(update={"memory": peak}), "memory": MemoryPeak(rss_gb=0.25 + i)})
        for i, (sg, peak) in enumerate(zip(scored, generated, strict=True))
    ]
    result = TrainStepResult(
        adapter=AdapterRef(version=1, dir=Dir(path="/tmp/none")),
        num_rollouts=6,
        num_contributing=6,
        stats=StepStats(),
        train_s=1.0,
        memory=MemoryPeak(rss_gb=3.0, gpu_gb=9.0, gpu_allocated_gb=7.0),
    )
    row = MetricsRow(iteration=1, adapter_version=1, memory=memory_metrics(MemoryPeak(rss_gb=4.0), scored, result))
    assert row.flat() == {
        "iteration": 1,
        "adapter_version": 1,
        "peak_rss_gb": 4.0,
        "generate_peak_rss_gb": 2.75,  # the largest of the generate calls that reported one
        "generate_peak_gpu_gb": 6.0,  # each figure's own largest: reserved and allocated may come from different calls
        "generate_peak_gpu_allocated_gb": 4.5,
        "score_peak_rss_gb": 2.25,
        "train_peak_rss_gb": 3.0,
        "train_peak_gpu_gb": 9.0,
        "train_peak_gpu_allocated_gb": 7.0,
    }
    assert MetricsRow.from_flat(row.flat()) == row
    # iteration 0's row: the driver's alone; a CPU run's: no GPU keys in metrics.jsonl
    alone = MetricsRow(iteration=0, adapter_version=0, memory=memory_metrics(MemoryPeak(rss_gb=1.5))).flat()
    assert alone == {"iteration": 0, "adapter_version": 0, "peak_rss_gb": 1.5}
    cpu = memory_metrics(MemoryPeak(rss_gb=1.5), [scored[2]], result.model_copy(update={"memory": MemoryPeak(rss_gb=1.0)}))
    assert "train_peak_gpu_gb" not in MetricsRow(iteration=1, adapter_version=1, memory=cpu).flat()
    assert cpu.generate_peak_rss_gb is None and cpu.score_peak_rss_gb == 2.25


def test_reward_means_per_named_reward_and_failures():
    config = RunConfig(rewards={"correct": 1.0, "tags": 0.5}, prompts_per_iter=1)
    group = _scored(0, [0.0, 0.0], ["stop", "stop"], [1, 1]).group
    parts = [
        RewardParts(reward=1.5, correct=True, format=False, scores={"correct": 1.0, "tags": 1.0}),
        RewardParts(reward=0.0, correct=False, format=False, scores={"correct": 0.0, "tags": 0.0}, errors=["tags"]),
    ]
    means, errors = reward_means(config, [ScoredGroup(group=group, rewards=parts)])
    assert (means, errors) == ({"correct": 0.5, "tags": 0.5}, 1)


def test_iteration_metrics_count_zero_std_after_truncation_policy():
    # the only nonzero reward is a truncated completion's: floored to 0 the group is uninformative
    scored = [_scored(0, [0.2, 0.0], ["length", "stop"], [8, 2])]
    result = TrainStepResult(
        adapter=AdapterRef(version=1, dir=Dir(path="/tmp/none")), num_rollouts=2, num_contributing=0, stats=StepStats(), train_s=0.0
    )
    timings = {"generate_s": 1.0, "score_s": 0.0, "train_s": 0.0, "iteration_s": 1.0}
    assert iteration_metrics(RunConfig(truncated="min_reward", prompts_per_iter=1), scored, result, timings).frac_zero_std_groups == 1.0
    assert iteration_metrics(RunConfig(truncated="keep", prompts_per_iter=1), scored, result, timings).frac_zero_std_groups == 0.0


def _train_metrics(**values) -> TrainMetrics:
    """A TrainMetrics with every field 0 (reward_means and episode_ends empty) but those given."""
    zeros = {name: ({} if name in ("reward_means", "episode_ends") else 0) for name in TrainMetrics.model_fields}
    return TrainMetrics(**{**zeros, **values})


def test_progress_lines_for_evaluation_and_iteration_rows():
    evaluated = EvalMetrics(
        eval_reward=0.25,
        eval_reward_ci95=0.05,
        eval_accuracy=0.2,
        eval_accuracy_ci95=0.1,
        eval_format_rate=0.5,
        eval_reward_means={},
        eval_reward_errors=0,
        eval_size=100,
        eval_s=12.0,
    )
    line = progress_line(MetricsRow(iteration=0, adapter_version=0, eval=evaluated), 20)
    assert line.startswith("iter 0/20") and "held-out reward 0.250 +- 0.050" in line and "n=100" in line
    trained = _train_metrics(
        mean_reward=0.5,
        accuracy=0.25,
        format_rate=1.0,
        loss=-0.01,
        completion_len_mean=12.0,
        generate_s=1.0,
        score_s=0.1,
        train_s=2.0,
        iteration_s=3.5,
    )
    row = MetricsRow(iteration=3, adapter_version=3, train=trained)
    assert "held-out" not in progress_line(row, 20)
    both = progress_line(row.model_copy(update={"eval": evaluated}), 20)
    assert both.startswith("iter 3/20") and "held-out reward 0.250" in both
    # rewards beyond accuracy and format, and failed scores, join the line
    custom = trained.model_copy(update={"reward_means": {"correct": 0.25, "mod:fn": 0.75}, "reward_errors": 2})
    line = progress_line(MetricsRow(iteration=3, adapter_version=3, train=custom), 20)
    assert "mod:fn 0.750  reward errors 2" in line and "correct 0.250" not in line
    # multi-turn: failed steps and turns cut by --max-new-tokens (which end their episodes) are said
    episodes = trained.model_copy(update={"turns_mean": 1.0, "tool_call_rate": 0.0, "tool_errors": 3, "episode_ends": {"turn_tokens": 5}})
    line = progress_line(MetricsRow(iteration=3, adapter_version=3, train=episodes), 20)
    assert "turns 1.0  tool use 0%  tool errors 3  cut at --max-new-tokens 5" in line
    one = evaluated.model_copy(update={"eval_reward_ci95": None, "eval_accuracy_ci95": None, "eval_size": 1, "eval_tool_errors": 2})
    assert "held-out reward 0.250 (one question: no interval)" in (
        line := progress_line(MetricsRow(iteration=0, adapter_version=0, eval=one), 20)
    )
    assert "tool errors 2" in line


def test_a_metrics_row_flattens_to_the_metrics_file_keys():
    evaluated = EvalMetrics(
        eval_reward=0.25,
        eval_reward_ci95=0.05,
        eval_accuracy=0.2,
        eval_accuracy_ci95=0.1,
        eval_format_rate=0.5,
        eval_reward_means={"correct": 0.2},
        eval_reward_errors=1,
        eval_size=100,
        eval_s=12.0,
    )
    row = MetricsRow(iteration=2, adapter_version=2, train=_train_metrics(reward_means={"correct": 0.5, "m:f": 0.1}), eval=evaluated)
    flat = row.flat()
    assert (flat["iteration"], flat["adapter_version"]) == (2, 2)
    assert (flat["reward/correct"], flat["reward/m:f"], flat["eval_reward/correct"], flat["eval_reward_errors"]) == (0.5, 0.1, 0.2, 1)
    assert "reward_means" not in flat and "eval_reward_means" not in flat
    assert set(MetricsRow(iteration=0, adapter_version=0, eval=evaluated).flat()) == set(flat) - set(TrainMetrics.model_fields) - {
        "reward/correct",
        "reward/m:f",
    }


def test_the_eta_counts_iterations_and_evaluations_still_due():
    from grpo_flyte.reporting.progress import eta_seconds

    config = RunConfig(iterations=10, eval_every=5)
    held_out = EvalMetrics(eval_reward=0.2, eval_reward_ci95=0.1, eval_accuracy=0.2, eval_accuracy_ci95=0.1,
                           eval_format_rate=0.5, eval_reward_means={}, eval_reward_errors=0, eval_size=10, eval_s=4.0)  # fmt: skip
    history = [
        MetricsRow(iteration=0, adapter_version=0, eval=held_out),
        MetricsRow(iteration=1, adapter_version=1, train=_train_metrics(iteration_s=10.0)),
        MetricsRow(iteration=2, adapter_version=2, train=_train_metrics(iteration_s=20.0)),
    ]
    # 8 iterations left at 15 s, and the evaluations after iterations 5 and 10 at 4 s
    assert eta_seconds(config, history, 2) == 8 * 15 + 2 * 4
    assert eta_seconds(config, history[:1], 0) is None  # nothing timed yet
    line = progress_line(history[2], 10, 128.0)
    assert line.endswith("| ETA 2m08s")
    assert "ETA" not in progress_line(history[2].model_copy(update={"iteration": 10}), 10, 0.0)  # the last one


@pytest.mark.parametrize(("mode", "distributed"), [("remote", True), ("local", False)])
def test_with_several_train_gpus_a_cluster_run_trains_on_the_distributed_step(monkeypatch, mode, distributed):
    """envs.train_dist_env declared (GRPO_FLYTE_TRAIN_GPU=A100:4): on a cluster the driver calls
    train_step_distributed (a sync plugin task, through .aio); a local run keeps train_step."""
    import asyncio
    import types

    from grpo_flyte.loop import batches

    calls = []

    async def record(name, *args, **kwargs):
        calls.append((name, args[2], kwargs))
        return name

    async def local_step(*args, **kwargs):
        return await record("train_step", *args, **kwargs)

    fake = types.SimpleNamespace(aio=lambda *a, **k: record("train_step_distributed", *a, **k))
    monkeypatch.setattr(batches, "DISTRIBUTED_STEP", fake)
    monkeypatch.setattr(batches, "train_step", local_step)
    monkeypatch.setattr(batches.flyte, "ctx", lambda: types.SimpleNamespace(mode=mode))
    config = RunConfig(iterations=3)
    adapter = batches.AdapterRef(version=0, dir=Dir(path="/nowhere"))
    got = asyncio.run(batches.train_batch(config, Dir(path="/base"), adapter, [], 0))
    assert got == ("train_step_distributed" if distributed else "train_step")
    assert calls == [(got, config.train, {"total_iterations": 3, "reward_weights": dict(config.scoring.rewards)})]


def test_the_completion_sample_keeps_groups_in_prompt_order_with_their_advantages():
    """Group 1's rewards [1, 0, 0]: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3),
    so advantages (2/3) / sqrt(1/3) = 2/sqrt(3) and -(1/3) / sqrt(1/3) = -1/sqrt(3) (eps 1e-4 aside);
    group 0's rewards are equal: advantages 0."""
    scored = [_scored(1, [1.0, 0.0, 0.0], ["stop", "stop", "length"], [2, 2, 2]), _scored(0, [0.2, 0.2, 0.2], ["stop"] * 3, [1, 1, 1])]
    config = RunConfig(group_size=3, prompts_per_iter=2, truncated="keep", log_completions=True)
    sample = completion_sample(config, scored, iteration=7)
    assert [(c.iteration, c.group, c.reward) for c in sample] == [(7, 0, 0.2)] * 3 + [(7, 1, 1.0), (7, 1, 0.0), (7, 1, 0.0)]
    assert [c.advantage for c in sample[:3]] == [0.0, 0.0, 0.0]
    root3 = math.sqrt(3)
    assert [c.advantage for c in sample[3:]] == pytest.approx([2 / root3, -1 / root3, -1 / root3], rel=1e-3)
    assert sample[5].finish_reason == "length" and sample[3].scores == {"correct": 1.0, "format": 0.0}
    # the first N of them, whole groups first; one per prompt with log_unique_prompts
    assert [(c.group, c.reward) for c in completion_sample(config.model_copy(update={"num_completions_to_log": 4}), scored, 7)] == [
        (0, 0.2), (0, 0.2), (0, 0.2), (1, 1.0),
    ]  # fmt: skip
    unique = completion_sample(config.model_copy(update={"log_unique_prompts": True}), scored, 7)
    assert [(c.group, c.reward) for c in unique] == [(0, 0.2), (1, 1.0)]
    assert unique[1].advantage == pytest.approx(2 / root3, rel=1e-3)  # still the whole group's advantage
    # the truncation policy as the train step applies it: min_reward floors the cut completion at min(0, min r) = 0
    floored = completion_sample(config.model_copy(update={"train": config.train.model_copy(update={"truncated": "min_reward"})}), scored, 7)
    assert [c.advantage for c in floored[3:]] == [c.advantage for c in sample[3:]]  # its reward was 0 already


def _held_out_group(index: int, rewards: list[tuple[float, bool, bool, dict[str, float]]]) -> ScoredGroup:
    """One held-out question's scored group: a completion per (reward, correct, format, scores)."""
    rollouts = [
        Rollout(completion_ids=[5, 2], sampling_logprobs=[-1.0, -1.0], finish_reason="stop", text=f"c{j}") for j in range(len(rewards))
    ]
    group = RolloutGroup(
        index=index, example=Example(question=f"q{index}", answer="7"), adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0
    )
    parts = [RewardParts(reward=r, correct=c, format=f, scores=s) for r, c, f, s in rewards]
    return ScoredGroup(group=group, rewards=parts)


def test_a_greedy_evaluation_keeps_one_answer_per_question_as_before():
    config = RunConfig(rewards={"correct": 1.0})
    scored = [
        _held_out_group(0, [(1.0, True, True, {"correct": 1.0})]),
        _held_out_group(1, [(0.0, False, True, {"correct": 0.0})]),
    ]
    metrics, answers = eval_results(config, scored, eval_s=2.0)
    assert config.evaluation.num_generations_eval is None
    # the dump a run folder and a checkpoint hold: no `completions` key, correctness a bool
    assert answers[0].model_dump(exclude_none=True) == {
        "question": "q0", "answer": "7", "completion": "c0", "reward": 1.0, "correct": True, "format": True, "scores": {"correct": 1.0},
    }  # fmt: skip
    assert "completions" not in answers[1].model_dump() and answers[1].correct is False
    assert (metrics.eval_reward, metrics.eval_accuracy, metrics.eval_format_rate) == (0.5, 0.5, 1.0)
    assert metrics.eval_accuracy_ci95 == pytest.approx(1.96 * math.sqrt(0.5) / math.sqrt(2))
    # the normal interval 0.5 +- 0.98 leaves [0, 1]; the proportion's (Wilson, 1 of 2) does not:
    # centre (0.5 + 0.9604) / 2.9208 = 0.5, half 1.96 / 2.9208 * sqrt(0.125 + 0.2401) = 0.40547
    assert (metrics.eval_accuracy_lo, metrics.eval_accuracy_hi) == (pytest.approx(0.09453, abs=1e-4), pytest.approx(0.90547, abs=1e-4))


def test_a_sampled_evaluation_scores_each_question_by_its_means():
    config = RunConfig(rewards={"correct": 1.0, "format": 0.5}, num_generations_eval=3)
    scored = [
        # question 0: rewards 1.5, 0.5, 0.0 (mean 2/3); 1 of 3 correct; 2 of 3 in format
        _held_out_group(
            0,
            [(1.5, True, True, {"correct": 1.0, "format": 1.0}), (0.5, False, True, {"correct": 0.0, "format": 1.0}), (0.0, False, False, {"correct": 0.0, "format": 0.0})],
        ),
        # question 1: rewards 1.5, 1.5, 1.0 (mean 4/3); 3 of 3 correct; 2 of 3 in format
        _held_out_group(
            1,
            [(1.5, True, True, {"correct": 1.0, "format": 1.0}), (1.5, True, True, {"correct": 1.0, "format": 1.0}), (1.0, True, False, {"correct": 1.0, "format": 0.0})],
        ),
    ]  # fmt: skip
    metrics, answers = eval_results(config, scored, eval_s=2.0)
    first, second = answers
    assert first.completion == "c0" and [c.completion for c in first.completions] == ["c0", "c1", "c2"]
    assert [(c.reward, c.correct) for c in first.completions] == [(1.5, True), (0.5, False), (0.0, False)]
    assert (first.reward, first.correct, first.format) == (pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert first.scores == {"correct": pytest.approx(1 / 3), "format": pytest.approx(2 / 3)}
    assert (second.reward, second.correct) == (pytest.approx(4 / 3), 1.0)
    # the held-out figures: means over the questions of the questions' means, intervals over the questions
    assert metrics.eval_reward == pytest.approx(1.0) and metrics.eval_accuracy == pytest.approx(2 / 3)
    # per-question accuracies 1/3 and 1, rewards 2/3 and 4/3: each pair 2/3 apart, so a sample sd of
    # (2/3) / sqrt(2) and a half-width of 1.96 * sd / sqrt(2) = 1.96 / 3 (over 2 questions, not 6 completions)
    assert metrics.eval_accuracy_ci95 == pytest.approx(1.96 / 3)
    assert metrics.eval_reward_ci95 == pytest.approx(1.96 / 3)
    assert metrics.eval_format_rate == pytest.approx(2 / 3) and metrics.eval_size == 2
    assert metrics.eval_reward_means == {"correct": pytest.approx(2 / 3), "format": pytest.approx(2 / 3)}
    # a checkpoint keeps them: the answer round-trips through its JSON
    assert EvalAnswer.model_validate_json(first.model_dump_json()) == first


def test_sampled_episodes_give_each_question_its_share_with_a_tool_call():
    """Multi-turn with num_generations_eval 2: the tool-call rate is each question's share of episodes
    with a tool call, averaged over the questions (its interval over them); turns are per episode."""

    def episode_group(index: int, calls: list[int]) -> ScoredGroup:
        turn = EpisodeTurn(role="model", text="t", num_tokens=1)
        rollouts = [
            Rollout(
                completion_ids=[5],
                sampling_logprobs=[-1.0],
                finish_reason="stop",
                text="t",
                episode=Episode(turns=[turn] * (1 + c), tool_calls=c),
            )
            for c in calls
        ]
        group = RolloutGroup(
            index=index, example=Example(question="q", answer="1"), adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0
        )
        return ScoredGroup(group=group, rewards=[RewardParts(reward=0.0, correct=False, format=False)] * len(calls))

    metrics, answers = eval_results(RunConfig(num_generations_eval=2), [episode_group(0, [1, 0]), episode_group(1, [2, 3])], eval_s=1.0)
    # shares 1/2 and 1: mean 3/4, sample sd (1/2) / sqrt(2), half-width 1.96 * sd / sqrt(2) = 0.49
    assert metrics.eval_tool_call_rate == pytest.approx(0.75) and metrics.eval_tool_call_rate_ci95 == pytest.approx(0.49)
    assert metrics.eval_turns_mean == pytest.approx((2 + 1 + 3 + 4) / 4)
    assert answers[1].tool_calls == 2 and [c.tool_calls for c in answers[1].completions] == [2, 3]
