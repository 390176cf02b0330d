"""Directories that appear whole or not at all: built beside their final place, then renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_dir_atomic(final: Path, build: Callable[[Path], object], *, replace: bool = True) -> Path:
    """Run `build(staging)` in a fresh folder beside `final`, then rename it to `final`.

    A crash or an error leaves no half-written `final`. With `replace=False` an existing non-empty
    `final` is kept and the rename raises OSError (e.g. a concurrent builder won the race).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; these folders are meant to be read
        if replace:
            shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
