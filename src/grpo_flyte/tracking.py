"""Experiment tracking: the per-iteration metrics rows, also sent to Weights & Biases.

Optional: only `--wandb-project NAME` imports wandb (the `wandb` extra). The W&B run id is kept in
the loop's checkpoint, so a resumed or retried driver continues the same W&B run. WANDB_MODE,
WANDB_ENTITY and WANDB_API_KEY are read by wandb itself (on a cluster, give the driver the key as
a secret); WANDB_MODE=offline writes the run under the run dir for a later `wandb sync`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

logger = logging.getLogger("grpo_flyte")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class Tracker:
    """Logs metrics rows to a W&B run when a project is given; does nothing otherwise."""

    def __init__(self, project: str | None, run_id: str, config: dict[str, Any]):
        self._run = None
        if not project:
            return
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                f"--wandb-project {project!r} needs the wandb package: pip install 'grpo-flyte[wandb]'"
            ) from None
        # WANDB_DIR says where wandb keeps its local files (a local run sets it to the run folder).
        self._run = wandb.init(project=project, id=run_id, resume="allow", config=config)
        logger.info("logging metrics to W&B project %s, run %s", project, run_id)

    def log(self, row: dict[str, Any], answers: list[dict[str, Any]] | None = None) -> None:
        """One metrics row; with a held-out evaluation's answers, also a table of them (question,
        expected answer, the greedy completion, its reward, correct), at the same step."""
        if self._run is not None:
            values: dict[str, Any] = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if answers:
                import wandb

                columns = ["question", "answer", "completion", "reward", "correct"]
                values["held_out_answers"] = wandb.Table(columns=columns, data=[[a[c] for c in columns] for a in answers])
            self._run.log(values, step=int(row["iteration"]))

    def finish(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None
