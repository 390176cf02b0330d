"""This module names the folder where grpo_flyte keeps what it builds once per machine (the
converted embedded model, Hub snapshots): `GRPO_FLYTE_CACHE`, else ~/.cache/grpo_flyte.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_flyte.errors import ModelError
from grpo_flyte.runtime.files import unwritable


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_FLYTE_CACHE", Path.home() / ".cache" / "grpo_flyte"))


def check_cache_writable() -> Path:
    """The cache folder, checked writable (without creating it) before any slow work fills it: the
    embedded model's conversion runs a while before its first write (docs/measurements.md#measured)."""
    root = cache_root()
    problem = unwritable(root)
    if problem:
        where = "GRPO_FLYTE_CACHE" if "GRPO_FLYTE_CACHE" in os.environ else "the cache folder"
        raise ModelError(
            f"{where} {str(root)!r} cannot be written ({str(problem[0])!r} {problem[1]}); expected a writable folder (set GRPO_FLYTE_CACHE)"
        )
    return root
