"""This module publishes what a run shows and hands out: the report (re-rendered into the task's
report tab after every iteration, and shown to observers), the final report folder, and the exported adapter (or merged
model) pushed to the Hugging Face Hub."""

from __future__ import annotations

import asyncio

import flyte
import flyte.report
from flyte.io import Dir

from grpo_flyte.config.constants import LIST_PRICES, PROG
from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop import observers
from grpo_flyte.loop.guard import untrained_best
from grpo_flyte.loop.state import LoopState
from grpo_flyte.report_helpers import render_report, render_report_fragment
from grpo_flyte.reporting import hub
from grpo_flyte.reporting.cost import cluster_accelerators, prices_with_defaults
from grpo_flyte.runtime.storage import LocalDirCache, publish_dir
from grpo_flyte.types import REPORT_FILE, AdapterRef, ExportCheck, MetricsRow

REPORT_TITLE = "grpo_flyte: GRPO + LoRA"


def cluster_pools() -> dict[str, tuple[str, int]] | None:
    """Each GPU pool's accelerators on a cluster (envs.py's settings: type and count per call); None
    in a local run, whose pools share this machine."""
    ctx = flyte.ctx()
    if not ctx or ctx.mode == "local":
        return None
    from grpo_flyte.envs import settings

    gpus = {
        "generate": settings.rollout_gpu,
        "judge": settings.judge_gpu,
        "reward_model": settings.reward_model_gpu,
        "train": settings.train_gpu,
    }
    return cluster_accelerators(gpus, settings.train_nodes)


async def publish_report(config: RunConfig, state: LoopState, status: str, message: str | None = None) -> str:
    """Render the report, put it in the task's report tab (a fragment: the tab is a page of its
    own), show the whole document to observers; returns the document."""
    parts = {
        "title": REPORT_TITLE,
        "status": status,
        "config": config.flat(),
        "history": [row.flat() for row in state.history],
        "best_completion": state.best_completion.model_dump() if state.best_completion else None,
        "held_out_answers": [answer.model_dump() for answer in state.held_out_sample],
        "completions": [c.model_dump() for c in state.completions],
        "message": message,
        "accelerators": cluster_pools(),
        "prices": prices_with_defaults(config.prices, LIST_PRICES),
    }
    html = render_report(**parts)
    observers.report(html)
    if flyte.ctx():
        await flyte.report.replace.aio(render_report_fragment(**parts), do_flush=True)
    return html


def exported(config: RunConfig, state: LoopState) -> tuple[AdapterRef, int]:
    """The adapter --push-to-hub and --export-merged take (--export-adapter), and its iteration:
    the best one (the final one when nothing was evaluated), or the final one."""
    best = state.guard.best
    if config.guard.export_adapter != "final" and best is not None:
        return best.adapter, best.iteration
    return state.adapter, state.iterations_done


def unchosen_start(config: RunConfig, history: list[MetricsRow]) -> str | None:
    """Why the run's merge and push are skipped, when they are: no trained adapter beat the start
    (`guard.untrained_best`), --export-adapter was left unset, and --export-merged, --export-gguf or
    --push-to-hub asked for one. The untrained adapter is the base model itself; shipping it in silence would
    look like a fine-tune. None: nothing is skipped."""
    asked = [
        f
        for f, on in (
            ("--export-merged", config.export_merged),
            ("--export-gguf", config.export_gguf),
            ("--push-to-hub", config.push_to_hub),
        )
        if on
    ]
    if not asked or config.guard.export_adapter is not None or not untrained_best(history):
        return None
    return (
        f"{' and '.join(asked)} skipped: best/ is the untrained start; choose with --export-adapter final (the last "
        "iteration's adapter) or best (the start), e.g. a local run: "
        f"{PROG} --local --resume --run-dir DIR --export-adapter final"
    )


async def push_to_hub(
    config: RunConfig, history: list[MetricsRow], folder: Dir, check: ExportCheck, iteration: int, folders: LocalDirCache
) -> str:
    """Upload `folder`, a form that passed its check (`check`: the merged model's, or the adapter's
    files as uploaded: loop.shipping), with its model card stating the check's figures
    (`hub.push_folder`), read through `folders` (the driver's download cache). A failure fails the
    run after its last checkpoint: a resume (or the driver's retry) goes straight to the export and
    tries again."""
    if not check.passed:
        raise ValueError(f"push_to_hub given a form that failed its check: {check.failure}")
    path = await folders.get(folder)
    card = hub.model_card(config, history, merged=check.form == "merged", iteration=iteration, check=check)
    return await asyncio.to_thread(hub.push_folder, path, config.push_to_hub, card)


async def report_dir(html: str, version: int) -> Dir:
    """The final report as a task output: a folder holding `report.html`, published like an adapter
    (locally it stays under the run's raw data; a temp folder would be gone once this returns).

    A Dir rather than a File: `File.from_local` requires `flyte.init()`, which a local run started
    with `flyte.with_runcontext(mode="local")` need not have called.
    """
    folder, _ = await publish_dir(lambda out: (out / REPORT_FILE).write_text(html, encoding="utf-8"), f"v{version:04d}", folder="reports")
    return folder
