"""`train_rl`: the GRPO loop as one async Flyte task.

Per iteration, inside `flyte.group(f"iter-{i}")`:
    sample prompts -> generate (one task per prompt, fanned out) -> score each group as it lands
    -> (optionally top up with fresh prompts until enough groups are informative)
    -> GRPO step(s) -> (held-out evaluation every `eval_every`) -> checkpoint -> metrics and report.
The held-out evaluation also runs before the first iteration and after the last.

Run it with `python -m grpo_flyte.driver --local` (this machine, Flyte local mode, the embedded
model) or without `--local` against the cluster in your Flyte config; `--help` lists every option.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import flyte
import flyte.report
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte.config import RunConfig
from grpo_flyte.data import Example, sample_prompts, topup_prompts, train_eval_split
from grpo_flyte.envs import driver_env
from grpo_flyte.files import build_dir_atomic, write_text_atomic
from grpo_flyte.report_helpers import render_report
from grpo_flyte.reward import ScoredGroup, score_group, score_groups
from grpo_flyte.rollout import AdapterRef, generate, generate_eval
from grpo_flyte.tracking import Tracker, new_run_id
from grpo_flyte.trainer import TrainStepResult, init_adapter, merge_adapter, train_step

logger = logging.getLogger("grpo_flyte")

METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
# Held-out questions per generate_eval task: spread over the warm pool, batched within a replica.
EVAL_CHUNK = 64
REPORT_FILE = "report.html"
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"


class LoopState(BaseModel):
    """Everything needed to continue a run: saved to flyte.Checkpoint after every iteration."""

    iterations_done: int
    adapter: AdapterRef
    history: list[dict[str, Any]]
    best_completion: dict[str, Any] | None = None
    # The experiment-tracking run this loop logs to (kept so that a resumed run continues it).
    tracking_id: str = ""


def rollout_seed(seed: int, iteration: int, index: int) -> int:
    """The sampling seed of one group: a function of (run seed, iteration, prompt) only."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its normal-approximation 95% interval (1.96 standard errors)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.inf
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(n)


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def reward_means(config: RunConfig, scored: list[ScoredGroup], prefix: str = "") -> dict[str, float]:
    """Each weighted reward's mean (unweighted) score, keyed '<prefix>reward/<name>', and how many
    (completion, reward) scores failed and counted as 0 (on_reward_error='zero')."""
    parts = [p for sg in scored for p in sg.rewards]
    means = {f"{prefix}reward/{name}": statistics.fmean(p.scores[name] for p in parts) for name in config.rewards}
    return {**means, f"{prefix}reward_errors": sum(len(p.errors) for p in parts)}


def iteration_metrics(
    config: RunConfig, iteration: int, scored: list[ScoredGroup], result: TrainStepResult, timings: dict[str, float]
) -> dict[str, Any]:
    parts = [p for sg in scored for p in sg.rewards]
    rollouts = [r for sg in scored for r in sg.group.rollouts]
    lengths = [len(r.completion_ids) for r in rollouts]
    stats = result.stats
    return {
        "iteration": iteration,
        "adapter_version": result.adapter.version,
        "mean_reward": statistics.fmean(p.reward for p in parts),
        "accuracy": statistics.fmean(p.correct for p in parts),
        "format_rate": statistics.fmean(p.format for p in parts),
        **reward_means(config, scored),
        "loss": stats.loss,
        "num_rollouts": len(parts),
        "num_groups": len(scored),
        "topup_groups": len(scored) - config.prompts_per_iter,
        "num_contributing": result.num_contributing,
        "frac_zero_std_groups": sum(not sg.informative(config.truncated) for sg in scored) / len(scored),
        "num_updates": stats.num_updates,
        "num_tokens": stats.num_tokens,
        "kl": stats.kl,
        "clip_fraction": stats.clip_fraction,
        "is_ratio_mean": stats.is_ratio_mean,
        "is_ratio_max": stats.is_ratio_max,
        "entropy": stats.entropy,
        "grad_norm": stats.grad_norm,
        "completion_len_mean": statistics.fmean(lengths),
        "completion_len_max": max(lengths),
        "truncated_fraction": statistics.fmean(r.finish_reason == "length" for r in rollouts),
        **timings,
        "generate_tokens_per_s": _per_second(sum(lengths), timings["generate_s"]),
        "score_tokens_per_s": _per_second(sum(lengths), sum(sg.score_s for sg in scored)),
        "train_tokens_per_s": _per_second(stats.num_tokens, timings["train_s"]),
    }


def best_completion(scored: list[ScoredGroup]) -> dict[str, Any]:
    sg, i = max(((sg, i) for sg in scored for i in range(len(sg.rewards))), key=lambda x: x[0].rewards[x[1]].reward)
    return {
        "question": sg.group.example.question,
        "answer": sg.group.example.answer,
        "completion": sg.group.rollouts[i].text,
        "reward": sg.rewards[i].reward,
    }


