"""`train_rl`: the GRPO loop as one async Flyte task, pure orchestration.

Per iteration, inside `flyte.group(f"iter-{i}")`:
    sample prompts -> generate (one task per prompt, fanned out) -> score each group as it lands
    -> (optionally top up with fresh prompts until enough groups are informative)
    -> GRPO step(s) -> (held-out evaluation every `eval_every`) -> checkpoint -> metrics and report.
The held-out evaluation also runs before the first iteration and after the last.

The task returns a `RunResult` (final adapter, metrics history, report, merged model) as Flyte
outputs and publishes the live report to its Flyte report tab. It writes no local files: in local
mode the CLI registers a `RunObserver` (`observe`) and writes the run folder as iterations land.

Run it with `python -m grpo_flyte --local` (this machine, Flyte local mode, the embedded model) or
without `--local` against the cluster in your Flyte config; `--help` lists every option.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import flyte
import flyte.report
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte import grpo, hub
from grpo_flyte.config import RunConfig
from grpo_flyte.data import sample_prompts, topup_prompts, train_eval_split
from grpo_flyte.envs import driver_env
from grpo_flyte.errors import is_not_retried, not_retried
from grpo_flyte.report_helpers import render_report, render_report_fragment
from grpo_flyte.reward import score_group, score_groups
from grpo_flyte.rollout import generate, generate_eval
from grpo_flyte.storage import as_payload, from_payload, located_path, portable_path, publish_dir, replica_cache, save_checkpoint
from grpo_flyte.tracking import Tracker, WandbRun, new_run_id
from grpo_flyte.trainer import init_adapter, merge_adapter, train_step
from grpo_flyte.types import (
    REPORT_FILE,
    AdapterRef,
    BestCompletion,
    EvalAnswer,
    EvalMetrics,
    Example,
    MetricsRow,
    Rollout,
    RunResult,
    ScoredGroup,
    TrainMetrics,
    TrainStepResult,
)

logger = logging.getLogger("grpo_flyte")

# Held-out questions per generate_eval task: spread over the warm pool, batched within a replica.
EVAL_CHUNK = 64
# Folders the driver reads (a large dataset file, the model it pushes to the Hub): one cache, so
# two users of it never remove each other's downloads.
_driver_dirs = replica_cache("driver", capacity=1)
# Held-out answers the report shows (spread over the evaluation's questions).
HELD_OUT_SHOWN = 6
REPORT_TITLE = "grpo_flyte: GRPO + LoRA"


class LoopState(BaseModel):
    """Everything needed to continue a run: saved to flyte.Checkpoint after every iteration."""

    iterations_done: int
    adapter: AdapterRef
    history: list[MetricsRow]
    best_completion: BestCompletion | None = None
    # The experiment-tracking run this loop logs to (kept so that a resumed run continues it).
    tracking_id: str = ""
    # A few answers of the latest held-out evaluation, for the report.
    held_out_sample: list[EvalAnswer] = []


class RunObserver(Protocol):
    """Sees a run's progress in this process (local mode). On a cluster nobody observes the
    driver pod; its report tab and outputs carry the same information."""

    def recorded(self, state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> None:
        """A checkpointed iteration (iteration 0: the evaluation before training) and its held-out answers."""

    def report(self, html: str) -> None:
        """The report, republished."""

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        """The held-out evaluation after `iteration` iterations (0: before training) has `answered`
        of its `total` questions answered and scored: 0 as it starts, `total` as it ends."""


_observers: list[RunObserver] = []


@contextlib.contextmanager
def observe(observer: RunObserver) -> Iterator[None]:
    """Let `observer` see every run of this process while the block runs."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def rollout_seed(seed: int, iteration: int, index: int) -> int:
    """The sampling seed of one group: a function of (run seed, iteration, prompt) only."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its normal-approximation 95% interval (1.96 standard errors)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.inf
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(n)


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


def iteration_metrics(config: RunConfig, scored: list[ScoredGroup], result: TrainStepResult, timings: dict[str, float]) -> TrainMetrics:
    parts = [p for sg in scored for p in sg.rewards]
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
        entropy=stats.entropy,
        grad_norm=stats.grad_norm,
        lr=stats.lr,
        completion_len_mean=statistics.fmean(lengths),
        completion_len_max=max(lengths),
        truncated_fraction=statistics.fmean(r.finish_reason == "length" for r in rollouts),
        **timings,
        generate_tokens_per_s=_per_second(sum(r.num_model_tokens for r in rollouts), timings["generate_s"]),
        score_tokens_per_s=_per_second(sum(lengths), sum(sg.score_s for sg in scored)),
        train_tokens_per_s=_per_second(stats.num_tokens, timings["train_s"]),
        **episode_metrics(rollouts),
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
        "model_tokens_mean": statistics.fmean(r.num_model_tokens for r, _ in episodes),
        "env_tokens_mean": statistics.fmean(len(r.completion_ids) - r.num_model_tokens for r, _ in episodes),
        "episode_ends": dict(collections.Counter(e.end for _, e in episodes)),
    }


def _episode_fields(rollout: Rollout) -> dict[str, Any]:
    episode = rollout.episode
    return {} if episode is None else {"tool_calls": episode.tool_calls, "turns": episode.turns}


def eval_episode_metrics(rollouts: list[Rollout]) -> dict[str, Any]:
    """Multi-turn held-out metrics: the share of episodes with a tool call (with its 95% interval)
    and the mean number of model turns ({} for single-turn answers)."""
    episodes = [r.episode for r in rollouts if r.episode is not None]
    if not episodes:
        return {}
    rate, ci = mean_ci95([float(e.tool_calls > 0) for e in episodes])
    return {"eval_tool_call_rate": rate, "eval_tool_call_rate_ci95": ci, "eval_turns_mean": statistics.fmean(e.model_turns for e in episodes)}


def best_completion(scored: list[ScoredGroup]) -> BestCompletion:
    sg, i = max(((sg, i) for sg in scored for i in range(len(sg.rewards))), key=lambda x: x[0].rewards[x[1]].reward)
    rollout = sg.group.rollouts[i]
    return BestCompletion(
        question=sg.group.example.question,
        answer=sg.group.example.answer,
        completion=rollout.text,
        reward=sg.rewards[i].reward,
        turns=rollout.episode.turns if rollout.episode else None,
    )


async def generate_and_score(
    generating: list[asyncio.Task], score: Callable[[Any], Awaitable[Any]]
) -> tuple[list[Any], float, float]:
    """Score each generate result the moment it lands; on any failure cancel everything in flight.

    Returns the scores in landing order, the seconds until the last generate task finished, and
    the scoring tail after it.
    """
    started = time.perf_counter()
    scoring: list[asyncio.Task] = []
    try:
        for next_result in asyncio.as_completed(generating):
            scoring.append(asyncio.create_task(score(await next_result)))
        generated = time.perf_counter()
        results = await asyncio.gather(*scoring)
    except BaseException:
        for task in generating + scoring:
            task.cancel()
        raise
    return results, generated - started, time.perf_counter() - generated


def _generate_parts(config: RunConfig) -> dict[str, Any]:
    """The config parts the generate tasks take."""
    return {"model": config.base, "engine": config.engine, "prompt": config.prompt, "sampling": config.sampling, "episode": config.episode}


def informative_group(sg: ScoredGroup, truncated: str) -> bool:
    """Whether the group's training rewards (after the truncation policy) differ."""
    return grpo.informative(grpo.training_rewards(sg.reward_values, sg.truncated, truncated))


