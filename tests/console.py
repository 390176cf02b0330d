"""A run of the command line as a user's terminal shows it: a child process, its stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def failed_run_lines(args: list[str], import_from: Path) -> list[str]:
    """The stderr lines of `python -m grpo_flyte.driver ARGS`, with `import_from` importable (a
    user's reward or environment module), after checking that it failed with exit 1 and showed no
    traceback (that goes to the run folder's run.log)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(import_from), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "grpo_flyte.driver", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()
