"""The command line of `python -m grpo_flyte` (also `python -m grpo_flyte.driver`), generated from `RunConfig`.

Every config field is a flag (`group_size` -> `--group-size`) with its description as help; a
`--config FILE` (YAML or JSON, flat or nested) gives base values that flags override. Bad input
exits with status 2 and one line naming the value and what was expected, before anything is written.

This module parses and dispatches: a local run is `grpo_flyte.launch.local_run` (its folder
`grpo_flyte.launch.run_folder`), a local sweep `grpo_flyte.launch.sweep_folder`, a cluster submission
`grpo_flyte.launch.submit`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, create_model
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict, SettingsError

from grpo_flyte.config.constants import PROG
from grpo_flyte.config.errors import format_validation_error, make_config
from grpo_flyte.config.files import SWEEP_SECTION, load_config_file
from grpo_flyte.config.grid import expand_sweep, sweep_grid
from grpo_flyte.config.run import RunConfig, leaf_fields
from grpo_flyte.config.table import shown_default
from grpo_flyte.config.trl_names import TRL_ALIASES, TRL_REFUSED, TRL_TRANSLATED, refused
from grpo_flyte.errors import GrpoFlyteError, UserError, flag
from grpo_flyte.launch import exporting
from grpo_flyte.launch.local_run import run_local
from grpo_flyte.launch.stopping import ctrl_c_stops
from grpo_flyte.launch.submit import resume_remote, run_remote
from grpo_flyte.launch.sweep_folder import is_sweep_dir, run_sweep_local
from grpo_flyte.models.loading import quiet_bitsandbytes

logger = logging.getLogger("grpo_flyte")

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


SWEEP_HELP = (
    "Run a sweep: one config per combination of the values (repeat the flag for a grid; separate values with ';' "
    "when they hold commas), all trained at once on the same pools, compared in one report (docs/configuration.md#sweeps)."
)


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
_METAVARS = {
    "run_dir": "DIR",
    "config": "FILE",
    "resume_run": "RUN_NAME",
    "model": "MODEL",
    "dataset": "DATASET",
    "env": "ENV",
    "prices": "TYPE=DOLLARS,...",
}
_TYPE_METAVARS = {int: "N", float: "NUM", str: "TEXT", Path: "PATH"}


def _metavar(name: str, annotation: Any) -> str | None:
    if name in _METAVARS:
        return _METAVARS[name]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if typing.get_origin(annotation) is dict:
        return "NAME=WEIGHT,..." if typing.get_args(annotation)[1] is float else "JSON"
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
    parser = _Parser(
        prog=PROG,
        description="GRPO + LoRA fine-tuning as Flyte 2 tasks. A finished local run: `export RUN --to adapter|merged` "
        "and `eval PATH` (each with --help; docs/exporting.md).",
    )
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
    # Shown in --help only: `take_sweep_flags` takes --sweep out of the arguments before they are parsed.
    parser.add_argument("--sweep", action="append", metavar="KEY=V1,V2,...", help=SWEEP_HELP)
    return source


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
            if key in TRL_REFUSED:
                raise UserError(refused(key))
            if key in TRL_TRANSLATED:
                ours = TRL_TRANSLATED[key]
                raise UserError(f"--{name} is TRL's name for {flag(ours)} in config files and Python; as a flag, give {flag(ours)}")
            arg = flag(TRL_ALIASES.get(key, key)) + eq + value
        out.append(arg)
    return out


def take_sweep_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments but `--sweep KEY=V1,V2`, the sweep flags' values): a sweep's values hold
    commas and equals signs that the options' own parsing would split."""
    rest, sweep = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--sweep":
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise UserError("--sweep expects KEY=VALUE1,VALUE2,... (e.g. --sweep learning_rate=1e-4,2e-4)")
            sweep.append(value)
        elif arg.startswith("--sweep="):
            sweep.append(arg.removeprefix("--sweep="))
        else:
            rest.append(arg)
    return rest, sweep


def parse_args(argv: list[str]) -> tuple[dict[str, Any], RunConfig, set[str]]:
    """(run options, the run's config, the config fields given: by a flag or in the --config file).
    With a sweep, `options["sweep"]` holds its configs (`sweep_grid.SweepMember`), each checked."""
    argv, sweep_flags = take_sweep_flags(argv)
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
    section = values.pop(SWEEP_SECTION, None)
    values.update({name: getattr(parsed, name) for name in explicit})
    grid = sweep_grid(sweep_flags, section)
    options["sweep"] = expand_sweep(values, grid, explicit | set(values), local=options["local"]) if grid else []
    return options, make_config(**values), explicit | set(values)


def quiet_libraries() -> None:
    """Keep the console to this run's lines: no per-file progress bars from Hugging Face
    downloads and model loads, and transformers' own messages only when they are errors. Set
    before those libraries are imported (they read these once); a value you set wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    quiet_bitsandbytes()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO)
    quiet_libraries()
    ctrl_c_stops()  # a run started with `cmd &` by a script or a tool would not stop on Ctrl-C
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in exporting.COMMANDS:  # `export RUN --to ...`, `eval PATH`
            return exporting.main(argv)
        options, config, explicit = parse_args(argv)
        if options["local"]:
            if options["resume_run"] is not None:
                raise UserError("--resume-run continues a cluster run; a local run continues with --resume --run-dir DIR")
            if options["sweep"] or (options["resume"] and is_sweep_dir(options["run_dir"])):
                return run_sweep_local(options, options["sweep"], explicit)
            return run_local(options, config, explicit)
        if options["resume"] or options["run_dir"]:
            raise UserError("--resume and --run-dir apply to local runs: add --local")
        if options["resume_run"] is not None:
            flags = sorted(
                {flag(name) for name in explicit}
                | ({"--config"} if options["config"] else set())
                | ({"--sweep"} if options["sweep"] else set())
            )
            if flags:
                raise UserError(f"--resume-run reruns the cluster run with its own inputs; drop {', '.join(flags)}")
            return resume_remote(options["resume_run"])
        return run_remote(config, options["sweep"])
    except GrpoFlyteError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a local run starts (a started one says what it kept), or a submission
        print("interrupted", file=sys.stderr)
        return 130
