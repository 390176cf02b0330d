"""This module defines a local run's folder: its layout (the names of its files), the checks before
anything is written in it, what `--resume` reads back from it (the saved config, the loop state, the
data it started with), and the clean-up of what a killed writer left half-written.

A sweep's folder holds one such folder per config (`grpo_flyte.launch.sweep_folder`); the lock is
`grpo_flyte.launch.lock`, the run in it `grpo_flyte.launch.local_run`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpo_flyte.config.errors import format_validation_error
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import UserError
from grpo_flyte.loop.state import LoopState
from grpo_flyte.runtime.files import leftovers, unwritable, write_text_atomic
from grpo_flyte.runtime.storage import is_remote
from grpo_flyte.types import REPORT_FILE, Example

logger = logging.getLogger("grpo_flyte")


CONFIG_FILE = "config.json"
FLYTE_DATA = "flyte"  # Flyte's raw data (adapters, checkpoint) inside a local run dir
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
COMPLETIONS_DIR = "completions"  # --log-completions: each iteration's sample
ADAPTER_DIR = "adapter"
BEST_DIR = "best"  # the best adapter by the held-out evaluations (grpo_flyte.loop.guard)
MERGED_DIR = "merged"
GGUF_DIR = "gguf-{quant}"  # the GGUF form of one quantization type (--export-gguf, export --to gguf)
DATA_FILE = "data.json"  # the data the run started with (a fingerprint), checked on --resume
CHECKPOINT_FILE = "checkpoint"  # the driver's saved loop state, under FLYTE_DATA
LOCK_FILE = ".lock"  # held by the run writing the folder; holds its process id
LOG_FILE = "run.log"  # Flyte's log lines in full (tracebacks included), appended to by every attempt


def saved_run_config(text: str) -> Any:
    """A run folder's saved config as data. The file is nested (each part's fields under its name),
    so a top-level 'num_iterations' is the loop's length of a folder saved before 2026-11, when it
    became 'iterations'; TRL's 'num_iterations' (each batch trained on that many times) is saved
    under 'train'."""
    data = json.loads(text)
    if isinstance(data, dict) and "num_iterations" in data:
        data["iterations"] = data.pop("num_iterations")
    return data


def prepare_local_run(options: dict[str, Any], config: RunConfig, explicit: set[str]) -> tuple[Path, RunConfig, str | None]:
    """Check everything a local run needs before writing anything: (run dir, config, checkpoint to resume)."""
    run_dir: Path | None = options["run_dir"]
    if options["resume"]:
        if run_dir is None:
            raise UserError("--resume needs --run-dir DIR: the folder of the run to continue")
        saved_file = run_dir / CONFIG_FILE
        if saved_file.is_file():
            check_writable(run_dir)
        if not saved_file.is_file():
            raise UserError(f"--resume: {str(saved_file)!r} not found; expected the folder of an earlier local run")
        try:
            saved = RunConfig.model_validate(saved_run_config(saved_file.read_text()))
        except (ValidationError, UnicodeDecodeError, ValueError) as exc:
            detail = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            raise UserError(f"--resume: {str(saved_file)!r} is not a valid saved config: {detail}") from None
        given, kept = config.flat(), saved.flat()
        # Flags and --config file values alike: each is applied (--iterations, --export-adapter: the
        # choice a finished run whose best is the untrained start asks for) or refused, never ignored.
        changed = sorted(f for f in explicit if f not in ("iterations", "export_adapter") and given.get(f) != kept.get(f))
        if changed:
            flags = ", ".join("--" + f.replace("_", "-") for f in changed)
            raise UserError(
                f"--resume continues the saved config; {flags} differ from {saved_file} (only --iterations and --export-adapter may change)"
            )
        if "export_adapter" in explicit:
            saved = saved.model_copy(update={"guard": saved.guard.model_copy(update={"export_adapter": config.guard.export_adapter})})
        checkpoint, state = saved_state(run_dir)
        if "iterations" in explicit:
            done = state.iterations_done if state else 0
            if config.iterations < done:
                raise UserError(
                    f"--iterations {config.iterations} is below the {done} iterations this run finished; "
                    f"expected at least {done} (a resume never drops finished iterations)"
                )
            saved = saved.model_copy(update={"iterations": config.iterations})
        return run_dir, saved, checkpoint
    if run_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"
    if (run_dir / CONFIG_FILE).exists():
        raise UserError(f"--run-dir {str(run_dir)!r} already holds a run: add --resume to continue it, or pick another folder")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is a file; expected a folder")
    check_writable(run_dir)
    return run_dir, config, None


def check_writable(run_dir: Path) -> None:
    """That the run folder can be created (or written) here, without creating it yet."""
    problem = unwritable(run_dir)
    if problem and problem[1] == "is a file":
        raise UserError(f"--run-dir {str(run_dir)!r} cannot be created: {str(problem[0])!r} is a file; expected a folder")
    if problem:
        raise UserError(f"--run-dir {str(run_dir)!r} cannot be written ({str(problem[0])!r} {problem[1]})")


def create_run_dir(run_dir: Path) -> None:
    """Create the run (or sweep) folder, once every check has passed."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--run-dir {str(run_dir)!r} cannot be created ({exc.strerror}); expected a folder this user can write") from None


