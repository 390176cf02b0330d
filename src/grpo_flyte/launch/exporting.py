"""The `export` and `eval` commands: a finished local run's adapter shipped as a form others load,
checked on the run's held-out questions before it is called done, and any adapter or model folder or GGUF file
evaluated on a run's held-out set.

    python -m grpo_flyte export RUN --to adapter|merged|gguf [--quant f16] [--export-adapter final|best] [--max-disagreement 0.2]
    python -m grpo_flyte eval PATH [--run RUN]

`export` writes the form into a staging folder beside the run's adapter/ and best/ (`lora/`: the
PEFT adapter with the base's tokenizer, chat template and generation config; `merged/`: PEFT's
merge_and_unload saved as one transformers folder, the same; `gguf-<quant>/`: the merge written as one
GGUF file, `models.gguf_writer`), evaluates it with the run's own
held-out evaluation (`loop.evaluation.run_eval`: the transformers engine, or vLLM on a GPU, loads the
merged folder as a plain model with its own tokenizer and chat template, and the adapter through
PEFT on the run's base; the GGUF through transformers' GGUF loader, its tokenizer and chat template
read from the file), evaluates the adapter it came from the same way, compares the two
(`loop.verification`), writes `export.json` into the form and only then renames the staging folder
to its name. A form that fails the check is removed, and one line says why.

Both commands run the evaluation's tasks in this process (outside a Flyte run a task is a function
call) and hold the run folder's lock while they write, so they never meet a live run in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from grpo_flyte.config.constants import PROG
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import GrpoFlyteError, UserError
from grpo_flyte.launch.local_run import check_data
from grpo_flyte.launch.lock import run_dir_lock
from grpo_flyte.launch.run_folder import (
    ADAPTER_DIR,
    BEST_DIR,
    CHECKPOINT_FILE,
    CONFIG_FILE,
    FLYTE_DATA,
    GGUF_DIR,
    MERGED_DIR,
    METRICS_FILE,
    remove_leftovers,
    saved_run_config,
)
from grpo_flyte.learning.merge import copy_serving_files
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import resolve_metric, untrained_best
from grpo_flyte.loop.state import LoopState
from grpo_flyte.loop.verification import DEFAULT_MAX_DISAGREEMENT, EXPORT_FILE, ExportCheck, check_line
from grpo_flyte.models.gguf_writer import DEFAULT_QUANT, QUANT_TYPES, check_model, check_quant, gguf_in
from grpo_flyte.records import EvalMetrics
from grpo_flyte.reporting.figures import accuracy_interval, plus_minus
from grpo_flyte.runtime.files import build_dir_atomic, write_text_atomic
from grpo_flyte.types import Example

logger = logging.getLogger("grpo_flyte")

COMMANDS = ("export", "eval")
LORA_DIR = "lora"  # the exported adapter form: PEFT's files and what a server needs beside them

FORMS = {"adapter": LORA_DIR, "merged": MERGED_DIR, "gguf": GGUF_DIR}  # gguf: one folder a quantization type


class ExportFailed(GrpoFlyteError):
    """An exported form answered unlike its adapter: the check's line; nothing was written."""

    def __init__(self, check: ExportCheck):
        super().__init__(check_line(check))
        self.check = check


