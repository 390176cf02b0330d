"""The benchmarks: their bare loop does exactly grpo_flyte's work (same token ids, same loss, same
adapter), and every one of them runs in its quick mode."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support import warm_python

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _loops import bare_iteration, flyte_iteration, same_adapter

from grpo_flyte import reward
from grpo_flyte.config.run import RunConfig

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


BENCHMARKS = sorted(p for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_every_benchmark_runs_in_its_quick_mode(script, tmp_path):
    """Each benchmark's plumbing, from this checkout, on every change: a benchmark whose code drifted
    from the package's (a task's signature changed) fails here, not in front of a reader. A quick
    run may miss its speed target (exit 1, said in its output); it may not crash. Each runs as
    `python SCRIPT --quick` in a process of its own (a warm one: tests/support/warm_python.py), its
    temporary folders under the test's (TMPDIR), which pytest removes in time."""
    out = tmp_path / f"{script.stem}.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = warm_python.run([script, "--quick", "--out", out], cwd=script.parent, env=env, timeout=900)
    assert "Traceback" not in done.stderr + done.stdout, (done.stdout + done.stderr)[-4000:]
    assert done.returncode in (0, 1) and out.is_file(), (done.returncode, (done.stdout + done.stderr)[-4000:])
    assert isinstance(json.loads(out.read_text()), dict)


@pytest.mark.parametrize("mode", ["--function-tools", "--agent"])
def test_tool_learning_trains_the_examples_tool_and_agent_in_its_quick_mode(mode, tmp_path):
    """tool_learning.py's other two modes (the quick test above runs the `<calc>` environment): the
    calculator of examples/tools_calculator.py as a --tools function, and examples/agent_openai.py's
    own agent loop, each through the real CLI to the end, tool use read per iteration and held out."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "tool_learning.py"
    out = tmp_path / "tools.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = warm_python.run([script, "--quick", mode, "--out", out], cwd=script.parent, env=env, timeout=900)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert [r["iteration"] for r in result["eval_tool_curve"]] == [0, 1, 2] and len(result["train_tool_call_rate"]) == 2
    assert all(0 <= r["eval_tool_call_rate"] <= 1 for r in result["eval_tool_curve"])


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


def _without(tmp_path: Path, *packages: str) -> dict[str, str]:
    """An environment in which importing any of `packages` fails: a package of that name, first on
    PYTHONPATH, that raises ImportError (a GPU machine with torch and grpo_flyte only)."""
    for name in packages:
        (tmp_path / "blocked" / name).mkdir(parents=True)
        (tmp_path / "blocked" / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), str(src)])}


def test_the_fork_check_says_no_cuda_on_a_cpu_and_needs_neither_flyte_nor_transformers(tmp_path):
    """`device_check.py --fork-check` is the GPU rehearsal of issue 54's item 1, for a lent GPU
    machine that has torch and grpo_flyte but no flyte, vLLM or transformers. On this CPU build of
    torch it forks nothing and says why, instead of reporting checks it could not make; each
    sub-check (benchmarks/_fork_check.py) runs too, and reports the child's error honestly."""
    import subprocess

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    env = _without(tmp_path, "flyte", "transformers", "vllm", "peft")
    out = tmp_path / "fork.json"
    done = subprocess.run(
        [sys.executable, "device_check.py", "--fork-check", "--out", str(out)], cwd=benchmarks, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())["fork_check"]
    assert result == {"cuda": False, "reason": result["reason"]} and "CPU build" in result["reason"]
    assert "nothing was forked" in done.stdout
    done = subprocess.run(
        [sys.executable, "_fork_check.py", "grpo_flyte_dtype_bfloat16", "fork"], cwd=benchmarks, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    sub = json.loads(done.stdout.strip().splitlines()[-1])
    assert sub["probe_result"] == ["bfloat16", "cpu"] and sub["cuda_initialized_after_probe"] is False
    assert "not compiled with CUDA" in sub["child"]  # the forked child ran, and CUDA is not here


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


def test_learning_curve_runs_its_seeds_as_one_sweep_and_reads_each_seeds_figures_from_it(
    tmp_path, tiny_model_dir, caplog, capsys, monkeypatch
):
    """--seeds is one sweep (`--sweep seed=...`): one engine build and one base load for every seed,
    a run folder per seed in the sweep folder, each seed's figures read from it; the same call
    again reads the finished sweep and runs nothing; another set of seeds there is refused."""
    import learning_curve

    from grpo_flyte.engine import cache
    from grpo_flyte.learning import policy

    cache._engines.clear()  # a cold replica: what this process built for earlier tests would hide the count
    policy.release_models()
    run_dir = tmp_path / "gate"
    argv = ["--quick", "--seeds", "0", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir), "--gate", "0.1"]
    with caplog.at_level("INFO"):
        assert learning_curve.main(argv) == 1  # a random tiny model learns nothing: the gate fails, and says so
    messages = [r.getMessage() for r in caplog.records]
    assert sum("building the hf generator" in m for m in messages) == 1
    assert sum("loading the base model for training" in m for m in messages) == 1
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["seed=0", "seed=1"]
    assert (run_dir / "sweep.json").is_file() and (run_dir / "report.html").is_file()
    combined = json.loads((run_dir / "learning_curve.json").read_text())
    assert list(combined["seeds"]) == ["0", "1"] and list(combined["gate"]["failures"]) == ["0", "1"]
    for seed in (0, 1):
        figures = combined["seeds"][str(seed)]
        assert figures["config"]["seed"] == seed and figures["iterations"] == 2
        assert [p["iteration"] for p in figures["curve"]] == [0, 1, 2]
    printed = capsys.readouterr().out
    assert "\nseed 0\n" in printed and "\nseed 1\n" in printed and "over 2 seeds: paired accuracy gain" in printed and "FAILED" in printed

    def no_run(argv):
        raise AssertionError(f"a finished sweep was run again: {argv}")

    monkeypatch.setattr(learning_curve, "cli_main", no_run)
    assert learning_curve.main(argv) == 1
    assert json.loads((run_dir / "learning_curve.json").read_text()) == combined
    assert f"reused the finished sweep in {run_dir}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        learning_curve.main(["--quick", "--seeds", "0", "2", "--run-dir", str(run_dir)])
    assert refused.value.code == 2
    assert "holds the sweep [{'seed': 0}, {'seed': 1}], not --seeds 0 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning_curve.main(["--seeds", "0", "1", "--jobs", "2"])  # one sweep runs every seed at once


