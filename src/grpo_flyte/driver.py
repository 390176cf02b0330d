"""`train_rl`: the GRPO loop as one async Flyte task, pure orchestration.

Per iteration, inside `flyte.group(f"iter-{i}")`:
    sample prompts -> generate (one task per prompt, fanned out) -> score each group as it lands
    -> (optionally top up with fresh prompts until enough groups are informative)
    -> GRPO step(s) -> (held-out evaluation every `eval_every`) -> the guard's verdict
    -> checkpoint -> metrics and report.
The held-out evaluation also runs before the first iteration and after the last. The guard
(grpo_flyte.guard) keeps the best adapter; on a collapse it warns, stops the run, or rolls back to
the best adapter at a lower learning rate; it stops a run whose evaluations stall.

The task returns a `RunResult` (final and best adapters, metrics history, report, merged model) as Flyte
outputs and publishes the live report to its Flyte report tab. It writes no local files: in local
mode the CLI registers a `RunObserver` (`observe`) and writes the run folder as iterations land.

Run it with `python -m grpo_flyte --local` (this machine, Flyte local mode, the embedded model) or
without `--local` against the cluster in your Flyte config; `--help` lists every option.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import flyte
import flyte.report
from flyte.io import Dir

from grpo_flyte import hub
from grpo_flyte.config import EngineConfig, RunConfig, eval_due
from grpo_flyte.data import sample_prompts, topup_prompts, train_eval_split
from grpo_flyte.decoding import sub_seed
from grpo_flyte.envs import driver_env
from grpo_flyte.errors import ConfigError, input_errors_not_retried
from grpo_flyte.guard import GuardState, best_summary, judge, question_values, resolve_metric, restore_from
from grpo_flyte.judge import judge_group
from grpo_flyte.judging import busy_seconds, with_judge
from grpo_flyte.loop_state import LoopState, checkpoint_payload, restore_state
from grpo_flyte.metrics import best_completion, eval_results, informative_group, iteration_metrics
from grpo_flyte.progress import eta_seconds, progress_line
from grpo_flyte.report_helpers import render_report, render_report_fragment
from grpo_flyte.reward import score_group, score_groups, start_reward_workers
from grpo_flyte.reward_fns import JUDGE_REWARD
from grpo_flyte.rollout import generate, generate_eval
from grpo_flyte.storage import as_payload, from_payload, publish_dir, replica_cache, save_checkpoint
from grpo_flyte.tracking import Tracker, WandbRun, new_run_id
from grpo_flyte.trainer import DISTRIBUTED_STEP, init_adapter, merge_adapter, train_step
from grpo_flyte.types import (
    REPORT_FILE,
    AdapterRef,
    EvalAnswer,
    EvalMetrics,
    Example,
    MetricsRow,
    RunResult,
    ScoredGroup,
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


async def generate_and_score(generating: list[asyncio.Task], score: Callable[[Any], Awaitable[Any]]) -> tuple[list[Any], float, float]:
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


def groups_scored_at_once(config: RunConfig) -> int:
    """The most groups the loop scores at once: a round's prompts (with --max-staleness, the
    batches ahead too), or the held-out evaluation's chunks."""
    eval_chunks = -(-config.evaluation.eval_size // EVAL_CHUNK)
    return max(config.prompts_per_iter * (config.max_staleness + 1), eval_chunks)


async def started(workers: asyncio.Task) -> None:
    """Wait for the reward workers' start; a failure is only logged: the first group that needs a
    worker starts it again and reports what stops it."""
    try:
        await workers
    except Exception as exc:  # noqa: BLE001 -- a head start only
        logger.warning("the reward workers did not start ahead of the first group (%s: %s)", type(exc).__name__, exc)


def engine_settings(config: RunConfig) -> EngineConfig:
    """The engine settings the generate and judge tasks get. Outside a cluster both engines live in
    this one process, on one GPU, and vLLM starts an engine only when its whole
    gpu_memory_utilization share of the GPU is still free (vllm/v1/worker/utils.py,
    request_memory): with the judge the two engines split `vllm_memory_fraction`, half each. On a
    cluster each pool has GPUs of its own."""
    ctx = flyte.ctx()
    if not config.judging or (ctx and ctx.mode != "local"):
        return config.engine
    return config.engine.model_copy(update={"vllm_memory_fraction": config.engine.vllm_memory_fraction / 2})


def _generate_parts(config: RunConfig) -> dict[str, Any]:
    """The config parts the generate tasks take."""
    return {
        "model": config.base,
        "engine": engine_settings(config),
        "prompt": config.prompt,
        "sampling": config.sampling,
        "episode": config.episode,
    }


def group_scorer(
    config: RunConfig, judge_model: Dir | None, judge_spans: list[tuple[float, float]]
) -> Callable[[Any], Awaitable[ScoredGroup]]:
    """What scores a generated group: score_group, and with the 'judge' reward judge_group beside
    it (on its own pool), the judge's scores added by weight. Each judge call's (start, end) is
    appended to `judge_spans`."""
    if not config.judging:
        return lambda group: score_group(config.scoring, config.sampling, group)

    async def judged(group: Any) -> Any:
        started = time.perf_counter()
        try:
            return await judge_group(config.judge, engine_settings(config), config.scoring, judge_model, group)
        finally:
            judge_spans.append((started, time.perf_counter()))

    async def score_and_judge(group: Any) -> ScoredGroup:
        scored, verdict = await asyncio.gather(score_group(config.scoring, config.sampling, group), judged(group))
        return with_judge(scored, verdict, config.scoring.rewards[JUDGE_REWARD])

    return score_and_judge


async def collect_batch(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int, judge_model: Dir | None = None
) -> tuple[list[ScoredGroup], dict[str, float]]:
    """Iteration `iteration`'s scored groups (0-based: the prompts of `iteration`), generated by
    `adapter`, topped up with fresh prompts until enough are informative; and the seconds of
    generation, of the scoring tail and (judge_s, with the 'judge' reward) of the judge."""
    prompts = sample_prompts(dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter)
    scored: list[ScoredGroup] = []
    timings = {"generate_s": 0.0, "score_s": 0.0}  # score_s: the scoring tail after generation
    judge_spans: list[tuple[float, float]] = []
    score = group_scorer(config, judge_model, judge_spans)
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
                    seed=sub_seed(config.seed, iteration, first + i),
                )
            )
            for i, ex in enumerate(prompts)
        ]
        landed, gen_s, tail_s = await generate_and_score(generating, score)
        scored.extend(landed)
        timings["generate_s"] += gen_s
        timings["score_s"] += tail_s
        missing = config.min_informative_groups - sum(informative_group(sg, truncated) for sg in scored)
        if missing <= 0 or round_ == config.max_topup_rounds:
            break
        prompts = topup_prompts(dataset, seed=config.seed, iteration=iteration, round_=round_, num=missing)
    scored.sort(key=lambda sg: sg.group.index)
    if config.judging:
        timings["judge_s"] = busy_seconds(judge_spans)
    return scored, timings


