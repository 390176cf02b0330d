"""A local sweep (`--local --sweep KEY=V1,V2 ...`): every config trained at once in this process,
in one folder.

The sweep folder holds each config's run folder (exactly what a lone run of that config writes, so
every tool that reads a run folder reads it: each config is checked, begun and watched by
`grpo_flyte.launch.local_run`'s own steps), `sweep.json` (the configs), `sweep.jsonl` (each
config's outcome and held-out figures) and `report.html` (the comparison, `grpo_flyte.reporting.sweep_report`).
The configs run as concurrent Flyte local runs on Flyte's one event loop, so their `generate` calls
meet in the replica's batcher and engine, and their train steps share the loaded base (both are
per-process caches). They meet before each iteration's rollouts and each evaluation
(`grpo_flyte.loop.lockstep`), so that those of every config are one engine batch; configs of another base model (`--sweep model=A,B`) get that base's own
engine and loaded base, each built once. A failing config ends alone and the sweep says why; `--resume --run-dir SWEEP`
continues every config that did not finish, each from its own checkpoint.

On the console each line of a config starts with its name, a terminal shows a progress bar per
config (`progress.RunProgress` on the sweep's shared bars), and the sweep ends with the comparison
(`sweep_report.comparison_lines`). Ctrl-C and SIGTERM stop it as they stop a lone run
(`grpo_flyte.launch.stopping`): one line, what each config kept, the resume command.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_flyte.config.constants import PROG
from grpo_flyte.config.grid import CheckProgress, SweepMember
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import UserError
from grpo_flyte.launch.local_run import ScoringDirs, begin_run, check_data, check_fits, new_run_name
from grpo_flyte.launch.lock import run_dir_lock
from grpo_flyte.launch.run_files import finish_local_run, peak_words
from grpo_flyte.launch.run_folder import (
    CONFIG_FILE,
    LOG_FILE,
    METRICS_FILE,
    check_writable,
    create_run_dir,
    prepare_local_run,
    remove_leftovers_in,
    save_data_fingerprint,
    trained_iterations,
)
from grpo_flyte.launch.run_log import one_line
from grpo_flyte.launch.stopping import sigterm_stops_like_ctrl_c, stop_interrupted
from grpo_flyte.launch.sweep_plan import machine_memory, plan_line, plan_sweep
from grpo_flyte.loop import observers
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.lockstep import leave, lockstep
from grpo_flyte.loop.pruning import pruning
from grpo_flyte.loop.state import LoopState
from grpo_flyte.reporting.sweep_report import ConfigOutcome, comparison_lines, figures, held_out_key, render_sweep_report
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.files import write_text_atomic
from grpo_flyte.types import REPORT_FILE, Example, MetricsRow

if TYPE_CHECKING:
    from rich.progress import Progress

logger = logging.getLogger("grpo_flyte")

SWEEP_FILE = "sweep.json"  # the sweep's configs: each one's name, what it changes, its whole config
OUTCOMES_FILE = "sweep.jsonl"  # a line per config: its outcome and held-out figures
PRUNED_FILE = "pruned.json"  # --sweep-prune's decisions: each stopped config's iteration and why (a resume keeps them)
# What configs compared by --sweep-prune must share: the same held-out questions, answered and valued alike.
PRUNE_SHARED_KEYS = ("dataset", "eval_size", "num_generations_eval", "select_by", "sweep_prune")


def is_sweep_dir(path: Path | None) -> bool:
    return path is not None and (path / SWEEP_FILE).is_file()


class SweepBoard:
    """Where each config stands; `sweep.jsonl` and the comparison report rewritten whole on every change."""

    def __init__(self, root: Path, members: list[SweepMember]):
        self.root = root
        self.outcomes = {
            m.name: ConfigOutcome(name=m.name, overrides=m.overrides, seed=m.config.seed, model=m.config.base.model) for m in members
        }

    def update(self, name: str, **changes: Any) -> None:
        self.outcomes[name] = self.outcomes[name].model_copy(update=changes)
        self.write()

    def write(self, status: str = "running") -> None:
        outcomes = list(self.outcomes.values())
        key = held_out_key(outcomes)
        write_text_atomic(self.root / OUTCOMES_FILE, "".join(json.dumps(figures(o, key)) + "\n" for o in outcomes))
        write_text_atomic(self.root / REPORT_FILE, render_sweep_report(outcomes, status))


class _ConfigProgress:
    """A run observer that keeps one config's rows on the board."""

    def __init__(self, board: SweepBoard, name: str):
        self.board, self.name = board, name

    def recorded(self, state: LoopState, row: MetricsRow, answers: list[EvalAnswer] | None) -> None:
        self.board.update(self.name, status="running", history=[r.flat() for r in state.history])

    def report(self, html: str) -> None:
        """Each config's own report is its run folder's; the board renders the comparison."""

    def evaluating(self, iteration: int, answered: int, total: int) -> None:
        """The comparison changes when an evaluation is recorded, not while it runs."""


