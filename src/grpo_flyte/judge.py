"""This module holds the model-based scorers, each on a warm, reusable pool of its own: the LLM judge
(`judge_group`) and the reward models (`reward_model_group`), whose scores the driver adds to the
reward functions' (grpo_flyte.scoring.compose).

In `judge_group` an LLM judge scores one group of completions. One judge prompt per group
(RULER-style, see grpo_flyte.scoring.judging): the question once, every completion numbered, one
score in [0, 1] each, relative to the others. The replica loads the judge model once (its own engine
cache, grpo_flyte.engine.cache) and its batcher puts concurrent judge calls in one engine batch, as
the generate pool does. Both backends hold the reply to the scores' JSON (`scores_regex`: vLLM's
structured outputs; on transformers a logits mask per step, see grpo_flyte.engine.grammar), so it
parses. A reply that still does not (an engine without the constraint, or a reply cut at its token
budget) is sampled once more, and a chunk still unparsable fails the task
(on_reward_error='fail') or scores 0 and is counted ('zero').

In `reward_model_group` a sequence-classification reward model (a `rewards` entry that names a
model) scores every completion of one group in one batched forward, each on its conversation: the
prompt the policy was given, then the completion (an episode: its turns), see
grpo_flyte.models.reward_model. The replica loads each reward model once; a score that is not a
finite number is handled as a reward function's is (on_reward_error).

Usable from your own workflow like the other tasks:

    verdict = await judge_group(config.judge, config.engine, config.scoring, judge_model_dir, rollout_group)
    scores = await reward_model_group(reward, config.prompt, config.scoring, reward_model_dir, rollout_group)
"""

from __future__ import annotations

import time
from pathlib import Path

from flyte.io import Dir

from grpo_flyte.config.constants import MAX_REWARD_MODELS
from grpo_flyte.config.generation import EngineConfig, JudgeConfig, PromptConfig, RewardConfig
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.prompts import prompt_messages
from grpo_flyte.envs import judge_env, reward_model_env
from grpo_flyte.errors import ModelError, RewardError, input_errors_not_retried
from grpo_flyte.models.reward_model import RewardModelKey, get_reward_model, reward_model_problem
from grpo_flyte.reward_fns import reward_model_ref
from grpo_flyte.runtime.device import resolve_dtype
from grpo_flyte.runtime.storage import fetch_group, replica_cache
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.scoring.compose import checked_model_scores
from grpo_flyte.scoring.judging import (
    REPLY_END,
    chunk_indices,
    completion_room,
    fixed_tokens,
    parse_scores,
    render_judge_prompt,
    reply_tokens,
    scores_regex,
    token_count,
)
from grpo_flyte.types import JudgeVerdict, RewardModelScores, RolloutGroup

_judge_dirs = replica_cache("judge-models", capacity=1)
_reward_model_dirs = replica_cache("reward-models", capacity=MAX_REWARD_MODELS)
# The retry of an unparsable reply samples (the first, greedy reply would only repeat itself).
RETRY_TEMPERATURE = 0.7
SHOWN_REPLY_CHARS = 120


class _Chunk:
    """One judge prompt's completions and what came of it."""

    def __init__(self, indices: list[int]):
        self.indices = indices
        self.scores: list[float] | None = None
        self.retried = False
        self.reply = ""


def _cut(tokenizer, text: str, max_tokens: int) -> str:
    """The start of `text` that is at most `max_tokens` tokens (a completion too long for the judge alone)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[: max(1, max_tokens)])


async def _ask(key: EngineKey, tokenizer, judging: JudgeConfig, question: str, texts: list[str], chunk: _Chunk) -> None:
    """One judge prompt for the chunk's completions; once more, sampled, if the reply does not parse."""
    prompt, chat = render_judge_prompt(tokenizer, judging.judge_rubric, question, texts)
    ids = list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])
    request = SamplingRequest(
        prompt_ids=ids,
        group_size=1,
        temperature=RETRY_TEMPERATURE,
        top_p=1.0,
        max_new_tokens=reply_tokens(len(texts)),
        seed=0,
        greedy=True,
        regex=scores_regex(len(texts)),
        stop=(REPLY_END,),  # an unconstrained judge stops at the object's end, not at the token budget
    )
    for _ in range(2):
        [[reply]] = await batching.generate_groups(key, None, [request])
        chunk.reply = reply.text
        chunk.scores = parse_scores(reply.text, len(texts))
        if chunk.scores is not None:
            return
        chunk.retried = True
        request = request.model_copy(update={"greedy": False, "seed": 1})