async def train_batch(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, scored: list[ScoredGroup], iteration: int
) -> TrainStepResult:
    """One GRPO step from `adapter` on the scored groups of `iteration` (0-based)."""
    inline, payload = await as_payload(scored, f"scored-{iteration + 1:04d}")
    args = (config.base, config.lora, config.train, config.sampling, base_model, adapter, inline, payload)
    if DISTRIBUTED_STEP is not None and flyte.ctx() and flyte.ctx().mode != "local":
        # several train GPUs configured (envs.train_dist_env), on a cluster: the data-parallel step (a sync task)
        return await DISTRIBUTED_STEP.aio(*args, total_iterations=config.iterations)
    return await train_step(*args, total_iterations=config.iterations)


async def run_iteration(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int, judge_model: Dir | None = None
) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float]]:
    """The synchronous iteration (max_staleness 0): generate and score with `adapter`, then train."""
    started = time.perf_counter()
    scored, timings = await collect_batch(config, base_model, adapter, dataset, iteration, judge_model)
    scored_at = time.perf_counter()
    result = await train_batch(config, base_model, adapter, scored, iteration)
    finished = time.perf_counter()
    timings["train_s"] = finished - scored_at
    timings["iteration_s"] = finished - started
    timings["batch_wait_s"] = scored_at - started
    return scored, result, timings


def generation_version(iteration: int, max_staleness: int) -> int:
    """The adapter version that generates iteration `iteration`'s batch (0-based) in a pipelined
    run: `max_staleness` versions before the one it trains (version `iteration`), or the first."""
    return max(0, iteration - max_staleness)


