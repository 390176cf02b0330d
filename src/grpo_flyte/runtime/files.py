"""This module writes files and directories that appear whole or not at all: built beside their final
place, then renamed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Every temp file and staging folder written here is named `.grpo_flyte-tmp-<pid>-<random>`: the
# marker, the writer's process id and mkstemp's random part. No user names a file so, so the
# clean-up after a kill (`leftovers`) deletes only what a writer of this package left.
TEMP_MARKER = ".grpo_flyte-tmp-"
_TEMP_NAME = re.compile(re.escape(TEMP_MARKER) + r"([1-9][0-9]{0,6})-\w+")  # pids stay below 2**22 on Linux


def _temp_prefix() -> str:
    return f"{TEMP_MARKER}{os.getpid()}-"


def build_dir_atomic(final: Path, build: Callable[[Path], T], *, replace: bool = True) -> T:
    """Run `build(staging)` in a fresh folder beside `final`, then rename it to `final`; returns
    what `build` returned.

    A crash or an error leaves no half-written `final`. With `replace=False` an existing non-empty
    `final` is kept and the rename raises OSError (e.g. a concurrent builder won the race).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_temp_prefix(), dir=final.parent))
    try:
        value = build(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; these folders are meant to be read
        if replace:
            shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return value


def write_text_atomic(path: os.PathLike[str] | str, text: str) -> None:
    """Write to a temp file in the same directory, fsync, then os.replace, so a reader (or a crash)
    never sees a half-written file. Missing parent directories are created."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, not {type(text).__name__}")
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: os.PathLike[str] | str, data: bytes) -> None:
    """`write_text_atomic` for bytes."""
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temp_prefix())
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600; these files are meant to be read by others (viewers, uploaders).
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; some platforms and filesystems refuse, which is fine.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def leftovers(directory: Path) -> list[Path]:
    """What `write_bytes_atomic` and `build_dir_atomic` left in `directory` when their process died
    mid-write: the temp files and staging folders named with `TEMP_MARKER` whose writer no longer
    runs. A name without the marker is never one, however temporary it looks (a user's)."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob(TEMP_MARKER + "*")):
        writer = _TEMP_NAME.fullmatch(path.name)
        if writer and not _another_live_process(int(writer[1])):
            found.append(path)
    return found


def _another_live_process(pid: int) -> bool:
    """Whether a process other than this one has id `pid` (signal 0 checks, sending nothing: the
    standard library, rather than psutil for one call). This process's own id counts as gone: it
    has no write in flight at a clean-up, and a run restarted in a container often gets the id of
    the one that was killed."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def unwritable(folder: Path) -> tuple[Path, str] | None:
    """Why `folder` could not be created or written, found without creating anything: (its nearest
    existing ancestor, "is a file" or "is read-only for this user"); None when it can be."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return existing, "is a file"
    if not _can_write(existing):
        return existing, "is read-only for this user"
    return None


def _can_write(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def files_of(folder: str) -> tuple:
    """(name, size, modification time) of each file of a folder: what changes if it is edited or replaced."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()))
