"""The benchmarks: their bare loop does exactly grpo_flyte's work (same token ids, same loss, same
adapter), and every one of them runs in its quick mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    run may miss its speed target (exit 1, said in its output); it may not crash."""
    out = tmp_path / f"{script.stem}.json"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(out)], cwd=script.parent, capture_output=True, text=True, timeout=900
    )
    assert "Traceback" not in done.stderr + done.stdout, (done.stdout + done.stderr)[-4000:]
    assert done.returncode in (0, 1) and out.is_file(), (done.returncode, (done.stdout + done.stderr)[-4000:])
    assert isinstance(json.loads(out.read_text()), dict)
