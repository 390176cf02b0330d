"""This module defines the multi-turn episode part of a run's config: the environment, tools or
agent the model talks to, an episode's budgets, and the generate engine's context length that they set.

A part of `RunConfig` (grpo_flyte.config.run), beside the rollout's parts in grpo_flyte.config.generation.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from grpo_flyte.config.generation import PromptConfig, SamplingConfig
from grpo_flyte.config.part import Part
from grpo_flyte.errors import given as given_option
from grpo_flyte.errors import is_user_attribute
from grpo_flyte.multiturn import NO_ENV, check_env_name
from grpo_flyte.tools.functions import tool_names


class EpisodeConfig(Part):
    """Multi-turn episodes: the environment the model talks to, and the budgets of an episode."""

    env: str = Field(
        NO_ENV,
        description=(
            "'none' (one completion per prompt), 'calculator' (arithmetic with a <calc> tool; its own dataset of "
            "3-digit products), 'guess' (guess-the-number dialogue; its own dataset and reward), or 'module:Class' "
            "for your own environment (see docs/rewards-and-environments.md). With an environment, max_new_tokens is per model turn."
        ),
    )
    agent: str = Field(
        NO_ENV,
        description=(
            "'none', or 'module:function' naming your own agent, trained as it is: async def rollout(client, example) -> float | "
            "None, where client is an openai.AsyncOpenAI whose chat.completions.create calls the policy being trained answers "
            "(any model name; tools= and tool_choice passed to the chat template), and the return value is the episode's reward "
            "('env'), or None to let the rewards score the final conversation. The multi-turn budgets apply: max_turns requests, "
            "max_new_tokens per completion, max_episode_tokens, tool_timeout_s between requests (see docs/rewards-and-environments.md)."
        ),
    )
    max_turns: int = Field(
        4,
        ge=1,
        le=256,
        description="Multi-turn: model turns (an agent's requests) per episode at most (--max-tool-calling-iterations N: N + 1).",
    )
    max_episode_tokens: int = Field(
        384,
        ge=2,
        le=131_072,
        description=(
            "Multi-turn: tokens after the prompt, the model's and the environment's together, per episode at most. A long "
            "episode's memory grows with its tokens, not their square: generating, its key/value cache (2 x layers x key/value "
            "heads x head size x the dtype's bytes a token: 23 KB on the embedded model in bfloat16; the transformers engine "
            "decodes at most 1 GiB of it at a time, prefills 1,024 tokens at a time); training, a sequence longer than "
            "micro_batch_tokens trains alone with its activations recomputed (see micro_batch_tokens)."
        ),
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        description="Multi-turn: seconds one environment step (--tools: one call) may take; past it the model gets an error reply.",
    )
    tools: tuple[str, ...] = Field(
        (),
        description=(
            "Python functions the model calls through its chat template (TRL's tools), comma-separated 'module:function': "
            "schemas from their type hints and docstrings, shown by the template (or a fallback), calls read in its format, "
            "run in a sandbox, answered as tool messages. Not with --env; docs/rewards-and-environments.md#tools-python-functions."
        ),
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        le=255,
        description="With --tools: turns whose calls run, per episode (TRL's name); the next turn ends it. Unset: max_turns.",
    )

    @field_validator("env")
    @classmethod
    def _known_env(cls, env: str) -> str:
        check_env_name(env)
        return env

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_list(cls, value: Any) -> Any:
        return tool_names(value)  # each one 'module:function'

    @model_validator(mode="after")
    def _tools_or_env(self) -> EpisodeConfig:
        if self.tools and self.env != NO_ENV:
            raise ValueError(f"tools={','.join(self.tools)!r} with env={self.env!r}: expected one of them (tools play their own episodes)")
        if self.max_tool_calling_iterations is not None and not self.tools:
            raise ValueError(f"max_tool_calling_iterations={self.max_tool_calling_iterations} without tools: expected --tools too")
        if self.tools and self.agent != NO_ENV:
            raise ValueError(
                f"tools={','.join(self.tools)!r} with {given_option('agent', self.agent)}: expected one of them "
                "(an agent runs its own tools: pass them to client.chat.completions.create(tools=...))"
            )
        return self

    @field_validator("agent")
    @classmethod
    def _agent_shape(cls, agent: str) -> str:
        if agent != NO_ENV and not is_user_attribute(agent):
            raise ValueError("expected 'none' or 'module:function' naming an async function rollout(client, example)")
        return agent

    @model_validator(mode="after")
    def _env_or_agent(self) -> EpisodeConfig:
        if self.env != NO_ENV and self.agent != NO_ENV:
            raise ValueError(
                f"{given_option('env', self.env)} with {given_option('agent', self.agent)}: expected one of them (an agent plays its own episodes)"
            )
        return self

    @property
    def multi_turn(self) -> bool:
        """Whether a generation is an episode: of an environment, of tools or of an agent."""
        return self.env != NO_ENV or bool(self.tools) or self.agent != NO_ENV


def context_length(prompt: PromptConfig, sampling: SamplingConfig, episode: EpisodeConfig) -> int:
    """The longest sequence a request can reach, the generate engine's max_model_len:
    max_prompt_tokens + max_new_tokens, or with a multi-turn environment max_prompt_tokens +
    max_episode_tokens (the whole episode)."""
    return prompt.max_prompt_tokens + (episode.max_episode_tokens if episode.multi_turn else sampling.max_new_tokens)
