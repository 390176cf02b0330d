"""This module keeps a local run's log: Flyte's lines in full (tracebacks included) in the run
folder's run.log, the console kept to its warnings, and an error said on one line.

A failed run's message is its last console line, its traceback in the log; in a sweep each
config's run.log gets the lines of its own Flyte run only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from grpo_flyte.loop import observers


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a task's error can carry the lines of its cause)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class _ConsoleLines(logging.Filter):
    """Flyte's console lines during a local run: its warnings (retries), never its errors, whose
    tracebacks go to the run log and whose message is the run's last line. Other loggers' lines
    pass: Flyte's handlers may be shared (pytest's, a notebook's), and in a sweep a config's
    failure is said while the others run."""

    def filter(self, record: logging.LogRecord) -> bool:
        flyte = record.name == "flyte" or record.name.startswith("flyte.")
        return not flyte or (record.levelno < logging.ERROR and not record.exc_info)


class _OneRun(logging.Filter):
    """The lines logged inside one Flyte run (a local sweep runs several in this process)."""

    def __init__(self, run: str):
        super().__init__()
        self.run = run

    def filter(self, record: logging.LogRecord) -> bool:
        return observers.current_run() == self.run


@contextlib.contextmanager
def flyte_log_in(path: Path, run: str | None = None) -> Iterator[None]:
    """Flyte's log lines go to `path` in full while the run lasts (with `run`, those of that Flyte
    run only); the console keeps `_ConsoleLines`."""
    flyte_logger = logging.getLogger("flyte")
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    if run is not None:
        to_file.addFilter(_OneRun(run))
    console, keep = flyte_logger.handlers[:], _ConsoleLines()
    for handler in console:
        handler.addFilter(keep)
    flyte_logger.addHandler(to_file)
    try:
        yield
    finally:
        flyte_logger.removeHandler(to_file)
        to_file.close()
        for handler in console:
            handler.removeFilter(keep)
