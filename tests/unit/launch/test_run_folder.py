"""A local run folder cannot lose work: one writer at a time, relocatable, a resume that never
silently starts over, SIGTERM like Ctrl-C, and whole files whatever point a kill hits."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import flyte
import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.loop.state import LoopState
from tests.support import SUPPORT, warm_python

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
DRILL = SUPPORT / "kill_drill.py"
ENTRY = [sys.executable, "-m", "grpo_flyte.driver"]


def _args(model: Path, run_dir: Path, iterations: int = 2) -> list[str]:
    return ["--local", "--model", str(model), *TINY, "--iterations", str(iterations), "--run-dir", str(run_dir)]


def _iterations(run_dir: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def _wait_for(proc: subprocess.Popen, predicate, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None and not predicate():
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the test could act on it"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 2-iteration run folder, copied by the tests that change one."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert cli_main(_args(tiny_model_dir, run_dir)) == 0
    return run_dir


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to, symlinks=True)
    return to


# --------------------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_naming_the_live_run_and_a_dead_ones_lock_does_not_block(tmp_path, tiny_model_dir, finished, capsys):
    run_dir = _copy(finished, tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from grpo_flyte.launch.lock import run_dir_lock\n"
         "with run_dir_lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(120)", str(run_dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _listing(run_dir)
        # a second --resume, and a new run naming the same folder, are both refused in one line
        assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"being written by a live run (process {holder.pid})" in err and err.count("\n") == 1
        assert cli_main(_args(tiny_model_dir, run_dir, 3)) == 2
        assert _listing(run_dir) == before  # nothing written
    finally:
        holder.kill()  # SIGKILL: the lock goes with the process
        holder.wait()
    assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume"]) == 0
    assert _iterations(run_dir) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- resume never starts over silently


def test_a_resume_without_the_saved_state_stops_and_writes_nothing(tmp_path, tiny_model_dir, finished, capsys):
    run_dir = _copy(finished, tmp_path / "run")
    (run_dir / "flyte" / "checkpoint").unlink()
    before = _listing(run_dir)
    assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "saved loop state" in err and "is missing" in err and "metrics.jsonl (iterations 0-2)" in err
    assert "Nothing was written" in err and err.count("\n") == 1
    assert _listing(run_dir) == before


def test_a_damaged_saved_state_is_named_and_nothing_is_written(tmp_path, tiny_model_dir, finished, capsys):
    run_dir = _copy(finished, tmp_path / "run")
    checkpoint = run_dir / "flyte" / "checkpoint"
    checkpoint.write_bytes(checkpoint.read_bytes()[:40])  # truncated
    before = _listing(run_dir)
    assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{str(checkpoint)!r} is damaged" in err and err.count("\n") == 1
    assert _listing(run_dir) == before


def test_a_moved_run_folder_resumes(tmp_path, tiny_model_dir, finished):
    moved = _copy(finished, tmp_path / "elsewhere" / "renamed")
    state = LoopState.model_validate_json((moved / "flyte" / "checkpoint").read_bytes())
    assert not Path(state.adapter.dir.path).is_absolute()  # stored relative to the run's data folder
    assert cli_main([*_args(tiny_model_dir, moved, 3), "--resume"]) == 0
    assert _iterations(moved) == [0, 1, 2, 3]
    assert not any(str(finished) in line for line in (moved / "flyte" / "checkpoint").read_text().splitlines())


# --------------------------------------------------------------------------- SIGTERM


def test_a_live_run_holds_its_folder_and_sigterm_stops_it_like_ctrl_c_with_the_resume_command(tmp_path, tiny_model_dir, capsys):
    """A run in a process of its own (one start-up for two behaviours): while it runs, its folder
    is refused to a second writer naming its process; then SIGTERM stops it as Ctrl-C does, with
    the resume command, and that resume finishes."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*ENTRY, *_args(tiny_model_dir, run_dir, 30)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(proc, lambda: (run_dir / "metrics.jsonl").is_file())
        assert cli_main([*_args(tiny_model_dir, run_dir, 30), "--resume"]) == 2, "a live run's folder was let to a second writer"
        assert f"(process {proc.pid})" in capsys.readouterr().err, "the refusal does not name the live run's process"
        _wait_for(proc, lambda: len(_iterations(run_dir)) >= 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err and f"--resume --run-dir {run_dir}" in err
    done = max(_iterations(run_dir))
    assert f"iterations 1-{done} of 30 are kept" in err
    assert cli_main([*_args(tiny_model_dir, run_dir, done + 1), "--resume"]) == 0
    assert _iterations(run_dir) == list(range(done + 2))


# --------------------------------------------------------------------------- Ctrl-C and SIGTERM in every mode (issue 40)


def _tagged(tag: str) -> dict[int, str]:
    """The live processes whose environment holds TEST_RUN_TAG=`tag` (a run and every process it
    started, wherever they were reparented): pid -> command line. Zombies are dead and left out."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"TEST_RUN_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
    return found


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before it starts: SIGINT handled, as a terminal's shell starts a command. The
    tests' own process may have it ignored, and a child inherits that: a shell without job control
    ignores SIGINT in what it starts with `&` (`make test &`, a CI runner's background step), and a
    Python started with SIGINT ignored keeps ignoring it, as a user's run started that way would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c_ignored() -> None:
    """In the child before it starts: SIGINT ignored, as a shell without job control starts
    `cmd &` (a script, a CI step, an agent's tool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _cpu_load(processes: int) -> Iterator[None]:
    """`processes` CPU-bound Python processes beside the test while the block runs."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def _interrupt(
    tmp_path: Path,
    args: list[str],
    ready,
    sig: signal.Signals,
    to_group: bool,
    started_as=_ctrl_c_as_in_a_terminal,
    load: int = 0,
    within_s: float = 120,
) -> tuple[int, list[str], str]:
    """Start the CLI in a session of its own (`started_as` runs in the child first), wait until
    `ready(tag, console so far)`, then send `sig` to the run (`to_group`: to its whole process
    group, as a terminal's Ctrl-C does) with `load` CPU-bound processes beside it until it exits,
    which it must within `within_s` seconds. Returns (exit status, the console lines written after
    the signal, the whole console)."""
    from uuid import uuid4

    tag, console = uuid4().hex, tmp_path / "console.txt"
    with console.open("w") as err:
        proc = subprocess.Popen([*ENTRY, *args], stdout=subprocess.DEVNULL, stderr=err, text=True, preexec_fn=started_as,
                                env={**os.environ, "TEST_RUN_TAG": tag}, start_new_session=True)  # fmt: skip
        try:
            _wait_for(proc, lambda: ready(tag, console.read_text()))
            with _cpu_load(load):
                mark = console.stat().st_size
                os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
                code = proc.wait(timeout=within_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _tagged(tag) and time.monotonic() < deadline:  # killed children take a moment to go
        time.sleep(0.1)
    assert _tagged(tag) == {}, f"processes of the run outlived it ({sig.name})"
    text = console.read_text()
    return code, text[mark:].splitlines(), text


def _train_processes(tag: str) -> list[str]:
    """The run's child processes that are not reward workers: its train processes."""
    return [c for c in _tagged(tag).values() if "grpo_flyte.runtime.sandbox" not in c and " grpo_flyte.driver " not in c]


def test_a_signal_during_a_data_parallel_step_stops_the_run_in_one_line_and_ends_its_processes(tmp_path, tiny_model_dir):
    """--train-processes 2, a signal while the step's processes run: the run ends at once with
    one line (its processes, in sessions of their own, print nothing), no process of it left
    behind. Ctrl-C to the run's process group first (exit 130), then SIGTERM to the resumed run
    alone (exit 143): one run, its start-up paid once; the resume after both finishes. Before:
    two tracebacks of the train processes, and a run that went on for the step's length and
    printed Flyte's retries."""
    run_dir = tmp_path / "run"
    args = [*_args(tiny_model_dir, run_dir, 30), "--train-processes", "2"]
    for sig, to_group, again, code, how in [
        (signal.SIGINT, True, [], 130, "interrupted"),
        (signal.SIGTERM, False, ["--resume"], 143, "stopped by SIGTERM"),
    ]:
        ended, after, console = _interrupt(tmp_path, [*args, *again], lambda tag, _: len(_train_processes(tag)) >= 2, sig, to_group)
        assert ended == code, f"{sig.name}: exit {ended}, expected {code}\n{console[-3000:]}"
        assert len(after) == 1 and how in after[0] and f"--resume --run-dir {run_dir}" in after[0], f"{sig.name}:\n{console[-3000:]}"
        assert "Traceback" not in console and "KeyboardInterrupt" not in console, f"{sig.name}:\n{console[-3000:]}"
    done = max(_iterations(run_dir))
    assert cli_main([*_args(tiny_model_dir, run_dir, done + 1), "--train-processes", "2", "--resume"]) == 0
    assert _iterations(run_dir) == list(range(done + 2))


def test_ctrl_c_while_a_pipelined_run_scores_its_next_batch_prints_no_reward_worker_traceback(tmp_path, tiny_model_dir):
    """--max-staleness 1: Ctrl-C (to the run's process group) while the next batch is generated
    and scored: one line, exit 130, the reward workers gone without a word. Before: every
    worker's KeyboardInterrupt traceback (sandbox._serve), over a hundred lines."""
    run_dir = tmp_path / "run"
    args = [*_args(tiny_model_dir, run_dir, 30), "--max-staleness", "1"]

    def scoring(tag: str, console: str) -> bool:  # iteration 1 is recorded, the next batch is in flight
        return " iter 1/30 " in console and any("grpo_flyte.runtime.sandbox" in c for c in _tagged(tag).values())

    code, after, console = _interrupt(tmp_path, args, scoring, signal.SIGINT, True)
    assert code == 130, console[-3000:]
    assert len(after) == 1 and "interrupted: iterations 1-" in after[0], console[-3000:]
    assert "Traceback" not in console and "KeyboardInterrupt" not in console


def test_ctrl_c_stops_a_run_started_with_sigint_ignored_under_cpu_load(tmp_path, tiny_model_dir):
    """A run started as `cmd &` starts from a shell without job control (SIGINT ignored), with no
    terminal, and four CPU-bound processes beside it: Ctrl-C to its process group stops it within
    30 s (measured: under 1 s at a load average of 17 on 2 cores), in the one documented line,
    and the folder resumes. Before: SIGINT stayed ignored and the run went on to its end."""
    run_dir = tmp_path / "run"
    args = _args(tiny_model_dir, run_dir, 30)
    code, after, console = _interrupt(
        tmp_path, args, lambda _, text: " iter 1/30 " in text, signal.SIGINT, True, started_as=_ctrl_c_ignored, load=4, within_s=30
    )
    assert code == 130, console[-3000:]
    assert len(after) == 1 and "interrupted: iterations 1-" in after[0] and f"--resume --run-dir {run_dir}" in after[0], console[-3000:]
    done = max(_iterations(run_dir))
    assert cli_main([*_args(tiny_model_dir, run_dir, done + 1), "--resume"]) == 0
    assert _iterations(run_dir) == list(range(done + 2))


# --------------------------------------------------------------------------- a user's files in the run folder

# Names a user may keep in a run folder, of every shape that the clean-up of a killed writer's
# temp files once matched by shape alone (a hidden name with a dash, `.name.*.tmp`; issue 43).
USER_FILES = {
    ".my-notes/notes.txt": "notes",
    ".plot.v2.tmp": "a scratch plot",
    ".metrics.jsonl.k2j4h1xz.tmp": "a copy of the metrics",
    ".adapter-before-tuning/adapter_config.json": "{}",
    ".grpo_flyte-tmp-notes/todo.txt": "the temp marker, no writer's process id",
    "eval/.my-notes/answers.txt": "notes on the answers",
    "eval/.iter-0001.jsonl.tmp": "a filtered copy",
}


def _plant_user_files(run_dir: Path) -> None:
    for name, text in USER_FILES.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)


def _user_files(run_dir: Path) -> dict[str, str | None]:
    return {name: (run_dir / name).read_text() if (run_dir / name).is_file() else None for name in USER_FILES}


def _temp_names(run_dir: Path) -> set[Path]:
    """The temp files and staging folders of this package's writers anywhere in the run folder."""
    return {p.resolve() for p in run_dir.rglob(".grpo_flyte-tmp-[0-9]*")}


def _removed(caplog) -> set[Path]:
    said = [r.getMessage() for r in caplog.records if r.getMessage().endswith(", left half-written by a run that was killed")]
    return {Path(m.removeprefix("removed ").removesuffix(", left half-written by a run that was killed")) for m in said}


def test_a_resume_removes_only_the_temp_names_of_dead_writers_of_this_package(tmp_path, tiny_model_dir, finished, caplog):
    """A user's files of every shape the clean-up once matched survive a resume, and so does a temp
    name whose writer still runs; a dead writer's temp file and staging folder go (issue 43)."""
    run_dir = _copy(finished, tmp_path / "run").resolve()
    _plant_user_files(run_dir)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)
    half_file = run_dir / f".grpo_flyte-tmp-{dead}-k2j4h1xz"
    half_file.write_text('{"iteration": ')
    half_dir = run_dir / "flyte" / "adapters" / f".grpo_flyte-tmp-{dead}-0a9b8c7d"
    half_dir.mkdir()
    (half_dir / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    live = run_dir / f".grpo_flyte-tmp-{os.getppid()}-zz11yy22"  # the process that started pytest
    live.write_text("being written")
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume"]) == 0
    assert _iterations(run_dir) == [0, 1, 2, 3]
    assert _user_files(run_dir) == USER_FILES
    assert _removed(caplog) == {half_file, half_dir} and _temp_names(run_dir) == {live}


# --------------------------------------------------------------------------- the kill drill

# (point, occurrence): spread over an iteration, the writes and publishes included
KILL_POINTS = [
    ("config.json", 1),  # the first write of the run
    ("v0000", 1),  # publishing the initial adapter
    ("iter-0000.jsonl", 1),  # the held-out answers before training
    ("generate", 2),  # iteration 1's engine batch
    ("train", 1),  # iteration 1's GRPO step
    ("save_adapter", 2),  # inside iteration 1's adapter save
    ("v0001", 1),  # publishing iteration 1's adapter
    ("checkpoint", 2),  # saving iteration 1's loop state
    ("metrics.jsonl", 2),  # writing iteration 1's metrics row
    ("report.html", 2),  # rewriting the report
    ("generate", 3),  # iteration 2's engine batch
    ("checkpoint", 3),  # saving iteration 2's loop state
    ("adapter", 1),  # exporting the final adapter into the run folder
]


def _check_whole_files(run_dir: Path) -> None:
    """What a kill may leave: only whole files, and a saved state no older than the metrics."""
    from safetensors.torch import load_file

    if (run_dir / "config.json").exists():
        json.loads((run_dir / "config.json").read_text())
    rows = _iterations(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert rows == sorted(set(rows))
    checkpoint = run_dir / "flyte" / "checkpoint"
    if checkpoint.exists():
        state = LoopState.model_validate_json(checkpoint.read_bytes())
        assert set(rows) <= {r.iteration for r in state.history}
    if (run_dir / "report.html").exists():
        assert (run_dir / "report.html").read_text().rstrip().endswith("</html>")
    for adapter in (run_dir / "flyte" / "adapters").glob("v[0-9]*"):
        load_file(str(adapter / "adapter_model.safetensors"))
        json.loads((adapter / "grpo_state.json").read_text())


@pytest.mark.parametrize(("point", "nth"), KILL_POINTS, ids=[f"{p}-{n}" for p, n in KILL_POINTS])
def test_a_kill_at_any_point_leaves_whole_files_and_the_resume_finishes(tmp_path, tiny_model_dir, point, nth, caplog):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    args = _args(tiny_model_dir, run_dir, 2)
    killed = warm_python.run([DRILL, point, str(nth), *args], timeout=300, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _check_whole_files(run_dir)
    left = _temp_names(run_dir)
    # a kill mid-write (a rename not done) or inside a step publishing its adapter leaves its temp file or staging folder
    assert bool(left) == (point != "generate"), left
    _plant_user_files(run_dir)

    # a kill before config.json was written left no run to resume: start it again
    again = [*args, "--resume"] if (run_dir / "config.json").exists() else args
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(again) == 0
    assert _removed(caplog) == left  # what the kill left, and nothing else
    assert _user_files(run_dir) == USER_FILES
    _check_whole_files(run_dir)
    assert _iterations(run_dir) == [0, 1, 2]
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.iterations_done == 2 == state.history[-1].iteration
    assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == state.adapter.version
    load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert not _temp_names(run_dir)


# With --max-staleness 1 a batch is generating while the trainer trains: kills inside that overlap.
PIPELINED_KILL_POINTS = [
    ("train", 2),  # iteration 2's step, iteration 3's batch in flight
    ("generate", 5),  # an engine batch of a batch generated ahead
    ("checkpoint", 3),  # saving iteration 2's loop state, with its batches in flight
]


@pytest.mark.parametrize(("point", "nth"), PIPELINED_KILL_POINTS, ids=[f"{p}-{n}" for p, n in PIPELINED_KILL_POINTS])
def test_a_pipelined_run_killed_anywhere_resumes_each_iteration_once_with_its_schedules_adapters(tmp_path, tiny_model_dir, point, nth):
    run_dir = tmp_path / "run"
    args = [*_args(tiny_model_dir, run_dir, 3), "--max-staleness", "1"]
    killed = warm_python.run([DRILL, point, str(nth), *args], timeout=300, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _check_whole_files(run_dir)
    assert cli_main([*args, "--resume"]) == 0
    _check_whole_files(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    # every iteration trained its whole batch once, generated one version behind after the first
    assert [(r["num_rollouts"], r["staleness_max"], r["stale_dropped"]) for r in rows[1:]] == [(6, 0, 0), (6, 1, 0), (6, 1, 0)]
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.iterations_done == 3 and state.in_flight == {} and [a.version for a in state.recent_adapters] == [2]


# --------------------------------------------------------------------------- inputs that change under a resume


def test_a_resume_never_drops_finished_iterations(tmp_path, tiny_model_dir, finished, capsys):
    run_dir = _copy(finished, tmp_path / "run")
    before = _listing(run_dir)
    assert cli_main([*_args(tiny_model_dir, run_dir, 1), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--iterations 1 is below the 2 iterations this run finished" in err and err.count("\n") == 1
    assert _listing(run_dir) == before


def test_a_config_file_given_with_resume_is_applied_or_refused_never_ignored(tmp_path, tiny_model_dir, finished, capsys):
    run_dir = _copy(finished, tmp_path / "run")
    before = _listing(run_dir)
    changed = tmp_path / "changed.yaml"
    changed.write_text("learning_rate: 0.1\niterations: 3\n")
    assert cli_main([*_args(tiny_model_dir, run_dir, 3), "--resume", "--config", str(changed)]) == 2
    err = capsys.readouterr().err
    assert "--learning-rate differ" in err and err.count("\n") == 1
    assert _listing(run_dir) == before
    # a file that agrees with the saved config, extending the run, is applied
    same = tmp_path / "same.yaml"
    same.write_text("max_new_tokens: 8\niterations: 3\n")
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--run-dir", str(run_dir)]
    assert cli_main([*args, "--resume", "--config", str(same)]) == 0
    assert _iterations(run_dir) == [0, 1, 2, 3]


def test_a_dataset_changed_under_a_resume_is_refused(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(12)))
    run_dir = tmp_path / "run"
    args = [*_args(tiny_model_dir, run_dir, 1), "--dataset", str(data)]
    assert cli_main(args) == 0
    assert json.loads((run_dir / "data.json").read_text())["train_rows"] == 10
    data.write_text(data.read_text().replace("What is 3 + 3?", "What is 3 + 4?").replace('"6"', '"7"'))
    before = _listing(run_dir)
    assert cli_main([*_args(tiny_model_dir, run_dir, 2), "--dataset", str(data), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--dataset {str(data)!r} changed since this run started" in err and err.count("\n") == 1
    assert _listing(run_dir) == before


# --------------------------------------------------------------------------- large payloads


def test_a_batch_too_large_to_inline_travels_as_a_file_with_the_same_result(tmp_path, tiny_model_dir, monkeypatch):
    from safetensors.torch import load_file

    from grpo_flyte import trainer
    from grpo_flyte.runtime import storage

    received = []
    train_step = trainer.train_step.func

    async def spy(*args, **kwargs):
        given = inspect.signature(train_step).bind(*args, **kwargs).arguments
        received.append((len(given["scored"]), bool(given.get("scored_payload"))))
        return await train_step(*args, **kwargs)

    monkeypatch.setattr(trainer.train_step, "func", spy)
    inline = tmp_path / "inline"
    assert cli_main(_args(tiny_model_dir, inline, 2)) == 0
    assert received and all(n > 0 and not as_file for n, as_file in received)
    received.clear()
    monkeypatch.setattr(storage, "INLINE_LIMIT_BYTES", 0)  # every batch is "too large"
    monkeypatch.setattr(storage, "GROUPS_INLINE_BYTES", 0)  # and every group a generate task returns (issue 54, item 7)
    spilled = tmp_path / "spilled"
    assert cli_main(_args(tiny_model_dir, spilled, 2)) == 0
    assert received and all(n == 0 and as_file for n, as_file in received)
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (inline, spilled))
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    assert not list((spilled / "flyte" / "payloads").glob("scored-*"))  # consumed, then removed
    # the groups went as folders (training and held-out alike), each removed once the driver read it back
    assert (spilled / "flyte" / "groups").is_dir() and not list((spilled / "flyte" / "groups").iterdir())


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


# --------------------------------------------------------------------------- driver retries


def test_a_failed_driver_attempt_continues_from_its_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    """A preempted driver pod: the retry picks up the last checkpoint, each iteration recorded once."""
    from grpo_flyte import driver

    calls = {"n": 0}
    record_report = driver.publish_report

    async def dies_once_after_iteration_1(config, state, status, message=None):
        calls["n"] += 1
        if status == "running" and state.iterations_done == 1 and calls.setdefault("died", 0) == 0:
            calls["died"] = 1
            raise ConnectionError("the pod went away")
        return await record_report(config, state, status, message)

    starts = []
    restore = driver.restore_state

    async def counted_restore(resume_from):
        checkpoint, state = await restore(resume_from)
        starts.append(state.iterations_done if state else None)
        return checkpoint, state

    monkeypatch.setattr(driver, "publish_report", dies_once_after_iteration_1)
    monkeypatch.setattr(driver, "restore_state", counted_restore)
    run_dir = tmp_path / "run"
    assert cli_main(_args(tiny_model_dir, run_dir, 3)) == 0
    assert starts == [None, 1]  # the second attempt started after iteration 1
    assert _iterations(run_dir) == [0, 1, 2, 3]


def test_bad_input_inside_the_driver_is_not_retried(tmp_path, tiny_model_dir, monkeypatch, caplog):
    from grpo_flyte import driver
    from grpo_flyte.errors import DatasetError

    attempts = []

    def bad_split(config, examples):
        attempts.append(1)
        raise DatasetError("'gsm8k' could not be read (offline)")

    monkeypatch.setattr(driver, "train_eval_split", bad_split)
    monkeypatch.setattr("grpo_flyte.launch.local_run.data_fingerprint", lambda config, examples: {"sha256": "x"})
    assert cli_main(_args(tiny_model_dir, tmp_path / "run", 2)) == 1
    assert attempts == [1]
    assert "could not be read (offline)" in caplog.text


def test_a_programming_error_in_the_driver_is_attempted_once(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """A wrong attribute in the driver's code fails every attempt alike: one attempt (it ran the
    whole loop 3 times), and one line naming the task and the cause."""
    from grpo_flyte import driver

    attempts = []

    def wrong_attribute(config, examples):
        attempts.append(1)
        return config.prompts_per_iteration  # RunConfig has prompts_per_iter

    monkeypatch.setattr(driver, "train_eval_split", wrong_attribute)
    monkeypatch.setattr("grpo_flyte.launch.local_run.data_fingerprint", lambda config, examples: {"sha256": "x"})
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, tmp_path / "run", 2)) == 1
    assert attempts == [1]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run failed: ")]
    assert line == "run failed: train_rl: AttributeError: 'RunConfig' object has no attribute 'prompts_per_iteration'"


def test_an_engine_that_refuses_its_settings_is_built_once(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """A ValueError from the engine's build (vLLM refusing a setting) fails the same way on every
    attempt of generate and of the driver: built once (it was 3 generate attempts x 3 driver
    attempts, 9 builds), and the run's last line names the task and the cause."""
    from grpo_flyte.engine import cache
    from grpo_flyte.engine.cache import EngineCache, EngineKey

    builds = []
    monkeypatch.setattr(cache, "_engines", EngineCache(cache._engines.capacity))  # a fresh replica: no engine yet

    def refused(self):
        builds.append(self.backend)
        raise ValueError("max_model_len (4096) is greater than the derived max_model_len (2048)")

    monkeypatch.setattr(EngineKey, "build", refused)
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, tmp_path / "run", 2)) == 1
    assert builds == ["hf"]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run failed: ")]
    # the held-out evaluation before iteration 1 (generate_eval) builds the engine first
    assert line == "run failed: generate_eval: ValueError: max_model_len (4096) is greater than the derived max_model_len (2048)"


# --------------------------------------------------------------------------- remote resume (--resume-run)


class RecoveringDispatch:
    """Flyte's recovery, simulated in the local controller: a task whose action name finished in
    the recorded run returns that run's outputs instead of running (what `flyte.rerun(...,
    recover=True)` does on a cluster, matching actions by the same deterministic names)."""

    def __init__(self, dispatch, fail_on=None):
        self.dispatch = dispatch
        self.fail_on = fail_on  # (task name suffix, call number): raise there, as a lost pod would
        self.finished: dict[str, object] = {}  # action name -> outputs of the recorded run
        self.reused: list[str] = []
        self.ran: list[tuple[str, str]] = []  # (task, action name) executed
        self.calls: dict[str, int] = {}

    async def __call__(self, task, controller, action, **kwargs):
        short = task.name.rsplit(".", 1)[-1]
        if short == "train_rl":  # the driver itself: the rerun's new root
            return await self.dispatch(task=task, controller=controller, action=action, **kwargs)
        if action.name in self.finished:
            self.reused.append(action.name)
            return self.finished[action.name], None
        self.calls[short] = self.calls.get(short, 0) + 1
        if self.fail_on == (short, self.calls[short]):
            from grpo_flyte.errors import GrpoFlyteError

            raise GrpoFlyteError(f"injected: the {short} pod was lost")
        self.ran.append((short, action.name))
        out, err = await self.dispatch(task=task, controller=controller, action=action, **kwargs)
        if err is None:
            self.finished[action.name] = out
        return out, err


def test_a_recovered_rerun_reuses_every_finished_task(tmp_path, tiny_model_dir, monkeypatch):
    """`--resume-run` relies on every child action getting the same name in the rerun. Run 1 dies
    in iteration 2's train step; the rerun (fresh driver, no checkpoint) reuses every task that
    finished and runs only that train step and what follows. Train batches go as payload folders
    here (inline limit 0), so their content hash must keep the names stable too."""
    from flyte._internal.controllers import _local_controller

    from grpo_flyte.driver import train_rl
    from grpo_flyte.runtime import storage

    monkeypatch.setattr(storage, "INLINE_LIMIT_BYTES", 0)
    recovering = RecoveringDispatch(_local_controller.direct_dispatch, fail_on=("train_step", 2))
    monkeypatch.setattr(_local_controller, "direct_dispatch", recovering)
    config = RunConfig(iterations=2, prompts_per_iter=2, group_size=3, max_new_tokens=6, eval_size=2, min_informative_groups=0)
    model = Dir(path=str(tiny_model_dir))

    def run(name: str):
        # On a cluster both runs' root action is 'a0'; a local run's root is named after the run.
        runner = flyte.with_runcontext(mode="local", name=f"drill-{tmp_path.name}", raw_data_path=str(tmp_path / name))
        return runner.run(train_rl, config=config, base_model=model)

    with pytest.raises(Exception, match="the train_step pod was lost"):
        run("first")
    first_ran = [short for short, _ in recovering.ran]
    assert first_ran.count("train_step") == 1 and first_ran.count("generate") == 4  # iteration 2 generated
    finished = set(recovering.finished)
    recovering.ran, recovering.fail_on = [], None
    result = run("rerun").outputs()[0]
    assert set(recovering.reused) == finished  # every finished task reused, none run twice
    rerun = [short for short, _ in recovering.ran]
    assert rerun == ["train_step", "generate_eval", "score_groups"]  # the lost step, then the final evaluation
    assert [row.iteration for row in result.history] == [0, 1, 2] and result.adapter.version == 2


def test_a_run_that_fails_on_every_attempt_says_what_is_kept_and_how_to_continue(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """A failure that is not the input's (a lost worker, every attempt): the finished iterations
    are kept and the resume command is printed, as it can help."""
    from grpo_flyte import driver

    run_iteration = driver.run_iteration

    async def second_iteration_lost(config, base_model, adapter, dataset, iteration, judge_model=None):
        if iteration == 1:
            raise ConnectionError("the worker pod went away")
        return await run_iteration(config, base_model, adapter, dataset, iteration, judge_model)

    monkeypatch.setattr(driver, "run_iteration", second_iteration_lost)
    run_dir = tmp_path / "run"
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 2)) == 1
    assert (
        f"iterations 1-1 of 2 are kept; the traceback is in {run_dir / 'run.log'}; continue with: "
        f"python -m grpo_flyte.driver --local --resume --run-dir {run_dir}"
    ) in caplog.text
    assert "meets again" not in caplog.text


# --------------------------------------------------------------------------- bigger models' flags (issue 27)


def _files(run_dir: Path) -> set[str]:
    """The run folder's files, Flyte's raw data (adapter versions, payloads) left out."""
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and p.relative_to(run_dir).parts[0] != "flyte"}


@pytest.mark.parametrize(
    ("flags", "world"),
    [(["--load-in-4bit"], 1), (["--load-in-4bit", "--embeddings-in-4bit"], 1), (["--train-processes", "2"], 2)],
    ids=["4bit", "4bit-embeddings", "2-processes"],
)
def test_a_run_with_a_bigger_model_flag_writes_every_file_and_resumes_after_a_kill(tmp_path, tiny_model_dir, finished, flags, world):
    """Killed while publishing iteration 1's adapter, resumed: the folder holds what a normal run's
    holds, every iteration once, and the metrics say how many processes trained."""
    run_dir = tmp_path / "run"
    args = [*_args(tiny_model_dir, run_dir, 2), *flags]
    killed = warm_python.run([DRILL, "v0001", "1", *args], timeout=300, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _check_whole_files(run_dir)
    assert cli_main([*args, "--resume"]) == 0
    _check_whole_files(run_dir)
    assert _files(run_dir) == _files(finished)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["train_world_size"] for r in rows[1:]] == [world, world] and all(r["train_restore_s"] >= 0 for r in rows[1:])
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["lora"]["load_in_4bit"], saved["train"]["train_processes"]) == ("--load-in-4bit" in flags, world)
    assert saved["lora"]["embeddings_in_4bit"] == ("--embeddings-in-4bit" in flags)
