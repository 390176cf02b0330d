"""This module checks what a finished run ships before it leaves: --export-merged's merged model,
--export-gguf's GGUF file and --push-to-hub's upload, each evaluated on the run's held-out
questions and paired against the adapter it came from, as the export command checks its forms
(the same functions: `greedy`, `check_form`).

- The merged model: `merge_adapter` (a task on the train pool) writes it; the run's held-out
  evaluation (`loop.evaluation.run_eval`, the generate pool) answers with it loaded as a plain model
  with its own tokenizer and chat template; `loop.verification.compare` pairs its answers with the
  adapter's. Passed: `export.json` is written into the folder and the folder is the run's `merged`.
  Failed: the folder is removed (a local one; on a cluster it stays in the run's raw data, never
  returned) and the run keeps its adapters and report.
- The GGUF file: `write_gguf` (a task on the train pool) writes the merged model (merged here when
  --export-merged was not given, and that merge then removed; a merge that failed its own check
  writes none) as one file in --export-gguf's type, alone in a folder; the held-out evaluation
  reads it on the transformers engine (`hf_engine`: transformers' GGUF loader), and the adapter's
  answers it is paired with are the transformers engine's too (evaluated again unless the run's
  --backend is hf), as the export command checks the form. Passed: export.json, the run's `gguf`;
  failed: removed. The push never takes it.
- The upload: the merged model when --export-merged (only if it passed), else the adapter's files as
  they are uploaded (without the optimizer state), staged as a folder of their own and evaluated
  through PEFT on the run's base. A failed check pushes nothing.

The adapter's answers are the run's own evaluation of it when that evaluation was greedy and is at
hand (`kept`: the driver keeps the last and the best); otherwise it is evaluated greedily here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import flyte
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.evaluation import run_eval
from grpo_flyte.loop.guard import Metric
from grpo_flyte.loop.publishing import exported, push_to_hub
from grpo_flyte.loop.state import LoopState
from grpo_flyte.loop.verification import DEFAULT_MAX_DISAGREEMENT, EXPORT_FILE, RUN_FAILED_TAIL, check_line, compare
from grpo_flyte.reporting.hub import NOT_SHARED
from grpo_flyte.runtime.files import write_text_atomic
from grpo_flyte.runtime.storage import LocalDirCache, is_remote, publish_dir
from grpo_flyte.trainer import merge_adapter, write_gguf
from grpo_flyte.types import AdapterRef, Example, ExportCheck

logger = logging.getLogger("grpo_flyte")

LOADED_MERGED = "transformers AutoModelForCausalLM (no PEFT) with its own tokenizer and chat template"
LOADED_ADAPTER = "PEFT PeftModel.from_pretrained on the run's base"
LOADED_GGUF = (
    "transformers' GGUF loader (from_pretrained with gguf_file=, dequantized), its tokenizer and chat template "
    "read from the file (llama.cpp itself not run)"
)


class Shipped(NamedTuple):
    """What the run shipped: the merged model (None unless asked for and passed), the check of the
    form it shipped or tried to (None: nothing was asked for), the Hub repo's URL (None: no push),
    the GGUF form's folder (None unless asked for and passed) and its check (None: not asked for,
    or no passed merge to write it from)."""

    merged: Dir | None
    check: ExportCheck | None
    url: str | None
    gguf: Dir | None = None
    gguf_check: ExportCheck | None = None


def hf_engine(config: RunConfig):
    """The run's engine settings on the transformers backend (the one that reads a GGUF file)."""
    return config.engine.model_copy(update={"backend": "hf"})


def greedy(config: RunConfig) -> RunConfig:
    """The config an export is evaluated with: one greedy completion a question, whatever the run's
    --num-generations-eval, so that the export's answers compare with the adapter's word for word."""
    return config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"num_generations_eval": None})})


async def check_form(
    config: RunConfig,
    model: Dir,
    answering: AdapterRef | None,
    held_out: list[Example],
    reference: list[EvalAnswer],
    metric: Metric,
    names: dict[str, object],
    max_disagreement: float = DEFAULT_MAX_DISAGREEMENT,
    iteration: int = 0,
) -> ExportCheck:
    """An exported form's check: `answering` on `model` (None: `model` as it is) answers the
    held-out questions greedily with the run's evaluation, compared with the adapter's answers
    `reference` (`loop.verification.compare`); `names`: the check's form, path, loaded_with, adapter
    and adapter_iteration."""
    _, answers = await run_eval(greedy(config), model, answering, held_out, iteration)
    return compare(answers, reference, metric, max_disagreement, **names)


async def adapter_answers(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, held_out: list[Example], kept: dict[int, list[EvalAnswer]], iteration: int
) -> list[EvalAnswer]:
    """The adapter's greedy held-out answers: the run's own (`kept`, by adapter version, when its
    evaluation was greedy), else a greedy evaluation now."""
    if config.evaluation.num_generations_eval is None and adapter.version in kept:
        return kept[adapter.version]
    logger.info("evaluating the exported adapter v%d greedily on %d held-out questions", adapter.version, len(held_out))
    _, answers = await run_eval(greedy(config), base_model, adapter, held_out, iteration)
    return answers