class FinishedRun:
    """A finished local run folder as the commands read it: its config, loop state and held-out set."""

    def __init__(self, run_dir: Path):
        self.root = run_dir
        if not (run_dir / CONFIG_FILE).is_file() or not (run_dir / METRICS_FILE).is_file():
            raise UserError(f"{str(run_dir)!r} is not a local run folder (no {CONFIG_FILE} and {METRICS_FILE}); expected a run's --run-dir")
        checkpoint = run_dir / FLYTE_DATA / CHECKPOINT_FILE
        if not checkpoint.is_file() or not (run_dir / ADAPTER_DIR).is_dir():
            raise UserError(
                f"{str(run_dir)!r} holds no finished run (no {ADAPTER_DIR}/ or saved loop state); finish it with --resume first"
            )
        self.config = RunConfig.model_validate(saved_run_config((run_dir / CONFIG_FILE).read_text()))
        self.state = LoopState.model_validate_json(checkpoint.read_bytes())

    def held_out(self) -> list[Example]:
        """The run's held-out questions, the data checked against what the run started with."""
        _, (_, held_out), _ = check_data(self.config, self.root, resuming=True)
        if not held_out:
            raise UserError(f"the run in {str(self.root)!r} has no held-out set (--eval-size 0): nothing to evaluate an export on")
        return held_out

    def base_model(self) -> Path:
        from grpo_flyte.models.folders import resolve_local_model

        return resolve_local_model(self.config.base.model)

    def chosen(self, choice: str | None) -> tuple[str, Path, int]:
        """The adapter to export: ('best' or 'final', its folder, its iteration). Unset: 'best',
        but the untrained start is never taken without being named. (The run's own --export-adapter
        is not read: a config saved before the option could be unset holds 'best', chosen or not.)"""
        best = self.state.guard.best
        if choice == "final" or best is None or not (self.root / BEST_DIR).is_dir():
            return "final", self.root / ADAPTER_DIR, self.state.iterations_done
        if choice is None and untrained_best(self.state.history):
            raise UserError(
                "nothing trained beat the start: best/ is the untrained adapter (iteration 0, the base model itself); "
                "choose --export-adapter final (the last iteration's adapter) or best (the start)"
            )
        return "best", self.root / BEST_DIR, best.iteration


def evaluate(
    runner: asyncio.Runner, run: FinishedRun, model: Path, adapter: Path | None, held_out: list[Example]
) -> tuple[EvalMetrics, list[EvalAnswer]]:
    """The run's held-out evaluation (`loop.evaluation.run_eval`) of `adapter` on `model` (None:
    `model` as it is), in this process, on `runner`'s event loop (one for a command: the engine's
    batcher lives on it)."""
    from flyte.io import Dir

    from grpo_flyte.loop.evaluation import run_eval
    from grpo_flyte.types import AdapterRef

    ref = AdapterRef(version=0, dir=Dir(path=str(adapter))) if adapter is not None else None
    return runner.run(run_eval(run.config, Dir(path=str(model)), ref, held_out, run.state.iterations_done))


def write_form(form: str, model_path: Path, adapter: Path, out: Path, quant: str = DEFAULT_QUANT) -> str:
    """Write `form` of `adapter` into `out`; returns how its users load it (for export.json). The
    GGUF form: the merged folder, written in a folder of its own inside `out` and removed once
    written, as `out/model-<quant>.gguf`."""
    from grpo_flyte.loop.shipping import LOADED_ADAPTER, LOADED_GGUF, LOADED_MERGED

    if form == "gguf":
        from grpo_flyte.models.gguf_writer import gguf_name, write_gguf

        merged = out / f".{MERGED_DIR}"
        write_form("merged", model_path, adapter, merged)
        write_gguf(merged, out / gguf_name(quant), quant)
        shutil.rmtree(merged)
        return LOADED_GGUF
    if form == "merged":
        from grpo_flyte.learning import merge

        merge.merge_into_base(str(model_path), str(adapter), out)
        copy_serving_files(model_path, out)  # what the merge's save left out (a generation config the base had)
        return LOADED_MERGED
    shutil.copytree(adapter, out, dirs_exist_ok=True)
    copy_serving_files(model_path, out)
    return LOADED_ADAPTER


