"""`train_rl`: the GRPO loop as one async Flyte task.

Per iteration, inside `flyte.group(f"iter-{i}")`:
    sample prompts -> generate (one task per prompt, fanned out) -> score each group as it lands
    -> one GRPO step -> checkpoint -> metrics and report.

Run it with `python -m grpo_flyte.driver --local` (this machine, Flyte local mode, the embedded
model) or without `--local` against the cluster in your Flyte config; `--help` lists every option.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import flyte
import flyte.report
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte.config import RunConfig
from grpo_flyte.data import Example, load_train_examples, sample_prompts
from grpo_flyte.envs import driver_env
from grpo_flyte.files import build_dir_atomic
from grpo_flyte.report_helpers import render_report, write_report_atomic
from grpo_flyte.reward import ScoredGroup, score_group
from grpo_flyte.rollout import AdapterRef, generate
from grpo_flyte.trainer import TrainStepResult, init_adapter, train_step

logger = logging.getLogger("grpo_flyte")

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.html"
ADAPTER_DIR = "adapter"


class LoopState(BaseModel):
    """Everything needed to continue a run: saved to flyte.Checkpoint after every iteration."""

    iterations_done: int
    adapter: AdapterRef
    history: list[dict[str, Any]]
    best_completion: dict[str, Any] | None = None


def rollout_seed(seed: int, iteration: int, index: int) -> int:
    """The sampling seed of one group: a function of (run seed, iteration, prompt) only."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def iteration_metrics(iteration: int, scored: list[ScoredGroup], result: TrainStepResult, timings: dict[str, float]) -> dict[str, Any]:
    parts = [p for sg in scored for p in sg.rewards]
    lengths = [len(r.completion_ids) for sg in scored for r in sg.group.rollouts]
    return {
        "iteration": iteration,
        "adapter_version": result.adapter.version,
        "mean_reward": statistics.fmean(p.reward for p in parts),
        "accuracy": statistics.fmean(p.correct for p in parts),
        "format_rate": statistics.fmean(p.format for p in parts),
        "loss": result.loss,
        "num_rollouts": len(parts),
        "num_contributing": result.num_contributing,
        "grad_norm": result.grad_norm,
        "num_tokens": result.num_tokens,
        "completion_len_mean": statistics.fmean(lengths),
        "completion_len_max": max(lengths),
        **timings,
    }


def best_completion(scored: list[ScoredGroup]) -> dict[str, Any]:
    sg, i = max(((sg, i) for sg in scored for i in range(len(sg.rewards))), key=lambda x: x[0].rewards[x[1]].reward)
    return {
        "question": sg.group.example.question,
        "answer": sg.group.example.answer,
        "completion": sg.group.rollouts[i].text,
        "reward": sg.rewards[i].reward,
    }


async def run_iteration(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, prompts: list[Example], iteration: int
) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float]]:
    started = time.perf_counter()
    generating = [
        asyncio.create_task(generate(config, base_model, adapter, example, i, rollout_seed(config.seed, iteration, i)))
        for i, example in enumerate(prompts)
    ]
    scoring: list[asyncio.Task] = []
    try:
        for next_group in asyncio.as_completed(generating):
            scoring.append(asyncio.create_task(score_group(await next_group)))
        generated = time.perf_counter()
        scored = sorted(await asyncio.gather(*scoring), key=lambda sg: sg.group.index)
    except BaseException:
        for task in generating + scoring:
            task.cancel()
        raise
    scored_at = time.perf_counter()
    result = await train_step(config, base_model, adapter, scored)
    finished = time.perf_counter()
    timings = {
        "generate_s": generated - started,
        "score_s": scored_at - generated,  # scoring overlaps generation; this is the tail after it
        "train_s": finished - scored_at,
        "iteration_s": finished - started,
    }
    return scored, result, timings


class LocalRunFiles:
    """The files of a local run under --run-dir, each written atomically."""

    def __init__(self, run_dir: str | None):
        self.root = Path(run_dir) if run_dir else None

    def write_metrics(self, history: list[dict[str, Any]]) -> None:
        # Rewritten whole from the checkpointed history: a resumed run records each iteration once.
        if self.root:
            text = "".join(json.dumps(row) + "\n" for row in history)
            write_report_atomic(self.root / METRICS_FILE, text)  # any text file: temp, fsync, rename

    def write_report(self, html: str) -> None:
        if self.root:
            write_report_atomic(self.root / REPORT_FILE, html)

    def export_adapter(self, adapter: AdapterRef) -> None:
        if self.root and "://" not in adapter.dir.path:
            build_dir_atomic(self.root / ADAPTER_DIR, lambda d: shutil.copytree(adapter.dir.path, d, dirs_exist_ok=True))

    def prune_adapters(self, current: AdapterRef, keep: int) -> None:
        path = Path(current.dir.path)
        if not self.root or "://" in current.dir.path or not path.parent.is_dir():
            return
        for old in path.parent.glob("v[0-9]*"):
            if old.name[1:].isdigit() and int(old.name[1:]) <= current.version - keep:
                shutil.rmtree(old, ignore_errors=True)


