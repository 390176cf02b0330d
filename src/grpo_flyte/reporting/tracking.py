"""This module tracks experiments: it also sends the per-iteration metrics rows to Weights & Biases.

Optional: only `--wandb-project NAME` imports wandb (the `wandb` extra). The W&B run id is kept in
the loop's checkpoint, so a resumed or retried driver continues the same W&B run. WANDB_MODE,
WANDB_ENTITY and WANDB_API_KEY are read by wandb itself (on a cluster, give the driver the key as
a secret); WANDB_MODE=offline writes the run under the run dir for a later `wandb sync`.

On a cluster the CLI chooses the W&B run before it submits (`WandbRun`): the run's custom context
names it the way flyteplugins-wandb does, so the plugin's link on the driver task opens it from the
Flyte UI, and the driver logs to it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("grpo_flyte")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class WandbRun:
    """A W&B run chosen before a cluster run starts, carried in the run's custom context under
    flyteplugins-wandb's keys (`wandb_config`): the plugin's `Wandb` link reads them when the task
    is submitted, so the link exists before the driver's pod does, and the driver reads them to
    log to that run. Its entity is the W&B user or team the link needs (the link opens the W&B
    front page without one)."""

    project: str
    id: str
    entity: str | None = None

    def context(self) -> dict[str, str]:
        """The custom context of a run logging to this W&B run (needs flyteplugins-wandb)."""
        from flyteplugins.wandb import wandb_config

        return dict(wandb_config(project=self.project, entity=self.entity, id=self.id))

    @staticmethod
    def link() -> Any:
        """flyteplugins-wandb's link for a task's page in the Flyte UI:
        `https://wandb.ai/<entity>/<project>/runs/<id>`, from the run's custom context."""
        from flyteplugins.wandb import Wandb

        return Wandb()

    @classmethod
    def from_context(cls, context: Mapping[str, str] | None) -> WandbRun | None:
        """The W&B run a task's custom context names, or None. Read without the plugin (the keys
        `wandb_config` writes), so the driver needs it only where the link is made."""
        context = context or {}
        if not context.get("wandb_project") or not context.get("wandb_id"):
            return None
        return cls(project=context["wandb_project"], id=context["wandb_id"], entity=context.get("wandb_entity") or None)


class Tracker:
    """Logs metrics rows to a W&B run when a project is given; does nothing otherwise."""

    def __init__(self, project: str | None, run_id: str, config: dict[str, Any], entity: str | None = None):
        self._run = None
        if not project:
            return
        try:
            import wandb
        except ImportError:
            raise RuntimeError(f"--wandb-project {project!r} needs the wandb package: pip install 'grpo-flyte[wandb]'") from None
        # WANDB_DIR says where wandb keeps its local files (a local run sets it to the run folder).
        # entity None: WANDB_ENTITY, else the key's default entity (wandb's own choice)
        self._run = wandb.init(project=project, entity=entity, id=run_id, resume="allow", config=config)
        logger.info("logging metrics to W&B project %s, run %s", project, run_id)

    def log(self, row: dict[str, Any], answers: list[dict[str, Any]] | None = None) -> None:
        """One metrics row; with a held-out evaluation's answers, also a table of them (question,
        expected answer, the greedy completion, its reward, correct; with num_generations_eval the
        first sampled completion, and the question's mean reward and share correct), at the same step."""
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
