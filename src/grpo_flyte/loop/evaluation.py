"""This module runs the held-out evaluation: greedy answers to the held-out questions (or, with
num_generations_eval, that many sampled completions each), in chunks spread over the generate pool,
scored as each chunk lands; its metrics and per-question answers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop import observers
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.batches import generate_and_score, generate_parts
from grpo_flyte.loop.metrics import eval_results
from grpo_flyte.records import EvalMetrics
from grpo_flyte.reward import score_groups
from grpo_flyte.rollout import generate_eval
from grpo_flyte.runtime.storage import discard_stowed, fetch_group
from grpo_flyte.types import AdapterRef, Example, ScoredGroup

# Held-out completions per generate_eval task (greedy: questions; with num_generations_eval N, a
# task takes EVAL_CHUNK // N questions): spread over the warm pool, batched within a replica.
EVAL_CHUNK = 64


async def run_eval(
    config: RunConfig, base_model: Dir, adapter: AdapterRef | None, questions: list[Example], iteration: int
) -> tuple[EvalMetrics, list[EvalAnswer]]:
    """Greedy answers to the held-out questions (or num_generations_eval sampled completions each,
    seeded per question from the run's seed) on the generate pool: metrics and per-question
    answers. Observers hear how many are answered as each chunk is scored (`iteration`: the
    iterations trained before it). `adapter` None: `base_model` answers as it is (an exported
    merged model). Outside a Flyte run the tasks run in this process (the export command's)."""
    started = time.perf_counter()
    answered = 0

    async def score_chunk(groups: list[Any]) -> list[ScoredGroup]:
        nonlocal answered
        chunk, whole = await asyncio.gather(
            score_groups(config.scoring, config.sampling, groups), asyncio.gather(*map(fetch_group, groups))
        )
        for group in groups:  # a group that travelled as a file (runtime.storage.stow_groups) is read back
            discard_stowed(group)
        chunk = [scored.model_copy(update={"group": g}) for scored, g in zip(chunk, whole, strict=True)]
        answered += len(groups)
        observers.evaluating(iteration, answered, len(questions))
        return chunk

    observers.evaluating(iteration, 0, len(questions))
    per_task = max(1, EVAL_CHUNK // (config.evaluation.num_generations_eval or 1))
    generating = [
        asyncio.create_task(
            generate_eval(
                **generate_parts(config),
                base_model=base_model,
                adapter=adapter,
                examples=questions[i : i + per_task],
                first_index=i,
                num_generations=config.evaluation.num_generations_eval,
                seed=config.seed,
            )
        )
        for i in range(0, len(questions), per_task)
    ]
    landed, _, _ = await generate_and_score(generating, score_chunk)
    scored: list[ScoredGroup] = sorted((sg for chunk in landed for sg in chunk), key=lambda sg: sg.group.index)
    return eval_results(config, scored, time.perf_counter() - started)
