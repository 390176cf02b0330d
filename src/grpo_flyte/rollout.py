"""This module defines the `generate` and `generate_eval` tasks, which run on a warm, reusable pool of
replicas.

A task body fetches its inputs (the base model and adapter folders, cached per replica), hands its
groups to the replica's engine through the batcher in `grpo_flyte.engine.batching`, and returns them as
`RolloutGroup`s. Warm state is only a cache: the same inputs give the same rollouts on any replica
(the sampling seed is an input). Each rollout carries the prompt and completion token ids and the
per-token sampling log-probs, so the trainer never re-tokenizes text.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from flyte.io import Dir

from grpo_flyte.config.constants import MAX_BASES, MAX_STALENESS
from grpo_flyte.config.episode import EpisodeConfig, context_length
from grpo_flyte.config.generation import EngineConfig, ModelConfig, PromptConfig, SamplingConfig
from grpo_flyte.engine import agents, batching, cache, episodes, interface, tool_episodes
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.sampling import sub_seed
from grpo_flyte.envs import rollout_env, settings
from grpo_flyte.errors import input_errors_not_retried
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.device import resolve_dtype
from grpo_flyte.runtime.storage import replica_cache, stow_groups
from grpo_flyte.types import AdapterRef, Example, Rollout, RolloutGroup

# One base model folder per base a sweep trains (a run: one).
_model_dirs = replica_cache("models", capacity=MAX_BASES)
# A call holds its adapter's folder until it ends (`LocalDirCache.use`), and a replica runs up to
# rollout_concurrency calls at once, each with one adapter (a sweep's configs each bring their
# own); a pipelined run has up to max_staleness + 1 versions in flight and the newest. The cache
# keeps that many, so the folders in flight always fit and are downloaded once.
_adapter_dirs = replica_cache("adapters", capacity=max(MAX_STALENESS + 2, settings.rollout_concurrency))


@asynccontextmanager
async def _engine_inputs(
    model: ModelConfig, engine: EngineConfig, max_model_len: int, base_model: Dir, adapter: AdapterRef | None
) -> AsyncIterator[tuple[EngineKey, str | None]]:
    """The engine key and the adapter's local folder (None: the model as it is, e.g. an exported
    merged model); the base model's and the adapter's folders stay on disk until the block ends
    (the engine loads the adapter when its batch runs)."""
    async with contextlib.AsyncExitStack() as stack:
        model_path = await stack.enter_async_context(_model_dirs.use(base_model))
        adapter_path = await stack.enter_async_context(_adapter_dirs.use(adapter.dir)) if adapter is not None else None
        key = cache.engine_key(
            model_path,
            resolve_dtype(model.dtype),
            engine.backend,
            engine.adapter_cache_size,
            adapter_path,
            max_model_len=max_model_len,
            memory_fraction=engine.vllm_memory_fraction,
        )
        yield key, adapter_path


async def _sample(
    key: EngineKey,
    adapter_path: str,
    examples: list[Example],
    prompts: list[list[int]],
    requests: list[SamplingRequest],
    episode: EpisodeConfig,
    prompt: PromptConfig,
) -> list[list[Rollout]]:
    """Each request's rollouts: completions, or with a multi-turn environment or an agent, episodes
    (all played at once)."""
    if not episode.multi_turn:
        return await batching.generate_groups(key, adapter_path, requests)
    if episode.tools:
        return await batching.all_or_none(
            [
                tool_episodes.play_tool_episodes(key, adapter_path, example, ids, request, episode, prompt)
                for example, ids, request in zip(examples, prompts, requests, strict=True)
            ]
        )
    if episode.agent != agents.NO_AGENT:
        window = prompt.max_prompt_tokens + episode.max_episode_tokens  # context_length of an episode: the engine's window
        return await batching.all_or_none(
            [
                agents.play_agent_episodes(key, adapter_path, episode.agent, example, ids, request, episode, prompt, window)
                for example, ids, request in zip(examples, prompts, requests, strict=True)
            ]
        )
    return await batching.all_or_none(
        [
            episodes.play_episodes(key, adapter_path, episode.env, example, ids, request, episode, prompt)
            for example, ids, request in zip(examples, prompts, requests, strict=True)
        ]
    )


@rollout_env.task(retries=2)
async def generate(
    model: ModelConfig,
    engine: EngineConfig,
    prompt: PromptConfig,
    sampling: SamplingConfig,
    episode: EpisodeConfig,
    base_model: Dir,
    adapter: AdapterRef,
    example: Example,
    index: int,
    seed: int,
) -> RolloutGroup:
    """Sample `sampling.group_size` completions of one prompt with the given adapter (with a
    multi-turn environment: that many episodes, see grpo_flyte.multiturn). A group too large to
    return inline (long episodes) comes back stowed in a folder (`runtime.storage.stow_groups`). A
    broken multi-turn environment, adapter or GPU fails the same way on every attempt: not retried."""
    started = time.perf_counter()
    with input_errors_not_retried("generate"), memory.span(gpu=True) as measured:
        async with _engine_inputs(model, engine, context_length(prompt, sampling, episode), base_model, adapter) as (key, adapter_path):
            if episode.tools:  # the prompt shows the model its tools
                prompt = await tool_episodes.tool_prompt(key, prompt, episode)
            [prompt_ids] = await cache.tokenize(key, [example], prompt)
            [rollouts] = await _sample(
                key, adapter_path, [example], [prompt_ids], [interface.sampling_request(sampling, prompt_ids, seed)], episode, prompt
            )
    group = RolloutGroup(
        index=index,
        example=example,
        adapter_version=adapter.version,
        prompt_ids=prompt_ids,
        rollouts=rollouts,
        generate_s=time.perf_counter() - started,
        memory=measured.peak,
    )
    [group] = await stow_groups([group])
    return group


# The held-out questions' seeds: sub_seed(run seed, EVAL_STREAM, question), apart from every
# training group's sub_seed(run seed, iteration >= 0, prompt).
EVAL_STREAM = -1


def eval_seed(seed: int, question: int) -> int:
    """The sampling seed of held-out question `question` (its position in the held-out set): the
    same at every evaluation, so two adapters are compared on the same random numbers."""
    return sub_seed(seed, EVAL_STREAM, question)


@rollout_env.task(retries=2)
async def generate_eval(
    model: ModelConfig,
    engine: EngineConfig,
    prompt: PromptConfig,
    sampling: SamplingConfig,
    episode: EpisodeConfig,
    base_model: Dir,
    adapter: AdapterRef | None,
    examples: list[Example],
    first_index: int,
    num_generations: int | None = None,
    seed: int = 0,
) -> list[RolloutGroup]:
    """Held-out questions' completions (or episodes), one group per question, on the warm pool:
    one greedy completion each, or with `num_generations` that many sampled at the run's
    sampling settings, question `first_index + i` seeded `eval_seed(seed, first_index + i)`.
    `adapter` None: `base_model` answers as it is (an exported merged model, `launch.exporting`)."""
    started = time.perf_counter()
    with input_errors_not_retried("generate_eval"), memory.span(gpu=True) as measured:
        async with _engine_inputs(model, engine, context_length(prompt, sampling, episode), base_model, adapter) as (key, adapter_path):
            if episode.tools:
                prompt = await tool_episodes.tool_prompt(key, prompt, episode)
            prompts = await cache.tokenize(key, examples, prompt)
            if num_generations is None:
                requests = [interface.sampling_request(sampling, ids, seed=0, greedy=True) for ids in prompts]
            else:
                requests = [
                    interface.sampling_request(sampling, ids, seed=eval_seed(seed, first_index + i), group_size=num_generations)
                    for i, ids in enumerate(prompts)
                ]
            answered = await _sample(key, adapter_path, examples, prompts, requests, episode, prompt)
    elapsed = time.perf_counter() - started
    groups = [
        RolloutGroup(
            index=first_index + i,
            example=example,
            adapter_version=adapter.version if adapter is not None else 0,
            prompt_ids=prompt_ids,
            rollouts=rollouts,
            generate_s=elapsed,
            memory=measured.peak,
        )
        for i, (example, prompt_ids, rollouts) in enumerate(zip(examples, prompts, answered, strict=True))
    ]
    return await stow_groups(groups)
