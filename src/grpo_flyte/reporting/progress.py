"""This module shows a run's progress as a person reads it: the line the driver logs per iteration
(`progress_line`), the ETA (`eta_seconds`), and, for a local run on a terminal, progress bars: one
for the run's iterations, one for each held-out evaluation, each with an ETA, below the run's log
lines.

`RunProgress` is a run observer (`grpo_flyte.loop.observers.observe`), fed by the same events as
the run folder's writer. The bars are drawn only when stderr is a terminal; in a pipe, a file or CI the log lines
are all there is, as before.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from grpo_flyte.config.run import RunConfig, eval_due
from grpo_flyte.reporting.figures import accuracy_interval, change_plus_minus, plus_minus, shown_change
from grpo_flyte.types import MetricsRow


class Checkpointed(Protocol):
    """What the bars read of the driver's loop state (`grpo_flyte.loop.state.LoopState`)."""

    iterations_done: int
    history: list[MetricsRow]


def clock(seconds: float) -> str:
    """'1m32s', '2h05m': the ETA as the log lines write it."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class EtaColumn(ProgressColumn):
    """The time a bar still needs: its own estimate when it has one (`eta_s` seconds as of
    `eta_at`, counted down since), else rich's from the rate so far; blank once finished."""

    def __init__(self, now: Callable[[], float]):
        super().__init__()
        self._now = now

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("")
        eta_s = task.fields.get("eta_s")
        left = max(0.0, eta_s - (self._now() - task.fields["eta_at"])) if eta_s is not None else task.time_remaining
        return Text(f"ETA {clock(left)}" if left is not None else "ETA --", style="progress.remaining")


def new_bars(console: Console, now: Callable[[], float] = time.monotonic) -> Progress:
    """Bars drawn below the log lines on a terminal (none elsewhere): a run's, or a sweep's (a bar per config)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        EtaColumn(now),
        console=console,
        get_time=now,
        transient=True,  # gone at the end: the log lines are the record
        disable=not console.is_terminal,
    )


@contextlib.contextmanager
def bars_shown(bars: Progress) -> Iterator[None]:
    """Draw `bars` while the block runs, with log records printed above them."""
    if bars.disable:  # not a terminal: the log lines alone
        yield
        return
    with bars, _logs_above_bars(bars.console):
        yield


class RunProgress:
    """The bars of one local run. `eta(history, iterations_done)` is the run's time left
    (`eta_seconds`); an evaluation's is the time the previous one took. In a sweep each
    config's run has its bars among the sweep's (`bars`), named for its config (`name`)."""

    def __init__(
        self,
        iterations: int,
        done: int,
        eta: Callable[[list[MetricsRow], int], float | None],
        console: Console | None = None,
        now: Callable[[], float] = time.monotonic,
        bars: Progress | None = None,
        name: str | None = None,
    ):
        self.console = console or (bars.console if bars is not None else Console(stderr=True))
        self._eta = eta
        self._now = now
        self._eval_s: float | None = None
        self._eval: TaskID | None = None
        self._name = name
        self.bars = bars if bars is not None else new_bars(self.console, now)
        self._run = self.bars.add_task(name or "iterations", total=iterations, completed=done, eta_s=None, eta_at=now())

    def shown(self) -> contextlib.AbstractContextManager[None]:
        """Draw the bars while the block runs, with log records printed above them."""
        return bars_shown(self.bars)

    def recorded(self, state: Checkpointed, row: MetricsRow, answers: Any) -> None:
        self.bars.update(
            self._run, completed=state.iterations_done, eta_s=self._eta(state.history, state.iterations_done), eta_at=self._now()
        )
        # the latest evaluation's time: the first one also loaded the model
        self._eval_s = next((r.eval.eval_s for r in reversed(state.history) if r.eval), None)

    def report(self, html: str) -> None:
        """The report is the run folder's business."""

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        if self._eval is None:
            what = "before training" if iteration == 0 else f"after iteration {iteration}"
            named = f"{self._name}: " if self._name else ""
            self._eval = self.bars.add_task(f"{named}held-out eval {what}", total=total, eta_s=self._eval_s, eta_at=self._now())
        self.bars.update(self._eval, completed=answered)
        if answered >= total:  # its result is the next log line
            self.bars.remove_task(self._eval)
            self._eval = None


class _AboveBars(io.TextIOBase):
    """A log handler's stream while the bars show: each whole line is printed above them, not
    wrapped (the terminal wraps it, as it did before)."""

    def __init__(self, console: Console):
        self._console = console
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._console.print(Text(line), soft_wrap=True)
        return len(text)


@contextlib.contextmanager
def _logs_above_bars(console: Console) -> Iterator[None]:
    """Log handlers writing to the terminal (logging.basicConfig's, flyte's) would write over the
    bars: they write above them meanwhile."""
    terminal = {id(s) for s in (sys.__stderr__, sys.__stdout__, getattr(sys.stderr, "rich_proxied_file", sys.stderr))}
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    moved = {h: h.stream for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler and id(h.stream) in terminal}
    for handler in moved:
        handler.setStream(_AboveBars(console))
    try:
        yield
    finally:
        for handler, stream in moved.items():
            handler.setStream(stream)


