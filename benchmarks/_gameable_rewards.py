"""Faulty rewards for benchmarks/guardian.py, as `module:function` names (`_gameable_rewards:flipped`).

The reward workers import them from sys.path: guardian.py puts this folder on PYTHONPATH. A reward
sees only its group, so `flipped` reads the run's clock from the run folder the benchmark names in
GUARDIAN_RUN_DIR: the iterations its metrics.jsonl records (rewritten whole from the checkpoint, so
a resumed run reads the same clock).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_flyte.reward_fns import correct_reward


def trained_iterations() -> int:
    """The iterations the run folder's metrics.jsonl records (0 before the first one)."""
    metrics = Path(os.environ["GUARDIAN_RUN_DIR"]) / "metrics.jsonl"
    return metrics.read_text().count('"mean_reward"') if metrics.is_file() else 0


def flipped(completions: list[str], *, answer: str, **kwargs: Any) -> list[float]:
    """The 'correct' reward until GUARDIAN_FLIP_AT iterations are recorded, its negative after:
    from then on a right answer costs what it earned before (and so does the held-out reward)."""
    scores = correct_reward(completions, answer=answer)
    if trained_iterations() >= int(os.environ["GUARDIAN_FLIP_AT"]):
        return [-score for score in scores]
    return scores