async def publish_report(config: RunConfig, state: LoopState, files: LocalRunFiles, status: str, message: str | None = None) -> None:
    html = render_report(
        title="grpo_flyte: GRPO + LoRA",
        status=status,
        config=config.model_dump(mode="json"),
        history=state.history,
        best_completion=state.best_completion,
        message=message,
    )
    files.write_report(html)
    if flyte.ctx():
        await flyte.report.replace.aio(html, do_flush=True)


def progress_line(row: dict[str, Any], total: int) -> str:
    return (
        f"iter {row['iteration']}/{total}  reward {row['mean_reward']:.3f}  acc {row['accuracy']:.1%}  "
        f"format {row['format_rate']:.1%}  loss {row['loss']:+.4f}  len {row['completion_len_mean']:.0f}  "
        f"| generate {row['generate_s']:.1f}s  score {row['score_s']:.1f}s  train {row['train_s']:.1f}s  "
        f"total {row['iteration_s']:.1f}s"
    )


async def restore_state(resume_from: str | None) -> tuple[flyte.Checkpoint | None, LoopState | None]:
    """The checkpoint to save to, and the state saved by an earlier attempt or run, if any."""
    ctx = flyte.ctx()
    checkpoint = ctx.checkpoint if ctx else None
    if checkpoint is not None and resume_from:
        checkpoint = flyte.Checkpoint(checkpoint.remote_destination, resume_from)
    previous = await checkpoint.load() if checkpoint is not None else None
    if previous is None:
        return checkpoint, None
    payload = Path(previous).read_bytes()
    state = LoopState.model_validate_json(payload)
    # Re-save at once so that every later attempt sees it, even if this one dies before its first
    # iteration (the previous-checkpoint path always points at attempt 1: flyteorg/flyte#2894).
    await checkpoint.save(payload)
    return checkpoint, state


@driver_env.task(report=True)
async def train_rl(
    config: RunConfig,
    base_model: Dir,
    examples: list[Example] | None = None,
    run_dir: str | None = None,
    resume_from: str | None = None,
) -> AdapterRef:
    """Run GRPO for `config.num_iterations` iterations and return the final adapter.

    `examples` overrides `config.dataset` (the CLI passes the rows of a .jsonl file this way);
    `run_dir` is where a local run writes its files; `resume_from` is a checkpoint to continue from.
    """
    dataset = examples if examples is not None else load_train_examples(config.dataset)
    files = LocalRunFiles(run_dir)
    checkpoint, state = await restore_state(resume_from)
    if state is None:
        state = LoopState(iterations_done=0, adapter=await init_adapter(config, base_model), history=[])
    else:
        logger.info("resuming after iteration %d (adapter v%d)", state.iterations_done, state.adapter.version)
    try:
        while state.iterations_done < config.num_iterations:
            it = state.iterations_done
            prompts = sample_prompts(dataset, seed=config.seed, iteration=it, num=config.prompts_per_iter)
            with flyte.group(f"iter-{it}"):
                scored, result, timings = await run_iteration(config, base_model, state.adapter, prompts, it)
            row = iteration_metrics(it + 1, scored, result, timings)
            state = LoopState(
                iterations_done=it + 1,
                adapter=result.adapter,
                history=[*state.history, row],
                best_completion=best_completion(scored),
            )
            if checkpoint is not None:
                await checkpoint.save(state.model_dump_json().encode())
            files.write_metrics(state.history)
            files.prune_adapters(state.adapter, config.adapters_to_keep)
            await publish_report(config, state, files, "running")
            logger.info(progress_line(row, config.num_iterations))
    except Exception as exc:
        await publish_report(config, state, files, "failed", f"{type(exc).__name__}: {exc}")
        raise
    await publish_report(config, state, files, "complete")
    files.export_adapter(state.adapter)
    return state.adapter


def main(argv: list[str] | None = None) -> int:
    from grpo_flyte.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
