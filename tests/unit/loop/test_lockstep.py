"""A local sweep's meeting point before each iteration's rollouts (grpo_flyte.loop.lockstep), and the
torch thread's idle signals it and the batcher rely on (grpo_flyte.runtime.torch_thread)."""

from __future__ import annotations

import asyncio
import time

import pytest

from grpo_flyte.loop import lockstep
from grpo_flyte.runtime.torch_thread import is_idle, run_on_torch_thread, until_idle


@pytest.fixture
def long_grace(monkeypatch):
    """No going on for an idle torch thread within a test's waits."""
    monkeypatch.setattr(lockstep, "IDLE_GRACE_S", 60.0)


async def _waiting(*tasks: asyncio.Task, seconds: float = 0.3) -> list[bool]:
    await asyncio.sleep(seconds)
    return [not task.done() for task in tasks]


def test_runs_go_on_together_once_every_running_one_has_come(long_grace):
    async def scenario():
        step = lockstep.Lockstep(["a", "b", "c"])
        a, b = asyncio.create_task(step.meet("a")), asyncio.create_task(step.meet("b"))
        assert await _waiting(a, b) == [True, True]
        await asyncio.wait_for(asyncio.gather(a, b, step.meet("c")), 5)
        # the next round starts empty: "a" waits again for the others
        again = asyncio.create_task(step.meet("a"))
        assert await _waiting(again) == [True]
        again.cancel()
        return step.meetings

    assert asyncio.run(scenario()) == 1


def test_a_run_that_ends_is_no_longer_waited_for(long_grace):
    async def scenario():
        step = lockstep.Lockstep(["a", "b", "c"])
        a, b = asyncio.create_task(step.meet("a")), asyncio.create_task(step.meet("b"))
        assert await _waiting(a, b) == [True, True]
        step.leave("c")
        await asyncio.wait_for(asyncio.gather(a, b), 5)
        step.leave("b")
        await asyncio.wait_for(step.meet("a"), 5)  # alone now: at once
        await asyncio.wait_for(step.meet("b"), 5)  # ended: never waits

    asyncio.run(scenario())


def test_waiters_go_on_when_the_torch_thread_idles_past_the_grace_and_not_while_it_works(monkeypatch):
    """ "b" never comes (busy elsewhere): "a" goes on once the torch thread has idled for the grace,
    and a torch thread at work (another config's train step) keeps it waiting past that."""
    monkeypatch.setattr(lockstep, "IDLE_GRACE_S", 0.3)

    async def scenario():
        step = lockstep.Lockstep(["a", "b"])
        started = time.monotonic()
        await asyncio.wait_for(step.meet("a"), 5)
        idle_wait = time.monotonic() - started
        busy = asyncio.ensure_future(run_on_torch_thread(time.sleep, 1.5))
        a = asyncio.create_task(step.meet("a"))
        assert await _waiting(a, seconds=1.0) == [True]  # over 3 graces, the thread at work
        await asyncio.wait_for(asyncio.gather(busy, a), 5)
        return idle_wait

    assert asyncio.run(scenario()) >= 0.3


def test_a_cancelled_waiter_leaves_no_trace(long_grace):
    async def scenario():
        step = lockstep.Lockstep(["a", "b"])
        a = asyncio.create_task(step.meet("a"))
        await asyncio.sleep(0.1)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        b = asyncio.create_task(step.meet("b"))
        assert await _waiting(b) == [True]  # "a" still runs: "b" waits for it to come again
        await asyncio.wait_for(asyncio.gather(b, step.meet("a")), 5)
        return step.meetings

    assert asyncio.run(scenario()) == 1


def test_runs_of_no_local_sweep_never_wait(long_grace):
    async def scenario():
        with lockstep.lockstep(["r1", "r2"]):
            r1 = asyncio.create_task(lockstep.meet("r1"))
            assert await _waiting(r1) == [True]
            await asyncio.wait_for(lockstep.meet("other-run"), 1)
            await asyncio.wait_for(lockstep.meet(None), 1)
            lockstep.leave("r2")
            await asyncio.wait_for(r1, 5)
        await asyncio.wait_for(lockstep.meet("r1"), 1)  # the sweep is over

    asyncio.run(scenario())


def test_until_idle_waits_for_every_call_on_the_torch_thread_those_queued_meanwhile_too():
    async def scenario():
        first = asyncio.ensure_future(run_on_torch_thread(time.sleep, 0.4))
        await asyncio.sleep(0.05)
        assert not is_idle()
        waiter = asyncio.create_task(until_idle())
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(run_on_torch_thread(time.sleep, 0.4))
        started = time.monotonic()
        await waiter
        assert is_idle() and time.monotonic() - started >= 0.6  # the first's rest, then the second
        await asyncio.gather(first, second)
        await until_idle()  # idle: at once
        # a thread kept busy by new calls: the waiter gives up after as many rounds as it was given
        calls = [asyncio.ensure_future(run_on_torch_thread(time.sleep, 0.2))]
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(until_idle(rounds=2))
        for _ in range(4):
            await asyncio.sleep(0.1)
            calls.append(asyncio.ensure_future(run_on_torch_thread(time.sleep, 0.2)))
            await asyncio.sleep(0)
        await asyncio.wait_for(waiter, 5)
        assert not is_idle()
        await asyncio.gather(*calls)

    asyncio.run(scenario())
