"""This module builds one iteration's batch and takes the train step on it: a generate task per
prompt, each group scored the moment it lands (by the reward functions, and by the LLM judge and the
reward models when the rewards name them, each on its own pool), fresh prompts topped up until enough
groups are informative; then `train_step` (on a
cluster with several train GPUs, the data-parallel one). The driver's loop and the pipelined run
(`grpo_flyte.loop.pipeline`) both build on these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import flyte
from flyte.io import Dir

from grpo_flyte.config.constants import LOCAL_VLLM_SHARE
from grpo_flyte.config.generation import EngineConfig
from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import sample_prompts, topup_prompts
from grpo_flyte.engine.sampling import sub_seed
from grpo_flyte.judge import judge_group, reward_model_group
from grpo_flyte.loop.metrics import informative_group
from grpo_flyte.reward import score_group
from grpo_flyte.reward_fns import JUDGE_REWARD, reward_model_ref
from grpo_flyte.rollout import generate
from grpo_flyte.runtime.storage import as_payload, discard_stowed, fetch_group
from grpo_flyte.scoring.compose import with_judge, with_reward_model
from grpo_flyte.scoring.judging import busy_seconds
from grpo_flyte.trainer import DISTRIBUTED_STEP, train_step
from grpo_flyte.types import AdapterRef, Example, ScoredGroup, TrainStepResult


async def generate_and_score(generating: list[asyncio.Task], score: Callable[[Any], Awaitable[Any]]) -> tuple[list[Any], float, float]:
    """Score each generate result the moment it lands; on any failure cancel everything in flight.

    Returns the scores in landing order, the seconds until the last generate task finished, and
    the scoring tail after it.
    """
    started = time.perf_counter()
    scoring: list[asyncio.Task] = []
    try:
        for next_result in asyncio.as_completed(generating):
            scoring.append(asyncio.create_task(score(await next_result)))
        generated = time.perf_counter()
        results = await asyncio.gather(*scoring)
    except BaseException:
        for task in generating + scoring:
            task.cancel()
        raise
    return results, generated - started, time.perf_counter() - generated


def read_back(score: Callable[[Any], Awaitable[ScoredGroup]]) -> Callable[[Any], Awaitable[ScoredGroup]]:
    """`score` whose scored group holds its prompt ids and rollouts: a group that travelled as a
    file (`runtime.storage.stow_groups`) is read back while it is scored, and its folder let go
    once scored (`discard_stowed`)."""

    async def scored_whole(group: Any) -> ScoredGroup:
        scored, whole = await asyncio.gather(score(group), fetch_group(group))
        discard_stowed(group)
        return scored.model_copy(update={"group": whole})

    return scored_whole


def local_vllm_share(fraction: float, judging: bool) -> float:
    """Each vLLM engine's gpu_memory_utilization in a local run, where one process holds the
    generate engine, the judge's (with the 'judge' reward) and the trainer on one GPU:

        share = fraction * LOCAL_VLLM_SHARE / (2 if judging else 1)

    so the engines together reserve LOCAL_VLLM_SHARE x `fraction` of the GPU and the trainer keeps
    the rest (its base model, activations and optimizer state). vLLM starts an engine only when its
    whole share of the GPU is still free (vllm/v1/worker/utils.py, request_memory), and holds it
    until it is freed. On a 24 GB card with the default 0.85: the generate engine 10.2 GB (5.1 GB
    each beside the judge's), the trainer 13.8 GB."""
    return fraction * LOCAL_VLLM_SHARE / (2 if judging else 1)


def engine_settings(config: RunConfig) -> EngineConfig:
    """The engine settings the generate and judge tasks get: on a cluster each pool has GPUs of its
    own and an engine reserves `vllm_memory_fraction` of one; outside a cluster, `local_vllm_share`
    of it."""
    ctx = flyte.ctx()
    if ctx and ctx.mode != "local":
        return config.engine
    share = local_vllm_share(config.engine.vllm_memory_fraction, config.judging)
    return config.engine.model_copy(update={"vllm_memory_fraction": share})


def generate_parts(config: RunConfig) -> dict[str, Any]:
    """The config parts the generate tasks take."""
    return {
        "model": config.base,
        "engine": engine_settings(config),
        "prompt": config.prompt,
        "sampling": config.sampling,
        "episode": config.episode,
    }


@dataclasses.dataclass(frozen=True)
class ScoringModels:
    """The model folders a run scores with besides its reward functions: the LLM judge's (the
    'judge' reward) and each reward model's, by the model its rewards name (reward_fns.reward_model_ref)."""

    judge: Dir | None = None
    reward_models: Mapping[str, Dir] = dataclasses.field(default_factory=dict)


# The stages of the models that score on pools of their own: their seconds (wall clock while a call was in flight).
MODEL_STAGES = ("judge_s", "reward_model_s")
# The score pool's busy seconds (wall clock while a score_group call was in flight).
SCORE_STAGE = "score_busy_s"


def group_scorer(
    config: RunConfig, models: ScoringModels | None, spans: dict[str, list[tuple[float, float]]]
) -> Callable[[Any], Awaitable[ScoredGroup]]:
    """What scores a generated group: score_group, and beside it, each on its own pool, judge_group
    with the 'judge' reward and reward_model_group for each reward that names a reward model, their
    scores added by weight. Each of their calls' (start, end) is appended to `spans` under its stage
    (SCORE_STAGE, MODEL_STAGES)."""
    models = models or ScoringModels()
    model_rewards = config.scoring.model_rewards

    async def timed(stage: str, call: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        try:
            return await call
        finally:
            spans.setdefault(stage, []).append((started, time.perf_counter()))

    def scored_alone(group: Any) -> Awaitable[Any]:
        return timed(SCORE_STAGE, score_group(config.scoring, config.sampling, group))

    if not config.judging and not model_rewards:
        return scored_alone

    def judged(group: Any) -> Awaitable[Any]:
        return timed("judge_s", judge_group(config.judge, engine_settings(config), config.scoring, models.judge, group))

    def rated(name: str, group: Any) -> Awaitable[Any]:
        folder = models.reward_models[reward_model_ref(name)[0]]
        return timed("reward_model_s", reward_model_group(name, config.prompt, config.scoring, folder, group))

    async def score_all(group: Any) -> ScoredGroup:
        calls = [scored_alone(group), *([judged(group)] if config.judging else [])]
        scored, *results = await asyncio.gather(*calls, *(rated(name, group) for name in model_rewards))
        if config.judging:
            verdict, *results = results
            scored = with_judge(scored, verdict, config.scoring.rewards[JUDGE_REWARD])
        for result in results:
            scored = with_reward_model(scored, result, config.scoring.rewards[result.reward])
        return scored

    return score_all


async def collect_batch(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int, models: ScoringModels | None = None
) -> tuple[list[ScoredGroup], dict[str, float]]:
    """Iteration `iteration`'s scored groups (0-based: the prompts of `iteration`), generated by
    `adapter`, topped up with fresh prompts until enough are informative; and the seconds of
    generation, of the scoring tail, the score pool's busy seconds and the scoring models' stages
    (judge_s with the 'judge' reward, reward_model_s with a reward model)."""
    prompts = sample_prompts(
        dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter, shuffle=config.data.shuffle_dataset
    )
    scored: list[ScoredGroup] = []
    timings = {"generate_s": 0.0, "score_s": 0.0}  # score_s: the scoring tail after generation
    spans: dict[str, list[tuple[float, float]]] = {}
    score = read_back(group_scorer(config, models, spans))
    truncated = config.train.truncated
    for round_ in range(config.max_topup_rounds + 1):
        first = len(scored)
        generating = [
            asyncio.create_task(
                generate(
                    **generate_parts(config),
                    base_model=base_model,
                    adapter=adapter,
                    example=ex,
                    index=first + i,
                    seed=sub_seed(config.seed, iteration, first + i),
                )
            )
            for i, ex in enumerate(prompts)
        ]
        landed, gen_s, tail_s = await generate_and_score(generating, score)
        scored.extend(landed)
        timings["generate_s"] += gen_s
        timings["score_s"] += tail_s
        missing = config.min_informative_groups - sum(informative_group(sg, truncated) for sg in scored)
        if missing <= 0 or round_ == config.max_topup_rounds:
            break
        prompts = topup_prompts(dataset, seed=config.seed, iteration=iteration, round_=round_, num=missing)
    scored.sort(key=lambda sg: sg.group.index)
    timings[SCORE_STAGE] = busy_seconds(spans.get(SCORE_STAGE, []))
    if config.judging:
        timings["judge_s"] = busy_seconds(spans.get("judge_s", []))
    if config.scoring.model_rewards:
        timings["reward_model_s"] = busy_seconds(spans.get("reward_model_s", []))
    return scored, timings


async def train_batch(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, scored: list[ScoredGroup], iteration: int
) -> TrainStepResult:
    """One GRPO step from `adapter` on the scored groups of `iteration` (0-based)."""
    inline, payload = await as_payload(scored, f"scored-{iteration + 1:04d}")
    args = (config.base, config.lora, config.train, config.sampling, base_model, adapter, inline, payload)
    if DISTRIBUTED_STEP is not None and flyte.ctx() and flyte.ctx().mode != "local":
        # several train GPUs configured (the Flyte task environment envs.train_dist_env), on a cluster:
        # the data-parallel step (a sync task)
        return await DISTRIBUTED_STEP.aio(*args, total_iterations=config.iterations, reward_weights=dict(config.scoring.rewards))
    return await train_step(*args, total_iterations=config.iterations, reward_weights=dict(config.scoring.rewards))


async def run_iteration(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, dataset: list[Example], iteration: int, models: ScoringModels | None = None
) -> tuple[list[ScoredGroup], TrainStepResult, dict[str, float]]:
    """The synchronous iteration (max_staleness 0): generate and score with `adapter`, then train."""
    started = time.perf_counter()
    scored, timings = await collect_batch(config, base_model, adapter, dataset, iteration, models)
    scored_at = time.perf_counter()
    result = await train_batch(config, base_model, adapter, scored, iteration)
    finished = time.perf_counter()
    timings["train_s"] = finished - scored_at
    timings["iteration_s"] = finished - started
    timings["batch_wait_s"] = scored_at - started
    return scored, result, timings
