"""`train_rl` runs the GRPO loop as one async Flyte task, pure orchestration.

Per iteration, inside `flyte.group(f"iter-{i}")`:
    sample prompts -> generate (one task per prompt, fanned out) -> score each group as it lands
    -> (optionally top up with fresh prompts until enough groups are informative)
    -> GRPO step(s) -> (held-out evaluation every `eval_every`) -> the guard's assessment
    -> checkpoint -> metrics and report.
The held-out evaluation also runs before the first iteration and after the last. The guard
(grpo_flyte.loop.guard) keeps the best adapter; on a collapse it warns, stops the run, or rolls back to
the best adapter at a lower learning rate; it stops a run whose evaluations stall.

The task returns a `RunResult` (final and best adapters, metrics history, report, merged model) as Flyte
outputs and publishes the live report to its Flyte report tab. It writes no local files: in local
mode the CLI registers a `RunObserver` (`loop.observers.observe`) and writes the run folder as
iterations land. The loop's parts are plain functions: an iteration's batch and train step
(`loop.batches`), generation ahead of training (`loop.pipeline`), the held-out evaluation
(`loop.evaluation`), the report (`loop.publishing`), the merged model and the push to the Hub, each
checked on the held-out set first (`loop.shipping`).

Run it with `python -m grpo_flyte --local` (this machine, Flyte local mode, the embedded model) or
without `--local` against the cluster in your Flyte config; `--help` lists every option.
"""

from __future__ import annotations

import asyncio
import logging
import time

import flyte
from flyte.io import Dir

from grpo_flyte.config.constants import LIST_PRICES
from grpo_flyte.config.run import RunConfig, eval_due
from grpo_flyte.data import train_eval_split
from grpo_flyte.envs import driver_env
from grpo_flyte.errors import ConfigError, input_errors_not_retried
from grpo_flyte.loop import lockstep, observers, pruning
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.batches import ScoringModels, run_iteration
from grpo_flyte.loop.evaluation import EVAL_CHUNK, run_eval
from grpo_flyte.loop.guard import GuardState, assess, best_summary, question_values, resolve_metric, restore_from
from grpo_flyte.loop.metrics import best_completion, completion_sample, iteration_metrics, memory_metrics, stage_cost
from grpo_flyte.loop.pipeline import BatchesAhead
from grpo_flyte.loop.publishing import cluster_pools, publish_report, report_dir, unchosen_start
from grpo_flyte.loop.shipping import Shipped, ship, shipped_line
from grpo_flyte.loop.state import LoopState, checkpoint_payload, restore_state
from grpo_flyte.records import GuardRecord
from grpo_flyte.reporting.cost import prices_with_defaults
from grpo_flyte.reporting.progress import eta_seconds, progress_line
from grpo_flyte.reporting.trackers import Trackers
from grpo_flyte.reporting.tracking import WandbRun, new_run_id
from grpo_flyte.reward import start_reward_workers
from grpo_flyte.reward_fns import reward_model_ref
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.storage import from_payload, replica_cache, save_checkpoint
from grpo_flyte.trainer import init_adapter
from grpo_flyte.types import AdapterRef, Example, MetricsRow, RunResult

logger = logging.getLogger("grpo_flyte")

# Folders the driver reads (a large dataset file, the model it pushes to the Hub): one cache, so
# two users of it never remove each other's downloads.
_driver_dirs = replica_cache("driver", capacity=1)
# Held-out answers the report shows (spread over the evaluation's questions).
HELD_OUT_SHOWN = 6


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


def guarded(config: RunConfig, guard: GuardState) -> RunConfig:
    """The config the train steps get: the learning rate scaled by the rollbacks so far."""
    if guard.lr_scale == 1.0:
        return config
    train = config.train.model_copy(update={"learning_rate": config.train.learning_rate * guard.lr_scale})
    return config.model_copy(update={"train": train})


