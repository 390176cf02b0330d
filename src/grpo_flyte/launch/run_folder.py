"""A local run and its folder (`--local`): the checks before anything is written, one writer at a
time (a lock), what a killed run left half-written, `--resume`, and the files written as the driver
reports progress (config, metrics, held-out answers, report, adapter, merged model).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpo_flyte.config.constants import PROG
from grpo_flyte.config.errors import format_validation_error
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import UserError, is_not_retried
from grpo_flyte.launch.preflight import check_inputs, check_judge_fits, check_model_fits
from grpo_flyte.loop import observers
from grpo_flyte.loop.guard import best_summary
from grpo_flyte.loop.state import LoopState
from grpo_flyte.runtime import child_processes
from grpo_flyte.runtime.files import build_dir_atomic, leftovers, unwritable, write_text_atomic
from grpo_flyte.runtime.storage import is_remote
from grpo_flyte.types import OPTIMIZER_FILE, REPORT_FILE, AdapterRef, EvalAnswer, Example, MetricsRow, RunResult

logger = logging.getLogger("grpo_flyte")


CONFIG_FILE = "config.json"
FLYTE_DATA = "flyte"  # Flyte's raw data (adapters, checkpoint) inside a local run dir
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
ADAPTER_DIR = "adapter"
BEST_DIR = "best"  # the best adapter by the held-out evaluations (grpo_flyte.loop.guard)
MERGED_DIR = "merged"
DATA_FILE = "data.json"  # the data the run started with (a fingerprint), checked on --resume
CHECKPOINT_FILE = "checkpoint"  # the driver's saved loop state, under FLYTE_DATA
LOCK_FILE = ".lock"  # held by the run writing the folder; holds its process id
LOG_FILE = "run.log"  # Flyte's log lines in full (tracebacks included), appended to by every attempt


def saved_run_config(text: str) -> Any:
    """A run folder's saved config as data; a folder saved before 'num_iterations' became
    'iterations' names the loop's length the old way (unambiguous in our own file)."""
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
        # Flags and --config file values alike: each is applied (--iterations) or refused, never ignored.
        changed = sorted(f for f in explicit if f != "iterations" and given.get(f) != kept.get(f))
        if changed:
            flags = ", ".join("--" + f.replace("_", "-") for f in changed)
            raise UserError(f"--resume continues the saved config; {flags} differ from {saved_file} (only --iterations may change)")
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