def eta_seconds(config: RunConfig, history: list[MetricsRow], done: int) -> float | None:
    """Seconds the run still needs: the mean iteration time so far times the iterations left, plus
    the held-out evaluations still due at their mean time (None before the first iteration)."""
    times = [row.train.iteration_s for row in history if row.train]
    if not times:
        return None
    evals = [row.eval.eval_s for row in history if row.eval]
    due = sum(eval_due(config, i) for i in range(done + 1, config.iterations + 1))
    return statistics.fmean(times) * (config.iterations - done) + (statistics.fmean(evals) * due if evals else 0.0)


# What the guard did, as the console says it (its reason follows).
_GUARD_EVENTS = {"collapse": "COLLAPSE", "rollback": "ROLLBACK"}


def guard_lines(row: MetricsRow) -> tuple[str, str]:
    """The guard's part of an evaluation's line (the best adapter so far, this one against it) and
    its event's own line ('' for none)."""
    g = row.guard
    if g is None:
        return "", ""
    best = ""
    if g.best_iteration is not None:
        best = f"  | best: iteration {g.best_iteration}"
        if g.vs_best is not None:
            best += f", this vs the best before: {'+' if g.vs_best >= 0 else ''}{shown_change(g.select_by, g.vs_best)}"
            best += f" {change_plus_minus(g.select_by, g.vs_best_ci99)} (99%)"
    event = ""
    if g.guard_event in ("stop", "early_stop"):
        event = str(g.guard_reason)  # 'stopped at iteration N: ...'
    elif g.guard_event is not None and g.guard_event != "new_best":
        event = f"{_GUARD_EVENTS[g.guard_event]} ({g.guard_signal}): {g.guard_reason}"
    elif g.guard_event == "new_best":
        best = best.replace("| best:", "| new best:", 1)
    return best, event


def progress_line(row: MetricsRow, total: int, eta_s: float | None = None) -> str:
    e, t = row.eval, row.train
    best, event = guard_lines(row)
    held_out = (
        f"held-out reward {e.eval_reward:.3f} {plus_minus(e.eval_reward_ci95)}  acc {e.eval_accuracy:.1%}"
        + (f" {accuracy_interval(e.eval_accuracy_lo, e.eval_accuracy_hi)}" if e.eval_accuracy_lo is not None else "")
        + f"  format {e.eval_format_rate:.1%}"
        + (f"  tool use {e.eval_tool_call_rate:.0%}" if e.eval_tool_call_rate is not None else "")
        + (f"  tool errors {e.eval_tool_errors}" if e.eval_tool_errors else "")
        + f"  (n={e.eval_size}, {e.eval_s:.1f}s)"
        + best
        if e
        else ""
    )
    event = f"\n  {event}" if event else ""
    if t is None:  # the evaluation before training
        return f"iter 0/{total}  {held_out}{event}"
    # accuracy and format rate are shown anyway; other rewards and failed scores are added
    others = "".join(f"  {name} {mean:.3f}" for name, mean in t.reward_means.items() if name not in ("correct", "format"))
    errors = f"  reward errors {t.reward_errors}" if t.reward_errors else ""
    # multi-turn: turns per episode, the share that used a tool, failed steps, turns cut by their budget
    episodes = (
        f"  turns {t.turns_mean:.1f}  tool use {t.tool_call_rate:.0%}"
        + (f"  tool errors {t.tool_errors}" if t.tool_errors else "")
        + (f"  cut at --max-new-tokens {cut}" if (cut := t.episode_ends.get("turn_tokens")) else "")
        if t.turns_mean is not None
        else ""
    )
    # pipelined (--max-staleness): how stale the trained groups were, and any dropped as too stale
    stale = (f"  staleness {t.staleness_mean:.1f}" if t.staleness_max else "") + (
        f"  stale dropped {t.stale_dropped}" if t.stale_dropped else ""
    )
    # the LLM judge: its calls (one per group), unparsable replies, and its seconds as a stage
    judged = (
        f"  judge calls {t.judge_calls}" + (f"  judge invalid {t.judge_invalid}" if t.judge_invalid else "")
        if t.judge_calls is not None
        else ""
    )
    judge_s = f"judge {t.judge_s:.1f}s  " if t.judge_s is not None else ""
    judge_s += f"reward model {t.reward_model_s:.1f}s  " if t.reward_model_s is not None else ""
    return (
        f"iter {row.iteration}/{total}  reward {t.mean_reward:.3f}  acc {t.accuracy:.1%}  "
        f"format {t.format_rate:.1%}{others}{errors}{judged}{episodes}{stale}  loss {t.loss:+.4f}  len {t.completion_len_mean:.0f}  "
        f"| generate {t.generate_s:.1f}s  score {t.score_s:.1f}s  {judge_s}train {t.train_s:.1f}s  "
        f"total {t.iteration_s:.1f}s"
        + (f"  | ETA {clock(eta_s)}" if eta_s is not None and row.iteration < total else "")
        + (f"\n  {held_out}" if held_out else "")
        + event
    )
