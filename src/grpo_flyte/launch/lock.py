"""This module keeps a run folder to one writer: an exclusive lock on `<run dir>/.lock`, which
holds the writer's process id.

The operating system drops the lock when the process ends, however it ends (a SIGKILL too), so a
dead run never blocks its resume. fcntl (the standard library) rather than the filelock package:
the message names the live run's process, read from the lock file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from grpo_flyte.errors import UserError
from grpo_flyte.launch.run_folder import LOCK_FILE


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while the block runs; a folder a live process holds is refused in one line naming it."""
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"--run-dir {str(run_dir)!r} cannot be written ({exc.strerror}); expected a folder this user can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(
            f"--run-dir {str(run_dir)!r} is being written by a live run (process {holder}); a run folder takes one "
            "writer at a time: wait for that run or stop it, then --resume"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
