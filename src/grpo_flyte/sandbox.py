"""The reward sandbox: a child Python that runs reward code with a time limit.

Every reward call, built-in or custom, runs in a worker process: a reward that never returns
(math-verify on `9^9^9^9`, a custom reward stuck in a loop) is killed with its process, and the limit
shows as that reward's error. One worker per `Worker`, started on first use with `python -c` and
replaced after a timeout; a `WorkerPool` lets concurrent callers (the groups a warm scoring
replica scores at once) each have one, so a slow reward holds up only its own group. Hand-written rather than a pool library (pebble, concurrent.futures):
those start workers through multiprocessing, which forks a threaded process (unsafe) or, with
"spawn", runs the parent's __main__ script again in the worker (an unguarded user script would
start its training run there).

Protocol: (import path, 'module:function', args) in; ("ok", value) or ("raised", (type name,
message)) out, each a pickle framed by its length.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
from typing import Any

from grpo_flyte.errors import RewardError, RewardTimeout

WORKER_START_S = 120


class WorkerRaised(Exception):
    """What the function raised in the worker: its type's name and message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _send(stream, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream) -> Any:
    size = stream.read(8)
    if len(size) < 8:
        raise EOFError("the worker closed its output")
    return pickle.loads(stream.read(int.from_bytes(size, "little")))


class Worker:
    """A child Python that runs functions on request, one at a time, each within a time limit.

    `preload`: modules the worker imports before it says it is ready, so that their import time
    (math-verify and sympy: a second or more) is no call's time.
    """

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self.preload = preload
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from grpo_flyte.sandbox import _serve; _serve()", *self.preload],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            )  # fmt: skip
            # Start-up (Python and the preloaded modules) is not any call's time.
            ready, _, _ = select.select([self.proc.stdout], [], [], WORKER_START_S)
            if not ready or _receive(self.proc.stdout) != ("ok", "ready"):
                self.stop()
                raise RewardError(f"the reward worker process did not start within {WORKER_START_S} s")
        return self.proc

    def call(self, fn: str, args: tuple, timeout_s: float, what: str) -> Any:
        """`fn(*args)` in the worker within `timeout_s` seconds; `fn` is 'module:function'.
        RewardTimeout past the limit, WorkerRaised for what `fn` raised, RewardError when the
        worker dies (`what` names the call in those messages)."""
        with self.lock:
            proc = self._started()
            try:
                _send(proc.stdin, (list(sys.path), fn, args))
                ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
                if not ready:
                    self.stop()
                    raise RewardTimeout(f"{what} took longer than {timeout_s:g} s (reward_timeout_s) and was stopped")
                status, value = _receive(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError):
                code = proc.poll()
                self.stop()
                raise RewardError(f"{what} ended its worker process (exit code {code})") from None
        if status == "raised":
            raise WorkerRaised(*value)
        return value


def _serve() -> None:
    """The worker's loop (the module docstring's protocol); the modules to preload are its
    arguments. Anything the function raises is its answer, BaseException too."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a print() in user code must not corrupt the replies
    for module in sys.argv[1:]:
        importlib.import_module(module)

    _send(stdout, ("ok", "ready"))
    while True:
        try:
            path, fn, args = _receive(stdin)
        except EOFError:
            return
        sys.path[:] = path + [p for p in sys.path if p not in path]
        try:
            module, name = fn.split(":")
            reply = ("ok", getattr(importlib.import_module(module), name)(*args))
        except BaseException as exc:  # noqa: BLE001 -- user code: sys.exit() and KeyboardInterrupt are its errors too
            reply = ("raised", (type(exc).__name__, str(exc)))
        try:
            _send(stdout, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _send(stdout, ("raised", ("TypeError", f"returned a value that cannot be sent back ({exc})")))


class WorkerPool:
    """Up to `size` workers for concurrent callers, each call on a worker of its own. A worker
    starts only when every started one is busy, so one caller at a time keeps one process."""

    def __init__(self, size: int, preload: tuple[str, ...] = ()) -> None:
        self.idle: queue.LifoQueue[Worker] = queue.LifoQueue()  # the last used first: it is started
        for _ in range(size):
            self.idle.put(Worker(preload))

    def call(self, fn: str, args: tuple, timeout_s: float, what: str) -> Any:
        """`Worker.call` on a free worker (waiting for one when all `size` are busy)."""
        worker = self.idle.get()
        try:
            return worker.call(fn, args, timeout_s, what)
        finally:
            self.idle.put(worker)