async def generate_and_score(
    generating: list[asyncio.Task], score: Callable[[Any], Awaitable[Any]]
) -> tuple[list[Any], float, float]:
    """Score each generate result the moment it lands; on any failure cancel everything in flight.

    Returns the scores in landing order, the seconds until the last generate task finished, and
    the scoring tail after it.
    """
    started = time.perf_counter()
    scoring: list[asyncio.Task] = []
    try:
        for next_result in asyncio.as_completed(generating):
            scoring.append(asyncio.create_task(score(await next_result)))
        generated = time.perf_counter()
        results = await asyncio.gather(*scoring)
    except BaseException:
        for task in generating + scoring:
            task.cancel()
        raise
    return results, generated - started, time.perf_counter() - generated


async def run_iteration(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int
) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float]]:
    started = time.perf_counter()
    prompts = sample_prompts(dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter)
    scored: list[ScoredGroup] = []
    timings = {"generate_s": 0.0, "score_s": 0.0}  # score_s: the scoring tail after generation
    for round_ in range(config.max_topup_rounds + 1):
        first = len(scored)
        generating = [
            asyncio.create_task(
                generate(config, base_model, adapter, ex, first + i, rollout_seed(config.seed, iteration, first + i))
            )
            for i, ex in enumerate(prompts)
        ]
        landed, gen_s, tail_s = await generate_and_score(generating, lambda group: score_group(config, group))
        scored.extend(landed)
        timings["generate_s"] += gen_s
        timings["score_s"] += tail_s
        missing = config.min_informative_groups - sum(sg.informative(config.truncated) for sg in scored)
        if missing <= 0 or round_ == config.max_topup_rounds:
            break
        prompts = topup_prompts(dataset, seed=config.seed, iteration=iteration, round_=round_, num=missing)
    scored.sort(key=lambda sg: sg.group.index)
    scored_at = time.perf_counter()
    result = await train_step(config, base_model, adapter, scored)
    finished = time.perf_counter()
    timings["train_s"] = finished - scored_at
    timings["iteration_s"] = finished - started
    return scored, result, timings


