"""The run's guard keeps the best adapter, catches a collapse and stops a stalled run (pure: no Flyte, no torch).

After each held-out evaluation the adapter is compared with the best one so far on the chosen
metric (`--select-by`), paired over the same questions; between evaluations the training metrics
are watched for a policy that has degenerated. `assess` turns one recorded iteration into the
guard's next state and what happened (a `GuardRecord`, part of the metrics row); the driver acts
on it: a rollback trains on from the best adapter and its optimizer state at a lower learning
rate, a stop ends the loop. The state is part of the loop's checkpoint, so a resumed run keeps its
best adapter, its rollbacks, its learning-rate scale and its patience.

What counts as a collapse, each test with its threshold (the data behind them:
docs/measurements.md#the-guard-2026-11-26; `benchmarks/guardian.py --replay` runs these functions
over recorded runs):
- **held_out**: the evaluation below the best one by more than the paired difference's 99%
  interval (COLLAPSE_Z). 99%, not the 95% the metrics show elsewhere: the best is the highest of
  several noisy evaluations, so it is biased upwards, and a healthy run of the recipe sweep came
  close to the 95% interval after its best.
- between evaluations, each over SIGNAL_RUN measured iterations in a row since the last collapse
  and against the run's start (the mean of its first START_ITERATIONS iterations: the base policy):
  see SIGNALS.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from grpo_flyte.config.training import GuardConfig
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.metrics import mean_ci95
from grpo_flyte.records import GuardRecord, TrainMetrics
from grpo_flyte.reporting.figures import change_plus_minus, metric_name, shown, shown_change
from grpo_flyte.types import AdapterRef, Example, MetricsRow

Metric = Literal["eval_accuracy", "eval_reward"]
# A collapse on the held-out set: the paired difference below minus this many standard errors (99%).
COLLAPSE_Z = 2.576
# Between evaluations: a signal fires after this many measured iterations in a row ...
SIGNAL_RUN = 3
# ... compared with the mean of the run's first iterations (the base policy's behaviour).
START_ITERATIONS = 3


class BestAdapter(BaseModel):
    """The best evaluation so far: its iteration, its adapter, the metric and its value per held-out
    question (in the held-out order: the other side of every later paired comparison)."""

    iteration: int
    adapter: AdapterRef
    value: float
    values: list[float]


class GuardState(BaseModel):
    """The guard's part of the loop state (checkpointed with it).

    `metric`: what `--select-by` resolved to; `evals_since_best`: evaluations in a row without a new
    best (the early stop's patience); `lr_scale`: the learning rate's factor after the rollbacks so
    far; `watch_from`: the first iteration the signals between evaluations read (the one after the
    last collapse, so one collapse is acted on once); `stopped`: why the run ended before its last
    iteration (None: it did not)."""

    metric: Metric | None = None
    best: BestAdapter | None = None
    evals_since_best: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    watch_from: int = 1
    stopped: str | None = None


def resolve_metric(select_by: str, held_out: list[Example]) -> Metric:
    """`--select-by` as a metric: 'auto' is the held-out accuracy when every held-out question has a
    gold answer (accuracy is then measured), else the held-out reward."""
    if select_by != "auto":
        return select_by  # type: ignore[return-value]
    return "eval_accuracy" if held_out and all(ex.answer.strip() for ex in held_out) else "eval_reward"


def question_values(answers: list[EvalAnswer], metric: Metric) -> list[float]:
    """Each held-out question's value of the metric: its reward, or for the accuracy 1 or 0 (a
    greedy answer) or the share of its completions that are correct (num_generations_eval). Values
    in [0, 1] rather than {0, 1} leave `paired` as it is: the differences are still bounded, the
    normal interval of their mean still holds, and the same questions pair up at every evaluation."""
    return [float(a.correct) if metric == "eval_accuracy" else a.reward for a in answers]


def paired(values: list[float], best: list[float]) -> tuple[float, float | None]:
    """The mean of `values` minus `best`, question by question, and the half-width of its 99%
    interval (None with one question)."""
    if len(values) != len(best):
        raise ValueError(f"paired comparison of {len(values)} held-out answers with {len(best)}: the held-out set changed")
    mean, ci95 = mean_ci95([a - b for a, b in zip(values, best, strict=True)])
    return mean, None if ci95 is None else ci95 * COLLAPSE_Z / 1.96


# --------------------------------------------------------------------------- signals between evaluations


@dataclasses.dataclass(frozen=True)
class Signal:
    """A sign between evaluations that the policy has degenerated.

    `measured(t)`: whether iteration t measured it; `fires(t, start)`: whether iteration t shows it,
    given the run's start; the signal fires when SIGNAL_RUN measured iterations in a row do.
    `says`: the collapse in words."""

    name: str
    measured: Callable[[TrainMetrics], bool]
    fires: Callable[[TrainMetrics, dict[str, float]], bool]
    says: str
    accuracy_only: bool = False


def _always(t: TrainMetrics) -> bool:
    return True


def _stepped(t: TrainMetrics) -> bool:
    """An optimizer step ran: without one the entropy and the importance weights are not measured."""
    return t.num_tokens > 0


ACCURACY_FLOOR = 0.02
NO_SPREAD = 0.9
ENTROPY_FLOOR = 0.02
LENGTH_FRACTION = 0.25
ESS_FLOOR = 0.5

# The runs behind each threshold: docs/measurements.md#the-guard-2026-11-26.
SIGNALS: tuple[Signal, ...] = (
    # Training accuracy at a floor after a start above it (benchmarks/learning_curve.py's gate calls
    # this a collapse): the format collapse of benchmarks/learning_seeds.json. No healthy run of the
    # recipe sweep stayed at the floor for two iterations in a row.
    Signal(
        "accuracy_floor",
        _always,
        lambda t, start: t.accuracy <= ACCURACY_FLOOR < start["accuracy"] / 3,
        f"training accuracy at or below {ACCURACY_FLOOR:.0%} for {SIGNAL_RUN} iterations, from {{accuracy:.0%}} at the start",
        accuracy_only=True,
    ),
    # Nothing left to learn from, and worse than the start: nearly every group's completions scored
    # alike. The recipe sweep's collapsed run stayed there from its fall on; no healthy run had two
    # iterations in a row at NO_SPREAD or above.
    Signal(
        "no_spread",
        _always,
        lambda t, start: t.frac_zero_std_groups >= NO_SPREAD > start["frac_zero_std_groups"] and t.mean_reward < start["mean_reward"],
        f"{NO_SPREAD:.0%} of the groups or more without a reward spread for {SIGNAL_RUN} iterations, the reward below "
        "the start's {mean_reward:.3f}",
    ),
    # Entropy fallen to near zero: the policy samples one completion. The floor is far below every
    # entropy the recipe sweep measured, healthy runs and their start included.
    Signal(
        "entropy",
        _stepped,
        lambda t, start: t.entropy <= ENTROPY_FLOOR,
        f"entropy at or below {ENTROPY_FLOOR} nats per token for {SIGNAL_RUN} trained iterations, from {{entropy:.2f}} at the start",
    ),
    # Completions shrunk to a few tokens: far shorter, against the start, than any run of the recipe sweep.
    Signal(
        "short",
        _always,
        lambda t, start: t.completion_len_mean <= LENGTH_FRACTION * start["completion_len_mean"],
        f"completions {LENGTH_FRACTION:.0%} of their length at the start ({{completion_len_mean:.1f}} tokens) or less "
        f"for {SIGNAL_RUN} iterations",
    ),
    # Importance weights out of range: the trainer's policy far from the one that sampled. The floor
    # is well below what the recipe sweep's 16-bit runs and the 4-bit runs of learning_seeds.json measured.
    Signal(
        "ess",
        _stepped,
        lambda t, start: t.is_ess <= ESS_FLOOR,
        f"importance weights' effective sample size at or below {ESS_FLOOR:.0%} for {SIGNAL_RUN} trained iterations",
    ),
)


def run_start(history: list[MetricsRow]) -> dict[str, float] | None:
    """The means of the run's first START_ITERATIONS trained iterations (None before there are as many)."""
    first = [row.train for row in history if row.train is not None][:START_ITERATIONS]
    if len(first) < START_ITERATIONS:
        return None
    stepped = [t for t in first if _stepped(t)]
    keys = ("accuracy", "mean_reward", "frac_zero_std_groups", "completion_len_mean")
    start = {key: statistics.fmean(getattr(t, key) for t in first) for key in keys}
    start["entropy"] = statistics.fmean(t.entropy for t in stepped) if stepped else math.nan
    return start