async def sealed(folder: Dir, check: ExportCheck) -> Dir:
    """`folder` with the check written into it as export.json (a file's upload on a cluster)."""
    text = check.model_dump_json(indent=2) + "\n"
    if not is_remote(folder.path):
        write_text_atomic(Path(folder.path) / EXPORT_FILE, text)
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / EXPORT_FILE).write_text(text, encoding="utf-8")
        await flyte.storage.put(str(Path(tmp) / EXPORT_FILE), flyte.storage.join(folder.path, EXPORT_FILE))
    return Dir(path=folder.path)


def discarded(folder: Dir) -> None:
    """A form that failed its check removed (a local folder; a cluster's stays in raw data, unreturned)."""
    if not is_remote(folder.path):
        shutil.rmtree(folder.path, ignore_errors=True)


async def staged_adapter(adapter: AdapterRef, folders: LocalDirCache) -> AdapterRef:
    """The adapter's files as --push-to-hub uploads them (without NOT_SHARED), as a folder of their own."""
    source = await folders.get(adapter.dir)
    folder, _ = await publish_dir(
        lambda out: shutil.copytree(source, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_SHARED)),
        f"upload-v{adapter.version:04d}",
        folder="exports",
    )
    return AdapterRef(version=adapter.version, dir=folder)


async def gguf_form(
    config: RunConfig,
    merged: Dir,
    base_model: Dir,
    adapter: AdapterRef,
    held_out: list[Example],
    reference: list[EvalAnswer],
    metric: Metric,
    names: dict[str, object],
    iteration: int,
) -> tuple[Dir | None, ExportCheck]:
    """The merged model `merged` written as --export-gguf's GGUF file and checked on the transformers
    engine against the adapter's answers there (`reference` when the run's engine is transformers,
    else the adapter evaluated again on it): (the sealed folder, or None when it failed, and the check)."""
    folder = await write_gguf(merged, config.export_gguf)
    on_hf = config.model_copy(update={"engine": hf_engine(config)})
    if config.engine.backend != "hf":  # both sides read by one engine, as the export command compares them
        _, reference = await run_eval(greedy(on_hf), base_model, adapter, held_out, iteration)
    form = {"form": "gguf", "path": folder.path, "loaded_with": LOADED_GGUF, **names}
    check = await check_form(on_hf, folder, None, held_out, reference, metric, form, iteration=iteration)
    if check.passed:
        return await sealed(folder, check), check
    discarded(folder)
    return None, check


async def ship(
    config: RunConfig,
    state: LoopState,
    base_model: Dir,
    held_out: list[Example],
    kept: dict[int, list[EvalAnswer]],
    folders: LocalDirCache,
) -> Shipped:
    """--export-merged, --export-gguf and --push-to-hub, each form checked first (module docstring)."""
    if not (config.export_merged or config.export_gguf or config.push_to_hub):
        return Shipped(None, None, None)
    adapter, iteration = exported(config, state)
    which = "final" if config.guard.export_adapter == "final" or state.guard.best is None else "best"  # as `exported` chose
    metric = state.guard.metric or "eval_reward"
    if not held_out:
        raise ValueError("the run has no held-out set (--eval-size 0): nothing to check an export on")
    with flyte.group("export-check"):
        reference = await adapter_answers(config, base_model, adapter, held_out, kept, state.iterations_done)
    names = {"adapter": which, "adapter_iteration": iteration}
    merged = check = gguf = gguf_check = None
    if config.export_merged or config.export_gguf:
        with flyte.group("export"):
            staged = await merge_adapter(base_model, adapter)
            if config.export_merged:
                form = {"form": "merged", "path": staged.path, "loaded_with": LOADED_MERGED, **names}
                check = await check_form(config, staged, None, held_out, reference, metric, form, iteration=state.iterations_done)
                if check.passed:
                    merged = await sealed(staged, check)
                else:
                    discarded(staged)
                logger.log(logging.INFO if check.passed else logging.ERROR, "%s", check_line(check, RUN_FAILED_TAIL))
            if config.export_gguf and (check is None or check.passed):
                done = state.iterations_done
                gguf, gguf_check = await gguf_form(config, staged, base_model, adapter, held_out, reference, metric, names, done)
                logger.log(logging.INFO if gguf_check.passed else logging.ERROR, "%s", check_line(gguf_check, RUN_FAILED_TAIL))
            if not config.export_merged:
                discarded(staged)  # the merge the GGUF was written from, not asked for
    if not config.push_to_hub or (check is not None and not check.passed):
        return Shipped(merged, check, None, gguf, gguf_check)
    with flyte.group("push"):
        if merged is not None:
            return Shipped(merged, check, await push_to_hub(config, state.history, merged, check, iteration, folders), gguf, gguf_check)
        upload = await staged_adapter(adapter, folders)
        form = {"form": "adapter", "path": upload.dir.path, "loaded_with": LOADED_ADAPTER, **names}
        check = await check_form(config, base_model, upload, held_out, reference, metric, form, iteration=state.iterations_done)
        if not check.passed:
            discarded(upload.dir)
            logger.error("%s", check_line(check, RUN_FAILED_TAIL))
            return Shipped(None, check, None, gguf, gguf_check)
        url = await push_to_hub(config, state.history, await sealed(upload.dir, check), check, iteration, folders)
        return Shipped(None, check, url, gguf, gguf_check)


def shipped_line(shipped: Shipped) -> str | None:
    """The export's, GGUF form's or push's failures, one line each, for the report's closing message
    (None: they passed or nothing was asked)."""
    failed = [c for c in (shipped.check, shipped.gguf_check) if c is not None and not c.passed]
    return "\n".join(check_line(c, RUN_FAILED_TAIL) for c in failed) or None
