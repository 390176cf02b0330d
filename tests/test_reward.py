"""Unit tests for the arithmetic reward and the score_group task called as a plain function."""

from __future__ import annotations

import asyncio

import pytest

from grpo_flyte.data import Example
from grpo_flyte.reward import (
    CORRECT_REWARD,
    FORMAT_REWARD,
    RewardParts,
    ScoredGroup,
    arithmetic_reward,
    extract_answer,
    score_group,
)
from grpo_flyte.rollout import Rollout, RolloutGroup

# --------------------------------------------------------------------------- extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 is 7, so\n#### 7", "7"),
        ("#### 12 and then 99 more words", "12"),  # the number right after the marker wins
        ("first #### 3 then #### 5", "5"),  # the last marker wins
        ("I think it is 41, no, 42.", "42"),  # no marker: last integer
        ("no marker: 10 then 20 then 30", "30"),
        ("#### -17", "-17"),
        ("the result is -3", "-3"),
        ("#### 1,234", "1234"),
        ("roughly 12,345,678 apples", "12345678"),
        ("#### 007", "7"),
        ("#### -0042", "-42"),
        ("#### 000", "0"),
        ("#### -0", "0"),
        ("The answer is 42 ####", "42"),  # marker with no number after it: fall back
        ("got 8\n#### unknown", "8"),
        ("", None),
        ("no digits at all", None),
        ("####", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# --------------------------------------------------------------------------- arithmetic_reward


def test_reward_constants():
    assert CORRECT_REWARD == 1.0
    assert FORMAT_REWARD == 0.2


@pytest.mark.parametrize(
    ("completion", "answer", "reward", "correct", "fmt"),
    [
        ("5 + 7 = 12\n#### 12", "12", 1.0 + 0.2, True, True),  # right and formatted: 1.0 + 0.2
        ("5 + 7 = 12", "12", 1.0, True, False),  # right, no marker: 1.0
        ("#### 13", "12", 0.2, False, True),  # wrong but formatted: 0.2
        ("it is 13", "12", 0.0, False, False),  # wrong, no marker: 0
        ("nothing", "12", 0.0, False, False),
        ("#### -5", "-5", 1.2, True, True),
        ("#### 5", "-5", 0.2, False, True),  # the sign matters
        ("#### 1,024", "1024", 1.2, True, True),
        ("#### 42", " 042 ", 1.2, True, True),  # the answer is normalized too
    ],
)
def test_arithmetic_reward_parts(completion, answer, reward, correct, fmt):
    parts = arithmetic_reward(completion, answer)
    assert isinstance(parts, RewardParts)
    assert parts.reward == pytest.approx(reward)
    assert parts.correct is correct
    assert parts.format is fmt


# --------------------------------------------------------------------------- score_group


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
    scored = asyncio.run(score_group(group))
    assert isinstance(scored, ScoredGroup)
    assert scored.group == group
    # in rollout order: 1.0 + 0.2, 1.0, 0.2, 0.0, 1.0 + 0.2
    assert [p.reward for p in scored.rewards] == pytest.approx([1.2, 1.0, 0.2, 0.0, 1.2])
    assert [p.correct for p in scored.rewards] == [True, True, False, False, True]
    assert [p.format for p in scored.rewards] == [True, False, True, False, True]


def test_score_group_empty_group():
    group = RolloutGroup(
        index=0,
        example=Example(question="What is 1 + 1?", answer="2"),
        adapter_version=0,
        prompt_ids=[1],
        rollouts=[],
        generate_s=0.0,
    )
    assert asyncio.run(score_group(group)).rewards == []


# --------------------------------------------------------------------------- training rewards


def _group(finishes: list[str], rewards: list[float]) -> ScoredGroup:
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[-0.1], finish_reason=f, text="x") for f in finishes]
    group = RolloutGroup(index=0, example=Example(question="q", answer="1"), adapter_version=0,
                         prompt_ids=[5], rollouts=rollouts, generate_s=0.0)
    parts = [RewardParts(reward=r, correct=r >= 1.0, format=r in (0.2, 1.2)) for r in rewards]
    return ScoredGroup(group=group, rewards=parts)


def test_training_rewards_zero_truncated_completions():
    sg = _group(["stop", "length", "length"], [1.2, 0.2, 0.0])
    assert sg.training_rewards("zero_reward") == [1.2, 0.0, 0.0]
    assert sg.training_rewards("keep") == [1.2, 0.2, 0.0]
    assert sg.training_rewards("mask") == [1.2, 0.2, 0.0]  # masking happens in the trainer


def test_informative_depends_on_the_truncation_policy():
    # the only reward comes from a truncated completion: with zero_reward every member scores 0
    sg = _group(["length", "stop"], [0.2, 0.0])
    assert sg.informative("keep")
    assert not sg.informative("zero_reward")