def degenerate(history: list[MetricsRow], watch_from: int, metric: Metric | None) -> tuple[str, str] | None:
    """The first signal that fires on the iterations from `watch_from` on: (its name, the collapse in
    words); None when none does."""
    start = run_start(history)
    if start is None:
        return None
    recent = [row.train for row in history if row.train is not None and row.iteration >= watch_from]
    for signal in SIGNALS:
        if signal.accuracy_only and metric != "eval_accuracy":
            continue
        window = [t for t in recent if signal.measured(t)][-SIGNAL_RUN:]
        if len(window) == SIGNAL_RUN and all(signal.fires(t, start) for t in window):
            return signal.name, signal.says.format(**start)
    return None


# --------------------------------------------------------------------------- the assessment


def assess(
    config: GuardConfig, state: GuardState, history: list[MetricsRow], values: list[float] | None, adapter: AdapterRef, last: bool
) -> tuple[GuardState, GuardRecord | None]:
    """The guard's next state and what it made of the iteration just recorded, `history[-1]`.

    `values`: its held-out evaluation per question (`question_values`; None: not evaluated);
    `adapter`: the adapter that iteration produced; `last`: the run's last iteration (nothing
    follows to roll back or stop: a collapse there is only recorded). A new best is never a
    collapse; the held-out comparison goes first, the signals between evaluations after it.
    """
    row = history[-1]
    record: dict = {}
    collapse: tuple[str, str] | None = None
    if values is not None and row.eval is not None and state.metric is not None:
        value = getattr(row.eval, state.metric)
        best = state.best
        record["select_by"] = state.metric
        if best is not None:
            record["vs_best"], record["vs_best_ci99"] = paired(values, best.values)
        if best is None or value > best.value:
            new = BestAdapter(iteration=row.iteration, adapter=adapter, value=value, values=values)
            state = state.model_copy(update={"best": new, "evals_since_best": 0})
            if best is not None:
                record["guard_event"] = "new_best"
        else:
            state = state.model_copy(update={"evals_since_best": state.evals_since_best + 1})
            diff, half = record["vs_best"], record["vs_best_ci99"]
            if half is not None and diff < -half:
                collapse = (
                    "held_out",
                    f"{metric_name(state.metric)} {shown(state.metric, value)} is {shown_change(state.metric, -diff)} +- "
                    f"{shown_change(state.metric, half)} below the best, iteration {best.iteration}'s {shown(state.metric, best.value)}",
                )
        record["best_iteration"] = state.best.iteration if state.best else None
    if collapse is None and row.train is not None and record.get("guard_event") != "new_best":
        collapse = degenerate(history, state.watch_from, state.metric)
    if collapse is not None:
        state, acted = _act(config, state, row.iteration, collapse, last)
        record.update(acted)
    elif values is not None and config.early_stop_patience and state.evals_since_best >= config.early_stop_patience and not last:
        reason = (
            f"stopped at iteration {row.iteration}: {state.evals_since_best} held-out evaluations in a row without a new best "
            f"(--early-stop-patience {config.early_stop_patience})"
        )
        state = state.model_copy(update={"stopped": reason})
        record.update(guard_event="early_stop", guard_reason=reason)
    record = {key: value for key, value in record.items() if value is not None}
    return state, GuardRecord(**record) if record else None


