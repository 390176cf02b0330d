"""The command line of `python -m grpo_flyte` (also `python -m grpo_flyte.driver`), generated from `RunConfig`.

Every config field is a flag (`group_size` -> `--group-size`) with its description as help; a
`--config FILE` (YAML or JSON, flat or nested) gives base values that flags override. Bad input
exits with status 2 and one line naming the value and what was expected, before anything is written.

A local run's folder (config, metrics, held-out answers, report, adapter, merged model) is written
here, from what the driver task reports (`driver.observe`) and returns (`RunResult`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, create_model
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict, SettingsError

from grpo_flyte.config import (
    ARITHMETIC_DATASET,
    EMBEDDED_MODEL,
    GSM8K_DATASET,
    RunConfig,
    flag,
    format_validation_error,
    leaf_fields,
    load_config_file,
    make_config,
)
from grpo_flyte.data import load_file, train_eval_split
from grpo_flyte.errors import GrpoFlyteError, ModelError
from grpo_flyte.files import build_dir_atomic, write_text_atomic
from grpo_flyte.rewards import resolve_reward
from grpo_flyte.storage import is_remote
from grpo_flyte.types import REPORT_FILE, AdapterRef, EvalAnswer, Example, MetricsRow

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
RUN_OPTIONS = {
    "local": (bool, Field(False, description="Run in Flyte local mode on this machine instead of a cluster.")),
    "run_dir": (
        Path | None,
        Field(None, description="Local runs: folder for config, metrics, report and adapter (default: a new ./runs/<time>)."),
    ),
    "resume": (bool, Field(False, description="Local runs: continue the run in --run-dir from its last finished iteration.")),
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


class UserError(GrpoFlyteError):
    """Bad command-line input: printed as one line, exit status 2."""


def user_message(exc: GrpoFlyteError) -> str:
    """The error as the command line says it: the config field it is about becomes its flag."""
    return f"{flag(exc.field)} {exc.detail}" if exc.field else str(exc)


def parse_args(argv: list[str]) -> tuple[dict[str, Any], RunConfig, set[str]]:
    """(run options, the run's config, the config fields given explicitly on the command line)."""
    try:
        parsed = CliApp.run(_cli_model(), cli_args=argv)
    except SettingsError as exc:
        raise UserError(str(exc).replace("error parsing CLI: ", "")) from None
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None
    options = {name: getattr(parsed, name) for name in RUN_OPTIONS}
    options_set = set(RUN_OPTIONS)
    explicit = {name for name in parsed.model_fields_set if name not in options_set}
    values = load_config_file(options["config"]) if options["config"] else {}
    values.update({name: getattr(parsed, name) for name in explicit})
    return options, make_config(**values), explicit


def check_inputs(config: RunConfig, local: bool) -> list[Example] | None:
    """Check the dataset and the rewards before any work starts; returns a file dataset's rows.

    Every row must have a usable answer and --eval-size must fit. A file's rows travel to the
    driver as an input; 'gsm8k' is loaded where the driver runs (here too, in a local run, to check
    it first). Custom rewards must import, and --wandb-project needs wandb.
    """
    examples = None
    data = config.data
    if data.dataset not in (ARITHMETIC_DATASET, GSM8K_DATASET):
        examples = load_file(data.dataset, data.question_column, data.answer_column)
    if examples is not None or local:
        train_eval_split(config, examples)
    for name in config.scoring.rewards:
        resolve_reward(name)
    if config.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UserError(f"--wandb-project {config.wandb_project!r} needs the wandb package: pip install 'grpo-flyte[wandb]'")
    return examples


def prepare_local_run(options: dict[str, Any], config: RunConfig, explicit: set[str]) -> tuple[Path, RunConfig, str | None]:
    """Check everything a local run needs before writing anything: (run dir, config, checkpoint to resume)."""
    run_dir: Path | None = options["run_dir"]
    if options["resume"]:
        if run_dir is None:
            raise UserError("--resume needs --run-dir DIR: the folder of the run to continue")
        saved_file = run_dir / CONFIG_FILE
        if not saved_file.is_file():
            raise UserError(f"--resume: {str(saved_file)!r} not found; expected the folder of an earlier local run")
        try:
            saved = RunConfig.model_validate_json(saved_file.read_text())
        except (ValidationError, UnicodeDecodeError) as exc:
            detail = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            raise UserError(f"--resume: {str(saved_file)!r} is not a valid saved config: {detail}") from None
        given, kept = config.flat(), saved.flat()
        changed = sorted(f for f in explicit if f != "num_iterations" and given[f] != kept[f])
        if changed:
            flags = ", ".join("--" + f.replace("_", "-") for f in changed)
            raise UserError(f"--resume continues the saved config; {flags} differ from {saved_file} (only --num-iterations may change)")
        if "num_iterations" in explicit:
            saved = saved.model_copy(update={"num_iterations": config.num_iterations})
        checkpoint = run_dir / FLYTE_DATA / "checkpoint"
        return run_dir, saved, str(checkpoint.resolve()) if checkpoint.is_file() else None
    if run_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"
    if (run_dir / CONFIG_FILE).exists():
        raise UserError(f"--run-dir {str(run_dir)!r} already holds a run: add --resume to continue it, or pick another folder")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is a file; expected a folder")
    return run_dir, config, None


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
            rows = "".join(json.dumps({"iteration": row.iteration, **a.model_dump()}) + "\n" for a in answers)
            write_text_atomic(self.root / EVAL_DIR / f"iter-{row.iteration:04d}.jsonl", rows)
        self.prune_adapters(state.adapter)

    def report(self, html: str) -> None:
        write_text_atomic(self.root / REPORT_FILE, html)

    def prune_adapters(self, current: AdapterRef) -> None:
        """Delete adapter versions older than the newest `adapters_to_keep` from the run's Flyte data."""
        path = Path(current.dir.path)
        if is_remote(current.dir.path) or not path.parent.is_dir():
            return
        for old in path.parent.glob("v[0-9]*"):
            if old.name[1:].isdigit() and int(old.name[1:]) <= current.version - self.adapters_to_keep:
                shutil.rmtree(old, ignore_errors=True)

    def export_adapter(self, adapter: AdapterRef) -> Path:
        return build_dir_atomic(self.root / ADAPTER_DIR, lambda d: shutil.copytree(adapter.dir.path, d, dirs_exist_ok=True))

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
    import flyte
    from flyte.io import Dir

    from grpo_flyte.driver import observe, train_rl
    from grpo_flyte.models import resolve_local_model

    run_dir, config, resume_from = prepare_local_run(options, config, explicit)
    examples = check_inputs(config, local=True)
    model_dir = resolve_local_model(config.base.model)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    write_text_atomic(run_dir / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
    logger.info(
        "grpo_flyte local run in %s: %d iterations x %d prompts x %d completions, model %s",
        run_dir, config.num_iterations, config.prompts_per_iter, config.sampling.group_size, model_dir,
    )
    if resume_from:
        logger.info("resuming from %s", resume_from)
    runner = flyte.with_runcontext(
        mode="local", name=f"grpo-{uuid.uuid4().hex[:10]}", raw_data_path=str(run_dir / FLYTE_DATA)
    )
    files = LocalRunFiles(run_dir, config.adapters_to_keep)
    try:
        with observe(files), _wandb_dir(run_dir):
            run = runner.run(train_rl, config=config, base_model=Dir(path=str(model_dir)), examples=examples, resume_from=resume_from)
        result = run.outputs()[0]
    except KeyboardInterrupt:
        logger.error("interrupted; continue with: %s --local --resume --run-dir %s", PROG, run_dir)
        return 130
    except Exception as exc:  # noqa: BLE001 -- top of the CLI: any failure becomes a message and exit 1
        logger.error("run failed: %s", exc)
        logger.error("finished iterations are kept; continue with: %s --local --resume --run-dir %s", PROG, run_dir)
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


def run_remote(config: RunConfig) -> int:
    import flyte

    from grpo_flyte.driver import train_rl

    require_cluster()
    examples = check_inputs(config, local=False)
    # root_dir = src/, so a checkout's modules resolve as grpo_flyte.* on the cluster.
    flyte.init_from_config(root_dir=Path(__file__).resolve().parents[1])
    base_model = resolve_remote_model(config.base.model)
    run = flyte.run(train_rl, config=config, base_model=base_model, examples=examples)
    print(run.url)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    argv = sys.argv[1:] if argv is None else argv
    try:
        options, config, explicit = parse_args(argv)
        if options["local"]:
            return run_local(options, config, explicit)
        if options["resume"] or options["run_dir"]:
            raise UserError("--resume and --run-dir apply to local runs: add --local")
        return run_remote(config)
    except GrpoFlyteError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