async def run_iteration(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int
) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float]]:
    started = time.perf_counter()
    prompts = sample_prompts(dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter)
    scored: list[ScoredGroup] = []
    timings = {"generate_s": 0.0, "score_s": 0.0}  # score_s: the scoring tail after generation
    truncated = config.train.truncated
    for round_ in range(config.max_topup_rounds + 1):
        first = len(scored)
        generating = [
            asyncio.create_task(
                generate(
                    **_generate_parts(config),
                    base_model=base_model,
                    adapter=adapter,
                    example=ex,
                    index=first + i,
                    seed=rollout_seed(config.seed, iteration, first + i),
                )
            )
            for i, ex in enumerate(prompts)
        ]
        landed, gen_s, tail_s = await generate_and_score(generating, lambda group: score_group(config.scoring, config.sampling, group))
        scored.extend(landed)
        timings["generate_s"] += gen_s
        timings["score_s"] += tail_s
        missing = config.min_informative_groups - sum(informative_group(sg, truncated) for sg in scored)
        if missing <= 0 or round_ == config.max_topup_rounds:
            break
        prompts = topup_prompts(dataset, seed=config.seed, iteration=iteration, round_=round_, num=missing)
    scored.sort(key=lambda sg: sg.group.index)
    scored_at = time.perf_counter()
    inline, payload = await as_payload(scored, f"scored-{iteration + 1:04d}")
    result = await train_step(
        config.base, config.lora, config.train, config.sampling, base_model, adapter, inline, payload, total_iterations=config.iterations
    )
    finished = time.perf_counter()
    timings["train_s"] = finished - scored_at
    timings["iteration_s"] = finished - started
    return scored, result, timings


