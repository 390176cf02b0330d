"""This module plays an agent's episodes: `--agent module:function`, your own agent code trained as
it is.

An agent is `async def rollout(client, example) -> float | None`: `client` is an
`openai.AsyncOpenAI` whose `chat.completions.create` calls the run's generate engine answers with
the current adapter (`grpo_flyte.engine.chat_client`), `example` the dataset row. It returns the
episode's reward (the `env` reward), or None to leave scoring to the configured rewards, which read
the final conversation.

Each episode's agent runs in a thread of its own, on an event loop of its own, so an agent that
blocks (a synchronous tool, a `time.sleep`) holds back neither the other episodes nor the engine;
its requests cross to the replica's loop, where every completion goes through the batcher as a
multi-turn environment's turns do. The budgets are the multi-turn ones: `max_turns` requests,
`max_new_tokens` per completion, `max_episode_tokens` in the episode's training sequences, and
`tool_timeout_s` seconds for each stretch the agent runs between its requests (and before the
first, after the last). A request past a token or turn budget is refused (HTTP 400, OpenAI's
`context_length_exceeded`); the episode's end names the budget however the agent goes on.

The episode's training sequences are its calls' ids (`chat_client.chains`): a linear conversation
is one sequence with the agent's messages masked out of the loss, and each call that branches
starts another, trained with the same advantage. An agent that raises or runs past its time ends
its episode as 'agent_error' (what it sampled is kept, scored by the configured rewards), one that
never calls the client as 'no_calls' (no training sequence); each is counted in the `ended/`
metrics and logged once per message, not per episode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import threading
import time
from typing import Any

from grpo_flyte.config.episode import EpisodeConfig
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.chat_client import BadRequest, Call, ChatServer, Limits, chains, openai_client, tool_format_of
from grpo_flyte.engine.episodes import transcript
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.sampling import sub_seed
from grpo_flyte.errors import EnvironmentSpecError, import_user_attribute, is_user_attribute
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.types import Branch, Episode, EpisodeTurn, Example, Rollout

log = logging.getLogger(__name__)
NO_AGENT = "none"


def load_agent(name: str):
    """The function an `agent` name stands for: `module:function`, an async function taking
    (client, example). EnvironmentSpecError (naming the value) for anything else."""

    def error(detail: str) -> EnvironmentSpecError:
        return EnvironmentSpecError(detail, field="agent")

    if not is_user_attribute(name):
        raise error(f"{name!r}: expected 'module:function' naming an async function rollout(client, example)")
    module_name, attr = name.split(":")
    fn = import_user_attribute(name, error)
    if fn is None:
        raise error(f"{name!r}: module {module_name!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise error(f"{name!r}: {attr} is not an async function; expected async def {attr}(client, example) -> float | None")
    try:
        inspect.signature(fn).bind(object(), object())
    except TypeError:
        raise error(f"{name!r}: {attr}{inspect.signature(fn)} cannot be called with (client, example)") from None
    return fn


# --------------------------------------------------------------------------- one episode


_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A failing agent fails alike in every episode: each message is logged once per process."""
    if message not in _logged and len(_logged) < 100:
        _logged.add(message)
        log.warning("%s (logged once; episodes that end this way count in ended/agent_error)", message)


async def run_agent(agent, example: Example, server: ChatServer, timeout_s: float) -> tuple[float | None, str | None]:
    """Runs `agent(client, example)` to its end: (its reward, None) or (None, why it failed).

    The agent runs in a daemon thread with its own event loop; each request is answered on this
    loop by `server`. Each stretch of the agent's own time (from its start to its first request,
    between a reply and its next request, after its last reply) may last `timeout_s`; past it the
    agent is cancelled, or left to its thread when it does not yield.
    """
    main = asyncio.get_running_loop()
    in_flight = 0
    since = time.monotonic()  # when the agent last had the control
    result: concurrent.futures.Future = concurrent.futures.Future()
    holder: dict[str, Any] = {}

    async def complete(body: dict) -> dict:
        nonlocal in_flight, since
        in_flight += 1
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.complete(body), main))
        finally:
            in_flight -= 1
            since = time.monotonic()

    def thread() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        try:
            client = openai_client(complete)
            task = loop.create_task(agent(client, example))
            holder["task"] = task
            result.set_result(loop.run_until_complete(task))
        except BaseException as exc:  # noqa: BLE001 -- whatever the agent raised ends its episode
            if not result.done():
                result.set_exception(exc)
        finally:
            loop.close()

    threading.Thread(target=thread, name="grpo_flyte-agent", daemon=True).start()
    waiting = asyncio.wrap_future(result)
    timed_out = False
    while not waiting.done():
        left = timeout_s - (time.monotonic() - since) if not in_flight else timeout_s
        done, _ = await asyncio.wait({waiting}, timeout=max(left, 0.0) if not in_flight else 0.05)
        if not done and not in_flight and time.monotonic() - since >= timeout_s:
            timed_out = True
            loop, task = holder.get("loop"), holder.get("task")
            if loop is not None and task is not None and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
            done, _ = await asyncio.wait({waiting}, timeout=1.0)  # an agent that does not yield is left behind
            break
    if timed_out:
        return None, f"the agent ran past {timeout_s:g} s (tool_timeout_s) between its requests"
    exc = waiting.exception()
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    if exc is not None:
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"
    reward = waiting.result()
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        return None, f"returned {type(reward).__name__} {str(reward)[:80]!r}; expected a finite number or None"
    return (None if reward is None else float(reward)), None


