"""A pruned local sweep (--sweep-prune): at each held-out evaluation, the configs that fell clearly behind the leader stop.

Successive halving over the evaluations the configs already make. At an evaluation every config
still running reports its held-out values, one per question (loop.guard.question_values); once all
of them have (`Pruning.evaluated` waits for the others, as loop.lockstep does), the leader is the
config with the highest mean, and a config stops when its values are below the leader's by more than
the paired difference's 99% interval over the same questions: the test the guard makes against a
run's own best evaluation (loop.guard.paired, COLLAPSE_Z), here against another config:

    d_q = v_q(config) - v_q(leader),  mean(d) + 2.576 sd(d) / sqrt(n) < 0   ->   stopped

A stopped config ends as an early stop does: its best adapter and its folder are kept, and its
driver leaves the sweep. Its share of the pools goes to the others by their taking less time: the
shared engine batches hold fewer configs' rows and the one torch thread has fewer train steps to run,
so the next evaluation comes sooner for them. Their batches are not made larger: a config's recipe
stays the one its name says, so the winner of a pruned sweep is the run a lone run of it would be.
A sweep of one config, an evaluation only one config makes (other eval_every), one held-out
question (no interval) never prunes, and a config's last evaluation (its final iteration) never
stops it: nothing is left to save, and it ends complete, ranked by the sweep's comparison; it still
counts as the leader the others are compared with. Each decision is reported to the sweep (`decided`), which keeps
it in its folder for --resume. A lone run and a cluster sweep have no pruning: `evaluated` returns None.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping

from grpo_flyte.config.run import RunConfig, eval_due
from grpo_flyte.loop.guard import paired
from grpo_flyte.loop.lockstep import registered
from grpo_flyte.reporting.figures import change_plus_minus, metric_name, shown, shown_change
from grpo_flyte.runtime.torch_thread import wake

_sweeps: dict[str, Pruning] = {}  # Flyte run name -> the pruning of the sweep it belongs to


def prune(values: Mapping[str, list[float]], metric: str) -> dict[str, str]:
    """The configs (by name) that stop at this evaluation and why: those whose `values` are below the
    leader's (the highest mean; the first named among equals) by more than the paired 99% interval.
    Fewer than two configs, or one question: none."""
    if len(values) < 2:
        return {}
    leader = max(values, key=lambda name: statistics.fmean(values[name]))
    best = values[leader]
    stopped = {}
    for name, own in values.items():
        if name == leader:
            continue
        diff, half = paired(own, best)
        if half is not None and diff + half < 0:
            stopped[name] = (
                f"{metric_name(metric)} {shown(metric, statistics.fmean(own))} is {shown_change(metric, -diff)} "
                f"{change_plus_minus(metric, half)} (99%) below the leader {leader}'s {shown(metric, statistics.fmean(best))}, "
                f"paired over the same {len(own)} questions"
            )
    return stopped


class Pruning:
    """The meeting point of a sweep's configs at each evaluation (their Flyte run names -> config
    names and configs); `decided(name, iteration, reason)` is told of every config stopped."""

    def __init__(self, configs: Mapping[str, tuple[str, RunConfig]], decided: Callable[[str, int, str], None]) -> None:
        self._lock = threading.Lock()  # the runs' tasks may live on several event loops
        self._configs = dict(configs)
        self._running = set(configs)
        self._decided = decided
        self._reports: dict[int, dict[str, list[float]]] = {}
        self._waiting: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._outcome: dict[int, dict[str, str]] = {}
        self._last: dict[str, int] = {}  # each run's latest reported iteration
        self._metric = ""

    async def evaluated(self, run: str, iteration: int, metric: str, values: list[float]) -> str | None:
        """Run `run`'s held-out values at `iteration`; once every config due there has reported (or
        left), why `run` stops, or None."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if run not in self._running:
                return None
            self._metric = metric
            self._reports.setdefault(iteration, {})[run] = values
            self._last[run] = iteration
            self._waiting.setdefault(iteration, []).append((loop, done))
            for pending in sorted(self._waiting):  # a run past an earlier evaluation (a resumed sweep) is not waited for there
                self._settle(pending)
        await done
        return self._outcome[iteration].get(run)

    def leave(self, run: str) -> None:
        """`run` ended (finished, stopped or failed): no evaluation waits for it any more."""
        with self._lock:
            self._running.discard(run)
            for iteration in list(self._waiting):
                self._settle(iteration)

    def _settle(self, iteration: int) -> None:
        """Decide `iteration` once every running config due there has reported (with the lock held); a
        config already past it (a resumed sweep's configs need not be at one iteration) is not due."""
        reported = self._reports.get(iteration, {})
        due = {run for run in self._running if eval_due(self._configs[run][1], iteration) and self._last.get(run, -1) <= iteration}
        if iteration not in self._waiting or not due <= reported.keys():
            return
        by_name = {self._configs[run][0]: values for run, values in reported.items() if run in self._running}
        last = {self._configs[run][0] for run in reported if iteration >= self._configs[run][1].iterations}
        stopped = {name: why for name, why in prune(by_name, self._metric).items() if name not in last}
        self._outcome[iteration] = {run: stopped[name] for run, (name, _) in self._configs.items() if name in stopped}
        for run, reason in self._outcome[iteration].items():
            self._running.discard(run)
            self._decided(self._configs[run][0], iteration, reason)
        for loop, done in self._waiting.pop(iteration):
            wake(loop, done)


@contextlib.contextmanager
def pruning(configs: Mapping[str, tuple[str, RunConfig]], decided: Callable[[str, int, str], None]) -> Iterator[Pruning | None]:
    """While the block runs, the runs of `configs` (Flyte run name -> config name and config) prune
    each other at their evaluations; nothing for fewer than two configs."""
    if len(configs) < 2:
        yield None
        return
    sweep = Pruning(configs, decided)
    with registered(_sweeps, configs, sweep):
        yield sweep


async def evaluated(run: str | None, iteration: int, metric: str, values: list[float]) -> str | None:
    """Why run `run` stops after its evaluation at `iteration` (`Pruning.evaluated`); None for a run of no pruned sweep."""
    if run is not None and (sweep := _sweeps.get(run)) is not None:
        return await sweep.evaluated(run, iteration, metric, values)
    return None


def leave(run: str | None) -> None:
    """Run `run` makes no more evaluations: its sweep's other configs stop waiting for it."""
    if run is not None and (sweep := _sweeps.get(run)) is not None:
        sweep.leave(run)