def fresh_groups(scored: list[ScoredGroup], trainer_version: int, max_staleness: int) -> tuple[list[ScoredGroup], int]:
    """The groups at most `max_staleness` versions older than the trainer's adapter, and how many
    were staler (never trained)."""
    fresh = [sg for sg in scored if trainer_version - sg.group.adapter_version <= max_staleness]
    return fresh, len(scored) - len(fresh)


class BatchesAhead:
    """A pipelined run (max_staleness K >= 1): while the trainer trains iteration i, the batches of
    iterations i+1..i+K are generated and scored, each by the adapter `generation_version` names.
    Every batch is a function of (seed, iteration, adapter version), so a resumed run that
    regenerates the batches its checkpoint lists in flight trains exactly what it would have."""

    def __init__(
        self,
        config: RunConfig,
        base_model: Dir,
        dataset: list[Example],
        adapters: list[AdapterRef],
        in_flight: dict[int, int],
        judge_model: Dir | None = None,
    ):
        self.config, self.base_model, self.dataset, self.judge_model = config, base_model, dataset, judge_model
        self.adapters = {a.version: a for a in adapters}
        self.versions = dict(in_flight)  # iteration -> generating version, recorded before the task starts
        self.tasks: dict[int, asyncio.Task] = {}

    def launch(self, done: int) -> None:
        """Start the batches of iterations done..done+K not started yet, each in the flyte.group of
        the iteration it trains (`_train_rl`'s `iter-{it + 1}`). A task keeps the group that was
        open when it was created, here the iteration being trained; the group shows the batch
        under its own iteration in the UI and names its actions, so a retried driver that starts
        a batch from another iteration's group still reuses what the first attempt generated."""
        k = self.config.max_staleness
        for it in range(done, min(done + k + 1, self.config.iterations)):
            if it not in self.tasks:
                version = self.versions.setdefault(it, generation_version(it, k))
                with flyte.group(f"iter-{it + 1}"):
                    self.tasks[it] = asyncio.create_task(
                        collect_batch(self.config, self.base_model, self.adapters[version], self.dataset, it, self.judge_model)
                    )

    async def iteration(self, adapter: AdapterRef, it: int) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float], int]:
        """Train iteration `it` from `adapter` on its batch, generated ahead; start the next batches
        the moment the new adapter exists. Groups staler than K are dropped and counted; with none
        left, the batch is generated again by `adapter`."""
        started = time.perf_counter()
        self.adapters[adapter.version] = adapter
        self.launch(it)
        scored, timings = await self.tasks.pop(it)
        scored, dropped = fresh_groups(scored, adapter.version, self.config.max_staleness)
        if not scored:
            scored, timings = await collect_batch(self.config, self.base_model, adapter, self.dataset, it, self.judge_model)
        scored_at = time.perf_counter()
        self.versions.pop(it)
        result = await train_batch(self.config, self.base_model, adapter, scored, it)
        finished = time.perf_counter()
        self.adapters = {v: a for v, a in self.adapters.items() if v >= result.adapter.version - self.config.max_staleness}
        self.adapters[result.adapter.version] = result.adapter
        self.launch(it + 1)
        timings.update(train_s=finished - scored_at, iteration_s=finished - started, batch_wait_s=scored_at - started)
        return scored, result, timings, dropped

    def restart(self, config: RunConfig, adapter: AdapterRef, done: int) -> None:
        """After a rollback: the batches in flight were generated by the adapters that collapsed.
        Drop them, and generate the next K + 1 from `adapter` (the best one restored, under the
        version the run is at); later batches follow the usual schedule from its successors."""
        self.cancel()
        self.config, self.tasks = config, {}
        self.adapters = {adapter.version: adapter}
        self.versions = {it: adapter.version for it in range(done, min(done + config.max_staleness + 1, config.iterations))}
        self.launch(done)

    def recent(self, current: int) -> list[AdapterRef]:
        """The adapters before version `current` that batches in flight may use (for the checkpoint)."""
        return [a for v, a in sorted(self.adapters.items()) if v < current]

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()


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
            generate_eval(
                **_generate_parts(config), base_model=base_model, adapter=adapter, examples=questions[i : i + EVAL_CHUNK], first_index=i
            )
        )
        for i in range(0, len(questions), EVAL_CHUNK)
    ]
    landed, _, _ = await generate_and_score(generating, score_chunk)
    scored: list[ScoredGroup] = sorted((sg for chunk in landed for sg in chunk), key=lambda sg: sg.group.index)
    return eval_results(config, scored, time.perf_counter() - started)


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