async def run_eval(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, questions: list[Example]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Greedy answers to the held-out questions on the generate pool: metrics and per-question rows."""
    started = time.perf_counter()
    generating = [
        asyncio.create_task(generate_eval(config, base_model, adapter, questions[i : i + EVAL_CHUNK], i))
        for i in range(0, len(questions), EVAL_CHUNK)
    ]
    landed, _, _ = await generate_and_score(generating, lambda groups: score_groups(config, groups))
    scored: list[ScoredGroup] = sorted((sg for chunk in landed for sg in chunk), key=lambda sg: sg.group.index)
    rows = [
        {
            "question": sg.group.example.question,
            "answer": sg.group.example.answer,
            "completion": sg.group.rollouts[0].text,
            "reward": sg.rewards[0].reward,
            "correct": sg.rewards[0].correct,
            "format": sg.rewards[0].format,
            "scores": sg.rewards[0].scores,
        }
        for sg in scored
    ]
    reward, reward_ci = mean_ci95([r["reward"] for r in rows])
    accuracy, accuracy_ci = mean_ci95([float(r["correct"]) for r in rows])
    metrics = {
        "eval_reward": reward,
        "eval_reward_ci95": reward_ci,
        "eval_accuracy": accuracy,
        "eval_accuracy_ci95": accuracy_ci,
        "eval_format_rate": statistics.fmean(r["format"] for r in rows),
        **reward_means(config, scored, prefix="eval_"),
        "eval_size": len(rows),
        "eval_s": time.perf_counter() - started,
    }
    return metrics, rows


def eval_due(config: RunConfig, iterations_done: int) -> bool:
    """Whether the held-out evaluation runs after this many iterations (0: before training)."""
    if config.eval_size == 0:
        return False
    if iterations_done in (0, config.num_iterations):
        return True
    return config.eval_every > 0 and iterations_done % config.eval_every == 0


class LocalRunFiles:
    """The files of a local run under --run-dir, each written atomically."""

    def __init__(self, run_dir: str | None):
        self.root = Path(run_dir) if run_dir else None

    def write_metrics(self, history: list[dict[str, Any]]) -> None:
        # Rewritten whole from the checkpointed history: a resumed run records each iteration once.
        if self.root:
            text = "".join(json.dumps(row) + "\n" for row in history)
            write_text_atomic(self.root / METRICS_FILE, text)

    def write_eval(self, iteration: int, rows: list[dict[str, Any]]) -> None:
        """Per-question held-out answers of one evaluation: eval/iter-NNNN.jsonl."""
        if self.root:
            text = "".join(json.dumps({"iteration": iteration, **row}) + "\n" for row in rows)
            write_text_atomic(self.root / EVAL_DIR / f"iter-{iteration:04d}.jsonl", text)

    def write_report(self, html: str) -> None:
        if self.root:
            write_text_atomic(self.root / REPORT_FILE, html)

    def export_adapter(self, adapter: AdapterRef) -> None:
        if self.root and "://" not in adapter.dir.path:
            build_dir_atomic(self.root / ADAPTER_DIR, lambda d: shutil.copytree(adapter.dir.path, d, dirs_exist_ok=True))

    def export_merged(self, merged: Dir) -> str:
        """Move the (complete) merged model folder to <run-dir>/merged: a rename, so never half there.

        Returns where the merged model now is.
        """
        if not self.root or "://" in merged.path:
            return merged.path
        target = self.root / MERGED_DIR
        shutil.rmtree(target, ignore_errors=True)
        os.replace(merged.path, target)
        return str(target)

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
    held_out = (
        f"held-out reward {row['eval_reward']:.3f} +- {row['eval_reward_ci95']:.3f}  "
        f"acc {row['eval_accuracy']:.1%}  format {row['eval_format_rate']:.1%}  "
        f"(n={row['eval_size']}, {row['eval_s']:.1f}s)"
        if "eval_reward" in row
        else ""
    )
    if "mean_reward" not in row:  # the evaluation before training
        return f"iter 0/{total}  {held_out}"
    # accuracy and format rate are shown anyway; other rewards and failed scores are added
    others = "".join(
        f"  {key.removeprefix('reward/')} {value:.3f}"
        for key, value in row.items()
        if key.startswith("reward/") and key not in ("reward/correct", "reward/format")
    )
    errors = f"  reward errors {row['reward_errors']}" if row.get("reward_errors") else ""
    return (
        f"iter {row['iteration']}/{total}  reward {row['mean_reward']:.3f}  acc {row['accuracy']:.1%}  "
        f"format {row['format_rate']:.1%}{others}{errors}  loss {row['loss']:+.4f}  len {row['completion_len_mean']:.0f}  "
        f"| generate {row['generate_s']:.1f}s  score {row['score_s']:.1f}s  train {row['train_s']:.1f}s  "
        f"total {row['iteration_s']:.1f}s" + (f"\n  {held_out}" if held_out else "")
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

    `examples` overrides `config.dataset` (the CLI passes the rows of a dataset file this way);
    `run_dir` is where a local run writes its files; `resume_from` is a checkpoint to continue from.
    """
    dataset, held_out = train_eval_split(config, examples)
    files = LocalRunFiles(run_dir)
    checkpoint, state = await restore_state(resume_from)
    if state is None:
        adapter = await init_adapter(config, base_model)
        state = LoopState(iterations_done=0, adapter=adapter, history=[], tracking_id=new_run_id())
    else:
        logger.info("resuming after iteration %d (adapter v%d)", state.iterations_done, state.adapter.version)
        if not state.tracking_id:  # a checkpoint written before tracking ids existed
            state = state.model_copy(update={"tracking_id": new_run_id()})
    tracker = Tracker(config.wandb_project, state.tracking_id, config.model_dump(mode="json"), run_dir)

    async def record(new_state: LoopState, row: dict[str, Any]) -> LoopState:
        """Checkpoint, then rewrite the run files and the report from the checkpointed state."""
        if checkpoint is not None:
            await checkpoint.save(new_state.model_dump_json().encode())
        files.write_metrics(new_state.history)
        tracker.log(row)
        files.prune_adapters(new_state.adapter, config.adapters_to_keep)
        await publish_report(config, new_state, files, "running")
        logger.info(progress_line(row, config.num_iterations))
        return new_state

    try:
        if eval_due(config, 0) and not any(row["iteration"] == 0 for row in state.history):
            with flyte.group("eval-0"):
                metrics, answers = await run_eval(config, base_model, state.adapter, held_out)
            files.write_eval(0, answers)
            row = {"iteration": 0, "adapter_version": state.adapter.version, **metrics}
            state = await record(state.model_copy(update={"history": [row, *state.history]}), row)
        while state.iterations_done < config.num_iterations:
            it = state.iterations_done
            with flyte.group(f"iter-{it + 1}"):
                scored, result, timings = await run_iteration(config, base_model, state.adapter, dataset, it)
                row = iteration_metrics(config, it + 1, scored, result, timings)
                if eval_due(config, it + 1):
                    metrics, answers = await run_eval(config, base_model, result.adapter, held_out)
                    row.update(metrics)
                    files.write_eval(it + 1, answers)
            state = await record(
                LoopState(
                    iterations_done=it + 1,
                    adapter=result.adapter,
                    history=[*state.history, row],
                    best_completion=best_completion(scored),
                    tracking_id=state.tracking_id,
                ),
                row,
            )
    except Exception as exc:
        await publish_report(config, state, files, "failed", f"{type(exc).__name__}: {exc}")
        tracker.finish(failed=True)
        raise
    files.export_adapter(state.adapter)
    if config.export_merged:
        with flyte.group("export"):
            merged = await merge_adapter(config, base_model, state.adapter)
        where = files.export_merged(merged)
        logger.info("merged model (base + adapter v%d): %s", state.adapter.version, where)
    await publish_report(config, state, files, "complete")
    tracker.finish()
    return state.adapter


def main(argv: list[str] | None = None) -> int:
    from grpo_flyte.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
