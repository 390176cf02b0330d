"""The score_group task called as a plain function, and the training rewards of a scored group."""

from __future__ import annotations

import asyncio

import flyte.errors
import pytest

from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import RewardError
from grpo_flyte.learning.grpo import group_advantages, informative, training_rewards
from grpo_flyte.reward import score_group
from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup

# --------------------------------------------------------------------------- score_group


def _parts(config: RunConfig):
    """What score_group takes of a run's config."""
    return config.scoring, config.sampling


def _rollout(text: str) -> Rollout:
    return Rollout(completion_ids=[1, 2], sampling_logprobs=[-0.1, -0.2], finish_reason="stop", text=text)


def test_score_group_called_directly_outside_flyte():
    texts = ["#### 9", "it is 9", "#### 8", "no idea", "4 + 5 = 9\n#### 9"]
    group = RolloutGroup(
        index=3,
        example=Example(question="What is 4 + 5?", answer="9"),
        adapter_version=2,
        prompt_ids=[10, 11, 12],
        rollouts=[_rollout(t) for t in texts],
        generate_s=0.5,
    )
    scored = asyncio.run(score_group(*_parts(RunConfig()), group))
    assert isinstance(scored, ScoredGroup)
    assert scored.group == group
    # in rollout order; the default reward is the answer alone, the format a flag beside it
    assert [p.reward for p in scored.rewards] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [p.correct for p in scored.rewards] == [True, True, False, False, True]
    assert [p.format for p in scored.rewards] == [True, False, True, False, True]
    assert [p.scores for p in scored.rewards][:2] == [{"correct": 1.0}, {"correct": 1.0}]


def test_score_group_uses_the_config_weights_and_error_policy(tmp_path, monkeypatch):
    (tmp_path / "grader_for_task.py").write_text(
        "def picky(completions, **kwargs):\n    return [1 / (0 if 'boom' in c else 1) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    group = RolloutGroup(
        index=0,
        example=Example(question="What is 4 + 5?", answer="9"),
        adapter_version=0,
        prompt_ids=[1],
        rollouts=[_rollout("#### 9"), _rollout("boom #### 9")],
        generate_s=0.0,
    )
    weights = {"correct": 2.0, "grader_for_task:picky": 0.5}
    # a reward that fails on these completions would fail again: Flyte must not retry it
    with pytest.raises(
        flyte.errors.NonRecoverableError, match=r"'grader_for_task:picky' raised ZeroDivisionError.*completion 2 of 2.*'boom #### 9'"
    ) as info:
        asyncio.run(score_group(*_parts(RunConfig(rewards=weights)), group))
    assert isinstance(info.value.__cause__, RewardError)
    scored = asyncio.run(score_group(*_parts(RunConfig(rewards=weights, on_reward_error="zero")), group))
    assert [p.reward for p in scored.rewards] == [2.5, 2.0]
    assert [p.errors for p in scored.rewards] == [[], ["grader_for_task:picky"]]


def test_score_group_empty_group():
    group = RolloutGroup(
        index=0,
        example=Example(question="What is 1 + 1?", answer="2"),
        adapter_version=0,
        prompt_ids=[1],
        rollouts=[],
        generate_s=0.0,
    )
    assert asyncio.run(score_group(*_parts(RunConfig()), group)).rewards == []


# --------------------------------------------------------------------------- training rewards


def _group(finishes: list[str], rewards: list[float]) -> ScoredGroup:
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[-0.1], finish_reason=f, text="x") for f in finishes]
    group = RolloutGroup(
        index=0, example=Example(question="q", answer="1"), adapter_version=0, prompt_ids=[5], rollouts=rollouts, generate_s=0.0
    )
    parts = [RewardParts(reward=r, correct=r >= 1.0, format=r in (0.2, 1.2)) for r in rewards]
    return ScoredGroup(group=group, rewards=parts)


def _training(sg: ScoredGroup, policy: str) -> list[float]:
    return training_rewards(sg.reward_values, sg.truncated, policy)


def test_training_rewards_floor_truncated_completions():
    sg = _group(["stop", "length", "length"], [1.2, 0.2, 0.0])
    assert sg.truncated == [False, True, True]
    assert _training(sg, "min_reward") == [1.2, 0.0, 0.0]  # non-negative rewards: the floor is 0
    assert _training(sg, "keep") == [1.2, 0.2, 0.0]
    assert _training(sg, "mask") == [1.2, 0.2, 0.0]  # masking happens in the trainer


