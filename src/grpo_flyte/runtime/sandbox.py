"""The reward sandbox is a child Python that runs reward code with a time limit.

Every reward call, built-in or custom, runs in a worker process: a reward that never returns
(math-verify on `9^9^9^9`, a custom reward stuck in a loop) is killed with its process, and the limit
shows as that reward's error. One worker per `Worker`, started on first use with `python -c` and
replaced after a timeout or any failure to talk to it; a `WorkerPool` lets concurrent callers (the
groups a warm scoring replica scores at once) each have one, so a slow reward holds up only its own
group. Hand-written rather than a pool library (pebble, concurrent.futures): those start workers
through multiprocessing, which forks a threaded process (unsafe) or, with "spawn", runs the parent's
__main__ script again in the worker (an unguarded user script would start its training run there).

The workers are the run's children in sessions of their own (`grpo_flyte.runtime.child_processes`):
a terminal's Ctrl-C reaches the run, which ends them, and never a worker halfway through a call.
Stopping a worker kills its process group: whatever a reward started goes with it.

Protocol: (import path, 'module:function', args) in; ("ok", value) or ("raised", (type name,
message)) out, each a pickle in a frame (a marker, then its length), over two pipes of their own
that user code never writes to. The worker's standard output is the parent's standard error and
its standard input is empty: a print, a subprocess's output or a C library's printf (all of which
write to file descriptor 1) land in the parent's stderr, next to its log, and cannot be mistaken
for a reply.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from grpo_flyte.errors import RewardError, RewardTimeout
from grpo_flyte.runtime import child_processes

WORKER_START_S = 120
# A frame: this marker, the pickle's length (8 bytes, little-endian), the pickle.
_MARKER = b"GRPOFLYT"
# A reply larger than this is not a reply (a desynchronized stream read as a length).
MAX_FRAME_BYTES = 1 << 31


class WorkerRaised(Exception):
    """What the function raised in the worker: its type's name and message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ProtocolError(Exception):
    """The worker's reply channel carried something other than a whole frame."""


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message)
    return _MARKER + len(data).to_bytes(8, "little") + data


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from `fd`; EOFError when it closes first, TimeoutError past `deadline`
    (a `time.monotonic()` value; None waits as long as it takes)."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the worker closed its reply channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None) -> Any:
    """One message from `fd`. ProtocolError when the bytes are not a frame (a desynchronized stream)."""
    head = _read_exact(fd, len(_MARKER) + 8, deadline)
    if head[: len(_MARKER)] != _MARKER:
        raise ProtocolError(f"the reply did not start with the frame marker (it started {head[:16]!r})")
    size = int.from_bytes(head[len(_MARKER) :], "little")
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"the reply announced {size} bytes (at most {MAX_FRAME_BYTES})")
    try:
        return pickle.loads(_read_exact(fd, size, deadline))
    except (pickle.UnpicklingError, AttributeError, ImportError, IndexError, ValueError, TypeError) as exc:
        raise ProtocolError(f"the reply could not be unpickled ({type(exc).__name__}: {exc})") from None


class Worker:
    """A child Python that runs functions on request, one at a time, each within a time limit.

    `preload`: modules the worker imports before it says it is ready, so that their import time
    (math-verify and sympy import slowly: docs/measurements.md#iteration-overhead-issue-41-2026-11-26)
    is no call's time.
    """

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self.preload = preload
        self.proc: subprocess.Popen | None = None
        self.requests = self.replies = -1  # the parent's ends of the two pipes
        self.starting = False  # launched, its ready frame not read yet
        self.lock = threading.Lock()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            child_processes.ended(self.proc.pid)
            self.proc = None
            for fd in (self.requests, self.replies):
                os.close(fd)
            self.requests = self.replies = -1
            self.starting = False

    def _started(self) -> subprocess.Popen:
        self._launch()
        self._await_ready()
        assert self.proc is not None
        return self.proc

    def _launch(self) -> bool:
        """Start the process unless it runs; whether it was started now (its ready frame still to
        read: `_await_ready`). Call with `lock` held."""
        if self.proc is not None and self.proc.poll() is None:
            return False
        self.stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with child_processes.starting() as started:
            request_r, request_w = os.pipe()
            reply_r, reply_w = os.pipe()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", "from grpo_flyte.runtime.sandbox import _serve; _serve()", str(request_r), str(reply_w), *self.preload],
                    stdin=subprocess.DEVNULL, stdout=2, pass_fds=(request_r, reply_w), env=env, start_new_session=True,
                )  # fmt: skip
                started(self.proc.pid)
            finally:
                os.close(request_r)
                os.close(reply_w)
        self.requests, self.replies = request_w, reply_r
        self.starting = True
        return True

    def _await_ready(self) -> None:
        """The launched process's ready frame, unless read already: start-up (Python and the
        preloaded modules) is not any call's time. RewardError (and the process stopped) when it
        does not come."""
        if not self.starting:
            return
        try:
            ready = _read_frame(self.replies, time.monotonic() + WORKER_START_S)
        except (OSError, EOFError, TimeoutError, ProtocolError):
            ready = None
        if ready != ("ok", "ready"):
            self.stop()
            raise RewardError(f"the reward worker process did not start within {WORKER_START_S} s")
        self.starting = False

    def _exit_code(self) -> int | None:
        """The worker's exit code once it has ended (it may still be exiting as its pipe closes)."""
        try:
            return self.proc.wait(timeout=1) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def call(self, fn: str, args: tuple, timeout_s: float, what: str) -> Any:
        """`fn(*args)` in the worker within `timeout_s` seconds; `fn` is 'module:function'.
        RewardTimeout past the limit, WorkerRaised for what `fn` raised, RewardError when the
        worker dies or its reply is not a reply (`what` names the call in those messages)."""
        with self.lock:
            self._started()
            try:
                _write(self.requests, _frame((list(sys.path), fn, args)))
                status, value = _read_frame(self.replies, time.monotonic() + timeout_s)
            except TimeoutError:
                self.stop()
                raise RewardTimeout(f"{what} took longer than {timeout_s:g} s (reward_timeout_s) and was stopped") from None
            except (OSError, EOFError) as exc:
                code = self._exit_code()
                self.stop()
                how = f"exit code {code}" if code is not None else f"{type(exc).__name__}: {exc}"
                raise RewardError(f"{what} ended its worker process ({how})") from None
            except ProtocolError as exc:
                self.stop()
                raise RewardError(f"{what} broke its worker's replies ({exc}); the worker was restarted") from None
        if status == "raised":
            raise WorkerRaised(*value)
        return value