async def run_eval(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, questions: list[Example], iteration: int
) -> tuple[EvalMetrics, list[EvalAnswer]]:
    """Greedy answers to the held-out questions on the generate pool: metrics and per-question
    answers. Observers hear how many are answered as each chunk is scored (`iteration`: the
    iterations trained before it)."""
    started = time.perf_counter()
    answered = 0

    def tell(count: int) -> None:
        for observer in _observers:
            observer.evaluating(iteration, count, len(questions))

    async def score_chunk(groups: list[Any]) -> list[ScoredGroup]:
        nonlocal answered
        chunk = await score_groups(config.scoring, config.sampling, groups)
        answered += len(groups)
        tell(answered)
        return chunk

    tell(0)
    generating = [
        asyncio.create_task(
            generate_eval(**_generate_parts(config), base_model=base_model, adapter=adapter, examples=questions[i : i + EVAL_CHUNK], first_index=i)
        )
        for i in range(0, len(questions), EVAL_CHUNK)
    ]
    landed, _, _ = await generate_and_score(generating, score_chunk)
    scored: list[ScoredGroup] = sorted((sg for chunk in landed for sg in chunk), key=lambda sg: sg.group.index)
    answers = [
        EvalAnswer(
            question=sg.group.example.question,
            answer=sg.group.example.answer,
            completion=sg.group.rollouts[0].text,
            reward=sg.rewards[0].reward,
            correct=sg.rewards[0].correct,
            format=sg.rewards[0].format,
            scores=sg.rewards[0].scores,
            **_episode_fields(sg.group.rollouts[0]),
        )
        for sg in scored
    ]
    reward, reward_ci = mean_ci95([a.reward for a in answers])
    accuracy, accuracy_ci = mean_ci95([float(a.correct) for a in answers])
    means, errors = reward_means(config, scored)
    metrics = EvalMetrics(
        eval_reward=reward,
        eval_reward_ci95=reward_ci,
        eval_accuracy=accuracy,
        eval_accuracy_ci95=accuracy_ci,
        eval_format_rate=statistics.fmean(a.format for a in answers),
        eval_reward_means=means,
        eval_reward_errors=errors,
        eval_size=len(answers),
        eval_s=time.perf_counter() - started,
        **eval_episode_metrics([sg.group.rollouts[0] for sg in scored]),
    )
    return metrics, answers


def eval_due(config: RunConfig, iterations_done: int) -> bool:
    """Whether the held-out evaluation runs after this many iterations (0: before training)."""
    every, size = config.evaluation.eval_every, config.evaluation.eval_size
    if size == 0:
        return False
    if iterations_done in (0, config.iterations):
        return True
    return every > 0 and iterations_done % every == 0


async def publish_report(config: RunConfig, state: LoopState, status: str, message: str | None = None) -> str:
    """Render the report, put it in the task's report tab (a fragment: the tab is a page of its
    own), show the whole document to observers; returns the document."""
    parts = {
        "title": REPORT_TITLE,
        "status": status,
        "config": config.flat(),
        "history": [row.flat() for row in state.history],
        "best_completion": state.best_completion.model_dump() if state.best_completion else None,
        "held_out_answers": [answer.model_dump() for answer in state.held_out_sample],
        "message": message,
    }
    html = render_report(**parts)
    for observer in _observers:
        observer.report(html)
    if flyte.ctx():
        await flyte.report.replace.aio(render_report_fragment(**parts), do_flush=True)
    return html


