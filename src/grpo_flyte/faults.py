"""A test-only hook that injects transient failures, to drill the retry path.

    GRPO_FLYTE_FAULTS="generate=1,train_step=2" GRPO_FLYTE_FAULTS_DIR=/tmp/faults ...

makes the first call of `generate` and the first two of `train_step` raise `InjectedFault` at their
fault point; later calls (Flyte's retries) run normally. Calls are counted with files in
GRPO_FLYTE_FAULTS_DIR, so the count holds across processes and replicas. Unset, it does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_FAULTS = "GRPO_FLYTE_FAULTS"
ENV_DIR = "GRPO_FLYTE_FAULTS_DIR"


class InjectedFault(RuntimeError):
    """A deliberate, transient failure (GRPO_FLYTE_FAULTS)."""


def _planned(spec: str) -> dict[str, int]:
    planned = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        if not count.isdigit():
            raise ValueError(f"{ENV_FAULTS}={spec!r}: expected name=count pairs, e.g. 'generate=1,train_step=1'")
        planned[name.strip()] = int(count)
    return planned


def inject(point: str) -> None:
    """Raise InjectedFault if this call of `point` is one of the first N planned to fail."""
    spec = os.environ.get(ENV_FAULTS)
    if not spec:
        return
    failures = _planned(spec).get(point, 0)
    if failures == 0:
        return
    directory = Path(os.environ.get(ENV_DIR) or "/tmp/grpo_flyte-faults")
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(1, failures + 1):
        try:
            # O_EXCL: each of the first N calls claims one numbered file, even across processes.
            os.close(os.open(directory / f"{point}-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        raise InjectedFault(f"injected transient failure {n} of {failures} in {point} ({ENV_FAULTS})")