def _serve() -> None:
    """The worker's loop (the module docstring's protocol). Its arguments: the request and reply
    pipes' descriptors, then the modules to preload. Anything the function raises is its answer,
    BaseException too."""
    requests, replies = int(sys.argv[1]), int(sys.argv[2])
    for fd in (requests, replies):
        os.set_inheritable(fd, False)  # a subprocess of user code gets neither pipe
    for module in sys.argv[3:]:
        importlib.import_module(module)

    _write(replies, _frame(("ok", "ready")))
    while True:
        try:
            path, fn, args = _read_frame(requests, None)
        except EOFError:
            return
        sys.path[:] = path + [p for p in sys.path if p not in path]
        try:
            module, name = fn.split(":")
            reply = ("ok", getattr(importlib.import_module(module), name)(*args))
        except BaseException as exc:  # noqa: BLE001 -- user code: sys.exit() and KeyboardInterrupt are its errors too
            reply = ("raised", (type(exc).__name__, _message(exc)))
        try:
            data = _frame(reply)
        except Exception as exc:  # noqa: BLE001 -- whatever pickling a user's value raises
            data = _frame(("raised", ("TypeError", f"returned a value that cannot be sent back ({type(exc).__name__}: {_message(exc)})")))
        _write(replies, data)


def _message(exc: BaseException) -> str:
    """`str(exc)`, or what can be said when even that fails (a user exception's broken __str__)."""
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 -- user code
        return f"<its message could not be shown: {type(inner).__name__}>"


class WorkerPool:
    """Up to `size` workers for concurrent callers, each call on a worker of its own. A worker
    starts only when every started one is busy, so one caller at a time keeps one process; `start`
    starts several at once, ahead of the calls that will need them."""

    def __init__(self, size: int, preload: tuple[str, ...] = ()) -> None:
        self.idle: queue.LifoQueue[Worker] = queue.LifoQueue()  # the last used first: it is started
        self.preload = preload
        self.size = 0  # the workers the pool is to hold
        self.held = 0  # the workers it holds, idle or busy (above `size` after a shrink, until the busy ones end)
        self._sizing = threading.Lock()
        self.resize(size)

    def resize(self, size: int) -> None:
        """Hold `size` workers from now on: more are added (started when calls need them); past it,
        idle workers are stopped now and busy ones when their call ends."""
        retired = []
        with self._sizing:
            self.size = size
            for _ in range(size - self.held):
                self.idle.put(Worker(self.preload))
                self.held += 1
            while self.held > size:
                try:
                    retired.append(self.idle.get_nowait())
                except queue.Empty:
                    break
                self.held -= 1
        for worker in retired:
            worker.stop()

    def start(self, count: int) -> int:
        """Have `count` of the idle workers running (at most `size`): the missing ones start side by
        side, each process importing its preloaded modules while the others do. A call that takes
        one of them meanwhile waits for it to be ready instead of starting another. Returns how many
        were started now; one that fails to start is left for its first call to report."""
        with self.idle.mutex:
            chosen = list(self.idle.queue)[-count:] if count > 0 else []  # the LIFO's next ones
        held = [worker for worker in chosen if worker.lock.acquire(blocking=False)]
        try:
            launched = [worker for worker in held if worker._launch()]
            started = 0
            for worker in launched:
                try:
                    worker._await_ready()
                    started += 1
                except RewardError:
                    pass
            return started
        finally:
            for worker in held:
                worker.lock.release()

    def stop(self) -> None:
        """Stop the idle workers (the next calls start new ones, with this process's stderr as it is now)."""
        for worker in list(self.idle.queue):
            worker.stop()

    def call(self, fn: str, args: tuple, timeout_s: float, what: str) -> Any:
        """`Worker.call` on a free worker (waiting for one when all `size` are busy)."""
        worker = self.idle.get()
        try:
            return worker.call(fn, args, timeout_s, what)
        finally:
            with self._sizing:
                retire = self.held > self.size
                self.held -= retire
            if retire:
                worker.stop()
            else:
                self.idle.put(worker)
