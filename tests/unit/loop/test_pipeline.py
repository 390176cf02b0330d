"""Generation ahead of training (--max-staleness K): which adapter generated every group the
trainer trained, with stand-in tasks of fixed durations around the real driver loop; and on the
tiny model, the same adapters as the synchronous loop where the schedule says they must be."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from _stand_ins import StandIns, run_loop

from grpo_flyte import driver
from grpo_flyte.config.errors import make_config
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import ConfigError
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.loop import pipeline
from grpo_flyte.loop.pipeline import fresh_groups, generation_version
from grpo_flyte.types import Example, RewardParts, RolloutGroup, ScoredGroup

LOOP = {"eval_size": 0, "prompts_per_iter": 3, "group_size": 2, "min_informative_groups": 0}


def test_generation_version_lags_by_k_from_the_first_adapter():
    assert [generation_version(it, 0) for it in range(5)] == [0, 1, 2, 3, 4]
    assert [generation_version(it, 1) for it in range(5)] == [0, 0, 1, 2, 3]
    assert [generation_version(it, 2) for it in range(5)] == [0, 0, 0, 1, 2]


def test_fresh_groups_drops_and_counts_the_staler_than_k():
    def group(version: int) -> ScoredGroup:
        rollout_group = RolloutGroup(
            index=version, example=Example(question="q", answer="1"), adapter_version=version, prompt_ids=[1], rollouts=[], generate_s=0.0
        )
        return ScoredGroup(group=rollout_group, rewards=[RewardParts(reward=0.0, correct=False, format=False)])

    scored = [group(v) for v in (1, 2, 3, 4)]
    kept, dropped = fresh_groups(scored, trainer_version=4, max_staleness=1)
    assert [sg.group.adapter_version for sg in kept] == [3, 4] and dropped == 2
    assert fresh_groups(scored, trainer_version=4, max_staleness=3) == (scored, 0)


def test_max_staleness_sizes_the_adapter_caches_and_refuses_too_small_ones():
    config = RunConfig(max_staleness=4)
    assert (config.adapters_to_keep, config.engine.adapter_cache_size) == (5, 6)
    assert (RunConfig().adapters_to_keep, RunConfig().engine.adapter_cache_size) == (3, 4)
    with pytest.raises(ConfigError, match=r"^--adapters-to-keep=2 with --max-staleness=2: expected at least 3$"):
        make_config(max_staleness=2, adapters_to_keep=2)
    with pytest.raises(ConfigError, match=r"^--adapter-cache-size=3 with --max-staleness=2: expected at least 4$"):
        make_config(max_staleness=2, adapter_cache_size=3)
    with pytest.raises(ConfigError, match="--max-staleness=7"):
        make_config(max_staleness=7)


@pytest.mark.parametrize("k", [1, 2])
def test_no_group_trains_staler_than_k_and_the_metrics_say_how_stale(tmp_path, k):
    stand_ins = StandIns(tmp_path / "adapters", generate_s=0.05, train_s=0.05)
    result = run_loop(RunConfig(iterations=6, max_staleness=k, **LOOP), stand_ins, tmp_path / "raw")
    assert [version for version, _ in stand_ins.trained] == [0, 1, 2, 3, 4, 5]  # each iteration trained once, in order
    for version, generated_by in stand_ins.trained:
        assert generated_by == [generation_version(version, k)] * 3  # the schedule's adapter, k older after the first
        assert all(0 <= version - g <= k for g in generated_by)
    rows = [row.train for row in result.history]
    assert [r.staleness_max for r in rows] == [min(k, it) for it in range(6)]
    assert all(r.stale_dropped == 0 for r in rows)


def test_groups_staler_than_k_are_dropped_counted_and_never_trained(tmp_path, monkeypatch):
    """A schedule gone wrong (generation two versions behind with K = 1): every stale group is
    dropped and counted, and the iteration trains on a batch generated again by its own adapter."""
    monkeypatch.setattr(pipeline, "generation_version", lambda it, k: max(0, it - k - 1))
    stand_ins = StandIns(tmp_path / "adapters", generate_s=0.01, train_s=0.01)
    result = run_loop(RunConfig(iterations=4, max_staleness=1, **LOOP), stand_ins, tmp_path / "raw")
    for version, generated_by in stand_ins.trained:
        assert all(version - g <= 1 for g in generated_by)
    assert [row.train.stale_dropped for row in result.history] == [0, 0, 3, 3]  # iterations 3 and 4 were 2 behind


def test_the_checkpoint_lists_the_batches_in_flight_and_their_adapters(tmp_path, monkeypatch):
    saved: list[dict] = []

    async def keep(checkpoint, payload: bytes) -> None:
        saved.append(json.loads(payload))

    monkeypatch.setattr(driver, "save_checkpoint", keep)
    monkeypatch.setattr(driver, "restore_state", _fake_restore)
    stand_ins = StandIns(tmp_path / "adapters", generate_s=0.01, train_s=0.01)
    run_loop(RunConfig(iterations=4, max_staleness=2, **LOOP), stand_ins, tmp_path / "raw")
    # after n iterations (adapter v n): the batches of iterations n..n+2 (0-based, up to the last) in
    # flight, each by the version two before the one that trains it
    assert [s["in_flight"] for s in saved] == [{"1": 0, "2": 0, "3": 1}, {"2": 0, "3": 1}, {"3": 1}, {}]
    assert [[a["version"] for a in s["recent_adapters"]] for s in saved] == [[0], [0, 1], [1, 2], [2, 3]]


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_generated_in_the_group_of_the_iteration_it_trains(tmp_path, k):
    """A batch generated ahead starts while the previous iterations train: its generate calls must
    still be in `iter-<n>` of the iteration that trains them (the UI shows them there, and the group
    names their actions, so a retried driver reuses them), not in the group open when it started."""
    import flyte

    from grpo_flyte.engine.sampling import sub_seed

    groups: dict[int, str | None] = {}  # the generate call's seed -> the group it ran in

    class Recording(StandIns):
        async def generate(self, *, seed: int, **parts):
            group = flyte.ctx().group_data
            groups[seed] = group.name if group else None
            return await super().generate(seed=seed, **parts)

    config = RunConfig(iterations=4, max_staleness=k, **LOOP)
    run_loop(config, Recording(tmp_path / "adapters", generate_s=0.02, train_s=0.02), tmp_path / "raw")
    iteration_of = {sub_seed(config.seed, it, i): it for it in range(config.iterations) for i in range(config.prompts_per_iter)}
    assert len(groups) == config.iterations * config.prompts_per_iter
    assert groups == {seed: f"iter-{iteration_of[seed] + 1}" for seed in groups}


async def _fake_restore(resume_from):
    class Checkpoint:  # save_checkpoint is patched: only its presence matters
        pass

    return Checkpoint(), None


TINY = ["--max-new-tokens", "6", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "0", "--min-informative-groups", "0"]


def _lora(run_dir: Path, version: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "flyte" / "adapters" / f"v{version:04d}" / "adapter_model.safetensors"))


def test_k1_trains_what_the_synchronous_loop_trains_until_the_schedules_part(tmp_path, tiny_model_dir, monkeypatch):
    """Iteration 1 is generated by adapter v0 in both loops: the same adapter v1, bit for bit.
    Iteration 2 is generated by v0 with K = 1 (by v1 without): staleness 1, another adapter."""
    import torch

    (tmp_path / "pipeline_reward.py").write_text(
        "def by_length(completions, **kwargs):\n    return [(len(c) % 3) / 2 for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # a random tiny model is never right: rewards that differ in a group
    runs = {}
    for k in (0, 1):
        run_dir = tmp_path / f"k{k}"
        args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "2", "--max-staleness", str(k), "--learning-rate", "0.05",
                "--rewards", "pipeline_reward:by_length=1", "--temperature", "1.0", "--truncated", "keep"]  # fmt: skip
        assert cli_main([*args, "--run-dir", str(run_dir)]) == 0
        runs[k] = run_dir
    sync, ahead = (_lora(runs[k], 1) for k in (0, 1))
    first = _lora(runs[0], 0)
    assert any(not torch.equal(first[name], sync[name]) for name in sync)  # the step did change the adapter
    assert sync.keys() == ahead.keys() and all(torch.equal(sync[name], ahead[name]) for name in sync)
    rows = {k: [json.loads(line) for line in (runs[k] / "metrics.jsonl").read_text().splitlines()] for k in (0, 1)}
    assert [r["staleness_max"] for r in rows[0]] == [0, 0] and [r["staleness_max"] for r in rows[1]] == [0, 1]
    assert rows[0][0]["loss"] == rows[1][0]["loss"] and rows[0][0]["mean_reward"] == rows[1][0]["mean_reward"]
    last = {k: _lora(runs[k], 2) for k in (0, 1)}
    assert any(not torch.equal(last[0][name], last[1][name]) for name in last[0])


def test_a_generate_replica_keeps_every_adapter_a_pipelined_run_has_in_flight():
    """The cluster path: the pool's engine keeps adapter_cache_size adapters loaded (the generate
    task's EngineConfig input, which follows K) and its download cache as many folders, at any K."""
    from grpo_flyte import rollout
    from grpo_flyte.config.constants import MAX_STALENESS

    for k in range(MAX_STALENESS + 1):
        config = RunConfig(max_staleness=k)
        assert config.engine.adapter_cache_size >= k + 2
        assert rollout._adapter_dirs.capacity >= config.engine.adapter_cache_size