def exported(config: RunConfig, state: LoopState) -> tuple[AdapterRef, int]:
    """The adapter --push-to-hub and --export-merged take (--export-adapter), and its iteration:
    the best one (the final one when nothing was evaluated), or the final one."""
    best = state.guard.best
    if config.guard.export_adapter == "best" and best is not None:
        return best.adapter, best.iteration
    return state.adapter, state.iterations_done


def guarded(config: RunConfig, guard: GuardState) -> RunConfig:
    """The config the train steps get: the learning rate scaled by the rollbacks so far."""
    if guard.lr_scale == 1.0:
        return config
    train = config.train.model_copy(update={"learning_rate": config.train.learning_rate * guard.lr_scale})
    return config.model_copy(update={"train": train})


async def push_to_hub(config: RunConfig, state: LoopState, merged: Dir | None) -> str:
    """Upload the exported adapter (`exported`), or the merged model, with its model card
    (`hub.push_folder`). A failure fails the run after its last checkpoint: a resume (or the
    driver's retry) goes straight to the export and tries again."""
    adapter, iteration = exported(config, state)
    folder = await _driver_dirs.get(merged if merged is not None else adapter.dir)
    card = hub.model_card(config, state.history, merged=merged is not None, iteration=iteration)
    return await asyncio.to_thread(hub.push_folder, folder, config.push_to_hub, card)


async def _report_dir(html: str, version: int) -> Dir:
    """The final report as a task output: a folder holding `report.html`, published like an adapter
    (locally it stays under the run's raw data; a temp folder would be gone once this returns).

    A Dir rather than a File: `File.from_local` requires `flyte.init()`, which a local run started
    with `flyte.with_runcontext(mode="local")` need not have called.
    """
    folder, _ = await publish_dir(lambda out: (out / REPORT_FILE).write_text(html, encoding="utf-8"), f"v{version:04d}", folder="reports")
    return folder


@driver_env.task(report=True, retries=2)
async def train_rl(
    config: RunConfig,
    base_model: Dir,
    examples: list[Example] | None = None,
    resume_from: str | None = None,
    examples_file: list[Dir] = [],  # noqa: B006 (Flyte copies inputs; an optional list would hide the content hash)
    judge_model: Dir | None = None,
) -> RunResult:
    """Run GRPO for `config.iterations` iterations; returns the final adapter, metrics and report.

    `examples` overrides `config.data.dataset` (the CLI passes the rows of a dataset file this way,
    or, past Flyte's inline limit, as the folder `examples_file`: see `storage.as_payload`);
    `resume_from` is a checkpoint to continue from; `judge_model` is the judge's model folder (the
    'judge' reward). A retried driver (a preempted pod) continues
    from its last checkpoint; bad input (a GrpoFlyteError here or in a task) is not retried.
    """
    with input_errors_not_retried():
        if examples_file:
            examples = await from_payload(examples or [], examples_file, Example, _driver_dirs)
        return await _train_rl(config, base_model, examples, resume_from, judge_model)