def test_a_truncated_completion_never_beats_a_finished_one_with_negative_rewards():
    # correct=1 plus length=0.1: rambling to the limit scores 0 + 0.1 * -1 = -0.1, stopping late
    # and wrong 0 + 0.1 * -0.6 = -0.06, right 1.0. Reward 0 for the rambler (the old 'zero_reward')
    # would put it above the late wrong answer; the floor is the group's lowest, -0.1.
    sg = _group(["stop", "stop", "length"], [1.0, -0.06, -0.1])
    assert _training(sg, "min_reward") == [1.0, -0.06, -0.1]
    sg = _group(["stop", "stop", "length"], [1.0, -0.5, 0.3])  # a truncated one that scored well
    assert _training(sg, "min_reward") == [1.0, -0.5, -0.5]
    advantages = group_advantages(_training(sg, "min_reward"), 1e-4)
    assert advantages[2] == min(advantages) and advantages[2] < 0


def test_the_old_truncation_name_means_the_floor():
    assert RunConfig(truncated="zero_reward").train.truncated == "min_reward"


def test_informative_depends_on_the_truncation_policy():
    # the only reward comes from a truncated completion: floored, every member scores 0
    sg = _group(["length", "stop"], [0.2, 0.0])
    assert informative(_training(sg, "keep"))
    assert not informative(_training(sg, "min_reward"))


_MEETS_THE_OTHER = """
import time
from pathlib import Path

FOLDER = Path(__file__).parent / "met"


def meets(completions, *, question, **kwargs):
    # each group's reward marks that it started, then waits until the other group's has started too
    folder = FOLDER
    (folder / question).touch()
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other group never started scoring")
        time.sleep(0.05)
    return [1.0 for _ in completions]
"""


def test_two_slow_groups_on_one_replica_score_at_once(tmp_path, monkeypatch):
    """score_group leaves the event loop free and each group has its own sandbox worker: a group
    whose reward waits for the other's to start finishes only if both score concurrently."""
    (tmp_path / "meet_reward.py").write_text(_MEETS_THE_OTHER)
    (tmp_path / "met").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig(rewards={"meet_reward:meets": 1.0}, reward_timeout_s=120)

    def group(question: str) -> RolloutGroup:
        example = Example(question=question, answer="1")
        return RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=[1], rollouts=[_rollout("#### 1")] * 2, generate_s=0.0)

    async def both():
        return await asyncio.gather(score_group(*_parts(config), group("a")), score_group(*_parts(config), group("b")))

    scored = asyncio.run(both())
    assert [p.scores["meet_reward:meets"] for sg in scored for p in sg.rewards] == [1.0] * 4
    assert sorted(p.name for p in (tmp_path / "met").iterdir()) == ["a", "b"]


def test_reward_workers_let_more_groups_score_at_once_than_the_cpus(tmp_path, monkeypatch):
    """--reward-workers past the default (one a CPU): a reward that waits on the network gets that
    many groups scoring at once. Each group's reward here waits until every group's has started:
    they finish only if all score at once, one more than the default pool holds."""
    from grpo_flyte.scoring import workers

    count = workers.MAX_WORKERS + 1
    (tmp_path / "meet_all.py").write_text(_MEETS_THE_OTHER.replace("< 2", f"< {count}"))
    (tmp_path / "met").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig(rewards={"meet_all:meets": 1.0}, reward_timeout_s=120, reward_workers=count)

    def group(question: str) -> RolloutGroup:
        example = Example(question=question, answer="1")
        return RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=[1], rollouts=[_rollout("#### 1")], generate_s=0.0)

    async def together():
        return await asyncio.gather(*(score_group(*_parts(config), group(str(i))) for i in range(count)))

    try:
        scored = asyncio.run(together())
        assert [p.scores["meet_all:meets"] for sg in scored for p in sg.rewards] == [1.0] * count
        assert workers._workers.size == count
    finally:
        workers.use_workers(None)  # the process's default again (the extra workers stopped)
    assert workers._workers.size == workers.MAX_WORKERS and workers._workers.held == workers.MAX_WORKERS


def test_reward_workers_are_one_a_cpu_at_least_two_and_at_most_eight():
    """Each worker is a Python process with math-verify loaded: no more of them than the CPUs can run
    (the demo on 2 cores held 8, 0.49 GB), never fewer than 2 (a stuck reward holds up no other group)."""
    import os

    from grpo_flyte.scoring import workers

    assert [workers.worker_count(n) for n in (1, 2, 3, 8, 64)] == [2, 2, 3, 8, 8]
    assert workers.MAX_WORKERS == workers.worker_count(len(os.sched_getaffinity(0)))
    assert workers._workers.idle.qsize() <= workers.MAX_WORKERS