def agent_rollout(calls: list[Call], reward: float | None, error: str | None, budget_end: str | None) -> Rollout:
    """The episode as a Rollout: the sequence of its last call as the rollout itself (its own
    prompt ids), every other sequence as a branch; turns are the last sequence's messages.

    Its end: the budget a refused request ran out of (`budget_end`; whatever the agent did then),
    else 'agent_error', 'no_calls', the budget that cut the last completion, or 'done'."""
    if budget_end is not None:
        end = budget_end
    elif error is not None:
        end = "agent_error"
    elif not calls:
        end = "no_calls"
    else:
        end = calls[-1].cut or "done"
    if not calls:
        episode = Episode(turns=[], end=end, reward=reward)
        return Rollout(completion_ids=[], sampling_logprobs=[], finish_reason="stop", text="", episode=episode)
    found = chains(calls)
    last = next(chain for chain in found if chain[-1] is calls[-1])
    sequences = {id(chain): _sequence(chain) for chain in found}
    ids, logprobs, mask = sequences[id(last)]
    branches = [Branch(prompt_ids=c[0].prompt_ids, completion_ids=s[0], sampling_logprobs=s[1], model_mask=s[2])
                for c in found if c is not last for s in [sequences[id(c)]]]  # fmt: skip
    turns = _turns(last)
    tool_calls = sum(bool(c.reply.get("tool_calls")) for c in calls)
    episode = Episode(turns=turns, tool_calls=tool_calls, end=end, reward=reward)
    return Rollout(
        completion_ids=ids,
        sampling_logprobs=logprobs,
        finish_reason="length" if end in ("turns", "turn_tokens", "episode_tokens") else "stop",
        text=transcript(turns),
        model_mask=mask,
        episode=episode,
        prompt_ids=last[0].prompt_ids,
        branches=branches,
    )


def _sequence(chain: list[Call]) -> tuple[list[int], list[float], list[bool]]:
    """A sequence's completion ids after its first prompt, their log-probs and the model's mask."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[bool] = []
    start = len(chain[0].prompt_ids)
    for call in chain:
        between = call.prompt_ids[start + len(ids) :]
        ids += between + call.completion.completion_ids
        logprobs += [0.0] * len(between) + call.completion.sampling_logprobs
        mask += [False] * len(between) + [True] * len(call.completion.completion_ids)
    return ids, logprobs, mask


def _turns(chain: list[Call]) -> list[EpisodeTurn]:
    turns: list[EpisodeTurn] = []
    for before, call in zip([None, *chain], chain, strict=False):
        if before is not None:
            k = len(before.messages) + 1
            added = call.messages[k:] if call.messages[: len(before.messages)] == before.messages else call.messages[-1:]
            between = len(call.prompt_ids) - len(before.ids)
            for i, m in enumerate(added):
                turns.append(EpisodeTurn(role=m["role"], text=m["content"], num_tokens=between if i == len(added) - 1 else 0))
        turns.append(EpisodeTurn(role="model", text=call.content, num_tokens=len(call.completion.completion_ids)))
    return turns


# --------------------------------------------------------------------------- a group's episodes


async def play_agent_episodes(
    key: EngineKey,
    adapter_path: str,
    agent_name: str,
    example: Example,
    prompt_ids: list[int],
    request: SamplingRequest,
    episode: EpisodeConfig,
    prompt: PromptConfig,
    context_tokens: int,
) -> list[Rollout]:
    """`request.group_size` episodes of the agent on one dataset row, played concurrently; each
    completion through the replica's batcher, seeded by (group seed, row, request number)."""
    agent = load_agent(agent_name)
    engine = await run_on_torch_thread(cache.get_engine, key)
    limits = Limits(episode.max_turns, request.max_new_tokens, episode.max_episode_tokens, context_tokens)
    tool_format = tool_format_of(engine.tokenizer, dict(prompt.template_kwargs))  # the template's tool-call format

    async def play(row: int) -> Rollout:
        async def sample(context: list[int], max_new_tokens: int, n: int, number: int, stop: tuple[str, ...]) -> list[Rollout]:
            one = request.model_copy(
                update={
                    "prompt_ids": context,
                    "group_size": n,
                    "max_new_tokens": max_new_tokens,
                    "seed": sub_seed(request.seed, row, number),
                    "stop": tuple(dict.fromkeys((*request.stop, *stop))),
                    "continues": True,
                }
            )
            [rollouts] = await batching.generate_groups(key, adapter_path, [one])
            return rollouts

        server = ChatServer(engine.tokenizer, sample, limits, dict(prompt.template_kwargs), tool_format)
        reward, error = await run_agent(agent, example, server, episode.tool_timeout_s)
        if error is not None and server.end is None:  # not an agent stopped by a budget's refusal
            _log_once(f"agent {agent_name!r} failed an episode: {error}")
        return agent_rollout(server.calls, reward, error, server.end)

    return await batching.all_or_none([play(row) for row in range(request.group_size)])


__all__ = ["NO_AGENT", "BadRequest", "agent_rollout", "load_agent", "play_agent_episodes", "run_agent"]