async def judge(key: EngineKey, judging: JudgeConfig, on_error: str, group: RolloutGroup) -> JudgeVerdict:
    """The judge's verdict on one group with the engine of `key` (the task body, without Flyte)."""
    started = time.perf_counter()
    tokenizer = (await run_on_torch_thread(cache.get_engine, key)).tokenizer
    texts = [r.text for r in group.rollouts]
    question = group.example.question
    fixed = fixed_tokens(tokenizer, judging.judge_rubric, question)
    budget = judging.judge_context_tokens
    chunks = [_Chunk(indices) for indices in chunk_indices(fixed, [token_count(tokenizer, t) for t in texts], budget)]
    room = completion_room(fixed, budget)  # one completion alone gets this much at most
    if room < 1:
        raise RewardError(
            f"the judge's rubric and the question take {fixed} of judge_context_tokens={budget} tokens; expected room for a completion"
        )

    def shown(chunk: _Chunk) -> list[str]:
        return [_cut(tokenizer, texts[i], room) if len(chunk.indices) == 1 else texts[i] for i in chunk.indices]

    await batching.all_or_none([_ask(key, tokenizer, judging, question, shown(c), c) for c in chunks])
    scores, failed = [0.0] * len(texts), [False] * len(texts)
    for chunk in chunks:
        if chunk.scores is None:
            if on_error != "zero":
                raise RewardError(
                    f"reward 'judge': the judge's reply to {len(chunk.indices)} completions is not "
                    f'{{"scores": [...]}} with {len(chunk.indices)} numbers in [0, 1], twice; the second starts '
                    f"{chunk.reply[:SHOWN_REPLY_CHARS]!r} (on_reward_error='zero' scores such groups 0 and counts them instead)"
                )
            for i in chunk.indices:
                failed[i] = True
            continue
        for i, score in zip(chunk.indices, chunk.scores, strict=True):
            scores[i] = score
    return JudgeVerdict(
        scores=scores,
        failed=failed,
        calls=len(chunks),
        retries=sum(c.retried for c in chunks),
        invalid=sum(c.scores is None for c in chunks),
        chunks=len(chunks),
        judge_s=time.perf_counter() - started,
    )


@judge_env.task(retries=2)
async def judge_group(
    judging: JudgeConfig, engine: EngineConfig, scoring: RewardConfig, judge_model: Dir, group: RolloutGroup
) -> JudgeVerdict:
    """Score every completion of one group with the judge model in `judge_model`, relative to the
    others, in one judge call (more when the group does not fit the judge's context). A judge that
    cannot be loaded, or replies unparsably with on_reward_error='fail', fails the same way again:
    not retried."""
    with input_errors_not_retried("judge_group"):
        model_path = await _judge_dirs.get(judge_model)
        key = cache.judge_engine_key(
            model_path, resolve_dtype("auto"), engine.backend, judging.judge_context_tokens, engine.vllm_memory_fraction
        )
        return await judge(key, judging, scoring.on_reward_error, await fetch_group(group))


# --------------------------------------------------------------------------- reward models


def conversations(group: RolloutGroup, prompt: PromptConfig) -> list[list[dict[str, str]]]:
    """Each completion of the group as a reward model reads it: the prompt the policy was given
    (`prompt_messages`), then the completion as the assistant's turn, or an episode's turns."""
    head = prompt_messages(group.example, prompt)
    return [
        [*head, *(r.episode.messages() if r.episode is not None else [{"role": "assistant", "content": r.text}])] for r in group.rollouts
    ]


async def score_with_reward_model(
    key: RewardModelKey, reward: str, prompt: PromptConfig, on_error: str, group: RolloutGroup
) -> RewardModelScores:
    """Reward `reward`'s scores of one group with the model of `key` (the task body, without Flyte)."""
    started = time.perf_counter()
    _, label = reward_model_ref(reward)
    # checked before a run starts; here too for a Hub model, which a cluster's pod fetches itself
    problem = reward_model_problem(Path(key.model_path), label)
    if problem:
        raise ModelError(f"{reward!r}: {problem}", field="rewards")
    try:
        model = await run_on_torch_thread(get_reward_model, key)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a bad folder or config fails the same way each time: one line
        # (a RuntimeError such as CUDA out of memory is the replica's, and Flyte retries it)
        raise ModelError(
            f"{reward!r}: its model cannot be loaded ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})", field="rewards"
        ) from None
    values = await run_on_torch_thread(model.score, conversations(group, prompt), label)
    scores, failed = checked_model_scores(reward, values, [r.answer_text for r in group.rollouts], on_error)
    return RewardModelScores(reward=reward, scores=scores, failed=failed, seconds=time.perf_counter() - started)


@reward_model_env.task(retries=2)
async def reward_model_group(
    reward: str, prompt: PromptConfig, scoring: RewardConfig, reward_model: Dir, group: RolloutGroup
) -> RewardModelScores:
    """Score every completion of one group with reward `reward`, a `rewards` entry naming a reward
    model whose folder is `reward_model`, in one batched forward. A folder that holds no such model
    (or lacks the label the reward names), or a score that is not finite with
    on_reward_error='fail', fails the same way again: not retried."""
    with input_errors_not_retried("reward_model_group"):
        model_path = await _reward_model_dirs.get(reward_model)
        key = RewardModelKey(model_path, resolve_dtype("auto"))
        return await score_with_reward_model(key, reward, prompt, scoring.on_reward_error, await fetch_group(group))
