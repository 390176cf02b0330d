"""This module defines the `score_group` task (one prompt group) and `score_groups` (held-out
evaluation), on CPU, and `start_reward_workers`, which the driver calls as a run starts.

The reward functions themselves are pure and live in `grpo_flyte.reward_fns`, their sandboxed calls
and weighted sum in `grpo_flyte.scoring`; the run's scoring part says which ones are weighted how
(`rewards`) and what a failing one does (`on_reward_error`).
"""

from __future__ import annotations

import asyncio
import time

from grpo_flyte.config.generation import RewardConfig, SamplingConfig
from grpo_flyte.envs import reward_env
from grpo_flyte.errors import input_errors_not_retried
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.storage import fetch_group
from grpo_flyte.scoring.compose import Group, score_completions
from grpo_flyte.scoring.workers import start_workers, use_workers
from grpo_flyte.types import RolloutGroup, ScoredGroup


def score(scoring: RewardConfig, sampling: SamplingConfig, group: RolloutGroup) -> ScoredGroup:
    assert group.stowed is None, "a stowed group is read back (runtime.storage.fetch_group) before it is scored"
    started = time.perf_counter()
    example = group.example
    episodes = all(r.episode is not None for r in group.rollouts)
    prompt = example.prompt if isinstance(example.prompt, str) or example.prompt is None else [m.model_dump() for m in example.prompt]
    about = Group(
        question=example.question,
        answer=example.answer,
        max_new_tokens=sampling.max_new_tokens,
        num_tokens=[r.num_model_tokens for r in group.rollouts],
        completion_ids=[r.completion_ids for r in group.rollouts],
        prompt=prompt,
        columns=example.columns,
        env_rewards=[r.episode.reward for r in group.rollouts] if episodes else (),
        episodes=[r.episode.messages() for r in group.rollouts] if episodes else (),
    )
    rewards = score_completions(
        [r.answer_text for r in group.rollouts],
        about,
        # the judge and the reward models are models on pools of their own (grpo_flyte.judge): the driver adds their scores
        scoring.function_rewards,
        on_error=scoring.on_reward_error,
        timeout_s=scoring.reward_timeout_s,
    )
    return ScoredGroup(group=group, rewards=rewards, score_s=time.perf_counter() - started)


def _score_all(scoring: RewardConfig, sampling: SamplingConfig, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """`score` on each group, in a pool of the run's --reward-workers (set once a task)."""
    use_workers(scoring.reward_workers)
    return [score(scoring, sampling, g) for g in groups]


@reward_env.task(retries=2)
async def score_group(scoring: RewardConfig, sampling: SamplingConfig, group: RolloutGroup) -> ScoredGroup:
    """Score every completion of one prompt group with the configured weighted rewards.

    A group that came stowed (`runtime.storage.stow_groups`) is read from its folder and returned
    as it came. A reward that fails on these completions fails the same way again: not retried."""
    with input_errors_not_retried("score_group"), memory.span() as measured:
        whole = await fetch_group(group)
        # off the event loop: the replica's other groups score meanwhile (each in a sandbox worker)
        (scored,) = await asyncio.to_thread(_score_all, scoring, sampling, [whole])
    return scored.model_copy(update={"group": group, "memory": measured.peak})


@reward_env.task(retries=2)
async def score_groups(scoring: RewardConfig, sampling: SamplingConfig, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """Score many groups in one task (held-out evaluation: one single-completion group per question);
    stowed groups as score_group takes them."""
    with input_errors_not_retried("score_groups"):
        whole = [await fetch_group(g) for g in groups]
        scored = await asyncio.to_thread(_score_all, scoring, sampling, whole)
    return [s.model_copy(update={"group": g}) for s, g in zip(scored, groups, strict=True)]


@reward_env.task(retries=2)
async def start_reward_workers(count: int, size: int | None = None) -> int:
    """Start this replica's reward workers for `count` groups at once (at most its pool's `size`: the
    run's --reward-workers, None one a CPU), side by side, so that a run's first groups do not wait
    while each worker imports math-verify; how many started now."""
    return await asyncio.to_thread(start_workers, count, size)
