"""This module writes a local run folder's files as the driver reports progress, each whole
(atomically), and the finished run's exports: its adapter, best adapter and merged model.

`metrics.jsonl` is rewritten from the checkpointed history (a resumed run records each iteration
once); old adapter versions are pruned but the best one's, which a rollback restores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from grpo_flyte.config.run import RunConfig
from grpo_flyte.launch.run_folder import ADAPTER_DIR, BEST_DIR, COMPLETIONS_DIR, EVAL_DIR, FLYTE_DATA, GGUF_DIR, MERGED_DIR, METRICS_FILE
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import best_summary
from grpo_flyte.loop.publishing import unchosen_start
from grpo_flyte.loop.state import LoopState
from grpo_flyte.loop.verification import EXPORT_FILE, RUN_FAILED_TAIL, check_line
from grpo_flyte.reporting.cost import totals, where_the_time_went
from grpo_flyte.runtime.files import build_dir_atomic, write_text_atomic
from grpo_flyte.runtime.storage import is_remote
from grpo_flyte.types import OPTIMIZER_FILE, REPORT_FILE, AdapterRef, MemoryPeak, MetricsRow, RunResult

logger = logging.getLogger("grpo_flyte")


class LocalRunFiles:
    """The files of a local run folder, each written whole (atomically) as the driver reports progress."""

    def __init__(self, root: Path, adapters_to_keep: int):
        self.root = root
        self.adapters_to_keep = adapters_to_keep

    def recorded(self, state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> None:
        # Rewritten whole from the checkpointed history: a resumed run records each iteration once.
        text = "".join(json.dumps(r.flat()) + "\n" for r in state.history)
        write_text_atomic(self.root / METRICS_FILE, text)
        if answers is not None:
            rows = "".join(json.dumps({"iteration": row.iteration, **a.model_dump(exclude_none=True)}) + "\n" for a in answers)
            write_text_atomic(self.root / EVAL_DIR / f"iter-{row.iteration:04d}.jsonl", rows)
        sample = [c for c in state.completions if c.iteration == row.iteration]
        if sample:  # --log-completions; a file per iteration, so a resumed run rewrites an iteration's whole
            rows = "".join(json.dumps(c.model_dump()) + "\n" for c in sample)
            write_text_atomic(self.root / COMPLETIONS_DIR / f"iter-{row.iteration:04d}.jsonl", rows)
        self.prune_adapters(state.adapter, keep=state.guard.best.adapter if state.guard.best else None)
        # batches that travelled as files (storage.as_payload) are consumed once the step is checkpointed
        for payload in (self.root / FLYTE_DATA / "payloads").glob("scored-*"):
            shutil.rmtree(payload, ignore_errors=True)

    def report(self, html: str) -> None:
        write_text_atomic(self.root / REPORT_FILE, html)

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        """An evaluation's answers are written once it is recorded."""

    def prune_adapters(self, current: AdapterRef, keep: AdapterRef | None = None) -> None:
        """Delete adapter versions older than the newest `adapters_to_keep` from the run's Flyte data,
        but `keep`'s folder (the best adapter: a rollback restores it, the export writes it)."""
        path = Path(current.dir.path)
        if is_remote(current.dir.path) or not path.parent.is_dir():
            return
        kept = Path(keep.dir.path).resolve() if keep is not None and not is_remote(keep.dir.path) else None
        for old in path.parent.glob("v[0-9]*"):
            if old.name[1:].isdigit() and int(old.name[1:]) <= current.version - self.adapters_to_keep and old.resolve() != kept:
                shutil.rmtree(old, ignore_errors=True)

    def export_adapter(self, adapter: AdapterRef, name: str = ADAPTER_DIR) -> Path:
        """An adapter to share, as the run folder's `name` (adapter/, best/): PEFT's files, naming a
        base others can load; the optimizer state stays with the run's adapter versions
        (flyte/adapters), which a resume reads."""

        def copy(d: Path) -> None:
            shutil.copytree(adapter.dir.path, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns(OPTIMIZER_FILE))

        build_dir_atomic(self.root / name, copy)
        return self.root / name

    def export_merged(self, merged_path: str, name: str = MERGED_DIR) -> Path:
        """Move the (complete) merged model folder (or the GGUF form's) into the run folder as `name`:
        a rename, so never half there."""
        target = self.root / name
        shutil.rmtree(target, ignore_errors=True)
        os.replace(merged_path, target)
        return target