async def _train_rl(
    config: RunConfig, base_model: Dir, examples: list[Example] | None, resume_from: str | None, judge_model: Dir | None = None
) -> RunResult:
    if config.judging and judge_model is None:
        raise ConfigError("rewards name 'judge' but train_rl got no judge_model folder; expected the judge model's Dir")
    # The reward workers the run will score with start now, beside the first task (a worker
    # imports math-verify, about a second of CPU), instead of inside its first iteration.
    workers = asyncio.create_task(start_reward_workers(groups_scored_at_once(config)))
    try:
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
    except BaseException:
        workers.cancel()
        raise
    await started(workers)
    tracker = Tracker(config.wandb_project, state.tracking_id, config.flat(), entity=chosen.entity if chosen else None)

    async def record(new_state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> LoopState:
        """Checkpoint, then tell observers and trackers and republish the report."""
        if answers:
            new_state = new_state.model_copy(
                update={"held_out_sample": answers[:: max(1, len(answers) // HELD_OUT_SHOWN)][:HELD_OUT_SHOWN]}
            )
        if checkpoint is not None:
            await save_checkpoint(checkpoint, checkpoint_payload(new_state))
        for observer in _observers:
            observer.recorded(new_state, row, answers)
        tracker.log(row.flat(), [answer.model_dump() for answer in answers] if answers else None)
        await publish_report(config, new_state, "running")
        logger.info(progress_line(row, config.iterations, eta_seconds(config, new_state.history, new_state.iterations_done)))
        return new_state

    if state.guard.metric is None:
        state = state.model_copy(
            update={"guard": state.guard.model_copy(update={"metric": resolve_metric(config.guard.select_by, held_out)})}
        )
    elif state.guard.stopped:
        logger.info("%s; nothing left to train", state.guard.stopped)

    def guarded_row(
        row: MetricsRow, answers: list[EvalAnswer] | None, adapter: AdapterRef, history: list[MetricsRow]
    ) -> tuple[MetricsRow, GuardState]:
        """The row with the guard's verdict on it, and the guard's next state."""
        values = question_values(answers, state.guard.metric) if answers is not None else None
        guard, verdict = judge(config.guard, state.guard, [*history, row], values, adapter, last=row.iteration >= config.iterations)
        return row.model_copy(update={"guard": verdict}), guard

    ahead = None
    if config.max_staleness:
        recent = [*state.recent_adapters, state.adapter]
        ahead = BatchesAhead(guarded(config, state.guard), base_model, dataset, recent, state.in_flight, judge_model)
        ahead.launch(state.iterations_done)  # generation starts now, beside the evaluation before training
    try:
        if eval_due(config, 0) and not any(row.iteration == 0 for row in state.history):
            with flyte.group("eval-0"):
                metrics, answers = await run_eval(config, base_model, state.adapter, held_out, 0)
            row, guard = guarded_row(
                MetricsRow(iteration=0, adapter_version=state.adapter.version, eval=metrics), answers, state.adapter, []
            )
            state = await record(state.model_copy(update={"history": [row, *state.history], "guard": guard}), row, answers)
        while state.iterations_done < config.iterations and state.guard.stopped is None:
            it = state.iterations_done
            answers = None
            dropped = 0
            with flyte.group(f"iter-{it + 1}"):
                if ahead is None:
                    step_config = guarded(config, state.guard)
                    scored, result, timings = await run_iteration(step_config, base_model, state.adapter, dataset, it, judge_model)
                else:
                    scored, result, timings, dropped = await ahead.iteration(state.adapter, it)
                row = MetricsRow(
                    iteration=it + 1,
                    adapter_version=result.adapter.version,
                    train=iteration_metrics(config, scored, result, timings, stale_dropped=dropped),
                )
                if eval_due(config, it + 1):
                    metrics, answers = await run_eval(config, base_model, result.adapter, held_out, it + 1)
                    row = row.model_copy(update={"eval": metrics})
            row, guard = guarded_row(row, answers, result.adapter, state.history)
            adapter = result.adapter
            if row.guard is not None and row.guard.guard_event == "rollback":
                adapter = restore_from(guard, result.adapter)
                if ahead is not None:
                    ahead.restart(guarded(config, guard), adapter, it + 1)
            state = await record(
                LoopState(
                    iterations_done=it + 1,
                    adapter=adapter,
                    history=[*state.history, row],
                    best_completion=best_completion(scored),
                    tracking_id=state.tracking_id,
                    held_out_sample=state.held_out_sample,
                    recent_adapters=ahead.recent(adapter.version) if ahead else [],
                    in_flight=dict(ahead.versions) if ahead else {},
                    guard=guard,
                ),
                row,
                answers,
            )
        merged = None
        if config.export_merged:
            with flyte.group("export"):
                merged = await merge_adapter(base_model, exported(config, state)[0])
        if config.push_to_hub:
            with flyte.group("push"):
                await push_to_hub(config, state, merged)
    except Exception as exc:
        await publish_report(config, state, "failed", f"{type(exc).__name__}: {exc}")
        tracker.finish(failed=True)
        raise
    finally:
        if ahead is not None:
            ahead.cancel()  # batches past the last iteration are never started; a failure leaves none running
    closing = [line for line in (state.guard.stopped, best_summary(state.history)) if line]
    html = await publish_report(config, state, "complete", "\n".join(closing) or None)
    tracker.finish()
    return RunResult(
        adapter=state.adapter,
        history=state.history,
        report=await _report_dir(html, state.adapter.version),
        merged=merged,
        best=state.guard.best.adapter if state.guard.best else None,
    )


if __name__ == "__main__":
    # `python -m grpo_flyte.driver` is the command line of `python -m grpo_flyte`; the CLI imports
    # this module, never the reverse.
    import runpy

    runpy.run_module("grpo_flyte", run_name="__main__", alter_sys=True)