def export(run_dir: Path, form: str, choice: str | None, max_disagreement: float, quant: str = DEFAULT_QUANT) -> ExportCheck:
    """Export the run's adapter as `form` (GGUF: in `quant`), check it against the adapter, keep it
    only if it passes (`ExportFailed` otherwise); the check."""
    from flyte.io import Dir

    from grpo_flyte.loop.shipping import check_form, greedy, hf_engine
    from grpo_flyte.types import AdapterRef

    run = FinishedRun(run_dir)
    run.config = greedy(run.config)  # one completion a question, to compare word for word
    if form == "gguf":
        check_quant(quant)  # an unknown type refused before any work
        # transformers reads the GGUF (and then answers for the adapter too, alike)
        run.config = run.config.model_copy(update={"engine": hf_engine(run.config)})
    which, adapter, iteration = run.chosen(choice)
    held_out, model_path = run.held_out(), run.base_model()
    if form == "gguf":
        check_model(model_path)  # an architecture the writer refuses, refused before any work
    metric = resolve_metric(run.config.guard.select_by, held_out)
    final = run_dir / FORMS[form].format(quant=quant)
    with run_dir_lock(run_dir), asyncio.Runner() as runner:
        remove_leftovers(run_dir)
        logger.info("evaluating the %s adapter (iteration %d) on %d held-out questions", which, iteration, len(held_out))
        _, theirs = evaluate(runner, run, model_path, adapter, held_out)

        def build(staging: Path) -> ExportCheck:
            logger.info("writing the %s form of the %s adapter", form, which)
            loaded_with = write_form(form, model_path, adapter, staging, quant)
            model, answering = (model_path, staging) if form == "adapter" else (staging, None)
            names = {"form": form, "path": str(final), "loaded_with": loaded_with, "adapter": which, "adapter_iteration": iteration}
            ref = AdapterRef(version=0, dir=Dir(path=str(answering))) if answering is not None else None
            checking = check_form(
                run.config, Dir(path=str(model)), ref, held_out, theirs, metric, names, max_disagreement, run.state.iterations_done
            )
            check = runner.run(checking)  # the run's own export checks with the same function (loop.shipping)
            if not check.passed:
                raise ExportFailed(check)
            write_text_atomic(staging / EXPORT_FILE, check.model_dump_json(indent=2) + "\n")
            return check

        return build_dir_atomic(final, build)


def default_run(path: Path) -> Path:
    """The run whose held-out set `eval PATH` uses without --run: PATH itself (a run folder), the
    folder holding PATH, or for a GGUF file the run holding its form folder (RUN/gguf-f16/model-f16.gguf)."""
    if (path / METRICS_FILE).is_file():
        return path
    return path.parent.parent if path.suffix == ".gguf" and path.is_file() else path.parent


def evaluate_path(path: Path, run_dir: Path | None) -> tuple[EvalMetrics, str]:
    """Evaluate an adapter folder, a model folder, a GGUF file (or a folder holding one) or a run
    folder (its final adapter) on a run's held-out set: the metrics and what was evaluated, in words."""
    if path.suffix == ".gguf" and path.is_file():
        with tempfile.TemporaryDirectory() as folder:  # the file alone in a folder, as the engine loads a GGUF form
            (Path(folder) / path.name).symlink_to(path.resolve())
            metrics, _ = evaluate_path(Path(folder), run_dir or default_run(path))
        return metrics, f"GGUF {path}"
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is neither a folder nor a .gguf file; expected an adapter, model or run folder, or a GGUF file")
    run = FinishedRun(run_dir or default_run(path))
    if (path / METRICS_FILE).is_file():
        path = path / ADAPTER_DIR
    held_out = run.held_out()
    with asyncio.Runner() as runner:
        if (gguf := gguf_in(path)) is not None:
            from grpo_flyte.loop.shipping import hf_engine

            run.config = run.config.model_copy(update={"engine": hf_engine(run.config)})
            metrics, _ = evaluate(runner, run, path, None, held_out)
            return metrics, f"GGUF {path / gguf}"
        if (path / "adapter_config.json").is_file():
            metrics, _ = evaluate(runner, run, run.base_model(), path, held_out)
            return metrics, f"adapter {path} on {run.config.base.model}"
        if (path / "config.json").is_file():
            metrics, _ = evaluate(runner, run, path, None, held_out)
            return metrics, f"model {path}"
    raise UserError(f"{str(path)!r} holds neither adapter_config.json (an adapter), config.json (a model) nor one .gguf file")


