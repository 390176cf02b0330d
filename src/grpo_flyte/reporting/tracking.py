"""This module holds what every experiment tracker shares: the interface its adapter implements
(`Tracker`, in `reporting.trackers`), the package and extra each needs, the values a metrics row
gives it, and the W&B run a cluster run's submitter chooses.

A run logs to the trackers `--report-to` names (and W&B with `--wandb-project`), each an optional
extra imported only when named. The tracking id is kept in the loop's checkpoint, so a resumed or
retried driver continues the same tracker runs. Each tracker's own environment variables (WANDB_*,
TRACKIO_*, MLFLOW_*) configure it; on a cluster, give the driver W&B's key as a secret.

On a cluster the CLI chooses the W&B run before it submits (`WandbRun`): the run's custom context
names it the way flyteplugins-wandb does, so the plugin's link on the driver task opens it from the
Flyte UI, and the driver logs to it. A sweep's id names its W&B group instead: each config's
train_rl is submitted with a run of its own in that group (`WandbRun.for_config`), and the sweep
task's link opens the group (`WandbGroupLink`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("grpo_flyte")

# tracker -> (the module it imports, the extra that installs it)
PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    "mlflow": ("mlflow", "mlflow"),
    "tensorboard": ("tensorboard", "tensorboard"),
}
# The tables a row may come with: a held-out evaluation's answers, and an iteration's completions (--log-completions).
ANSWER_COLUMNS = ("question", "answer", "completion", "reward", "correct")
COMPLETION_COLUMNS = ("group", "question", "answer", "completion", "reward", "advantage")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class WandbRun:
    """A W&B run chosen before a cluster run starts, carried in the run's custom context under
    flyteplugins-wandb's keys (`wandb_config`): the plugin's `Wandb` link reads them when the task
    is submitted, so the link exists before the driver's pod does, and the driver reads them to
    log to that run. Its entity is the W&B user or team the link needs (the link opens the W&B
    front page without one). A sweep's configs each have one (`for_config`), named for the config
    and grouped under the sweep (W&B's `group`)."""

    project: str
    id: str
    entity: str | None = None
    group: str | None = None
    name: str | None = None

    def context(self) -> dict[str, str]:
        """The custom context of a run logging to this W&B run (needs flyteplugins-wandb)."""
        from flyteplugins.wandb import wandb_config

        return dict(wandb_config(project=self.project, entity=self.entity, id=self.id, group=self.group, name=self.name))

    def for_config(self, name: str) -> WandbRun:
        """The W&B run of the sweep config `name`, when this is the sweep's: in the group of the
        sweep's id, named `name`, with the id `<sweep id>-<first 12 hex digits of sha256(name)>`,
        the same for every attempt of the config (a retried or recovered sweep reattaches each
        config to its own run) and within W&B's id characters (a config's name may hold '=', '/')."""
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        return WandbRun(project=self.project, id=f"{self.id}-{digest}", entity=self.entity, group=self.group or self.id, name=name)

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
        return cls(
            project=context["wandb_project"],
            id=context["wandb_id"],
            entity=context.get("wandb_entity") or None,
            group=context.get("wandb_group") or None,
            name=context.get("wandb_name") or None,
        )


@dataclass(frozen=True)
class WandbGroupLink:
    """A Flyte UI link (flyte's `Link` protocol) to the W&B group a sweep's configs log to:
    `https://wandb.ai/<entity>/<project>/groups/<group>`, from the task's custom context (the
    group the submitter chose, `WandbRun`); W&B's front page without a project or an entity."""

    name: str = "Weights & Biases (the sweep's runs)"
    icon_uri: str = ""
    host: str = "https://wandb.ai"

    def get_link(self, context: Mapping[str, str] | None = None, **_: Any) -> str:
        chosen = WandbRun.from_context(context)
        if chosen is None or chosen.entity is None:
            return self.host
        return f"{self.host}/{chosen.entity}/{chosen.project}/groups/{chosen.group or chosen.id}"


@dataclass(frozen=True)
class Table:
    """Rows of text and numbers logged at one step (held-out answers, an iteration's completions)."""

    columns: tuple[str, ...]
    rows: list[list[Any]]

    @classmethod
    def of(cls, columns: tuple[str, ...], records: list[dict[str, Any]]) -> Table:
        return cls(columns, [[record[c] for c in columns] for record in records])


class Tracker(Protocol):
    """One tracker's run, as `reporting.trackers` opens it for a train_rl run."""

    def log(self, step: int, values: dict[str, float], tables: dict[str, Table]) -> None:
        """One metrics row's numbers (and its tables) at `step`, the row's iteration."""

    def finish(self, failed: bool) -> None:
        """Close the run, marked failed or finished."""


def metric_values(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row (a line of metrics.jsonl), by the same keys: text (guard_event,
    select_by) and unmeasured values (None) stay in metrics.jsonl."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def missing_package(tracker: str) -> str:
    """What a tracker whose package is missing needs, in words: 'mlflow needs the mlflow package: pip install ...'."""
    module, extra = PACKAGES[tracker]
    return f"{tracker} needs the {module} package: pip install 'grpo-flyte[{extra}]'"


def wandb_project_of(wandb_project: str | None, tracking_project: str) -> str:
    """The W&B project a run logs to: --wandb-project, else WANDB_PROJECT, else --tracking-project."""
    return wandb_project or os.environ.get("WANDB_PROJECT") or tracking_project