@driver_env.task(report=True, retries=2)
async def train_rl(
    config: RunConfig,
    base_model: Dir,
    examples: list[Example] | None = None,
    resume_from: str | None = None,
    examples_file: list[Dir] = [],  # noqa: B006 (Flyte copies inputs; an optional list would hide the content hash)
    judge_model: Dir | None = None,
    reward_models: dict[str, Dir] | None = None,
) -> RunResult:
    """Run GRPO for `config.iterations` iterations; returns the final adapter, metrics and report.

    `examples` overrides `config.data.dataset` (the CLI passes the rows of a dataset file this way,
    or, past Flyte's inline limit, as the folder `examples_file`: see `runtime.storage.as_payload`);
    `resume_from` is a checkpoint to continue from; `judge_model` is the judge's model folder (the
    'judge' reward); `reward_models` maps each reward model the rewards name (its Hub id or folder,
    without '@label') to its folder. A retried driver (a preempted pod) continues
    from its last checkpoint; bad input (a GrpoFlyteError here or in a task) is not retried.
    """
    with input_errors_not_retried("train_rl"):
        if examples_file:
            examples = await from_payload(examples or [], examples_file, Example, _driver_dirs)
        # the peak memory of this process's tree, from here to each row (the row's MemoryMetrics)
        with memory.span() as driver_memory:
            models = ScoringModels(judge_model, reward_models or {})
            return await _train_rl(config, base_model, examples, resume_from, models, driver_memory)


def pruned(row: MetricsRow, guard: GuardState, iteration: int, why: str) -> tuple[MetricsRow, GuardState]:
    """The row and the guard's state of a config its sweep stopped at `iteration` (loop.pruning): a
    stop, as the guard's early stop is (the best adapter kept, the checkpoint saying why)."""
    reason = f"stopped at iteration {iteration}: pruned by --sweep-prune: {why}"
    record = (row.guard or GuardRecord()).model_copy(update={"guard_event": "stop", "guard_signal": "sweep_prune", "guard_reason": reason})
    return row.model_copy(update={"guard": record}), guard.model_copy(update={"stopped": reason})