def _holdings(run_dir: Path) -> str:
    """What a run folder still holds, for a message: 'metrics.jsonl (iterations 0-3), adapter/'."""
    done = finished_iterations(run_dir)
    parts = [f"{METRICS_FILE} (iterations {min(done)}-{max(done)})"] if done else []
    parts += [
        name + "/" if (run_dir / name).is_dir() else name
        for name in (ADAPTER_DIR, BEST_DIR, REPORT_FILE, EVAL_DIR)
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


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """One writer per run folder: an exclusive lock on `<run dir>/.lock`, which holds the writer's
    process id. The operating system drops the lock when the process ends, however it ends (a
    SIGKILL too), so a dead run never blocks its resume. fcntl (the standard library) rather than
    the filelock package: the message names the live run's process, read from the lock file."""
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"--run-dir {str(run_dir)!r} cannot be written ({exc.strerror}); expected a folder this user can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(
            f"--run-dir {str(run_dir)!r} is being written by a live run (process {holder}); a run folder takes one "
            "writer at a time: wait for that run or stop it, then --resume"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`): stops the run as Ctrl-C does."""


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c() -> Iterator[None]:
    def stop(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_now(code: int) -> typing.NoReturn:
    """End this process now, with `code`: its children killed (`child_processes.stop_all`: train
    processes, reward workers), the console flushed, and no wait for the work on its other threads
    (a train step or a generation runs on for minutes; Flyte would retry a step whose processes were
    just killed, and print it). Every file of a run folder is written whole or not at all, so this
    leaves what a killed run leaves, which --resume continues (the kill drills of the tests)."""
    child_processes.stop_all()
    logging.shutdown()  # flushes every handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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

    def export_merged(self, merged_path: str) -> Path:
        """Move the (complete) merged model folder into the run folder: a rename, so never half there."""
        target = self.root / MERGED_DIR
        shutil.rmtree(target, ignore_errors=True)
        os.replace(merged_path, target)
        return target


@contextlib.contextmanager
def _wandb_dir(run_dir: Path) -> Iterator[None]:
    """W&B (--wandb-project) keeps its local files, e.g. an offline run, in the run folder, unless
    the user chose WANDB_DIR; the variable is restored afterwards (several runs in one process)."""
    if "WANDB_DIR" in os.environ:
        yield
        return
    os.environ["WANDB_DIR"] = str(run_dir)
    try:
        yield
    finally:
        os.environ.pop("WANDB_DIR", None)


def run_local(options: dict[str, Any], config: RunConfig, explicit: set[str]) -> int:
    from grpo_flyte.models.folders import resolve_local_model
    from grpo_flyte.runtime.cache import check_cache_writable

    resuming = bool(options["resume"])
    # Every check first (nothing is written until they pass), then the folder's lock, then writes.
    run_dir, config, resume_from = prepare_local_run(options, config, explicit)
    examples, split = check_inputs(config, local=True)
    fingerprint = data_fingerprint(config, split)
    if resuming:
        check_same_data(run_dir, fingerprint)
    check_cache_writable()
    model_dir = resolve_local_model(config.base.model)
    check_model_fits(config, model_dir, split)
    judge_dir = resolve_local_model(config.judge.judge_model, field="judge_model") if config.judging else None
    if judge_dir is not None:
        check_judge_fits(config, judge_dir, split)
    if not resuming:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"--run-dir {str(run_dir)!r} cannot be created ({exc.strerror}); expected a folder this user can write"
            ) from None
    with run_dir_lock(run_dir):
        if resuming:  # what the checks read may have changed while a live writer held the folder
            run_dir, config, resume_from = prepare_local_run(options, config, explicit)
        elif (run_dir / CONFIG_FILE).exists():  # another run started in this folder meanwhile
            raise UserError(f"--run-dir {str(run_dir)!r} already holds a run: add --resume to continue it, or pick another folder")
        write_text_atomic(run_dir / DATA_FILE, json.dumps(fingerprint, indent=2) + "\n")
        return _run_locked(run_dir.resolve(), config, model_dir, examples, resume_from, judge_dir)


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a task's error can carry the lines of its cause)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class _ConsoleLines(logging.Filter):
    """Flyte's console lines during a local run: its warnings (retries), never its errors, whose
    tracebacks go to the run log and whose message is the run's last line. Other loggers' lines
    pass: Flyte's handlers may be shared (pytest's, a notebook's), and in a sweep a config's
    failure is said while the others run."""

    def filter(self, record: logging.LogRecord) -> bool:
        flyte = record.name == "flyte" or record.name.startswith("flyte.")
        return not flyte or (record.levelno < logging.ERROR and not record.exc_info)


class _OneRun(logging.Filter):
    """The lines logged inside one Flyte run (a local sweep runs several in this process)."""

    def __init__(self, run: str):
        super().__init__()
        self.run = run

    def filter(self, record: logging.LogRecord) -> bool:
        return observers.current_run() == self.run


@contextlib.contextmanager
def flyte_log_in(path: Path, run: str | None = None) -> Iterator[None]:
    """Flyte's log lines go to `path` in full while the run lasts (with `run`, those of that Flyte
    run only); the console keeps `_ConsoleLines`."""
    flyte_logger = logging.getLogger("flyte")
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    if run is not None:
        to_file.addFilter(_OneRun(run))
    console, keep = flyte_logger.handlers[:], _ConsoleLines()
    for handler in console:
        handler.addFilter(keep)
    flyte_logger.addHandler(to_file)
    try:
        yield
    finally:
        flyte_logger.removeHandler(to_file)
        to_file.close()
        for handler in console:
            handler.removeFilter(keep)


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete what a killed writer left half-done beside the run's files, held-out answers, checkpoint
    and published folders (adapters, reports, payloads): only this package's temp names
    (`files.leftovers`), never a file of the user's. Only the lock holder calls this."""
    removed = []
    flyte_data = run_dir / FLYTE_DATA
    for parent in (run_dir, run_dir / EVAL_DIR, flyte_data, flyte_data / "adapters", flyte_data / "reports", flyte_data / "payloads"):
        for path in leftovers(parent):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
    return removed


def _run_locked(
    run_dir: Path,
    config: RunConfig,
    model_dir: Path,
    examples: list[Example] | None,
    resume_from: str | None,
    judge_dir: Path | None = None,
) -> int:
    import flyte
    from flyte.io import Dir

    from grpo_flyte.driver import train_rl
    from grpo_flyte.loop.observers import observe
    from grpo_flyte.reporting.progress import RunProgress, eta_seconds

    for path in remove_leftovers(run_dir):
        logger.info("removed %s, left half-written by a run that was killed", path)
    write_text_atomic(run_dir / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
    logger.info(
        "grpo_flyte local run in %s: %d iterations x %d prompts x %d completions, model %s",
        run_dir,
        config.iterations,
        config.prompts_per_iter,
        config.sampling.group_size,
        model_dir,
    )
    if resume_from:
        logger.info("resuming from %s", resume_from)
    runner = flyte.with_runcontext(mode="local", name=f"grpo-{uuid.uuid4().hex[:10]}", raw_data_path=str(run_dir / FLYTE_DATA))
    files = LocalRunFiles(run_dir, config.adapters_to_keep)
    done = max([i for i in finished_iterations(run_dir) if i > 0], default=0)
    progress = RunProgress(config.iterations, done, eta=lambda history, finished: eta_seconds(config, history, finished))
    try:
        # the bars stop (and the terminal is whole again) before any message below
        with (
            flyte_log_in(run_dir / LOG_FILE),
            observe(files),
            observe(progress),
            progress.shown(),
            _wandb_dir(run_dir),
            sigterm_stops_like_ctrl_c(),
        ):
            judge = {"judge_model": Dir(path=str(judge_dir))} if judge_dir is not None else {}
            run = runner.run(
                train_rl, config=config, base_model=Dir(path=str(model_dir)), examples=examples, resume_from=resume_from, **judge
            )
            result = run.outputs()[0]
    except KeyboardInterrupt as exc:
        for stopping in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C while the run stops changes nothing
            signal.signal(stopping, signal.SIG_IGN)
        done = [i for i in finished_iterations(run_dir) if i > 0]
        where = f"iterations 1-{max(done)} of {config.iterations} are kept" if done else "no iteration had finished"
        how = "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
        logger.error("%s: %s in %s; continue with: %s --local --resume --run-dir %s", how, where, run_dir, PROG, run_dir)
        exit_now(143 if isinstance(exc, Terminated) else 130)
    except Exception as exc:  # noqa: BLE001 -- top of the CLI: any failure becomes a message and exit 1
        done = [i for i in finished_iterations(run_dir) if i > 0]
        kept = f"iterations 1-{max(done)} of {config.iterations} are kept" if done else "no iteration had finished"
        resume = f"{PROG} --local --resume --run-dir {run_dir}"
        log = f"the traceback is in {run_dir / LOG_FILE}"
        if is_not_retried(exc):  # bad input: a resume as it is would fail the same way
            logger.error(
                "%s; %s; the failure comes from the run's input (below), which a resume meets again: fix it, then: %s", kept, log, resume
            )
        else:
            logger.error("%s; %s; continue with: %s", kept, log, resume)
        logger.error("run failed: %s", one_line(exc))  # last and alone: the line that matters
        return 1
    finish_local_run(files, config, result)
    return 0


def finish_local_run(files: LocalRunFiles, config: RunConfig, result: RunResult) -> None:
    """A finished run's folder completed: the adapter (and best adapter, merged model) exported,
    and the lines that say where they are and which adapter was best."""
    run_dir = files.root
    files.export_adapter(result.adapter)
    best = f", best adapter {files.export_adapter(result.best, BEST_DIR)}" if result.best is not None else ""
    logger.info("done: adapter %s%s, report %s, metrics %s", run_dir / ADAPTER_DIR, best, run_dir / REPORT_FILE, run_dir / METRICS_FILE)
    if result.merged is not None:
        merged = result.best if config.guard.export_adapter == "best" and result.best is not None else result.adapter
        where = files.export_merged(result.merged.path)
        logger.info(
            "merged model (base + adapter v%d; loads with AutoModelForCausalLM.from_pretrained, no PEFT): %s", merged.version, where
        )
    stopped = next((r.guard.guard_reason for r in result.history if r.guard and r.guard.guard_event in ("stop", "early_stop")), None)
    for line in (stopped, best_summary(result.history)):
        if line:
            logger.info("%s", line)  # the last line: which adapter was best, and by how much
