"""The benchmarks: their bare loop does exactly grpo_flyte's work (same token ids, same loss, same
adapter), and every one of them runs in its quick mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import warm_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _loops import bare_iteration, flyte_iteration, same_adapter

from grpo_flyte import reward
from grpo_flyte.config import RunConfig

# A random tiny model never answers right; this reward still differs within groups.
LENGTH_REWARD = "def by_length(completions, **kwargs):\n    return [(len(c) % 3) / 2 for c in completions]\n"


@pytest.mark.parametrize("topup", [0, 4])
def test_bare_iteration_matches_the_local_flyte_run(tmp_path, tiny_model_dir, monkeypatch, topup):
    """iteration_overhead.py compares the two; that only means something if they do the same work.
    With top-up on, the extra generate round (a function of the rewards) must match too."""
    (tmp_path / "bench_length_reward.py").write_text(LENGTH_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    original_score = reward.score

    def recording_score(scoring, sampling, group):
        seen.append((group.index, group.prompt_ids, [r.completion_ids for r in group.rollouts]))
        return original_score(scoring, sampling, group)

    monkeypatch.setattr(reward, "score", recording_score)  # the score_group task's body
    config = RunConfig(
        model=str(tiny_model_dir), iterations=1, eval_size=0, prompts_per_iter=3, group_size=3,
        max_new_tokens=6, temperature=1.0, truncated="keep", min_informative_groups=topup, max_topup_rounds=1,
        rewards={"bench_length_reward:by_length": 1.0},
    )  # fmt: skip
    flyte_out = flyte_iteration(config, tiny_model_dir, tmp_path / "flyte")
    bare = bare_iteration(config, tiny_model_dir, tmp_path / "bare")

    bare_groups = [(sg.group.index, sg.group.prompt_ids, [r.completion_ids for r in sg.group.rollouts]) for sg in bare["scored"]]
    assert sorted(seen) == bare_groups
    assert (len(bare_groups) > 3) == (topup > 0)  # 3 prompts can never give 4 informative groups
    row = flyte_out["row"]
    assert bare["stats"].num_updates == 1 and bare["stats"].num_tokens > 0
    assert (row["loss"], row["num_tokens"]) == (bare["stats"].loss, bare["stats"].num_tokens)
    assert same_adapter(flyte_out["adapter_dir"], bare["adapter_dir"])


BENCHMARKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_every_benchmark_runs_in_its_quick_mode(script, tmp_path):
    """Each benchmark's plumbing, from this checkout, on every change: a benchmark whose code drifted
    from the package's (a task's signature changed) fails here, not in front of a reader. A quick
    run may miss its speed target (exit 1, said in its output); it may not crash. Each runs as
    `python SCRIPT --quick` in a process of its own (a warm one: tests/warm_python.py)."""
    out = tmp_path / f"{script.stem}.json"
    done = warm_python.run([script, "--quick", "--out", out], cwd=script.parent, timeout=900)
    assert "Traceback" not in done.stderr + done.stdout, (done.stdout + done.stderr)[-4000:]
    assert done.returncode in (0, 1) and out.is_file(), (done.returncode, (done.stdout + done.stderr)[-4000:])
    assert isinstance(json.loads(out.read_text()), dict)


def seed_summary(
    start: float, accuracy: float, reward: float | None = None, ess: float = 1.0, lowest: float | None = None, floor_run: int = 0
) -> dict:
    """One seed's learning_curve.json as `summarize` writes it: a start and an end evaluation (accuracy
    as the reward unless given), their paired gain and the gate's inputs."""
    return {
        "curve": [
            {"iteration": 0, "eval_reward": start, "eval_reward_ci95": 0.05, "eval_accuracy": start},
            {"iteration": 20, "eval_reward": accuracy if reward is None else reward, "eval_reward_ci95": 0.05, "eval_accuracy": accuracy},
        ],
        "is_ess_mean": ess, "accuracy_gain": accuracy - start, "accuracy_gain_ci95": 0.06,
        "lowest_eval_accuracy": start if lowest is None else lowest, "lowest_eval_iteration": 5, "train_floor_run": floor_run,
    }  # fmt: skip