def _act(config: GuardConfig, state: GuardState, iteration: int, collapse: tuple[str, str], last: bool) -> tuple[GuardState, dict]:
    """What `--on-collapse` does with a collapse at `iteration`: the next state and the record's fields."""
    signal, reason = collapse
    action = "warn" if last else config.on_collapse
    update: dict = {"watch_from": iteration + 1}
    if action == "rollback" and state.best is None:
        action, reason = "warn", f"{reason}; nothing was evaluated, so nothing to roll back to"
    if action == "rollback" and state.rollbacks >= config.max_rollbacks:
        action, reason = "stop", f"{reason}; {state.rollbacks} rollbacks already (--max-rollbacks {config.max_rollbacks})"
    record: dict = {"guard_event": "collapse", "guard_signal": signal}
    if action == "rollback":
        assert state.best is not None
        update.update(rollbacks=state.rollbacks + 1, lr_scale=state.lr_scale * config.rollback_lr_factor)
        reason = (
            f"{reason}; rolled back to iteration {state.best.iteration}'s adapter and its optimizer state, learning rate "
            f"x{update['lr_scale']:g} from here (rollback {update['rollbacks']} of at most {config.max_rollbacks})"
        )
        record.update(guard_event="rollback", lr_scale=update["lr_scale"], rollbacks=update["rollbacks"])
    elif action == "stop":
        reason = f"stopped at iteration {iteration}: collapse ({signal}), {reason}"
        update["stopped"] = reason
        record["guard_event"] = "stop"
    record["guard_reason"] = reason
    return state.model_copy(update=update), record


