"""This module runs a local run (`--local`) in this process: every check before anything is written,
then its folder locked and made ready, then the driver run with the folder's files, log, progress
bars and signals, and the line that says how it ended.

A local sweep (`grpo_flyte.launch.sweep_folder`) takes each of its configs through the same steps
(`check_data`, `check_fits`, `begin_run`, `FolderRun.watched`, `stop_interrupted`), so a config's
folder is what its lone run writes, and a stop says the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_flyte.config.constants import PROG
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import UserError, is_not_retried
from grpo_flyte.launch.lock import run_dir_lock
from grpo_flyte.launch.preflight import check_inputs, check_judge_fits, check_model_fits, check_reward_model_fits, reward_model_dirs
from grpo_flyte.launch.run_files import LocalRunFiles, finish_local_run
from grpo_flyte.launch.run_folder import (
    CONFIG_FILE,
    FLYTE_DATA,
    LOG_FILE,
    check_same_data,
    create_run_dir,
    data_fingerprint,
    prepare_local_run,
    remove_leftovers,
    save_data_fingerprint,
    trained_iterations,
)
from grpo_flyte.launch.run_log import flyte_log_in, one_line
from grpo_flyte.launch.stopping import sigterm_stops_like_ctrl_c, stop_interrupted
from grpo_flyte.loop import observers
from grpo_flyte.reward_fns import reward_model_ref
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.files import write_text_atomic
from grpo_flyte.types import Example, RunResult

if TYPE_CHECKING:
    from rich.progress import Progress

    from grpo_flyte.reporting.progress import RunProgress

logger = logging.getLogger("grpo_flyte")


def new_run_name() -> str:
    """A Flyte local run's name, unique in this process (a sweep names its configs' runs before they start)."""
    return f"grpo-{uuid.uuid4().hex[:10]}"


def check_data(
    config: RunConfig, run_dir: Path, resuming: bool
) -> tuple[list[Example] | None, tuple[list[Example], list[Example]], dict[str, Any]]:
    """A config's data checked (`check_inputs`) and fingerprinted, and a resumed run's compared with
    the data it started with: (a file dataset's rows, the split, the fingerprint)."""
    examples, split = check_inputs(config, local=True)
    fingerprint = data_fingerprint(config, split)
    if resuming:
        check_same_data(run_dir, fingerprint)
    return examples, split, fingerprint


@dataclasses.dataclass
class ScoringDirs:
    """The folders of the models a run scores with besides its reward functions: the judge's (None
    without the 'judge' reward) and each reward model's, by the model its rewards name."""

    judge: Path | None = None
    reward_models: dict[str, Path] = dataclasses.field(default_factory=dict)

    def merged(self, other: ScoringDirs) -> ScoringDirs:
        """These folders and `other`'s (a sweep's configs share one judge and the reward models)."""
        return ScoringDirs(self.judge or other.judge, {**self.reward_models, **other.reward_models})

    def inputs(self) -> dict[str, Any]:
        """train_rl's inputs for them."""
        from flyte.io import Dir

        judge = {"judge_model": Dir(path=str(self.judge))} if self.judge is not None else {}
        models = {"reward_models": {m: Dir(path=str(d)) for m, d in self.reward_models.items()}} if self.reward_models else {}
        return {**judge, **models}


def check_fits(config: RunConfig, model_dir: Path, split: tuple[list[Example], list[Example]]) -> ScoringDirs:
    """The base model checked against the config and its prompts, and the judge's model and the
    reward models too when the rewards name them: their folders."""
    from grpo_flyte.models.folders import resolve_local_model

    check_model_fits(config, model_dir, split)
    judge_dir = resolve_local_model(config.judge.judge_model, field="judge_model") if config.judging else None
    if judge_dir is not None:
        check_judge_fits(config, judge_dir, split)
    reward_models = reward_model_dirs(config)
    for name in config.scoring.model_rewards:
        check_reward_model_fits(config, name, reward_models[reward_model_ref(name)[0]], split)
    return ScoringDirs(judge_dir, reward_models)


@dataclasses.dataclass
class FolderRun:
    """A config's Flyte local run in its locked folder, made ready by `begin_run`: the runner, the
    folder's files and the run's bars, and train_rl's inputs."""

    run_dir: Path
    name: str  # the Flyte run's
    runner: Any
    files: LocalRunFiles
    progress: RunProgress
    inputs: dict[str, Any]

    @contextlib.contextmanager
    def watched(self, *others: observers.RunObserver, only_this_run: bool = False) -> Iterator[None]:
        """While the block runs: Flyte's log lines in the folder's run.log, and the folder's files,
        `others` and the bars told of the run's progress; `only_this_run` keeps both to this Flyte
        run (a sweep runs several in this process)."""
        scope = self.name if only_this_run else None
        with contextlib.ExitStack() as stack:
            stack.enter_context(flyte_log_in(self.run_dir / LOG_FILE, scope))
            for observer in (self.files, *others, self.progress):
                stack.enter_context(observers.observe(observer, scope))
            yield

    def run(self) -> RunResult:
        """The driver's run to its end, on this thread (a lone run)."""
        from grpo_flyte.driver import train_rl

        return self.runner.run(train_rl, **self.inputs).outputs()[0]

    async def run_async(self) -> RunResult:
        """The driver's run on this event loop, beside others (a config of a sweep)."""
        from grpo_flyte.driver import train_rl

        return (await self.runner.run.aio(train_rl, **self.inputs)).outputs()[0]


def begin_run(
    run_dir: Path,
    config: RunConfig,
    name: str,
    *,
    model_dir: Path,
    examples: list[Example] | None,
    resume_from: str | None,
    scoring_dirs: ScoringDirs | None,
    bars: Progress | None = None,
    label: str | None = None,
) -> FolderRun:
    """Make a locked run folder ready for a run of `config` (what a killed writer left half-written
    removed, the config written) and set up that run: Flyte local run `name`, its raw data in the
    folder, its bars counting from the iterations the folder kept (among a sweep's `bars`, named
    `label`)."""
    import flyte
    from flyte.io import Dir

    from grpo_flyte.driver import train_rl  # noqa: F401 -- a driver that cannot load fails before the folder is touched
    from grpo_flyte.reporting.progress import RunProgress, eta_seconds

    remove_leftovers(run_dir)
    write_text_atomic(run_dir / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
    root = run_dir.resolve()
    runner = flyte.with_runcontext(mode="local", name=name, raw_data_path=str(root / FLYTE_DATA))
    files = LocalRunFiles(root, config.adapters_to_keep)
    done = max(trained_iterations(run_dir), default=0)
    progress = RunProgress(
        config.iterations, done, eta=lambda history, finished: eta_seconds(config, history, finished), bars=bars, name=label
    )
    models = scoring_dirs.inputs() if scoring_dirs is not None else {}
    inputs = {"config": config, "base_model": Dir(path=str(model_dir)), "examples": examples, "resume_from": resume_from, **models}
    return FolderRun(run_dir, name, runner, files, progress, inputs)


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
    """A local run from the command line's options: its exit status (errors before it starts are `UserError`s)."""
    from grpo_flyte.models.folders import resolve_local_model
    from grpo_flyte.runtime.cache import check_cache_writable

    observers.command_started(time.perf_counter())  # the rows' wall clock counts from here (records.StageCost)
    resuming = bool(options["resume"])
    # Every check first (nothing is written until they pass), then the folder's lock, then writes.
    run_dir, config, resume_from = prepare_local_run(options, config, explicit)
    examples, split, fingerprint = check_data(config, run_dir, resuming)
    check_cache_writable()
    model_dir = resolve_local_model(config.base.model)
    scoring_dirs = check_fits(config, model_dir, split)
    if not resuming:
        create_run_dir(run_dir)
    with run_dir_lock(run_dir):
        if resuming:  # what the checks read may have changed while a live writer held the folder
            run_dir, config, resume_from = prepare_local_run(options, config, explicit)
        elif (run_dir / CONFIG_FILE).exists():  # another run started in this folder meanwhile
            raise UserError(f"--run-dir {str(run_dir)!r} already holds a run: add --resume to continue it, or pick another folder")
        save_data_fingerprint(run_dir, fingerprint)
        return _run_locked(run_dir.resolve(), config, model_dir, examples, resume_from, scoring_dirs)


def _kept(run_dir: Path, config: RunConfig) -> str:
    done = trained_iterations(run_dir)
    return f"iterations 1-{max(done)} of {config.iterations} are kept" if done else "no iteration had finished"


def _run_locked(
    run_dir: Path,
    config: RunConfig,
    model_dir: Path,
    examples: list[Example] | None,
    resume_from: str | None,
    scoring_dirs: ScoringDirs | None = None,
) -> int:
    run = begin_run(
        run_dir, config, new_run_name(), model_dir=model_dir, examples=examples, resume_from=resume_from, scoring_dirs=scoring_dirs
    )
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
    try:
        # the bars stop (and the terminal is whole again) before any message below
        with run.watched(), run.progress.shown(), _wandb_dir(run_dir), sigterm_stops_like_ctrl_c(), memory.span() as whole:
            result = run.run()
    except KeyboardInterrupt as exc:
        stop_interrupted(exc, run_dir, lambda: f"{_kept(run_dir, config)} in {run_dir}")
    except Exception as exc:  # noqa: BLE001 -- top of the CLI: any failure becomes a message and exit 1
        kept = _kept(run_dir, config)
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
    return finish_local_run(run.files, config, result, whole.peak)
