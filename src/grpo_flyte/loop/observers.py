"""This module tells whoever watches a run in this process how it goes: in a local run, the run
folder's writer and the progress bars (`observe`); in a local sweep, several runs at once, each
config's folder sees its own run only (`observe(..., run=name)`). On a cluster nobody observes the driver pod; its report
tab and outputs carry the same information.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from grpo_flyte.loop.state import LoopState
    from grpo_flyte.types import MetricsRow
from grpo_flyte.loop.answers import EvalAnswer


class RunObserver(Protocol):
    """What an observer of a run is told, as it happens."""

    def recorded(self, state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> None:
        """A checkpointed iteration (iteration 0: the evaluation before training) and its held-out answers."""

    def report(self, html: str) -> None:
        """The report, republished."""

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        """The held-out evaluation after `iteration` iterations (0: before training) has `answered`
        of its `total` questions answered and scored: 0 as it starts, `total` as it ends."""


_observers: list[tuple[RunObserver, str | None]] = []
_command_started: list[float] = []


def command_started(at: float) -> None:
    """A local command (a run, a sweep) started at `at` (time.perf_counter()): its drivers, in this
    process, count their first row's wall clock from there, its checks and Flyte's start-up included."""
    _command_started[:] = [at]


def started_at(default: float) -> float:
    """When the command that runs the caller's driver started (`default`, the driver's own start, on
    a cluster or when no command said)."""
    return _command_started[0] if _command_started else default


@contextlib.contextmanager
def observe(observer: RunObserver, run: str | None = None) -> Iterator[None]:
    """Let `observer` see every run of this process while the block runs, or only the Flyte run
    named `run` (several local runs share a process in a sweep)."""
    entry = (observer, run)
    _observers.append(entry)
    try:
        yield
    finally:
        _observers.remove(entry)


def current_run() -> str | None:
    """The Flyte run the caller is part of (None outside a task)."""
    import flyte

    ctx = flyte.ctx()
    return ctx.action.run_name if ctx and ctx.action else None


def _watching() -> list[RunObserver]:
    run = current_run() if any(wanted is not None for _, wanted in _observers) else None
    return [observer for observer, wanted in _observers if wanted is None or wanted == run]


def run_folder() -> Path | None:
    """The local run folder the caller's run writes (an observer's `root`: `launch.run_files.LocalRunFiles`),
    or None (a cluster driver; a run started without the command line)."""
    for observer in _watching():
        root = getattr(observer, "root", None)
        if isinstance(root, Path):
            return root
    return None


def recorded(state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> None:
    """Tell every observer of a checkpointed iteration (`RunObserver.recorded`)."""
    for observer in _watching():
        observer.recorded(state, row, answers)


def report(html: str) -> None:
    """Tell every observer of the republished report (`RunObserver.report`)."""
    for observer in _watching():
        observer.report(html)


def evaluating(iteration: int, answered: int, total: int) -> None:
    """Tell every observer how far a held-out evaluation is (`RunObserver.evaluating`)."""
    for observer in _watching():
        observer.evaluating(iteration, answered, total)
