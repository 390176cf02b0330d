"""This module keeps track of the run's child processes (reward workers, train processes) and ends them.

Each child starts in a session of its own (`start_new_session=True`), so a terminal's Ctrl-C or a
signal to the run's process group reaches the run alone: no child dies halfway printing a
traceback of its own. The run handles the signal and ends them itself with `stop_all`, which kills
every registered child's process group (the child and whatever it started) and refuses any start
after it, as the run is about to exit.

A child is registered while its starter holds the registry's lock (`starting`), so `stop_all`
sees every child that was started before it, and none starts after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

_lock = threading.RLock()
_groups: set[int] = set()  # process group ids of live children (each a session leader: its pid)
_stopped = False


class Stopping(RuntimeError):
    """A child was about to start after `stop_all`: the run is stopping."""


@contextlib.contextmanager
def starting() -> Iterator[Callable[[int], None]]:
    """Hold while starting children (each with `start_new_session=True`); call the function given
    with each one's process id. Raises Stopping after `stop_all`."""
    with _lock:
        if _stopped:
            raise Stopping("the run is stopping: no new process starts")
        yield _groups.add


def ended(pid: int) -> None:
    """The child `pid` has ended (or was killed and waited for)."""
    with _lock:
        _groups.discard(pid)


def stop_all() -> None:
    """Kill every registered child's process group (SIGKILL: what a killed run would leave, which
    the run folder and a resume already handle) and refuse further starts."""
    global _stopped
    with _lock:
        _stopped = True
        for group in list(_groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        _groups.clear()
