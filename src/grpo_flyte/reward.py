"""The verifiable arithmetic reward and the `score_group` task (one CPU task per prompt group).

Rewards are pure functions of (completion, answer) and return their parts, so the driver reports
accuracy and format rate without re-parsing text.
"""

from __future__ import annotations

import re
import time

from pydantic import BaseModel

from grpo_flyte.envs import reward_env
from grpo_flyte.rollout import RolloutGroup

MARKER = "####"
CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.2
_INTEGER = re.compile(r"-?\d[\d,]*")


class RewardParts(BaseModel):
    reward: float
    correct: bool
    format: bool


class ScoredGroup(BaseModel):
    group: RolloutGroup
    rewards: list[RewardParts]
    score_s: float = 0.0

    def training_rewards(self, truncated: str) -> list[float]:
        """The rewards advantages are computed from: with truncated='zero_reward' a completion cut
        off at the length limit counts as 0 (it never reached its answer)."""
        if truncated == "zero_reward":
            return [0.0 if r.finish_reason == "length" else p.reward for r, p in zip(self.group.rollouts, self.rewards, strict=True)]
        return [p.reward for p in self.rewards]

    def informative(self, truncated: str) -> bool:
        """Whether the training rewards differ: a group scored all alike has zero advantages."""
        values = self.training_rewards(truncated)
        return max(values) != min(values)


def extract_answer(completion: str) -> str | None:
    """The integer after the last '####', else the last integer in the text; None if there is none."""
    if MARKER in completion:
        match = _INTEGER.search(completion.rsplit(MARKER, 1)[1])
        if match:
            return _normalize(match.group(0))
    numbers = _INTEGER.findall(completion)
    return _normalize(numbers[-1]) if numbers else None


def _normalize(number: str) -> str:
    number = number.replace(",", "")
    sign = "-" if number.startswith("-") else ""
    digits = number.lstrip("-").lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def arithmetic_reward(completion: str, answer: str) -> RewardParts:
    """1.0 for the right integer, plus 0.2 for emitting the '####' marker."""
    correct = extract_answer(completion) == _normalize(answer.strip())
    has_format = MARKER in completion
    reward = CORRECT_REWARD * correct + FORMAT_REWARD * has_format
    return RewardParts(reward=reward, correct=correct, format=has_format)


def score(group: RolloutGroup) -> ScoredGroup:
    started = time.perf_counter()
    rewards = [arithmetic_reward(r.text, group.example.answer) for r in group.rollouts]
    return ScoredGroup(group=group, rewards=rewards, score_s=time.perf_counter() - started)


@reward_env.task(retries=2)
async def score_group(group: RolloutGroup) -> ScoredGroup:
    """Score every completion of one prompt group."""
    return score(group)


@reward_env.task(retries=2)
async def score_groups(groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """Score many groups in one task (held-out evaluation: one single-completion group per question)."""
    return [score(g) for g in groups]