def eta_seconds(config: RunConfig, history: list[MetricsRow], done: int) -> float | None:
    """Seconds the run still needs: the mean iteration time so far times the iterations left, plus
    the held-out evaluations still due at their mean time (None before the first iteration)."""
    times = [row.train.iteration_s for row in history if row.train]
    if not times:
        return None
    evals = [row.eval.eval_s for row in history if row.eval]
    due = sum(eval_due(config, i) for i in range(done + 1, config.iterations + 1))
    return statistics.fmean(times) * (config.iterations - done) + (statistics.fmean(evals) * due if evals else 0.0)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def progress_line(row: MetricsRow, total: int, eta_s: float | None = None) -> str:
    e, t = row.eval, row.train
    held_out = (
        f"held-out reward {e.eval_reward:.3f} +- {e.eval_reward_ci95:.3f}  acc {e.eval_accuracy:.1%}  "
        f"format {e.eval_format_rate:.1%}"
        + (f"  tool use {e.eval_tool_call_rate:.0%}" if e.eval_tool_call_rate is not None else "")
        + f"  (n={e.eval_size}, {e.eval_s:.1f}s)"
        if e
        else ""
    )
    if t is None:  # the evaluation before training
        return f"iter 0/{total}  {held_out}"
    # accuracy and format rate are shown anyway; other rewards and failed scores are added
    others = "".join(f"  {name} {mean:.3f}" for name, mean in t.reward_means.items() if name not in ("correct", "format"))
    errors = f"  reward errors {t.reward_errors}" if t.reward_errors else ""
    # multi-turn: turns per episode and the share that used a tool
    episodes = f"  turns {t.turns_mean:.1f}  tool use {t.tool_call_rate:.0%}" if t.turns_mean is not None else ""
    return (
        f"iter {row.iteration}/{total}  reward {t.mean_reward:.3f}  acc {t.accuracy:.1%}  "
        f"format {t.format_rate:.1%}{others}{errors}{episodes}  loss {t.loss:+.4f}  len {t.completion_len_mean:.0f}  "
        f"| generate {t.generate_s:.1f}s  score {t.score_s:.1f}s  train {t.train_s:.1f}s  "
        f"total {t.iteration_s:.1f}s" + (f"  | ETA {_clock(eta_s)}" if eta_s is not None and row.iteration < total else "")
        + (f"\n  {held_out}" if held_out else "")
    )


async def restore_state(resume_from: str | None) -> tuple[flyte.Checkpoint | None, LoopState | None]:
    """The checkpoint to save to, and the state saved by an earlier attempt or run, if any."""
    ctx = flyte.ctx()
    checkpoint = ctx.checkpoint if ctx else None
    if checkpoint is not None and resume_from:
        checkpoint = flyte.Checkpoint(checkpoint.remote_destination, resume_from)
    previous = await checkpoint.load() if checkpoint is not None else None
    if previous is None:
        return checkpoint, None
    payload = Path(previous).read_bytes()
    state = LoopState.model_validate_json(payload)
    # Re-save at once so that every later attempt sees it, even if this one dies before its first
    # iteration (the previous-checkpoint path always points at attempt 1: flyteorg/flyte#2894).
    await save_checkpoint(checkpoint, payload)
    return checkpoint, _with_adapter_path(state, located_path(state.adapter.dir.path))


def _with_adapter_path(state: LoopState, path: str) -> LoopState:
    adapter = state.adapter.model_copy(update={"dir": state.adapter.dir.model_copy(update={"path": path})})
    return state.model_copy(update={"adapter": adapter})


def checkpoint_payload(state: LoopState) -> bytes:
    """The state as saved: a local adapter path relative to the run's raw data folder, so that a
    moved or copied run folder resumes (`restore_state` joins it to the new folder)."""
    return _with_adapter_path(state, portable_path(state.adapter.dir.path)).model_dump_json().encode()


async def push_to_hub(config: RunConfig, state: LoopState, merged: Dir | None) -> str:
    """Upload the final adapter, or the merged model, with its model card (`hub.push_folder`).
    A failure fails the run after its last checkpoint: a resume (or the driver's retry) goes
    straight to the export and tries again."""
    folder = await _driver_dirs.get(merged if merged is not None else state.adapter.dir)
    card = hub.model_card(config, state.history, merged=merged is not None)
    return await asyncio.to_thread(hub.push_folder, folder, config.push_to_hub, card)


async def _report_dir(html: str, version: int) -> Dir:
    """The final report as a task output: a folder holding `report.html`, published like an adapter
    (locally it stays under the run's raw data; a temp folder would be gone once this returns).

    A Dir rather than a File: `File.from_local` requires `flyte.init()`, which a local run started
    with `flyte.with_runcontext(mode="local")` need not have called.
    """
    return await publish_dir(lambda out: (out / REPORT_FILE).write_text(html, encoding="utf-8"), f"v{version:04d}", folder="reports")


