"""This module stops a local run or sweep on Ctrl-C or SIGTERM: at once, in one line saying what was
kept and how to continue, with exit status 130 or 143.

SIGTERM (a scheduler, `kill`) is made to stop a run as Ctrl-C does; the process then ends without
waiting for the work on its other threads, which leaves what a killed run leaves (whole files
only), and --resume continues it.

A process can start with SIGINT ignored: a shell without job control (a script, a CI step, an
agent's tool) ignores it in what it starts with `cmd &`, and Python then never installs its
KeyboardInterrupt handler, so Ctrl-C or `kill -INT` does nothing at all, however long one waits
(what looked like a Ctrl-C lost under load). `ctrl_c_stops` gives the CLI its handler back where
the ignoring protects nobody (`ctrl_c_wanted`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from grpo_flyte.config.constants import PROG
from grpo_flyte.runtime import child_processes

logger = logging.getLogger("grpo_flyte")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`): stops the run as Ctrl-C does."""


def ctrl_c_wanted(stdin_is_terminal: bool, has_terminal: bool) -> bool:
    """Whether a CLI that started with SIGINT ignored should handle it anyway.

    Yes when its input is a terminal (a user runs it and types Ctrl-C at it), and when it has no
    controlling terminal (no key press can reach it: a SIGINT is someone's `kill -INT` meant for
    it). No for a background job of a shell script run at a terminal (input from /dev/null, as
    POSIX gives `cmd &` without job control): that is what the ignoring is for, so that the
    Ctrl-C meant for the script's foreground command leaves it running; SIGTERM stops it."""
    return stdin_is_terminal or not has_terminal


def _has_terminal() -> bool:
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
    except OSError:
        return False
    return True


def ctrl_c_stops() -> None:
    """Give SIGINT Python's KeyboardInterrupt handler again when this process started with it
    ignored and `ctrl_c_wanted` says so (the main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return
    stdin_is_terminal = sys.stdin is not None and sys.stdin.isatty()
    if ctrl_c_wanted(stdin_is_terminal, _has_terminal()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c() -> Iterator[None]:
    def stop(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_now(code: int) -> typing.NoReturn:
    """End this process now, with `code`: its children killed (`child_processes.stop_all`: train
    processes, reward workers), the console flushed, and no wait for the work on its other threads
    (a train step or a generation runs on for minutes; Flyte would retry a step whose processes were
    just killed, and print it). Every file of a run folder is written whole or not at all, so this
    leaves what a killed run leaves, which --resume continues (the kill drills of the tests)."""
    child_processes.stop_all()
    logging.shutdown()  # flushes every handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_interrupted(exc: KeyboardInterrupt, folder: Path, kept: Callable[[], str]) -> typing.NoReturn:
    """End a local run or sweep that Ctrl-C or SIGTERM (`exc`) stopped, once its bars are gone:
    both signals ignored from here (a second Ctrl-C while the run stops changes nothing), one line
    saying how it stopped, what `folder` kept (`kept()`, read after that) and the resume command,
    then `exit_now` with 130 (Ctrl-C) or 143 (SIGTERM)."""
    for stopping in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stopping, signal.SIG_IGN)
    how = "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
    logger.error("%s: %s; continue with: %s --local --resume --run-dir %s", how, kept(), PROG, folder)
    exit_now(143 if isinstance(exc, Terminated) else 130)
