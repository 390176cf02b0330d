"""The command line of `python -m grpo_flyte` (also `python -m grpo_flyte.driver`), generated from `RunConfig`.

Every config field is a flag (`group_size` -> `--group-size`) with its description as help; a
`--config FILE` (YAML or JSON, flat or nested) gives base values that flags override. Bad input
exits with status 2 and one line naming the value and what was expected, before anything is written.

A local run's folder (config, metrics, held-out answers, report, adapter, merged model) is written
here, from what the driver task reports (`driver.observe`) and returns (`RunResult`); the same
reports move its progress bars on a terminal (`progress.RunProgress`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import typing
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, create_model
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict, SettingsError

from grpo_flyte.config import (
    ARITHMETIC_DATASET,
    EMBEDDED_MODEL,
    GSM8K_DATASET,
    NUM_ITERATIONS_REFUSED,
    TRL_ALIASES,
    RunConfig,
    flag,
    format_validation_error,
    leaf_fields,
    load_config_file,
    make_config,
    shown_default,
)
from grpo_flyte.data import is_file_dataset, load_rows, train_eval_split
from grpo_flyte.errors import ConfigError, GrpoFlyteError, ModelError, is_not_retried
from grpo_flyte.files import build_dir_atomic, leftovers, unwritable, write_text_atomic
from grpo_flyte.multiturn import BUILTIN_DATASETS, load_environment
from grpo_flyte.rewards import resolve_reward
from grpo_flyte.storage import is_remote, payload_key, payload_text, write_payload
from grpo_flyte.types import OPTIMIZER_FILE, REPORT_FILE, AdapterRef, EvalAnswer, Example, MetricsRow

if TYPE_CHECKING:
    from grpo_flyte.driver import LoopState

logger = logging.getLogger("grpo_flyte")

PROG = "python -m grpo_flyte.driver"
CONFIG_FILE = "config.json"
FLYTE_DATA = "flyte"  # Flyte's raw data (adapters, checkpoint) inside a local run dir
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
DATA_FILE = "data.json"  # the data the run started with (a fingerprint), checked on --resume
CHECKPOINT_FILE = "checkpoint"  # the driver's saved loop state, under FLYTE_DATA
LOCK_FILE = ".lock"  # held by the run writing the folder; holds its process id
RUN_OPTIONS = {
    "local": (bool, Field(False, description="Run in Flyte local mode on this machine instead of a cluster.")),
    "run_dir": (
        Path | None,
        Field(None, description="Local runs: folder for config, metrics, report and adapter (default: a new ./runs/<time>)."),
    ),
    "resume": (bool, Field(False, description="Local runs: continue the run in --run-dir from its last finished iteration.")),
    "resume_run": (
        str | None,
        Field(
            None,
            description="Cluster runs: continue the cluster run of this name. Flyte reruns it with recovery: "
            "every task that finished is reused, the rest runs again.",
        ),
    ),
    "config": (Path | None, Field(None, description="YAML or JSON file of config fields; flags override it.")),
}


class _CliBase(BaseSettings):
    model_config = SettingsConfigDict(
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=False,
        cli_prog_name=PROG,
        extra="forbid",
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_other_sources):
        # Flags only: an environment variable named like a field (SEED, MODEL) must not leak in.
        return (init_settings,)


def _cli_model() -> type[BaseSettings]:
    # Flags carry types and defaults only; RunConfig itself checks ranges, so a flag value and a
    # --config file value get the same checks and the same messages.
    fields: dict[str, Any] = dict(RUN_OPTIONS)
    for name, field in leaf_fields():
        fields[name] = (field.annotation, Field(field.get_default(call_default_factory=True), description=field.description))
    return create_model("GrpoFlyteCli", __base__=_CliBase, **fields)


# What a flag's value is, in words (argparse would show Python types: `{Path,null}`, `dict[str,float]`).
_METAVARS = {"run_dir": "DIR", "config": "FILE", "resume_run": "RUN_NAME", "model": "MODEL", "dataset": "DATASET", "env": "ENV"}
_TYPE_METAVARS = {int: "N", float: "NUM", str: "TEXT", Path: "PATH"}


def _metavar(name: str, annotation: Any) -> str | None:
    if name in _METAVARS:
        return _METAVARS[name]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if typing.get_origin(annotation) is dict:
        return "NAME=WEIGHT,..."
    if typing.get_origin(annotation) is tuple:
        return "NAME,..."
    if len(args) == 1:  # X | None
        return _metavar(name, args[0])
    return _TYPE_METAVARS.get(annotation)


def _version() -> str:
    try:
        return importlib.metadata.version("grpo-flyte")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        # a bad flag is a UserError (one line, exit 2), not argparse's usage dump
        raise SettingsError(f"error parsing CLI: {message}")


def build_cli() -> CliSettingsSource:
    """The command line: pydantic-settings' flags for every option, with metavars in words, one
    default per flag (from the option itself; none shown for an unset optional one) and --version."""
    model = _cli_model()
    parser = _Parser(prog=PROG, description="GRPO + LoRA fine-tuning as Flyte 2 tasks.")
    source = CliSettingsSource(model, root_parser=parser)
    fields = model.model_fields
    for action in parser._actions:  # argparse keeps them here; it has no public accessor
        if action.dest not in fields:
            continue
        field = fields[action.dest]
        if action.metavar is not None:
            action.metavar = _metavar(action.dest, field.annotation) or action.metavar
        description = (field.description or "").rstrip()
        default = field.get_default(call_default_factory=True)
        told = "default" in description or default is None
        text = description if told else f"{description} (default: {shown_default(default)})"
        action.help = text.replace("%", "%%")  # argparse formats help with %
    parser.add_argument("--version", action="version", version=f"grpo-flyte {_version()}")
    return source


class UserError(GrpoFlyteError):
    """Bad command-line input: printed as one line, exit status 2."""


def user_message(exc: GrpoFlyteError) -> str:
    """The error as the command line says it: the config field it is about becomes its flag."""
    return f"{flag(exc.field)} {exc.detail}" if exc.field else str(exc)


def canonical_flags(argv: list[str]) -> list[str]:
    """The arguments with every flag in its kebab-case form (`--group_size` is `--group-size`) and
    TRL's names for shared options turned into ours (`--num_generations 8` is `--group-size 8`)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            key = name.replace("-", "_")
            if key == "num_iterations":
                raise UserError(NUM_ITERATIONS_REFUSED)
            arg = flag(TRL_ALIASES.get(key, key)) + eq + value
        out.append(arg)
    return out


