"""`train_sweep` runs a sweep as one Flyte run on a cluster: a parent task fanning out one `train_rl`
per config (each in a `flyte.group` named for it), all at once, so that their `generate` calls
share the warm generate pool's replicas and their train steps the train pool's loaded base (a
sweep over base models: each base its own engine and loaded base on those replicas, and its own
folder among the task's `base_models`).

Each config is a whole run: its own adapter lineage, checkpoint, metrics, held-out evaluations
and report (its `train_rl` action's), and with W&B its own W&B run in the sweep's group: the
submitter's W&B id names the group, and each config's `train_rl` is submitted with a custom context
naming its run (`WandbRun.for_config`) and a link to it. A failing config ends alone: the others go on, and the
parent's report (the comparison, `grpo_flyte.reporting.sweep_report`) says which failed and why.

In Flyte local mode every task of a run shares one raw data folder and one checkpoint, so a local
sweep runs a Flyte run per config instead (`grpo_flyte.launch.sweep_folder`, `--local --sweep`).
"""

from __future__ import annotations

import asyncio

import flyte
import flyte.report
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte.config.grid import SweepMember
from grpo_flyte.driver import train_rl
from grpo_flyte.envs import driver_env
from grpo_flyte.errors import ConfigError, input_errors_not_retried
from grpo_flyte.reporting.sweep_report import ConfigOutcome, render_sweep_fragment
from grpo_flyte.reporting.tracking import WandbRun
from grpo_flyte.runtime.storage import is_remote
from grpo_flyte.types import Example, RunResult


class SweepConfigResult(BaseModel):
    """One config's end: its run's result, or why it failed."""

    name: str
    result: RunResult | None = None
    error: str | None = None


class SweepResult(BaseModel):
    configs: list[SweepConfigResult]


def outcome(member: SweepMember, result: RunResult | BaseException) -> ConfigOutcome:
    named = {"name": member.name, "overrides": member.overrides, "seed": member.config.seed, "model": member.config.base.model}
    if isinstance(result, BaseException):
        error = " ".join(str(result).split()) or type(result).__name__
        return ConfigOutcome(**named, status="failed", error=error)
    return ConfigOutcome(**named, status="complete", history=[row.flat() for row in result.history])


@driver_env.task(report=True)
async def train_sweep(
    members: list[SweepMember],
    base_models: dict[str, Dir],
    examples: list[Example] | None = None,
    examples_file: list[Dir] = [],  # noqa: B006 (as train_rl's)
    judge_model: Dir | None = None,
    reward_models: dict[str, Dir] | None = None,
) -> SweepResult:
    """Train every config of `members` (`config.grid.expand_sweep`) at once, one `train_rl` each,
    on the folder `base_models` maps its base model (its `model` option) to; returns each one's
    result or error, and publishes the comparison as this task's report."""
    with input_errors_not_retried("train_sweep"):
        missing = sorted({m.config.base.model for m in members} - base_models.keys())
        if missing:
            raise ConfigError(f"base_models has no folder for model {missing[0]!r}; expected one for each config's model")
        ctx = flyte.ctx()
        raw = ctx.raw_data_path.path if ctx and ctx.raw_data_path else None
        if len(members) > 1 and raw and not is_remote(raw):
            raise ConfigError(
                "train_sweep shares one raw data folder and checkpoint between its configs in Flyte local mode; "
                "expected a cluster run, or a local sweep: python -m grpo_flyte --local --sweep ... (grpo_flyte.launch.sweep_folder)"
            )

    chosen = WandbRun.from_context(ctx.custom_context if ctx else None)

    async def one(member: SweepMember) -> RunResult:
        # the config's own W&B run (its context and its task's link), else the task as declared
        run = chosen.for_config(member.name) if chosen else None
        task = train_rl.override(links=(WandbRun.link(),)) if run else train_rl
        with flyte.group(member.name), flyte.custom_context(**(run.context() if run else {})):
            return await task(
                member.config, base_models[member.config.base.model], examples, None, examples_file, judge_model, reward_models
            )

    results = await asyncio.gather(*(one(m) for m in members), return_exceptions=True)
    outcomes = [outcome(m, r) for m, r in zip(members, results, strict=True)]
    failed = any(o.status == "failed" for o in outcomes)
    await flyte.report.replace.aio(render_sweep_fragment(outcomes, "failed" if failed else "complete"), do_flush=True)
    return SweepResult(
        configs=[
            SweepConfigResult(name=o.name, result=r if not isinstance(r, BaseException) else None, error=o.error)
            for o, r in zip(outcomes, results, strict=True)
        ]
    )