def finished_iterations(run_dir: Path) -> list[int]:
    """The iterations metrics.jsonl records (0 is the evaluation before training)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            found.append(int(json.loads(line)["iteration"]))
    return found


def trained_iterations(run_dir: Path) -> list[int]:
    """The training iterations metrics.jsonl records (1 and up: the evaluation before training left out)."""
    return [i for i in finished_iterations(run_dir) if i > 0]


def _holdings(run_dir: Path) -> str:
    """What a run folder still holds, for a message: 'metrics.jsonl (iterations 0-3), adapter/'."""
    done = finished_iterations(run_dir)
    parts = [f"{METRICS_FILE} (iterations {min(done)}-{max(done)})"] if done else []
    parts += [
        name + "/" if (run_dir / name).is_dir() else name
        for name in (ADAPTER_DIR, BEST_DIR, REPORT_FILE, EVAL_DIR, COMPLETIONS_DIR)
        if (run_dir / name).exists()
    ]
    return ", ".join(parts) or "nothing but its config"


def saved_state(run_dir: Path) -> tuple[str | None, LoopState | None]:
    """The checkpoint a `--resume` continues from, checked before anything is written.

    (path, state); (None, None) when the run never finished an iteration (it starts over, losing nothing). A run that did
    but whose loop state is missing or damaged cannot continue where it stopped: one line says what
    is missing and what the folder still holds, and nothing is written (starting over would
    rewrite metrics.jsonl from iteration 0).
    """
    checkpoint = run_dir / FLYTE_DATA / CHECKPOINT_FILE
    if not checkpoint.is_file():
        if not finished_iterations(run_dir):
            return None, None
        raise UserError(
            f"--resume: the saved loop state {str(checkpoint)!r} is missing, so the run cannot continue where it stopped; "
            f"{str(run_dir)!r} still holds {_holdings(run_dir)}. Nothing was written: restore its {FLYTE_DATA}/ folder, "
            "or start a new run in another --run-dir"
        )
    try:
        state = LoopState.model_validate_json(checkpoint.read_bytes())
    except ValidationError as exc:
        raise UserError(
            f"--resume: the saved loop state {str(checkpoint)!r} is damaged ({format_validation_error(exc)[:200]}); "
            f"{str(run_dir)!r} still holds {_holdings(run_dir)}. Nothing was written"
        ) from None
    named = [("adapter", state.adapter)] + ([("best adapter", state.guard.best.adapter)] if state.guard.best else [])
    for what, ref in named:
        adapter = Path(ref.dir.path)
        if not is_remote(ref.dir.path) and not (adapter if adapter.is_absolute() else run_dir / FLYTE_DATA / adapter).is_dir():
            raise UserError(
                f"--resume: {what} v{ref.version} of the saved loop state is missing ({str(adapter)!r}); "
                f"{str(run_dir)!r} still holds {_holdings(run_dir)}. Nothing was written"
            )
    return str(checkpoint.resolve()), state


def data_fingerprint(config: RunConfig, split: tuple[list[Example], list[Example]]) -> dict[str, Any]:
    """What the run trains and evaluates on: the dataset, its split sizes and a hash of the rows."""
    dataset, held_out = split
    digest = hashlib.sha256(json.dumps([[e.model_dump() for e in dataset], [e.model_dump() for e in held_out]]).encode())
    return {"dataset": config.data.dataset, "train_rows": len(dataset), "held_out_rows": len(held_out), "sha256": digest.hexdigest()}


def check_same_data(run_dir: Path, fingerprint: dict[str, Any]) -> None:
    """A resumed run must see the data it started with (else its held-out set changes mid-run)."""
    path = run_dir / DATA_FILE
    if not path.is_file():  # a run from before data fingerprints: nothing to compare with
        return
    with contextlib.suppress(ValueError, OSError):
        started = json.loads(path.read_text())
        if started.get("sha256") != fingerprint["sha256"]:
            raise UserError(
                f"--dataset {fingerprint['dataset']!r} changed since this run started ({fingerprint['train_rows']} + "
                f"{fingerprint['held_out_rows']} rows hashing to {fingerprint['sha256'][:12]}, the run's "
                f"{started.get('train_rows')} + {started.get('held_out_rows')} to {str(started.get('sha256'))[:12]}); "
                "a resumed run trains and evaluates on the same data: restore it, or start a new run"
            )


def save_data_fingerprint(run_dir: Path, fingerprint: dict[str, Any]) -> None:
    """Record the data the run starts with (`data_fingerprint`), which a resume compares (`check_same_data`)."""
    write_text_atomic(run_dir / DATA_FILE, json.dumps(fingerprint, indent=2) + "\n")


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete what a killed writer left half-done beside the run's files, held-out answers, checkpoint
    and published folders (adapters, reports, payloads): only this package's temp names
    (`files.leftovers`), never a file of the user's. Only the lock holder calls this."""
    flyte_data = run_dir / FLYTE_DATA
    return remove_leftovers_in(
        run_dir,
        run_dir / EVAL_DIR,
        run_dir / COMPLETIONS_DIR,
        flyte_data,
        flyte_data / "adapters",
        flyte_data / "reports",
        flyte_data / "payloads",
    )


def remove_leftovers_in(*folders: Path) -> list[Path]:
    """Delete the temp names of dead writers (`files.leftovers`) directly in `folders`, a line
    each: what `remove_leftovers` does for a run folder, and a sweep for its own files."""
    removed = []
    for parent in folders:
        for path in leftovers(parent):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            logger.info("removed %s, left half-written by a run that was killed", path)
            removed.append(path)
    return removed