# The config whose work this is, outside its Flyte run (its folder's last files, its failure):
# each config runs as an asyncio task of its own, which holds its own value.
_config_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("sweep_config", default=None)


class _NamedLines(logging.Filter):
    """The console's lines of a config's run start with its name: `[learning_rate=1e-4] iter 1/5 ...`."""

    def __init__(self, names: dict[str, str]):
        super().__init__()
        self.names = names  # Flyte run name -> config name

    def filter(self, record: logging.LogRecord) -> bool:
        name = self.names.get(observers.current_run() or "") or _config_name.get()
        if name and not getattr(record, "sweep_named", False):
            record.msg, record.sweep_named = f"[{name}] {record.msg}", True
        return True


def _saved_members(sweep_dir: Path) -> list[SweepMember]:
    try:
        return [SweepMember.model_validate(m) for m in json.loads((sweep_dir / SWEEP_FILE).read_text())["configs"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--resume: {str(sweep_dir / SWEEP_FILE)!r} is not a sweep's saved configs ({one_line(exc)[:200]})") from None


def _finished(sweep_dir: Path) -> set[str]:
    """The configs a resume leaves alone: complete, or stopped by --sweep-prune."""
    path = sweep_dir / OUTCOMES_FILE
    done = set(pruned_configs(sweep_dir))
    if not path.is_file():
        return done
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            if (entry := json.loads(line))["status"] in ("complete", "pruned"):
                done.add(entry["name"])
    return done


def pruned_configs(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """--sweep-prune's decisions kept in the sweep folder: config name -> {iteration, reason}."""
    path = sweep_dir / PRUNED_FILE
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise UserError(f"--resume: {str(path)!r} is not a sweep's pruning decisions ({one_line(exc)[:200]})") from None


class PruneLog:
    """Keeps each --sweep-prune decision: in the sweep folder (PRUNED_FILE, rewritten whole) and on the board."""

    def __init__(self, sweep_dir: Path, board: SweepBoard):
        self.path, self.board = sweep_dir / PRUNED_FILE, board
        self.decisions = pruned_configs(sweep_dir)
        self._lock = threading.Lock()  # the configs' drivers may decide from several threads

    def decided(self, name: str, iteration: int, reason: str) -> None:
        with self._lock:
            self.decisions[name] = {"iteration": iteration, "reason": reason}
            write_text_atomic(self.path, json.dumps(self.decisions, indent=2) + "\n")
            self.board.update(name, stopped=f"iteration {iteration}: {reason}")
        logger.info("[%s] pruned at iteration %d: %s", name, iteration, reason)


def check_prunable(members: list[SweepMember]) -> None:
    """--sweep-prune compares configs over the same held-out questions: refused, in one line, for a
    grid that changes them (or the metric)."""
    if not any(m.config.sweep_prune for m in members):
        return
    changed = [key for key in PRUNE_SHARED_KEYS if len({repr(m.config.flat().get(key)) for m in members}) > 1]
    if changed:
        raise UserError(
            f"--sweep-prune compares the configs over the same held-out questions, but the sweep changes {', '.join(changed)}; "
            "expected those the same for every config"
        )


def prepare_sweep(
    options: dict[str, Any], members: list[SweepMember], explicit: set[str]
) -> tuple[Path, list[SweepMember], dict[str, tuple[RunConfig, str | None]]]:
    """Check a sweep before writing anything: (sweep folder, its configs, for each config still to
    run: its config and the checkpoint it resumes from)."""
    sweep_dir: Path | None = options["run_dir"]
    if options["resume"]:
        if sweep_dir is None:
            raise UserError("--resume needs --run-dir DIR: the folder of the run or sweep to continue")
        if members or explicit:
            raise UserError("--resume continues the sweep's saved configs; drop --sweep and the other options")
        check_writable(sweep_dir)
        members, done = _saved_members(sweep_dir), _finished(sweep_dir)
        todo = {}
        for m in members:
            if m.name in done:
                continue
            run_dir = sweep_dir / m.name
            if (run_dir / CONFIG_FILE).is_file():
                _, config, checkpoint = prepare_local_run({"run_dir": run_dir, "resume": True}, m.config, set())
                todo[m.name] = (config, checkpoint)
            else:
                todo[m.name] = (m.config, None)
        return sweep_dir, members, todo
    if sweep_dir is None:
        sweep_dir = Path("runs") / f"sweep-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if (sweep_dir / SWEEP_FILE).exists() or (sweep_dir / CONFIG_FILE).exists():
        raise UserError(f"--run-dir {str(sweep_dir)!r} already holds a run or sweep: add --resume to continue it, or pick another folder")
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise UserError(f"--run-dir {str(sweep_dir)!r} is a file; expected a folder")
    check_writable(sweep_dir)
    return sweep_dir, members, {m.name: (m.config, None) for m in members}


def run_sweep_local(options: dict[str, Any], members: list[SweepMember], explicit: set[str]) -> int:
    """The local sweep: every check first (each config's data and model, nothing written until
    they pass), then the sweep folder and its configs' folders, each locked, then all configs at once."""
    from grpo_flyte.models.folders import resolve_local_model
    from grpo_flyte.runtime.cache import check_cache_writable

    observers.command_started(time.perf_counter())  # the rows' wall clock counts from here (records.StageCost)
    sweep_dir, members, todo = prepare_sweep(options, members, explicit)
    check_prunable(members)
    inputs: dict[str, tuple[list[Example] | None, dict[str, Any]]] = {}
    bases = {model: resolve_local_model(model) for model in dict.fromkeys(todo[name][0].base.model for name in todo)}
    model_dirs = {name: bases[config.base.model] for name, (config, _) in todo.items()}
    scoring_dirs = ScoringDirs()
    check_cache_writable()
    progress = CheckProgress("checking each config's data and model", len(todo))
    for m in members:
        if m.name not in todo:
            continue
        config, resume_from = todo[m.name]
        examples, split, fingerprint = check_data(config, sweep_dir / m.name, resuming=resume_from is not None)
        inputs[m.name] = (examples, fingerprint)
        scoring_dirs = scoring_dirs.merged(check_fits(config, model_dirs[m.name], split))  # one judge for every config that judges
        progress.step(len(inputs))
    logger.info("%s", _plan(sweep_dir, [m for m in members if m.name in todo], model_dirs, todo))
    create_run_dir(sweep_dir)
    with run_dir_lock(sweep_dir), contextlib.ExitStack() as locks:
        if not options["resume"] and (sweep_dir / SWEEP_FILE).exists():  # another sweep started here meanwhile
            raise UserError(f"--run-dir {str(sweep_dir)!r} already holds a sweep: add --resume to continue it, or pick another folder")
        remove_leftovers_in(sweep_dir)  # the sweep's own files (each config's folder is cleaned as it starts)
        configs = {"configs": [m.model_dump(mode="json") for m in members]}
        write_text_atomic(sweep_dir / SWEEP_FILE, json.dumps(configs, indent=2) + "\n")
        for name in todo:
            (sweep_dir / name).mkdir(exist_ok=True)
            locks.enter_context(run_dir_lock(sweep_dir / name))
            save_data_fingerprint(sweep_dir / name, inputs[name][1])
        board = SweepBoard(sweep_dir, members)
        decisions = pruned_configs(sweep_dir)
        for m in members:  # a resumed sweep shows what each config did before: finished, pruned, or its iterations so far
            done = {} if m.name in todo else {"status": "complete"}
            if m.name in decisions:
                done = {"status": "pruned", "stopped": f"iteration {decisions[m.name]['iteration']}: {decisions[m.name]['reason']}"}
            board.outcomes[m.name] = board.outcomes[m.name].model_copy(update={**done, "history": _history(sweep_dir / m.name)})
        board.write()
        return _run_all(sweep_dir, members, todo, inputs, model_dirs, scoring_dirs, board)


def _plan(sweep_dir: Path, running: list[SweepMember], model_dirs: dict[str, Path], todo: dict[str, tuple[RunConfig, str | None]]) -> str:
    """The line the sweep starts with (launch.sweep_plan): its configs at once, their memory, and on
    a resume the time the rest takes at the seconds per iteration its configs kept; a grid whose
    memory cannot fit this machine is refused (UserError)."""
    # the configs meet before every iteration (loop.lockstep), so a config's row already took as
    # long as the sweep's iteration: its wall clock (records.StageCost), else its iteration_s
    seconds = [
        row.get("wall_s", row["iteration_s"]) for m in running for row in _history(sweep_dir / m.name) if row.get("iteration_s") is not None
    ]
    left = max((config.iterations - max(trained_iterations(sweep_dir / name), default=0) for name, (config, _) in todo.items()), default=0)
    per_iteration = sum(seconds) / len(seconds) if seconds else None
    return plan_line(plan_sweep(running, model_dirs), machine_memory(), per_iteration, left)


def _history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _run_all(
    sweep_dir: Path,
    members: list[SweepMember],
    todo: dict[str, tuple[RunConfig, str | None]],
    inputs: dict[str, tuple[list[Example] | None, dict[str, Any]]],
    model_dirs: dict[str, Path],
    scoring_dirs: ScoringDirs,
    board: SweepBoard,
) -> int:
    from rich.console import Console

    from grpo_flyte.reporting.progress import bars_shown, new_bars

    runs = {name: new_run_name() for name in todo}
    named = _NamedLines({run: name for name, run in runs.items()})
    handlers = logging.getLogger().handlers
    models = ", ".join(map(str, dict.fromkeys(model_dirs.values())))
    logger.info("grpo_flyte local sweep in %s: %d configs (%d to run), model %s", sweep_dir, len(members), len(todo), models)
    for handler in handlers:
        handler.addFilter(named)
    bars = new_bars(Console(stderr=True))  # a bar per config on a terminal, as a lone run has its own

    async def all_configs() -> list[BaseException | None]:
        jobs = [
            _run_config(
                sweep_dir / name, name, runs[name], config, resume_from, inputs[name][0], model_dirs[name], scoring_dirs, board, bars
            )
            for name, (config, resume_from) in todo.items()
        ]
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        # the bars stop (and the terminal is whole again) before any message below
        prunes = PruneLog(sweep_dir, board)
        pruned_runs = {runs[name]: (name, config) for name, (config, _) in todo.items() if config.sweep_prune}
        with (
            sigterm_stops_like_ctrl_c(),
            bars_shown(bars),
            lockstep(runs.values()),
            pruning(pruned_runs, prunes.decided),
            memory.span() as whole,
        ):
            errors = asyncio.run(all_configs())
    except KeyboardInterrupt as exc:
        stop_interrupted(exc, sweep_dir, lambda: _kept(sweep_dir, todo))
    finally:
        for handler in handlers:
            handler.removeFilter(named)
    for name, error in zip(todo, errors, strict=True):
        if isinstance(error, BaseException):
            board.outcomes[name] = board.outcomes[name].model_copy(update={"status": "failed", "error": one_line(error)})
    failed = [o for o in board.outcomes.values() if o.status == "failed"]
    board.write("failed" if failed else "complete")
    logger.info("%s", "\n  ".join(comparison_lines(list(board.outcomes.values()), {m.name: m.config.iterations for m in members})))
    logger.info("sweep done: report %s, figures %s; %s", sweep_dir / REPORT_FILE, sweep_dir / OUTCOMES_FILE, peak_words(whole.peak))
    for outcome in failed:
        logger.error("config %s failed: %s", outcome.name, outcome.error)
    if failed:
        logger.error("%d of %d configs failed; the others finished. Continue the failed ones with: %s --local --resume --run-dir %s",
                     len(failed), len(members), PROG, sweep_dir)  # fmt: skip
        return 1
    return 0


def _kept(sweep_dir: Path, todo: dict[str, tuple[RunConfig, str | None]]) -> str:
    """The iterations each config kept, for the stop's line: 'iterations kept: seed=0 1-2 of 6, seed=1 none of 6'."""
    kept = []
    for name, (config, _) in todo.items():
        done = trained_iterations(sweep_dir / name)
        kept.append(f"{name} 1-{max(done)} of {config.iterations}" if done else f"{name} none of {config.iterations}")
    return "iterations kept: " + ", ".join(kept)


async def _run_config(
    run_dir: Path,
    name: str,
    run: str,
    config: RunConfig,
    resume_from: str | None,
    examples: list[Example] | None,
    model_dir: Path,
    scoring_dirs: ScoringDirs,
    board: SweepBoard,
    bars: Progress,
) -> None:
    """One config's run, as a lone local run of it would go (its folder, its files, its bars), beside the others."""
    _config_name.set(name)  # this task's own context: its lines outside the Flyte run are named too
    folder = begin_run(
        run_dir,
        config,
        run,
        model_dir=model_dir,
        examples=examples,
        resume_from=resume_from,
        scoring_dirs=scoring_dirs,
        bars=bars,
        label=name,
    )
    board.update(name, status="running")
    try:
        with folder.watched(_ConfigProgress(board, name), only_this_run=True):
            result = await folder.run_async()
    except Exception as exc:
        leave(run)  # a run that failed before its loop began: the others stop waiting for it
        board.update(name, status="failed", error=one_line(exc))
        logger.error("failed: %s; the traceback is in %s; the other configs go on", one_line(exc), run_dir / LOG_FILE)
        raise
    finish_local_run(folder.files, config, result)
    stopped = board.outcomes[name].stopped is not None  # by --sweep-prune (loop.pruning)
    board.update(name, status="pruned" if stopped else "complete", history=[row.flat() for row in result.history])