def eval_line(metrics: EvalMetrics, what: str, run_dir: Path) -> str:
    accuracy = f"{metrics.eval_accuracy:.1%} {accuracy_interval(metrics.eval_accuracy_lo, metrics.eval_accuracy_hi)}".rstrip()
    return (
        f"held-out accuracy {accuracy}, reward {metrics.eval_reward:.3f} {plus_minus(metrics.eval_reward_ci95)}, "
        f"format {metrics.eval_format_rate:.1%} (n={metrics.eval_size}): {what}, on the held-out set of {run_dir}"
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    out = commands.add_parser("export", help="export a finished local run's adapter as a form others load, checked")
    out.add_argument("run", type=Path, metavar="RUN", help="the run's folder (its --run-dir)")
    out.add_argument(
        "--to",
        choices=sorted(FORMS),
        required=True,
        help="adapter: lora/ (PEFT); merged: merged/ (plain transformers); gguf: gguf-<quant>/model-<quant>.gguf (llama.cpp, Ollama)",
    )
    out.add_argument(
        "--quant",
        default=None,
        metavar="TYPE",
        help=(
            f"the GGUF form's tensor type, one of {', '.join(QUANT_TYPES)} (default {DEFAULT_QUANT}: a 16-bit model's weights "
            "as they are, read by every llama.cpp build; the 8-, 5- and 4-bit types are smaller and answer less alike)"
        ),
    )
    out.add_argument(
        "--export-adapter",
        choices=("best", "final"),
        default=None,
        help="the adapter to export (default: best; asked for when best is the untrained start)",
    )
    out.add_argument(
        "--max-disagreement",
        type=float,
        default=DEFAULT_MAX_DISAGREEMENT,
        help=f"the share of held-out answers the export may word unlike the adapter (default {DEFAULT_MAX_DISAGREEMENT})",
    )
    ev = commands.add_parser("eval", help="evaluate an adapter, model or run folder, or a GGUF file, on a run's held-out set")
    ev.add_argument(
        "path", type=Path, metavar="PATH", help="an adapter folder, a model folder, a .gguf file, or a run folder (its adapter/)"
    )
    ev.add_argument(
        "--run", type=Path, default=None, help="the run whose held-out set to use (default: PATH's, or the folder holding PATH)"
    )
    return parser


def parse(argv: list[str]) -> dict[str, Any]:
    args = vars(_parser().parse_args(argv))
    if args["command"] == "export" and not 0.0 <= args["max_disagreement"] <= 1.0:
        raise UserError(f"--max-disagreement {args['max_disagreement']} must be a share between 0 and 1")
    if args["command"] == "export" and args["quant"] is not None and args["to"] != "gguf":
        raise UserError(f"--quant is the GGUF form's (--to gguf), not --to {args['to']}'s")
    if args["command"] == "export":
        args["quant"] = check_quant(args["quant"] or DEFAULT_QUANT)
    return args


def main(argv: list[str]) -> int:
    """The export or eval command: its exit status (2: bad input, 1: the export failed its check)."""
    args = parse(argv)
    if args["command"] == "eval":
        metrics, what = evaluate_path(args["path"], args["run"])
        print(eval_line(metrics, what, args["run"] or default_run(args["path"])))
        return 0
    try:
        check = export(args["run"], args["to"], args["export_adapter"], args["max_disagreement"], args["quant"])
    except ExportFailed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(check_line(check))
    return 0


def read_check(form_dir: Path) -> ExportCheck:
    """An exported form's check (its export.json)."""
    return ExportCheck.model_validate(json.loads((form_dir / EXPORT_FILE).read_text()))