def parse_args(argv: list[str]) -> tuple[dict[str, Any], RunConfig, set[str]]:
    """(run options, the run's config, the config fields given: by a flag or in the --config file)."""
    argv = canonical_flags(argv)
    try:
        source = build_cli()
        parsed = CliApp.run(source.settings_cls, cli_args=argv, cli_settings_source=source)
    except SettingsError as exc:
        raise UserError(str(exc).replace("error parsing CLI: ", "")) from None
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None
    options = {name: getattr(parsed, name) for name in RUN_OPTIONS}
    options_set = set(RUN_OPTIONS)
    explicit = {name for name in parsed.model_fields_set if name not in options_set}
    values = load_config_file(options["config"]) if options["config"] else {}
    values.update({name: getattr(parsed, name) for name in explicit})
    return options, make_config(**values), explicit | set(values)


def check_inputs(config: RunConfig, local: bool) -> tuple[list[Example] | None, tuple[list[Example], list[Example]] | None]:
    """Check the dataset and the rewards before any work starts; returns a file dataset's rows and
    the (training, held-out) split when it was made here.

    Every row must have a usable answer (when the 'correct' reward is weighted) and --eval-size must
    fit. The rows of a file or a local dataset folder travel to the driver as an input; 'gsm8k' and
    Hub ids are loaded where the driver runs (here too, in a local run, to check them first). Custom
    rewards must import, and --wandb-project needs wandb.
    """
    examples = split = None
    data = config.data
    if data.dataset not in (ARITHMETIC_DATASET, GSM8K_DATASET, *BUILTIN_DATASETS) and (is_file_dataset(data.dataset) or Path(data.dataset).exists() or local):
        examples = load_rows(config)
    if examples is not None or local:
        split = train_eval_split(config, examples)
    for name in config.scoring.rewards:
        resolve_reward(name)
    if config.episode.multi_turn:
        load_environment(config.episode.env)
    if config.wandb_project and not _installed("wandb"):
        raise UserError(f"--wandb-project {config.wandb_project!r} needs the wandb package: pip install 'grpo-flyte[wandb]'")
    if config.wandb_project and not local and not _installed("flyteplugins.wandb"):
        raise UserError(
            f"--wandb-project {config.wandb_project!r} on a cluster needs flyteplugins-wandb (the run's W&B link in the "
            "Flyte UI): pip install 'grpo-flyte[wandb]'"
        )
    return examples, split


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a missing parent package too)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


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


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def check_writable(run_dir: Path) -> None:
    """That the run folder can be created (or written) here, without creating it yet."""
    problem = unwritable(run_dir, _writable)
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
    parts += [name + "/" if (run_dir / name).is_dir() else name for name in (ADAPTER_DIR, REPORT_FILE, EVAL_DIR) if (run_dir / name).exists()]
    return ", ".join(parts) or "nothing but its config"