async def _train_rl(
    config: RunConfig,
    base_model: Dir,
    examples: list[Example] | None,
    resume_from: str | None,
    models: ScoringModels,
    driver_memory: memory.Span,
) -> RunResult:
    """The loop; `driver_memory`: the span each row's peak memory is read from (and restarted)."""
    clock = [observers.started_at(time.perf_counter())]  # when the last row was recorded (at first: the command's start)
    accelerators, prices = cluster_pools(), prices_with_defaults(config.prices, LIST_PRICES)

    def costed(row: MetricsRow) -> MetricsRow:
        """The row with where its wall clock went since the last row (records.StageCost)."""
        now = time.perf_counter()
        wall_s, clock[0] = now - clock[0], now
        return row.model_copy(update={"cost": stage_cost(row, wall_s, accelerators, prices)})

    models = models or ScoringModels()
    if config.judging and models.judge is None:
        raise ConfigError("rewards name 'judge' but train_rl got no judge_model folder; expected the judge model's Dir")
    missing = [name for name in config.scoring.model_rewards if reward_model_ref(name)[0] not in models.reward_models]
    if missing:
        raise ConfigError(
            f"rewards name the reward model {reward_model_ref(missing[0])[0]!r} but train_rl's reward_models has no folder for it; "
            "expected its Dir under that name"
        )
    # The reward workers the run will score with start now, beside the first task (a worker's
    # import of math-verify is slow: docs/measurements.md#iteration-overhead-issue-41-2026-11-26),
    # instead of inside its first iteration.
    workers = asyncio.create_task(start_reward_workers(groups_scored_at_once(config), config.scoring.reward_workers))
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
    tracker = Trackers(config, state.tracking_id, observers.run_folder(), chosen)

    kept: dict[int, list[EvalAnswer]] = {}  # adapter version -> its held-out answers: the latest and the best (loop.shipping)

    async def record(new_state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> LoopState:
        """Checkpoint, then tell observers and trackers and republish the report."""
        if answers is not None and config.evaluation.num_generations_eval is None:  # greedy: what an export compares with
            kept[row.adapter_version] = answers
        best = new_state.guard.best.adapter.version if new_state.guard.best else None
        for version in [v for v in kept if v not in (new_state.adapter.version, best)]:
            del kept[version]
        if answers:
            new_state = new_state.model_copy(
                update={"held_out_sample": answers[:: max(1, len(answers) // HELD_OUT_SHOWN)][:HELD_OUT_SHOWN]}
            )
        if checkpoint is not None:
            await save_checkpoint(checkpoint, checkpoint_payload(new_state))
        observers.recorded(new_state, row, answers)
        sample = [c.model_dump() for c in new_state.completions if c.iteration == row.iteration]
        tracker.log(row.flat(), [answer.model_dump() for answer in answers] if answers else None, sample)
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
        """The row with the guard's record on it, and the guard's next state."""
        values = question_values(answers, state.guard.metric) if answers is not None else None
        guard, record = assess(config.guard, state.guard, [*history, row], values, adapter, last=row.iteration >= config.iterations)
        return costed(row.model_copy(update={"guard": record})), guard

    ahead = None
    if config.max_staleness:
        recent = [*state.recent_adapters, state.adapter]
        ahead = BatchesAhead(guarded(config, state.guard), base_model, dataset, recent, state.in_flight, models)
        ahead.launch(state.iterations_done)  # generation starts now, beside the evaluation before training
    run = observers.current_run()  # a local sweep's configs meet before each iteration's rollouts (grpo_flyte.loop.lockstep)
    try:
        if eval_due(config, 0) and not any(row.iteration == 0 for row in state.history):
            await lockstep.meet(run)
            with flyte.group("eval-0"):
                metrics, answers = await run_eval(config, base_model, state.adapter, held_out, 0)
            peak = memory_metrics(memory.sampler().take(driver_memory))
            row, guard = guarded_row(
                MetricsRow(iteration=0, adapter_version=state.adapter.version, eval=metrics, memory=peak), answers, state.adapter, []
            )
            state = await record(state.model_copy(update={"history": [row, *state.history], "guard": guard}), row, answers)
        while state.iterations_done < config.iterations and state.guard.stopped is None:
            it = state.iterations_done
            answers = None
            dropped = 0
            await lockstep.meet(run)
            with flyte.group(f"iter-{it + 1}"):
                if ahead is None:
                    step_config = guarded(config, state.guard)
                    scored, result, timings = await run_iteration(step_config, base_model, state.adapter, dataset, it, models)
                else:
                    scored, result, timings, dropped = await ahead.iteration(state.adapter, it)
                row = MetricsRow(
                    iteration=it + 1,
                    adapter_version=result.adapter.version,
                    train=iteration_metrics(config, scored, result, timings, stale_dropped=dropped),
                )
                if eval_due(config, it + 1):
                    await lockstep.meet(run)  # the configs' evaluations meet too: their questions in one batch
                    metrics, answers = await run_eval(config, base_model, result.adapter, held_out, it + 1)
                    row = row.model_copy(update={"eval": metrics})
                row = row.model_copy(update={"memory": memory_metrics(memory.sampler().take(driver_memory), scored, result)})
            row, guard = guarded_row(row, answers, result.adapter, state.history)
            if answers is not None and config.sweep_prune:  # a pruned local sweep: the configs compare (loop.pruning)
                why = await pruning.evaluated(run, it + 1, guard.metric, question_values(answers, guard.metric))
                if why and guard.stopped is None:
                    row, guard = pruned(row, guard, it + 1, why)
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
                    completions=completion_sample(config, scored, it + 1) if config.log_completions else [],
                    recent_adapters=ahead.recent(adapter.version) if ahead else [],
                    in_flight=dict(ahead.versions) if ahead else {},
                    guard=guard,
                ),
                row,
                answers,
            )
        lockstep.leave(run)
        pruning.leave(run)
        shipped = Shipped(None, None, None)
        skipped = unchosen_start(config, state.history)
        if skipped:
            logger.warning("%s", skipped)
        else:  # --export-merged and --push-to-hub, each form checked before it is kept or pushed
            shipped = await ship(config, state, base_model, held_out, kept, _driver_dirs)
    except Exception as exc:
        await publish_report(config, state, "failed", f"{type(exc).__name__}: {exc}")
        tracker.finish(failed=True)
        raise
    finally:
        lockstep.leave(run)
        pruning.leave(run)
        if ahead is not None:
            ahead.cancel()  # batches past the last iteration are never started; a failure leaves none running
    ends = (state.guard.stopped, best_summary(state.history), unchosen_start(config, state.history), shipped_line(shipped))
    closing = [line for line in ends if line]
    html = await publish_report(config, state, "complete", "\n".join(closing) or None)
    tracker.finish()
    return RunResult(
        adapter=state.adapter,
        history=state.history,
        report=await report_dir(html, state.adapter.version),
        merged=shipped.merged,
        best=state.guard.best.adapter if state.guard.best else None,
        export_check=shipped.check,
        gguf=shipped.gguf,
        gguf_check=shipped.gguf_check,
    )


if __name__ == "__main__":
    # `python -m grpo_flyte.driver` is the command line of `python -m grpo_flyte`; the CLI imports
    # this module, never the reverse.
    import runpy

    runpy.run_module("grpo_flyte", run_name="__main__", alter_sys=True)