def restore_from(state: GuardState, adapter: AdapterRef) -> AdapterRef:
    """The adapter the next step trains from after a rollback: the best one's weights and optimizer
    state, under the version number the run is at (the next step writes the next version: the
    learning-rate schedule goes on, and no version's folder is written twice)."""
    assert state.best is not None
    return AdapterRef(version=adapter.version, dir=state.best.adapter.dir)


def untrained_best(history: list[MetricsRow]) -> bool:
    """Whether the run trained and no trained adapter beat the start: the best held-out evaluation
    is still iteration 0's, the adapter before any step (LoRA's B is zero there: the base model)."""
    evaluated = [row for row in history if row.guard is not None and row.guard.best_iteration is not None]
    return bool(evaluated) and evaluated[-1].guard.best_iteration == 0 and any(row.iteration > 0 for row in history)


def best_summary(history: list[MetricsRow]) -> str | None:
    """Which iteration was best and by how much, with its interval: the console's last line and the
    report's closing message (None: nothing was evaluated)."""
    evaluated = [row for row in history if row.eval is not None and row.guard is not None and row.guard.best_iteration is not None]
    if not evaluated:
        return None
    final, last = evaluated[-1], history[-1]
    metric = final.guard.select_by
    best = next(row for row in evaluated if row.iteration == final.guard.best_iteration)
    figure = f"{metric_name(metric)} {shown(metric, getattr(best.eval, metric))}, --select-by {metric}"
    if untrained_best(history):
        text = f"nothing trained beat the start: the best adapter is iteration 0's, the untrained one ({figure})"
    else:
        text = f"best adapter: iteration {best.iteration} ({figure})"
    interval = change_plus_minus(metric, final.guard.vs_best_ci99)
    if final.guard.vs_best is None:
        text += ", the only evaluation"
    elif best is final:
        previous = max(evaluated[:-1], key=lambda row: getattr(row.eval, metric))  # the first to reach the best value before it
        text += f", {shown_change(metric, final.guard.vs_best)} {interval} above the best before it (iteration {previous.iteration})"
    else:
        whose = "the final adapter's" if final is last else f"iteration {final.iteration}'s, the last evaluation's"
        text += f", {shown_change(metric, 0.0 - final.guard.vs_best)} {interval} above {whose} {shown(metric, getattr(final.eval, metric))}"
        text += f" (iteration {final.iteration})" if final is last else ""
    if last is not final:
        text += f"; the final adapter (iteration {last.iteration}) was not evaluated"
    return text + ("; paired over the same questions, 99% interval" if final.guard.vs_best is not None else "")
