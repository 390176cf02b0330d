"""A local sweep through the command line: every config's run folder is what its lone run writes
(same seed: the same completions, metrics and adapter up to float rounding), one engine and one
base load for all, a failing config ends
alone and is named, --resume finishes what did not finish, and a bad grid writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_flyte import engines, policy
from grpo_flyte.cli import main as cli_main

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
TIMINGS = ("_s", "per_s")


def _args(model: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--local", "--model", str(model), *TINY, "--iterations", "2", "--run-dir", str(run_dir), *extra]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _outcomes(sweep_dir: Path) -> dict[str, dict]:
    return {line["name"]: line for line in map(json.loads, (sweep_dir / "sweep.jsonl").read_text().splitlines())}


def test_each_config_runs_as_its_lone_run_would_on_one_engine_and_one_base(tmp_path, tiny_model_dir, caplog):
    engines._slot.clear()  # a cold replica: what this process built for earlier tests would hide the count
    policy.release_models()
    sweep_dir = tmp_path / "sweep"
    with caplog.at_level("INFO"):
        assert cli_main(_args(tiny_model_dir, sweep_dir, "--sweep", "learning_rate=1e-4,5e-3", "--sweep", "seed=0,1")) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("building the hf generator" in m for m in messages) == 1
    assert sum("loading the base model for training" in m for m in messages) == 1
    names = [f"learning_rate={lr}_seed={seed}" for lr in ("1e-4", "5e-3") for seed in (0, 1)]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == sorted(names)
    assert {n: o["status"] for n, o in _outcomes(sweep_dir).items()} == dict.fromkeys(names, "complete")
    assert any(m.startswith("[learning_rate=5e-3_seed=1] iter 2/2") for m in messages)  # each line names its config
    report = (sweep_dir / "report.html").read_text()
    assert all(name in report for name in names) and "Over seeds" in report

    lone = tmp_path / "lone"
    assert cli_main(_args(tiny_model_dir, lone, "--learning-rate", "5e-3", "--seed", "1")) == 0
    swept = sweep_dir / "learning_rate=5e-3_seed=1"
    assert _files(swept) == _files(lone)
    # The same completions and rewards; float figures equal to float rounding: in the sweep's
    # engine batches (four adapters' rows) a row's log-probs differ from its lone run's in the 7th
    # digit (PEFT's mixed adapter batches, larger matmuls).
    completions = [[json.loads(line)["completion"] for line in path.read_text().splitlines()] for path in sorted((lone / "eval").iterdir())]
    assert completions == [
        [json.loads(line)["completion"] for line in path.read_text().splitlines()] for path in sorted((swept / "eval").iterdir())
    ]
    assert _close(_metrics(swept), _metrics(lone))
    assert [r["iteration"] for r in _metrics(swept)] == [0, 1, 2]
    assert _weights(swept).keys() == _weights(lone).keys()
    assert max((_weights(swept)[k] - _weights(lone)[k]).abs().max().item() for k in _weights(lone)) < 1e-5
    # the other seed and learning rate trained something else (the folders are not copies of one run)
    other = _weights(sweep_dir / "learning_rate=1e-4_seed=0")
    assert max((other[k] - _weights(swept)[k]).abs().max().item() for k in other) > 1e-3


@pytest.fixture
def wide_batch_window(monkeypatch):
    """Identical groups merge when they meet in one batcher flush: a window that what one config
    does before the other's request (its init_adapter, its report) fits in, however busy the
    machine. A batcher of its own, so the tests after it get the usual window."""
    monkeypatch.setattr(engines, "BATCH_WINDOW_S", 2.0)
    engines.replica_batcher.cache_clear()
    yield
    engines.replica_batcher.cache_clear()


def test_configs_that_start_alike_decode_their_first_evaluation_and_rollouts_once(tmp_path, tiny_model_dir, monkeypatch, wide_batch_window):
    """Two learning rates, one seed: both configs start from adapters of the same content (at their
    own paths) and sample the same prompts with the same seeds, so the held-out evaluation before
    training and the first iteration's rollouts are decoded once for both; each config's metrics
    are exactly its lone run's."""
    decoded_rows: list[int] = []
    generate_mixed = engines.HFGenerator.generate_mixed

    def counted(self, requests, adapter_paths):
        decoded_rows.append(sum(r.group_size for r in requests))
        return generate_mixed(self, requests, adapter_paths)

    monkeypatch.setattr(engines.HFGenerator, "generate_mixed", counted)
    one_iteration = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1"]
    assert cli_main([*one_iteration, "--sweep", "learning_rate=1e-4,5e-3", "--run-dir", str(tmp_path / "sweep")]) == 0
    sweep_rows = sum(decoded_rows)
    for rate in ("1e-4", "5e-3"):
        decoded_rows.clear()
        assert cli_main([*one_iteration, "--learning-rate", rate, "--run-dir", str(tmp_path / rate)]) == 0
        assert _metrics(tmp_path / "sweep" / f"learning_rate={rate}") == _metrics(tmp_path / rate)
    # one lone run's rows (2 evaluations of 2 questions, 2 prompts x 3 rollouts), and the other
    # config's evaluation after training (its adapter differs by then)
    assert sum(decoded_rows) == 2 + 2 * 3 + 2
    assert sweep_rows == sum(decoded_rows) + 2


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
    last = caplog.records[-1].getMessage()
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
