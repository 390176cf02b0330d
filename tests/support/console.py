"""A run of the command line as a user's terminal shows it: a child process (`warm_python`), its stderr."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import warm_python


def failed_run_lines(args: list[str], import_from: Path) -> list[str]:
    """The stderr lines of `python -m grpo_flyte.driver ARGS`, with `import_from` importable (a
    user's reward or environment module), after checking that it failed with exit 1 and showed no
    traceback (that goes to the run folder's run.log)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(import_from), os.environ.get("PYTHONPATH", "")])}
    done = warm_python.run(["-m", "grpo_flyte.driver", *args], env=env, timeout=300, cli=True)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()
