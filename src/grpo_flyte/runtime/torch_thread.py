"""One thread runs every torch computation of a grpo_flyte process.

PyTorch's CPU kernels parallelize with OpenMP, and GNU OpenMP (the one in PyTorch's Linux wheels)
gives every calling thread its own team of worker threads, kept while that thread lives. Once the
live workers outnumber the cores, idle workers stop spin-waiting and sleep between parallel
regions, so every region pays a wake-up. Decoding is thousands of small regions: a local run whose
generate and train_step ran on two different threads left every later torch call markedly slower
(docs/measurements.md#measured). In local mode every task shares one process, and Flyte, asyncio
and the generate coalescing each bring their own threads, so grpo_flyte funnels model loading,
decoding, training and merging through this one thread instead. On a cluster each task has its
own process; the thread costs nothing there.

The thread also keeps the memory its steps reuse: `grpo_flyte.runtime.allocator` tunes glibc's malloc
when the thread starts (a train step's activations stay mapped between steps).

Rule: code submitted here never waits for a lock another thread may hold while it waits for this
thread (hold locks around `on_torch_thread`, not inside the function given to it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

from grpo_flyte.runtime.allocator import keep_memory

T = TypeVar("T")

THREAD_NAME = "grpo_flyte-torch"

_local = threading.local()


def _start() -> None:
    _local.is_torch_thread = True
    keep_memory()


IDLE_ROUNDS = 8  # `until_idle` waits for at most this many successive newest calls

_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=_start)
_queued = threading.Lock()  # guards the two below
_unfinished = 0  # calls submitted and not yet finished
_newest: concurrent.futures.Future | None = None  # the last call submitted


def is_torch_thread() -> bool:
    return getattr(_local, "is_torch_thread", False)


def _submit(fn: Callable[..., T], args, kwargs) -> concurrent.futures.Future[T]:
    global _unfinished, _newest
    with _queued:
        # The caller's context variables (Flyte's task context among them) travel with the call.
        future = _executor.submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))
        _unfinished += 1
        _newest = future
    future.add_done_callback(_finished)
    return future


def _finished(_future: concurrent.futures.Future) -> None:
    global _unfinished
    with _queued:
        _unfinished -= 1


def is_idle() -> bool:
    """Whether the torch thread has nothing to run (every call submitted to it finished)."""
    with _queued:
        return _unfinished == 0


async def until_idle(rounds: int = IDLE_ROUNDS) -> None:
    """Return once the torch thread has finished every call submitted to it, those submitted while
    waiting included (at once when it is idle), or after waiting for the newest call `rounds`
    times (a thread kept busy by ever new calls does not hold the caller forever). A generate call
    waits here before it joins the batcher: a decode would wait behind that work anyway, and the
    calls that arrive meanwhile (a sweep's configs whose train steps ran one after another) then
    form one engine batch instead of one each."""
    loop = asyncio.get_running_loop()
    for _ in range(rounds):
        with _queued:
            newest = _newest if _unfinished else None
        if newest is None:
            return
        done = loop.create_future()
        newest.add_done_callback(lambda _, done=done: wake(loop, done))
        await done


def wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future) -> None:
    """Resolve `waiter` (of event loop `loop`) from any thread, unless it is done already."""
    loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))


def on_torch_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """Run `fn(*args, **kwargs)` on the torch thread and wait for its result (or exception).
    Called from the torch thread itself, it just calls `fn`."""
    if is_torch_thread():
        return fn(*args, **kwargs)
    return _submit(fn, args, kwargs).result()


async def run_on_torch_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """`on_torch_thread` for async code: the event loop keeps running while `fn` does."""
    if is_torch_thread():
        return fn(*args, **kwargs)
    return await asyncio.wrap_future(_submit(fn, args, kwargs))
