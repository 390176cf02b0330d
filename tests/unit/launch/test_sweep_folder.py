"""A local sweep through the command line: every config's run folder is what its lone run writes
(same seed: the same completions, metrics and adapter up to float rounding), one engine and one
base load for all (a sweep over base models: one of each per base), each console line named for
its config and a comparison at the end, a failing config ends alone and is named, --resume
finishes what did not finish, Ctrl-C stops it in one line, a kill anywhere loses nothing (the lone
run's drills, tests/unit/launch/test_run_folder.py), and a bad grid writes nothing."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.launch import sweep_folder
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning import policy
from grpo_flyte.reporting import progress
from tests.support import warm_python
from tests.unit.launch.test_run_folder import DRILL, _check_whole_files, _interrupt, _iterations, _temp_names

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
TIMINGS = ("_s", "per_s", "_gb")  # the machine's measurements: seconds and memory
progress_class = progress.RunProgress


def _args(model: Path, run_dir: Path, *extra: str, iterations: int = 2) -> list[str]:
    return ["--local", "--model", str(model), *TINY, "--iterations", str(iterations), "--run-dir", str(run_dir), *extra]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _outcomes(sweep_dir: Path) -> dict[str, dict]:
    return {line["name"]: line for line in map(json.loads, (sweep_dir / "sweep.jsonl").read_text().splitlines())}


def test_each_config_runs_as_its_lone_run_would_on_one_engine_and_one_base(tmp_path, tiny_model_dir, caplog, monkeypatch):
    cache._engines.clear()  # a cold replica: what this process built for earlier tests would hide the count
    policy.release_models()
    bars = []
    monkeypatch.setattr(progress, "RunProgress", lambda *a, **kw: bars.append(progress_class(*a, **kw)) or bars[-1])
    sweep_dir = tmp_path / "sweep"
    with caplog.at_level("INFO"):
        assert cli_main(_args(tiny_model_dir, sweep_dir, "--sweep", "learning_rate=1e-4,5e-3", "--sweep", "seed=0,1")) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("building the hf generator" in m for m in messages) == 1
    assert sum("loading the base model for training" in m for m in messages) == 1
    names = [f"learning_rate={lr}_seed={seed}" for lr in ("1e-4", "5e-3") for seed in (0, 1)]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == sorted(names)
    assert {n: o["status"] for n, o in _outcomes(sweep_dir).items()} == dict.fromkeys(names, "complete")
    # each line names its config: its iterations and, outside its Flyte run, where its files are
    assert any(m.startswith("[learning_rate=5e-3_seed=1] iter 2/2") for m in messages)
    assert any(
        m.startswith(f"[learning_rate=5e-3_seed=1] done: adapter {sweep_dir.resolve()}/learning_rate=5e-3_seed=1/adapter") for m in messages
    )
    # the comparison ends it: a line per config, each setting's seeds, then where the report is
    table = next(m for m in messages if m.startswith("sweep: 4 of 4 configs complete")).splitlines()
    assert [line.split()[0] for line in table[1:5]] == names and all(" complete  2/2 iterations " in line for line in table[1:5])
    assert [line.split(":")[0] for line in table[5:]] == [
        "  over seeds 0, 1 of learning_rate=0.0001",
        "  over seeds 0, 1 of learning_rate=0.005",
    ]
    done = f"sweep done: report {sweep_dir / 'report.html'}, figures {sweep_dir / 'sweep.jsonl'}; peak memory "
    assert messages[-1].startswith(done) and messages[-1].endswith(" GB resident (this process and its children)")
    # a progress bar per config, all on one display (drawn on a terminal only), each at its end
    assert len({id(b.bars) for b in bars}) == 1
    assert [(t.description, t.completed, t.total) for t in bars[0].bars.tasks] == [(n, 2, 2) for n in names]
    report = (sweep_dir / "report.html").read_text()
    assert all(name in report for name in names) and "Over seeds" in report

    lone = tmp_path / "lone"
    assert cli_main(_args(tiny_model_dir, lone, "--learning-rate", "5e-3", "--seed", "1")) == 0
    swept = sweep_dir / "learning_rate=5e-3_seed=1"
    assert _files(swept) == _files(lone)
    # The same completions and rewards; float figures equal to float rounding: in the sweep's
    # engine batches (four adapters' rows) a row's log-probs differ from its lone run's in the 7th
    # digit (PEFT's mixed adapter batches, larger matmuls).
    assert _completions(swept) == _completions(lone)
    assert _close(_metrics(swept), _metrics(lone))
    assert [r["iteration"] for r in _metrics(swept)] == [0, 1, 2]
    assert _weights(swept).keys() == _weights(lone).keys()
    assert max((_weights(swept)[k] - _weights(lone)[k]).abs().max().item() for k in _weights(lone)) < 1e-5
    # the other seed and learning rate trained something else (the folders are not copies of one run)
    other = _weights(sweep_dir / "learning_rate=1e-4_seed=0")
    assert max((other[k] - _weights(swept)[k]).abs().max().item() for k in other) > 1e-3


def test_a_sweep_over_two_bases_builds_each_ones_engine_and_base_once_and_runs_each_config_as_alone(
    tmp_path, tiny_model_dir, embedded_dir, caplog, capsys
):
    """Two tiny bases (the second 48 wide: an adapter of one loads on no other, so a config served
    by the other's engine or trained on its base would fail): their configs' generate calls and
    train steps interleave on the process's one engine cache and loaded-base cache, and nothing is
    built twice; each config's metrics are its lone run's (its base's engine batches hold its rows only)."""
    from tests.support.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "tiny-b", embedded_dir, seed=1, hidden_size=48)
    cache._engines.clear()  # a cold replica
    policy.release_models()
    bases = (tiny_model_dir, other)
    sweep_dir = tmp_path / "sweep"
    common = ["--local", *TINY, "--iterations", "1", "--backend", "hf"]
    with caplog.at_level("INFO"):
        assert cli_main([*common, "--run-dir", str(sweep_dir), "--sweep", f"model={tiny_model_dir},{other}"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    for base in bases:
        assert sum(f"building the hf generator for {base} " in m for m in messages) == 1, base
        assert sum(f"loading the base model for training from {base} " in m for m in messages) == 1, base
    assert not any("freeing the" in m for m in messages)
    outcomes = _outcomes(sweep_dir)  # each config named by its model folder's name
    assert {n: (o["model"], o["status"]) for n, o in outcomes.items()} == {f"model={b.name}": (str(b), "complete") for b in bases}
    report = (sweep_dir / "report.html").read_text()
    assert all(str(b) in report for b in bases)

    widths = set()
    for name, outcome in outcomes.items():
        lone = tmp_path / f"lone-{Path(outcome['model']).name}"
        assert cli_main([*common, "--model", outcome["model"], "--run-dir", str(lone)]) == 0
        assert _metrics(sweep_dir / name) == _metrics(lone)
        assert _completions(sweep_dir / name) == _completions(lone)
        weights = _weights(sweep_dir / name)
        assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in _weights(lone).items()}
        widths.add(max(v.shape[-1] for v in weights.values()))  # each trained on its own base
    assert widths == {32, 48}

    capsys.readouterr()
    refused = tmp_path / "refused"
    four = ",".join(str(p) for p in (*bases, tmp_path / "c", tmp_path / "d"))
    assert cli_main([*common, "--run-dir", str(refused), "--sweep", f"model={four}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --sweep model={four}: 4 base models") and "expected at most 3" in err and "\n" not in err
    assert not refused.exists()


def _completions(run_dir: Path) -> list[list[str]]:
    """The held-out completions of each evaluation of a run folder."""
    return [[json.loads(line)["completion"] for line in path.read_text().splitlines()] for path in sorted((run_dir / "eval").iterdir())]


@pytest.fixture
def wide_batch_window(monkeypatch):
    """Identical groups merge when they meet in one batcher flush: a window that what one config
    does before the other's request (its init_adapter, its report) fits in, however busy the
    machine. A batcher of its own, so the tests after it get the usual window."""
    monkeypatch.setattr(batching, "BATCH_WINDOW_S", 2.0)
    batching.replica_batcher.cache_clear()
    yield
    batching.replica_batcher.cache_clear()


def test_configs_that_start_alike_decode_their_first_evaluation_and_rollouts_once(tmp_path, tiny_model_dir, monkeypatch, wide_batch_window):
    """Two learning rates, one seed: both configs start from adapters of the same content (at their
    own paths) and sample the same prompts with the same seeds, so the held-out evaluation before
    training and the first iteration's rollouts are decoded once for both, and so is the evaluation
    after an iteration that changed neither adapter; each config's metrics are exactly its lone
    run's."""
    decoded_rows: list[int] = []
    generate_mixed = HFGenerator.generate_mixed

    def counted(self, requests, adapter_paths):
        decoded_rows.append(sum(r.group_size for r in requests))
        return generate_mixed(self, requests, adapter_paths)

    monkeypatch.setattr(HFGenerator, "generate_mixed", counted)
    one_iteration = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1"]
    assert cli_main([*one_iteration, "--sweep", "learning_rate=1e-4,5e-3", "--run-dir", str(tmp_path / "sweep")]) == 0
    sweep_rows = sum(decoded_rows)
    for rate in ("1e-4", "5e-3"):
        decoded_rows.clear()
        assert cli_main([*one_iteration, "--learning-rate", rate, "--run-dir", str(tmp_path / rate)]) == 0
        assert _metrics(tmp_path / "sweep" / f"learning_rate={rate}") == _metrics(tmp_path / rate)
    # one lone run's rows: 2 evaluations of 2 questions, 2 prompts x 3 rollouts
    assert sum(decoded_rows) == 2 + 2 * 3 + 2
    # At this size the iteration has no update (no group's rewards differ): both adapters still
    # hold the same weights after it, their optimizer states differ (the learning rate), so even
    # the evaluation after training is decoded once for both.
    configs = [tmp_path / "sweep" / f"learning_rate={rate}" for rate in ("1e-4", "5e-3")]
    assert all(row.get("num_updates") == 0 for config in configs for row in _metrics(config) if row["iteration"] == 1)
    first, second = (_weights(config) for config in configs)
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)
    assert sweep_rows == sum(decoded_rows)


def test_a_sweeps_configs_ask_for_each_iterations_rollouts_and_evaluations_together(tmp_path, tiny_model_dir, monkeypatch):
    """One config's bookkeeping is slow (1.5 s more after its train step, 0.3 s more after its
    report: each longer than the batcher's window): the configs still meet before every iteration's rollouts and every held-out
    evaluation (grpo_flyte.loop.lockstep), so each is one batcher flush holding both configs' groups."""
    import asyncio

    from grpo_flyte import driver
    from grpo_flyte.loop import lockstep

    monkeypatch.setattr(lockstep, "IDLE_GRACE_S", 30.0)  # what is tested here is the meeting, not the grace
    publish = driver.publish_report

    async def slow_for_one(config, state, *args, **kwargs):
        if config.train.learning_rate == 5e-3:
            await asyncio.sleep(0.3)
        return await publish(config, state, *args, **kwargs)

    monkeypatch.setattr(driver, "publish_report", slow_for_one)
    iteration = driver.run_iteration

    async def late_for_one(config, *args, **kwargs):  # between its train step and its evaluation: longer than the other's
        done = await iteration(config, *args, **kwargs)
        if config.train.learning_rate == 5e-3:
            await asyncio.sleep(1.5)
        return done

    monkeypatch.setattr(driver, "run_iteration", late_for_one)
    flushes: dict[str, list[set[str]]] = {"rollouts": [], "evaluations": []}
    process = batching._process

    async def recorded(calls):
        kind = "rollouts" if calls[0].request.group_size == 3 else "evaluations"  # TINY's groups of 3; a question each
        flushes[kind].append({Path(c.adapter_path).relative_to(tmp_path / "sweep").parts[0] for c in calls})
        return await process(calls)

    monkeypatch.setattr(batching, "_process", recorded)
    batching.replica_batcher.cache_clear()  # a batcher whose function is the recording one
    try:
        assert cli_main(_args(tiny_model_dir, tmp_path / "sweep", "--sweep", "learning_rate=1e-4,5e-3", iterations=3)) == 0
    finally:
        batching.replica_batcher.cache_clear()
    both = {"learning_rate=1e-4", "learning_rate=5e-3"}
    assert flushes["rollouts"] == [both] * 3
    evaluations = [row for row in _metrics(tmp_path / "sweep" / "learning_rate=1e-4") if "eval_accuracy" in row]
    assert flushes["evaluations"] == [both] * len(evaluations) and len(evaluations) == 2  # before training, after the last


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def _close(a: list[dict], b: list[dict]) -> bool:
    """Equal rows, floats to a relative 1e-4 (absolute 1e-6 near 0)."""

    def same(u, v) -> bool:
        return u == pytest.approx(v, rel=1e-4, abs=1e-6) if isinstance(u, float) and isinstance(v, float) else u == v

    return len(a) == len(b) and all(x.keys() == y.keys() and all(same(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


def _fragile_reward(tmp_path: Path, monkeypatch) -> tuple[str, Path]:
    marker = tmp_path / "fail-now"
    (tmp_path / "fragile_sweep_reward.py").write_text(
        "from pathlib import Path\n"
        "def score(completions, **kwargs):\n"
        f"    if Path({str(marker)!r}).exists():\n"
        "        raise ValueError('the marker says fail')\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    marker.touch()
    return "fragile_sweep_reward:score", marker


def test_a_failing_config_ends_alone_is_named_and_a_resume_finishes_only_it(tmp_path, tiny_model_dir, monkeypatch, caplog):
    reward, marker = _fragile_reward(tmp_path, monkeypatch)
    sweep_dir = tmp_path / "sweep"
    args = _args(tiny_model_dir, sweep_dir, "--sweep", f"rewards=correct=1;correct=1,{reward}=1")
    with caplog.at_level("INFO"):
        assert cli_main(args) == 1
    good, bad = "rewards=correct=1", f"rewards=correct=1-{reward.replace(':', '-')}=1"
    outcomes = _outcomes(sweep_dir)
    assert outcomes[good]["status"] == "complete" and outcomes[good]["iterations_done"] == 2
    assert outcomes[bad]["status"] == "failed" and "the marker says fail" in outcomes[bad]["error"]
    assert "the marker says fail" in (sweep_dir / "report.html").read_text()
    messages = [r.getMessage() for r in caplog.records]
    # said as it fails, and in the comparison at the end
    assert any(
        m.startswith(f"[{bad}] failed: ") and m.endswith("; the other configs go on") and "the marker says fail" in m for m in messages
    )
    table = next(m for m in messages if m.startswith("sweep: 1 of 2 configs complete")).splitlines()
    assert table[2].split()[:2] == [bad, "failed"] and "failed: " in table[2] and "the marker says fail" in table[2]
    last = messages[-1]
    assert last.startswith("1 of 2 configs failed; the others finished") and f"--resume --run-dir {sweep_dir}" in last
    finished = {str(p): p.stat().st_mtime_ns for p in (sweep_dir / good).rglob("*") if p.is_file()}

    marker.unlink()
    assert cli_main(["--local", "--resume", "--run-dir", str(sweep_dir)]) == 0
    assert {n: o["status"] for n, o in _outcomes(sweep_dir).items()} == {good: "complete", bad: "complete"}
    assert [r["iteration"] for r in _metrics(sweep_dir / bad)] == [0, 1, 2]  # each iteration once
    assert {str(p): p.stat().st_mtime_ns for p in (sweep_dir / good).rglob("*") if p.is_file()} == finished  # left alone
    assert cli_main(["--local", "--resume", "--run-dir", str(sweep_dir), "--sweep", "seed=1,2"]) == 2


@pytest.mark.parametrize(
    ("sweep", "expected"),
    [
        ("learning_rate=1e-4,oops", "error: --sweep learning_rate=oops: --learning-rate='oops': Input should be a valid number"),
        ("lora_rank=8,16", "error: --sweep lora_rank=8,16: changes the train pool's loaded base"),
    ],
)
def test_a_bad_grid_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir, capsys, sweep, expected):
    sweep_dir = tmp_path / "sweep"
    assert cli_main(_args(tiny_model_dir, sweep_dir, "--sweep", sweep)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected) and "\n" not in err
    assert not sweep_dir.exists()


# --------------------------------------------------------------------------- Ctrl-C and kills (the lone run's drills)

SEEDS = ("--sweep", "seed=0,1")
NAMES = ("seed=0", "seed=1")


def test_ctrl_c_stops_a_sweep_in_one_line_ending_its_processes_and_the_resume_finishes_every_config(tmp_path, tiny_model_dir, monkeypatch):
    """Ctrl-C to the sweep's process group as its configs train: exit 130, one line saying what
    each config kept and how to continue, no traceback, no process of it left; the resume finishes
    both configs, each iteration once."""
    sweep_dir = tmp_path / "sweep"
    code, after, console = _interrupt(
        tmp_path, _args(tiny_model_dir, sweep_dir, *SEEDS, iterations=6), lambda _, text: "] iter 1/6 " in text, signal.SIGINT, True
    )
    assert code == 130, console[-3000:]
    # the configs run in step (grpo_flyte.loop.lockstep): the other's iteration line may land beside the
    # one the signal followed; past those, the stop is one line
    stop = [line for line in after if not re.search(r"\] iter \d+/6 ", line)]
    assert len(stop) == 1 and after[-1] == stop[0], console[-3000:]
    assert re.fullmatch(
        rf"\d\d:\d\d:\d\d interrupted: iterations kept: seed=0 (1-\d|none) of 6, seed=1 (1-\d|none) of 6; "
        rf"continue with: .* --local --resume --run-dir {re.escape(str(sweep_dir))}",
        stop[0],
    ), stop[0]
    assert "Traceback" not in console and "KeyboardInterrupt" not in console, console[-3000:]
    kept = {name: max(_iterations(sweep_dir / name), default=0) for name in NAMES}
    shown = []  # sweep.jsonl as the resumed sweep starts: each config's iterations so far, not 0 until its next one
    run_all = sweep_folder._run_all
    monkeypatch.setattr(sweep_folder, "_run_all", lambda *a: shown.append(_outcomes(sweep_dir)) or run_all(*a))
    assert cli_main(["--local", "--resume", "--run-dir", str(sweep_dir)]) == 0
    assert {name: line["iterations_done"] for name, line in shown[0].items()} == kept
    assert {n: o["status"] for n, o in _outcomes(sweep_dir).items()} == dict.fromkeys(NAMES, "complete")
    assert all(_iterations(sweep_dir / name) == list(range(7)) for name in NAMES)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir) -> Path:
    """The drills' sweep, run to its end without a kill."""
    sweep_dir = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    assert cli_main(_args(tiny_model_dir, sweep_dir, *SEEDS)) == 0
    return sweep_dir


# (point, occurrence): the sweep's own files, a config mid-iteration, a config done but not its folder
SWEEP_KILL_POINTS = [
    ("sweep.jsonl", 4),  # the sweep's figures, rewritten as a config records its evaluation before training
    ("checkpoint", 3),  # a config saving its loop state, the other mid-iteration
    ("adapter", 1),  # the first config to finish exporting its adapter into its folder
]


def _removed(caplog) -> set[Path]:
    """What the resume said it removed, left half-written by the kill (a config's lines start with its name)."""
    said = [re.sub(r"^\[[^]]*\] ", "", r.getMessage()) for r in caplog.records]
    suffix = ", left half-written by a run that was killed"
    return {Path(m.removeprefix("removed ").removesuffix(suffix)) for m in said if m.startswith("removed ") and m.endswith(suffix)}


@pytest.mark.parametrize(("point", "nth"), SWEEP_KILL_POINTS, ids=[f"{p}-{n}" for p, n in SWEEP_KILL_POINTS])
def test_a_sweep_killed_anywhere_resumes_every_config_once_with_the_uninterrupted_metrics(
    tmp_path, tiny_model_dir, uninterrupted, point, nth, caplog
):
    """SIGKILL mid-sweep, then --resume: whole files only, what the kill left half-written removed
    (the sweep folder's own files too: before, a temp file of sweep.jsonl stayed for good), every
    config complete with each iteration once and the uninterrupted sweep's metrics and adapter."""
    sweep_dir = tmp_path / "sweep"
    killed = warm_python.run([DRILL, point, str(nth), *_args(tiny_model_dir, sweep_dir, *SEEDS)], timeout=300, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    for name in NAMES:
        if (sweep_dir / name).is_dir():
            _check_whole_files(sweep_dir / name)
    left = _temp_names(sweep_dir)
    assert left
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(["--local", "--resume", "--run-dir", str(sweep_dir)]) == 0
    assert _removed(caplog) == left and not _temp_names(sweep_dir)  # what the kill left, and nothing else
    assert {n: o["status"] for n, o in _outcomes(sweep_dir).items()} == dict.fromkeys(NAMES, "complete")
    for name in NAMES:
        _check_whole_files(sweep_dir / name)
        assert _iterations(sweep_dir / name) == [0, 1, 2]
        assert _close(_metrics(sweep_dir / name), _metrics(uninterrupted / name))
        assert max((_weights(sweep_dir / name)[k] - w).abs().max().item() for k, w in _weights(uninterrupted / name).items()) < 1e-5
