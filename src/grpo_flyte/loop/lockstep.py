"""This module makes a local sweep's configs ask for each iteration's rollouts, and each evaluation,
together.

In a local sweep every config runs in one process: one engine and one torch thread
(`grpo_flyte.runtime.torch_thread`) do every config's decoding and train steps, one after another. Left
alone the configs drift apart: the config whose train step ran last asks for its next rollouts
after the others' groups left in a batch, so its groups get an engine batch of their own, every
iteration (`benchmarks/sweep_throughput.py`: docs/measurements.md#sweeps-on-one-warm-pool-issue-39-2026-11-26).

`Lockstep` is the sweep's meeting point. The driver waits at it (`meet`) before each iteration's
rollouts and before each held-out evaluation (the one after an iteration's train step came one
config at a time otherwise, in pieces of its questions); the waiters go on together once every config
still running has come, or once the torch thread has been idle for `IDLE_GRACE_S` while they
waited (then nothing they could share is running: a config busy elsewhere, e.g. scoring slow
rewards, is left behind for that iteration rather than holding up the others). A config whose
run ends leaves (`leave`). A lone run, and a sweep on a cluster (each config's driver its own
pod), has no lockstep: `meet` returns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from grpo_flyte.runtime.torch_thread import is_idle, wake

IDLE_GRACE_S = 1.0
POLL_S = 0.05

_sweeps: dict[str, Lockstep] = {}  # Flyte run name -> the lockstep of the sweep it belongs to


class Lockstep:
    """The meeting point of the runs `runs` (their Flyte run names), each waiting with `meet`."""

    def __init__(self, runs: Iterable[str]) -> None:
        self._lock = threading.Lock()  # the runs' tasks may live on several event loops
        self._running = set(runs)
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.meetings = 0  # how many times waiters went on together (the tests read it)

    async def meet(self, run: str) -> None:
        """Wait until every run still running waits here too (or the torch thread idles)."""
        loop = asyncio.get_running_loop()
        met = loop.create_future()
        with self._lock:
            if run not in self._running:
                return
            self._waiting[run] = (loop, met)
            if self._waiting.keys() >= self._running:
                self._go()
        idle_s = 0.0
        try:
            while not met.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(met), POLL_S)
                idle_s = idle_s + POLL_S if is_idle() else 0.0
                if not met.done() and idle_s >= IDLE_GRACE_S:
                    with self._lock:
                        self._go()
        finally:
            with self._lock:
                if self._waiting.get(run, (None, None))[1] is met:
                    del self._waiting[run]  # cancelled while waiting (Ctrl-C): nobody waits for it

    def leave(self, run: str) -> None:
        """`run` ended (finished or failed): nobody waits for it any more."""
        with self._lock:
            self._running.discard(run)
            if self._waiting and self._waiting.keys() >= self._running:
                self._go()

    def _go(self) -> None:
        """Every waiter goes on (with the lock held)."""
        for loop, met in self._waiting.values():
            wake(loop, met)
        if self._waiting:
            self.meetings += 1
        self._waiting.clear()


@contextlib.contextmanager
def registered(registry: dict[str, Any], runs: Iterable[str], value: Any) -> Iterator[None]:
    """`registry[run]` is `value` for each of `runs` (Flyte run names) while the block runs: how a
    run's driver finds the object of the local sweep it belongs to."""
    runs = list(runs)
    registry.update(dict.fromkeys(runs, value))
    try:
        yield
    finally:
        for run in runs:
            registry.pop(run, None)


@contextlib.contextmanager
def lockstep(runs: Iterable[str]) -> Iterator[Lockstep]:
    """The runs `runs` (Flyte run names; a local sweep's configs) meet before each iteration's
    rollouts while the block runs."""
    runs = list(runs)
    step = Lockstep(runs)
    with registered(_sweeps, runs, step):
        yield step


async def meet(run: str | None) -> None:
    """The driver of run `run`, before an iteration's rollouts: wait for its sweep's other configs
    (`Lockstep.meet`); at once for a run of no local sweep."""
    if run is not None and (step := _sweeps.get(run)) is not None:
        await step.meet(run)


def leave(run: str | None) -> None:
    """Run `run` asks for no more rollouts: its sweep's other configs stop waiting for it."""
    if run is not None and (step := _sweeps.get(run)) is not None:
        step.leave(run)
