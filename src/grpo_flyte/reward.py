"""The `score_group` task (one CPU task per prompt group) and `score_groups` (held-out evaluation).

The reward functions themselves are pure and live in `grpo_flyte.rewards`; the run's config says
which ones are weighted how (`rewards`) and what a failing one does (`on_reward_error`).
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from grpo_flyte.config import RunConfig
from grpo_flyte.envs import reward_env
from grpo_flyte.rewards import RewardParts, score_completions
from grpo_flyte.rollout import RolloutGroup


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


def score(config: RunConfig, group: RolloutGroup) -> ScoredGroup:
    started = time.perf_counter()
    rewards = score_completions(
        [r.text for r in group.rollouts],
        question=group.example.question,
        answer=group.example.answer,
        num_tokens=[len(r.completion_ids) for r in group.rollouts],
        max_new_tokens=config.max_new_tokens,
        weights=config.rewards,
        on_error=config.on_reward_error,
    )
    return ScoredGroup(group=group, rewards=rewards, score_s=time.perf_counter() - started)


@reward_env.task(retries=2)
async def score_group(config: RunConfig, group: RolloutGroup) -> ScoredGroup:
    """Score every completion of one prompt group with the config's weighted rewards."""
    return score(config, group)


@reward_env.task(retries=2)
async def score_groups(config: RunConfig, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """Score many groups in one task (held-out evaluation: one single-completion group per question)."""
    return [score(config, g) for g in groups]