def peak_words(peak: MemoryPeak, history: list[MetricsRow] = ()) -> str:
    """A run's peak memory for its last lines: `peak`, this process's tree over the run, and the
    largest GPU peak its rows recorded (reserved by torch in the generate and train tasks)."""
    gpu = [
        v
        for row in history
        if row.memory is not None
        for v in (row.memory.generate_peak_gpu_gb, row.memory.train_peak_gpu_gb)
        if v is not None
    ]
    on_gpu = f", GPU {max(gpu):.2f} GB (torch's peak reserved)" if gpu else ""
    return f"peak memory {peak.rss_gb:.2f} GB resident (this process and its children){on_gpu}"


def finish_local_run(files: LocalRunFiles, config: RunConfig, result: RunResult, peak: MemoryPeak | None = None) -> int:
    """A finished run's folder completed: the adapter (and best adapter, merged model) exported,
    and the lines that say where they are, the run's peak memory (`peak`: this process's tree over
    the run; a sweep's configs share the process, so the sweep says it once) and which adapter was
    best. Its exit status: 1 when the run's export or GGUF form failed its check (those lines last), else 0."""
    run_dir = files.root
    files.export_adapter(result.adapter)
    best = f", best adapter {files.export_adapter(result.best, BEST_DIR)}" if result.best is not None else ""
    went = where_the_time_went(totals([row.flat() for row in result.history]))
    went = f"; the time went to {went}" if went else ""
    where = (run_dir / ADAPTER_DIR, best, run_dir / REPORT_FILE, run_dir / METRICS_FILE)
    if peak is None:
        logger.info("done: adapter %s%s, report %s, metrics %s%s", *where, went)
    else:
        logger.info("done: adapter %s%s, report %s, metrics %s%s; %s", *where, went, peak_words(peak, result.history))
    if result.merged is not None:
        merged = result.best if config.guard.export_adapter != "final" and result.best is not None else result.adapter
        where = files.export_merged(result.merged.path)
        logger.info(
            "merged model (base + adapter v%d; loads with AutoModelForCausalLM.from_pretrained, no PEFT): %s", merged.version, where
        )
        if result.export_check is not None and result.export_check.form == "merged":
            # export.json as the export command writes it: the folder's path in the run folder
            check = result.export_check.model_copy(update={"path": str(where)})
            write_text_atomic(where / EXPORT_FILE, check.model_dump_json(indent=2) + "\n")
            logger.info("%s", check_line(check))
    if result.gguf is not None and result.gguf_check is not None:  # as `export RUN --to gguf` names it
        where = files.export_merged(result.gguf.path, GGUF_DIR.format(quant=config.export_gguf))
        check = result.gguf_check.model_copy(update={"path": str(where)})
        write_text_atomic(where / EXPORT_FILE, check.model_dump_json(indent=2) + "\n")
        logger.info("%s", check_line(check))
    stopped = next((r.guard.guard_reason for r in result.history if r.guard and r.guard.guard_event in ("stop", "early_stop")), None)
    summary = "; ".join(line for line in (best_summary(result.history), unchosen_start(config, result.history)) if line)
    for line in (stopped, summary):
        if line:
            logger.info("%s", line)  # the last line: which adapter was best, and by how much
    failed = [c for c in (result.export_check, result.gguf_check) if c is not None and not c.passed]
    for check in failed:
        logger.error("%s", check_line(check, RUN_FAILED_TAIL))
    return 1 if failed else 0
