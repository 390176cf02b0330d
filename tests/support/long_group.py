"""A long-episode group (about 450k tokens: 8 episodes of 56k) and a Flyte local run that stows
it as the generate tasks do (`runtime.storage.stow_groups`)."""

from __future__ import annotations

import random
from pathlib import Path

import flyte

from grpo_flyte.runtime.storage import stow_groups
from grpo_flyte.types import Episode, EpisodeTurn, Example, Rollout, RolloutGroup

stow_env = flyte.TaskEnvironment(name="grpo_flyte-test-stow")

WORDS = ["the", "answer", "is", "12", "calc", "<calc>3*4</calc>", "so", "####", "result", "=", "\n"]


@stow_env.task
async def stow(groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """What generate does with its groups before it returns them."""
    return await stow_groups(groups)


def long_group(group_size: int = 8, tokens: int = 56_000, seed: int = 0) -> RolloutGroup:
    """A group of `group_size` two-turn episodes of `tokens` tokens each (the model's turns, then the
    environment's reply), with a token's text, id and log-prob as a real one has them."""
    rng = random.Random(seed)
    rollouts = []
    for _ in range(group_size):
        ids = [rng.randrange(49_152) for _ in range(tokens)]
        words = [rng.choice(WORDS) for _ in range(tokens)]
        half = tokens // 2
        model_text, env_text = " ".join(words[:half]), " ".join(words[half:])
        turns = [
            EpisodeTurn(role="model", text=model_text, num_tokens=half),
            EpisodeTurn(role="tool", text=env_text, num_tokens=tokens - half),
        ]
        rollouts.append(
            Rollout(
                completion_ids=ids,
                sampling_logprobs=[-rng.random() * 3 if i < half else 0.0 for i in range(tokens)],
                finish_reason="stop",
                text=model_text + env_text,
                model_mask=[i < half for i in range(tokens)],
                episode=Episode(turns=turns, end="episode_tokens"),
            )
        )
    example = Example(question="What is 3 * 4?", answer="12")
    return RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=list(range(200)), rollouts=rollouts, generate_s=1.0)


def stowed_in_local_run(groups: list[RolloutGroup], raw_data: Path) -> list[RolloutGroup]:
    """`groups` as a generate task returns them, stowed under `raw_data` (a Flyte local run)."""
    return flyte.with_runcontext(mode="local", raw_data_path=str(raw_data)).run(stow, groups).outputs()[0]