def test_learning_curve_counts_the_longest_run_at_the_training_floor():
    import learning_curve

    assert learning_curve.longest_run([False, True, True, False, True, True, True, False]) == 3
    assert learning_curve.longest_run([]) == 0


def test_recipe_sweep_reports_the_seeds_a_stopped_sweep_finished_and_runs_nothing(tmp_path, monkeypatch, capsys):
    import recipe_sweep

    # center: seeds 0, 1 and 2 finished (+16, +14, +15 points); lr=5e-4: seed 0 only, the rest never ran
    for cell, gains in (("center", (0.16, 0.14, 0.15)), ("lr=5e-4", (0.02,))):
        for seed, gain in enumerate(gains):
            folder = tmp_path / recipe_sweep.folder_name(cell) / f"seed={seed}"
            folder.mkdir(parents=True)
            (folder / "learning_curve.json").write_text(json.dumps(seed_summary(0.18, 0.18 + gain)))

    def no_run(*_args):
        raise AssertionError("--report started a run")

    monkeypatch.setattr(recipe_sweep, "run_seeds", no_run)
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


def test_gpu_sizing_shapes_are_the_public_models_and_their_parameters_counted_right():
    """gpu_sizing.py's shapes against the Qwen3 model cards' non-embedding parameter counts (0.44B,
    1.4B, 3.6B), and its count against what transformers builds from a shape."""
    import gpu_sizing
    from transformers import Qwen3Config, Qwen3ForCausalLM

    embedding = gpu_sizing.COMMON["vocab_size"]
    non_embedding = {
        name: round((gpu_sizing.num_params(shape, gpu_sizing.COMMON) - embedding * shape["hidden_size"]) / 1e9, 2)
        for name, shape in gpu_sizing.SHAPES.items()
    }
    assert non_embedding == {"Qwen3-0.6B": 0.44, "Qwen3-1.7B": 1.41, "Qwen3-4B": 3.63}
    [shape] = gpu_sizing.TINY.values()
    model = Qwen3ForCausalLM(Qwen3Config(**gpu_sizing.TINY_COMMON, **shape))
    assert sum(p.numel() for p in model.parameters()) == gpu_sizing.num_params(shape, gpu_sizing.TINY_COMMON)