@driver_env.task(report=True, retries=2)
async def train_rl(
    config: RunConfig,
    base_model: Dir,
    examples: list[Example] | None = None,
    resume_from: str | None = None,
    examples_file: list[Dir] = [],  # noqa: B006 (Flyte copies inputs; an optional list would hide the content hash)
) -> RunResult:
    """Run GRPO for `config.iterations` iterations; returns the final adapter, metrics and report.

    `examples` overrides `config.data.dataset` (the CLI passes the rows of a dataset file this way,
    or, past Flyte's inline limit, as the folder `examples_file`: see `storage.as_payload`);
    `resume_from` is a checkpoint to continue from. A retried driver (a preempted pod) continues
    from its last checkpoint; bad input (a GrpoFlyteError here or in a task) is not retried.
    """
    try:
        if examples_file:
            examples = await from_payload(examples or [], examples_file, Example, _driver_dirs)
        return await _train_rl(config, base_model, examples, resume_from)
    except Exception as exc:
        if is_not_retried(exc):
            raise not_retried(exc) from exc
        raise


async def _train_rl(config: RunConfig, base_model: Dir, examples: list[Example] | None, resume_from: str | None) -> RunResult:
    dataset, held_out = train_eval_split(config, examples)
    checkpoint, state = await restore_state(resume_from)
    # The W&B run a cluster run's submitter chose (its id is in the run's W&B link); a resumed
    # loop keeps the id in its checkpoint.
    chosen = WandbRun.from_context(flyte.ctx().custom_context if flyte.ctx() else None)
    if state is None:
        adapter = await init_adapter(config.base, config.lora, config.seed, base_model)
        state = LoopState(iterations_done=0, adapter=adapter, history=[], tracking_id=chosen.id if chosen else new_run_id())
    else:
        logger.info("resuming after iteration %d (adapter v%d)", state.iterations_done, state.adapter.version)
    tracker = Tracker(config.wandb_project, state.tracking_id, config.flat(), entity=chosen.entity if chosen else None)

    async def record(new_state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> LoopState:
        """Checkpoint, then tell observers and trackers and republish the report."""
        if answers:
            new_state = new_state.model_copy(update={"held_out_sample": answers[:: max(1, len(answers) // HELD_OUT_SHOWN)][:HELD_OUT_SHOWN]})
        if checkpoint is not None:
            await save_checkpoint(checkpoint, checkpoint_payload(new_state))
        for observer in _observers:
            observer.recorded(new_state, row, answers)
        tracker.log(row.flat(), [answer.model_dump() for answer in answers] if answers else None)
        await publish_report(config, new_state, "running")
        logger.info(progress_line(row, config.iterations, eta_seconds(config, new_state.history, new_state.iterations_done)))
        return new_state

    try:
        if eval_due(config, 0) and not any(row.iteration == 0 for row in state.history):
            with flyte.group("eval-0"):
                metrics, answers = await run_eval(config, base_model, state.adapter, held_out, 0)
            row = MetricsRow(iteration=0, adapter_version=state.adapter.version, eval=metrics)
            state = await record(state.model_copy(update={"history": [row, *state.history]}), row, answers)
        while state.iterations_done < config.iterations:
            it = state.iterations_done
            answers = None
            with flyte.group(f"iter-{it + 1}"):
                scored, result, timings = await run_iteration(config, base_model, state.adapter, dataset, it)
                row = MetricsRow(
                    iteration=it + 1, adapter_version=result.adapter.version, train=iteration_metrics(config, scored, result, timings)
                )
                if eval_due(config, it + 1):
                    metrics, answers = await run_eval(config, base_model, result.adapter, held_out, it + 1)
                    row = row.model_copy(update={"eval": metrics})
            state = await record(
                LoopState(
                    iterations_done=it + 1,
                    adapter=result.adapter,
                    history=[*state.history, row],
                    best_completion=best_completion(scored),
                    tracking_id=state.tracking_id,
                    held_out_sample=state.held_out_sample,
                ),
                row,
                answers,
            )
        merged = None
        if config.export_merged:
            with flyte.group("export"):
                merged = await merge_adapter(base_model, state.adapter)
        if config.push_to_hub:
            with flyte.group("push"):
                await push_to_hub(config, state, merged)
    except Exception as exc:
        await publish_report(config, state, "failed", f"{type(exc).__name__}: {exc}")
        tracker.finish(failed=True)
        raise
    html = await publish_report(config, state, "complete")
    tracker.finish()
    return RunResult(adapter=state.adapter, history=state.history, report=await _report_dir(html, state.adapter.version), merged=merged)


if __name__ == "__main__":
    # `python -m grpo_flyte.driver` is the command line of `python -m grpo_flyte`; the CLI imports
    # this module, never the reverse.
    import runpy

    runpy.run_module("grpo_flyte", run_name="__main__", alter_sys=True)