def saved_state(run_dir: Path) -> tuple[str | None, LoopState | None]:
    """The checkpoint a `--resume` continues from, checked before anything is written.

    (path, state); (None, None) when the run never finished an iteration (it starts over, losing nothing). A run that did
    but whose loop state is missing or damaged cannot continue where it stopped: one line says what
    is missing and what the folder still holds, and nothing is written (starting over would
    rewrite metrics.jsonl from iteration 0).
    """
    from grpo_flyte.driver import LoopState

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
    adapter = Path(state.adapter.dir.path)
    if not is_remote(state.adapter.dir.path) and not (adapter if adapter.is_absolute() else run_dir / FLYTE_DATA / adapter).is_dir():
        raise UserError(
            f"--resume: adapter v{state.adapter.version} of the saved loop state is missing ({str(adapter)!r}); "
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
        self.prune_adapters(state.adapter)
        # batches that travelled as files (storage.as_payload) are consumed once the step is checkpointed
        for payload in (self.root / FLYTE_DATA / "payloads").glob("scored-*"):
            shutil.rmtree(payload, ignore_errors=True)

    def report(self, html: str) -> None:
        write_text_atomic(self.root / REPORT_FILE, html)

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        """An evaluation's answers are written once it is recorded."""

    def prune_adapters(self, current: AdapterRef) -> None:
        """Delete adapter versions older than the newest `adapters_to_keep` from the run's Flyte data."""
        path = Path(current.dir.path)
        if is_remote(current.dir.path) or not path.parent.is_dir():
            return
        for old in path.parent.glob("v[0-9]*"):
            if old.name[1:].isdigit() and int(old.name[1:]) <= current.version - self.adapters_to_keep:
                shutil.rmtree(old, ignore_errors=True)

    def export_adapter(self, adapter: AdapterRef) -> Path:
        """The adapter to share: PEFT's files, naming a base others can load; the optimizer state
        stays with the run's adapter versions (flyte/adapters), which a resume reads."""
        def copy(d: Path) -> None:
            shutil.copytree(adapter.dir.path, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns(OPTIMIZER_FILE))

        return build_dir_atomic(self.root / ADAPTER_DIR, copy)

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


def check_model_fits(config: RunConfig, model_dir: Path, split: tuple[list[Example], list[Example]] | None) -> None:
    """What the config asks of the model, checked before any task starts: the LoRA target layers
    and, when the rows are known here, every prompt's length in the model's tokens."""
    from grpo_flyte.models import lora_target_problem

    problem = lora_target_problem(model_dir, tuple(config.lora.lora_target_modules))
    if problem:
        raise ConfigError(problem, field="lora_target_modules")
    if split is not None:
        check_prompt_lengths(config, model_dir, [*split[0], *split[1]])


def check_prompt_lengths(config: RunConfig, model_dir: Path, rows: list[Example]) -> None:
    from transformers import AutoTokenizer

    from grpo_flyte.engines import overlong_prompts

    limit = config.prompt.max_prompt_tokens
    over = overlong_prompts(AutoTokenizer.from_pretrained(model_dir), rows, config.prompt)
    if not over:
        return
    longest = max(over, key=over.__getitem__)
    what = f"{len(over)} of {len(rows)} prompts are longer than {limit} tokens (the longest, {over[longest]} tokens: {rows[longest].question[:60]!r})"
    if config.prompt.overlong_prompts == "truncate":
        logger.warning("%s; each keeps its last %d tokens (--overlong-prompts truncate)", what, limit)
        return
    raise ConfigError(f"{limit}: {what}; expected at most {limit}: raise it, or add --overlong-prompts truncate", field="max_prompt_tokens")


def run_local(options: dict[str, Any], config: RunConfig, explicit: set[str]) -> int:
    from grpo_flyte.models import check_cache_writable, resolve_local_model

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
    if not resuming:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--run-dir {str(run_dir)!r} cannot be created ({exc.strerror}); expected a folder this user can write") from None
    with run_dir_lock(run_dir):
        if resuming:  # what the checks read may have changed while a live writer held the folder
            run_dir, config, resume_from = prepare_local_run(options, config, explicit)
        elif (run_dir / CONFIG_FILE).exists():  # another run started in this folder meanwhile
            raise UserError(f"--run-dir {str(run_dir)!r} already holds a run: add --resume to continue it, or pick another folder")
        write_text_atomic(run_dir / DATA_FILE, json.dumps(fingerprint, indent=2) + "\n")
        return _run_locked(run_dir.resolve(), config, model_dir, examples, resume_from)


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete what a killed writer left half-done (`files.leftovers`) beside the run's files,
    adapters and reports. Only the lock holder calls this."""
    removed = []
    for parent in (run_dir, run_dir / EVAL_DIR, run_dir / FLYTE_DATA, run_dir / FLYTE_DATA / "adapters", run_dir / FLYTE_DATA / "reports"):
        for path in leftovers(parent):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
    return removed


def _run_locked(run_dir: Path, config: RunConfig, model_dir: Path, examples: list[Example] | None, resume_from: str | None) -> int:
    import flyte
    from flyte.io import Dir

    from grpo_flyte.driver import eta_seconds, observe, train_rl
    from grpo_flyte.progress import RunProgress

    for path in remove_leftovers(run_dir):
        logger.info("removed %s, left half-written by a run that was killed", path)
    write_text_atomic(run_dir / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
    logger.info(
        "grpo_flyte local run in %s: %d iterations x %d prompts x %d completions, model %s",
        run_dir, config.iterations, config.prompts_per_iter, config.sampling.group_size, model_dir,
    )
    if resume_from:
        logger.info("resuming from %s", resume_from)
    runner = flyte.with_runcontext(
        mode="local", name=f"grpo-{uuid.uuid4().hex[:10]}", raw_data_path=str(run_dir / FLYTE_DATA)
    )
    files = LocalRunFiles(run_dir, config.adapters_to_keep)
    done = max([i for i in finished_iterations(run_dir) if i > 0], default=0)
    progress = RunProgress(config.iterations, done, eta=lambda history, finished: eta_seconds(config, history, finished))
    try:
        # the bars stop (and the terminal is whole again) before any message below
        with observe(files), observe(progress), progress.shown(), _wandb_dir(run_dir), sigterm_stops_like_ctrl_c():
            run = runner.run(train_rl, config=config, base_model=Dir(path=str(model_dir)), examples=examples, resume_from=resume_from)
            result = run.outputs()[0]
    except KeyboardInterrupt as exc:
        done = [i for i in finished_iterations(run_dir) if i > 0]
        where = f"iterations 1-{max(done)} of {config.iterations} are kept" if done else "no iteration had finished"
        how = "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
        logger.error("%s: %s in %s; continue with: %s --local --resume --run-dir %s", how, where, run_dir, PROG, run_dir)
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 -- top of the CLI: any failure becomes a message and exit 1
        logger.error("run failed: %s", exc)
        done = [i for i in finished_iterations(run_dir) if i > 0]
        kept = f"iterations 1-{max(done)} of {config.iterations} are kept" if done else "no iteration had finished"
        resume = f"{PROG} --local --resume --run-dir {run_dir}"
        if is_not_retried(exc):  # bad input: a resume as it is would fail the same way
            logger.error("%s; the failure comes from the run's input (above), which a resume meets again: fix it, then: %s", kept, resume)
        else:
            logger.error("%s; continue with: %s", kept, resume)
        return 1
    files.export_adapter(result.adapter)
    logger.info("done: adapter %s, report %s, metrics %s", run_dir / ADAPTER_DIR, run_dir / REPORT_FILE, run_dir / METRICS_FILE)
    if result.merged is not None:
        where = files.export_merged(result.merged.path)
        logger.info("merged model (base + adapter v%d; loads with AutoModelForCausalLM.from_pretrained, no PEFT): %s", result.adapter.version, where)
    return 0


def resolve_remote_model(model: str):
    """The base model as a Dir in remote storage: prefetched from the Hub or uploaded from here."""
    import flyte
    import flyte.prefetch
    from flyte.io import Dir

    from grpo_flyte.envs import settings
    from grpo_flyte.models import resolve_local_model

    if model == EMBEDDED_MODEL or Path(model).expanduser().is_dir():
        return Dir.from_local_sync(str(resolve_local_model(model)))
    if model.count("/") != 1:
        raise ModelError(f"{model!r}: expected 'embedded', a local model directory or a Hugging Face repo id like 'Qwen/Qwen3-0.6B'", field="model")
    logger.info("prefetching %s into the cluster's storage (cached after the first time)", model)
    prefetch = flyte.prefetch.hf_model(repo=model, hf_token_key=settings.hf_token_secret)
    prefetch.wait()
    return prefetch.outputs()[0]


def require_cluster() -> None:
    """Stop unless a Flyte cluster is configured: without an endpoint, flyte.run would quietly run
    the whole loop on this machine instead of submitting it."""
    import flyte.config

    if not flyte.config.auto().platform.endpoint:
        raise UserError(
            "no Flyte cluster is configured (no admin endpoint in ./.flyte/config.yaml, ~/.flyte/config.yaml, "
            "~/.union/config.yaml, $FLYTECTL_CONFIG or $UCTL_CONFIG); create one with "
            "'flyte create config --endpoint <your-cluster> --project <p> --domain <d>', or add --local to run on this machine"
        )


def examples_inputs(examples: list[Example] | None, upload: Callable[[str, str], Any]) -> dict[str, Any]:
    """A file dataset's rows as driver inputs: inline, or, past Flyte's inline limit, a folder
    uploaded with `upload(local folder, content hash)`."""
    text = payload_text(examples) if examples else None
    if text is None:
        return {"examples": examples}
    with tempfile.TemporaryDirectory() as tmp:
        write_payload(Path(tmp), text)
        return {"examples": [], "examples_file": [upload(tmp, payload_key(text))]}


def _connect(custom_context: dict[str, str] | None = None):
    """flyte.init for this package's code; returns the run context to submit with."""
    import flyte

    from grpo_flyte.envs import from_source_checkout

    require_cluster()
    # root_dir = src/ (or site-packages), so the modules resolve as grpo_flyte.* on the cluster.
    flyte.init_from_config(root_dir=Path(__file__).resolve().parents[1])
    # A checkout's code travels in the code bundle; an installed wheel is in the image already
    # (envs._with_package), and bundling site-packages would ship every loaded library.
    return flyte.with_runcontext(copy_style="loaded_modules" if from_source_checkout() else "none", custom_context=custom_context)


def wandb_submission(project: str | None) -> tuple[dict[str, str], tuple[Any, ...]]:
    """For --wandb-project on a cluster: the run context naming a new W&B run, and the W&B link
    (flyteplugins-wandb) for the driver task's page in the Flyte UI; ({}, ()) without W&B.

    The run is chosen here, before submitting, because the link is made when the task is
    submitted; the driver then logs to the run the context names. The link needs the W&B entity
    (user or team), from WANDB_ENTITY; wandb itself picks the key's default entity without it,
    which the link cannot know."""
    from grpo_flyte.tracking import WandbRun, new_run_id

    if not project:
        return {}, ()
    chosen = WandbRun(project=project, id=new_run_id(), entity=os.environ.get("WANDB_ENTITY") or None)
    if chosen.entity is None:
        logger.warning("W&B: set WANDB_ENTITY (your W&B user or team) for the Flyte UI's W&B link to open run %s; without it, it opens wandb.ai", chosen.id)
    logger.info("W&B run %s in project %s, linked from the driver task in the Flyte UI", chosen.id, project)
    return chosen.context(), (WandbRun.link(),)


def run_remote(config: RunConfig) -> int:
    from flyte.io import Dir

    from grpo_flyte.driver import train_rl
    from grpo_flyte.models import is_repo_id, resolve_local_model

    examples, split = check_inputs(config, local=False)
    context, links = wandb_submission(config.wandb_project)
    runner = _connect(context)
    if not is_repo_id(config.base.model):  # a Hub model is checked where it is fetched, by the trainer
        check_model_fits(config, resolve_local_model(config.base.model), split)
    base_model = resolve_remote_model(config.base.model)
    inputs = examples_inputs(examples, lambda folder, key: Dir.from_local_sync(folder, dir_cache_key=key))
    # the link is shown on the submitted task only: the driver's pod runs train_rl as declared
    task = train_rl.override(links=links) if links else train_rl
    run = runner.run(task, config=config, base_model=base_model, **inputs)
    print(run.url)
    return 0


def resume_remote(run_name: str) -> int:
    """Rerun a cluster run with recovery. The driver starts again from the same inputs; every task
    it submits gets the action name it had in the first run (names hash the inputs, and payload
    folders carry a content hash), so each finished generate, score and train step is reused and
    the loop is back where it stopped after a replay of its decisions."""
    runner = _connect()
    try:
        run = runner.rerun(run_name, recover=True)
    except NotImplementedError as exc:
        raise UserError(f"--resume-run {run_name!r}: this cluster cannot recover runs ({exc}); start a new run") from None
    except Exception as exc:  # noqa: BLE001 (a run not found, no access, ...: one line naming the run)
        raise UserError(f"--resume-run {run_name!r}: {type(exc).__name__}: {exc}") from None
    print(run.url)
    return 0


def quiet_libraries() -> None:
    """Keep the console to this run's lines: no per-file progress bars from Hugging Face
    downloads and model loads, and transformers' own messages only when they are errors. Set
    before those libraries are imported (they read these once); a value you set wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO)
    quiet_libraries()
    argv = sys.argv[1:] if argv is None else argv
    try:
        options, config, explicit = parse_args(argv)
        if options["local"]:
            if options["resume_run"] is not None:
                raise UserError("--resume-run continues a cluster run; a local run continues with --resume --run-dir DIR")
            return run_local(options, config, explicit)
        if options["resume"] or options["run_dir"]:
            raise UserError("--resume and --run-dir apply to local runs: add --local")
        if options["resume_run"] is not None:
            flags = sorted({flag(name) for name in explicit} | ({"--config"} if options["config"] else set()))
            if flags:
                raise UserError(f"--resume-run reruns the cluster run with its own inputs; drop {', '.join(flags)}")
            return resume_remote(options["resume_run"])
        return run_remote(config)
    except GrpoFlyteError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