def test_learning_curve_over_seeds_reports_each_seed_and_their_spread():
    import learning_curve

    seeds = {
        0: seed_summary(0.17, 0.37, 0.5, 1.0, 0.17),
        1: seed_summary(0.17, 0.27, 0.3, 0.98, 0.13),
        2: seed_summary(0.17, 0.32, 0.4, 0.96, 0.15, floor_run=3),
    }
    combined = learning_curve.combine(seeds, min_gain=0.10)
    assert list(combined["seeds"]) == ["0", "1", "2"]
    assert combined["final_reward"]["mean"] == pytest.approx(0.4) and combined["final_reward"]["sd"] == pytest.approx(0.1)
    # gains +0.20, +0.10, +0.15: mean 0.15, sd 0.05, t(2 df) = 4.303 -> half-width 4.303 * 0.05 / sqrt(3)
    assert combined["accuracy_gain"]["mean"] == pytest.approx(0.15)
    assert combined["accuracy_gain"]["ci95"] == pytest.approx(4.303 * 0.05 / 3**0.5)
    assert combined["accuracy_gain"]["min"] == pytest.approx(0.10)
    assert combined["lowest_eval_accuracy"]["min"] == pytest.approx(0.13)
    assert combined["is_ess_mean"]["mean"] == pytest.approx(0.98)
    # seed 1 dips 4 points below its start and seed 2 sat at the training floor for 3 iterations
    gate = combined["gate"]
    assert not gate["passed"] and list(gate["failures"]) == ["1", "2"]
    assert "more than 3% below its start" in gate["failures"]["1"][0]
    assert "3 iterations in a row" in gate["failures"]["2"][0]
    text = learning_curve.report_seeds(combined)
    assert "over 3 seeds: paired accuracy gain +15.0% +- 12.4%" in text and "FAILED" in text
    with pytest.raises(SystemExit) as stop:  # before any run starts
        learning_curve.main(["--seeds", "0", "1", "--seed", "3"])
    assert stop.value.code == 2
    with pytest.raises(SystemExit):
        learning_curve.main(["--gate", "0.1"])  # the gate is over seeds


def test_learning_curve_reuses_the_seeds_a_run_folder_finished(tmp_path, monkeypatch):
    """A gate of 5 seeds can be made in several sittings: a seed folder holding its summary is read, not run again."""
    import learning_curve

    for seed, gain in ((1, 0.05), (0, 0.13)):
        (tmp_path / f"seed-{seed}").mkdir()
        (tmp_path / f"seed-{seed}" / "learning_curve.json").write_text(json.dumps(seed_summary(0.17, 0.17 + gain)))

    def no_run(argv):
        raise AssertionError(f"a finished seed was run again: {argv}")

    monkeypatch.setattr(learning_curve, "cli_main", no_run)
    monkeypatch.setattr(learning_curve, "run_parallel", no_run)
    # seed 1 gained 5 points: the gate at +10 fails on it alone
    assert learning_curve.main(["--seeds", "0", "1", "--run-dir", str(tmp_path), "--gate", "0.10", "--jobs", "2"]) == 1
    combined = json.loads((tmp_path / "learning_curve.json").read_text())
    assert list(combined["seeds"]) == ["0", "1"] and list(combined["gate"]["failures"]) == ["1"]
    assert combined["accuracy_gain"]["mean"] == pytest.approx(0.09)


def test_learning_curve_counts_the_longest_run_at_the_training_floor():
    import learning_curve

    assert learning_curve.longest_run([False, True, True, False, True, True, True, False]) == 3
    assert learning_curve.longest_run([]) == 0


def test_recipe_sweep_reports_the_seeds_a_stopped_sweep_finished_and_runs_nothing(tmp_path, monkeypatch, capsys):
    import recipe_sweep

    # center: seeds 0, 1 and 2 finished (+16, +14, +15 points); lr=5e-4: seed 0 only, the rest never ran
    for cell, gains in (("center", (0.16, 0.14, 0.15)), ("lr=5e-4", (0.02,))):
        for seed, gain in enumerate(gains):
            folder = tmp_path / recipe_sweep.folder_name(cell) / f"seed-{seed}"
            folder.mkdir(parents=True)
            (folder / "learning_curve.json").write_text(json.dumps(seed_summary(0.18, 0.18 + gain)))

    def no_run(jobs, *_args):
        assert jobs == [], "--report started a run"
        return {}

    monkeypatch.setattr(recipe_sweep, "run_parallel", no_run)
    out = tmp_path / "sweep.json"
    assert (
        recipe_sweep.main(["--run-dir", str(tmp_path), "--report", "--cells", "center", "lr=5e-4", "cosine, warmup 0.1", "--out", str(out)])
        == 0
    )
    cells = json.loads(out.read_text())["cells"]
    assert list(cells) == ["center", "lr=5e-4"]  # a cell without a finished seed is left out
    assert cells["center"]["accuracy_gain"]["mean"] == pytest.approx(0.15) and cells["center"]["accuracy_gain"]["min"] == pytest.approx(
        0.14
    )
    assert list(cells["lr=5e-4"]["seeds"]) == ["0"] and cells["lr=5e-4"]["gate"]["failures"]["0"]
    table = capsys.readouterr().out
    assert "| center | 3 | +15.0% +- 2.5% | +14.0% |" in table and "| 3/3 |" in table
    assert "| lr=5e-4 | 1 | +2.0% | +2.0% |" in table and "| 0/1 |" in table
    with pytest.raises(SystemExit):
        recipe_sweep.main(["--report"])  # the table of which runs?
