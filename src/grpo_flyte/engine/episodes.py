"""This module plays multi-turn episodes: the loop that splices the RL environment's replies into the
model's token sequence, its budgets, and a group's episodes played at once.

The trainer gets exactly the ids built here: the model's sampled tokens (with their sampling
log-probs) and the environment's tokens, which a mask keeps out of the loss. The text is never
re-rendered. The loop is pure Python (the tokenizer is passed in, the model is behind
`sample_turn`) and runs the environment's steps off the event loop; `play_episodes` runs a group's
episodes next to the replica's engine, every model turn through the replica's batcher
(`grpo_flyte.engine.batching`), so the turns of concurrent episodes decode together.
What an environment is, and the built-in ones: `grpo_flyte.multiturn`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from grpo_flyte import multiturn
from grpo_flyte.config.episode import EpisodeConfig
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.prompts import is_chat
from grpo_flyte.engine.sampling import sub_seed
from grpo_flyte.errors import EpisodeError, quoted
from grpo_flyte.multiturn import Reply, ToolReply
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.types import Episode, EpisodeTurn, Example, Rollout

# --------------------------------------------------------------------------- splicing replies


class Splicer:
    """Tokenizes an environment reply once, inside the chat template's turn markers.

    With a chat template, the text between the end of an assistant message and the next assistant
    turn's start is read off the template itself (rendered around two placeholder strings), so the
    reply's tokens are what the template would have produced; the model's own end-of-turn token,
    when it wrote one, is not repeated. Without a chat template (plain prompts) a reply is its text
    on a line of its own.
    """

    _MODEL, _REPLY = "\x00model-turn\x00", "\x00env-reply\x00"

    def __init__(self, tokenizer, chat: bool, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.extra = dict(template_kwargs or {})  # PromptConfig.template_kwargs, as the prompt's
        self._frames: dict[str, tuple[str, str]] = {}
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def frame(self, role: str) -> tuple[str, str]:
        """(text before the reply, text after it) for a reply of `role` following an assistant turn."""
        if role not in self._frames:
            messages = [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": self._MODEL},
                {"role": role, "content": self._REPLY},
            ]
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.extra)
            except Exception as exc:  # noqa: BLE001 -- templates reject roles in their own ways
                raise EpisodeError(f"the model's chat template cannot render a {role!r} message ({type(exc).__name__}: {exc})") from None
            if self._MODEL not in text or self._REPLY not in text:
                raise EpisodeError(f"the model's chat template drops the content of a {role!r} message")
            after_model = text[text.index(self._MODEL) + len(self._MODEL) :]
            before, after = after_model.split(self._REPLY, 1)
            self._frames[role] = (before, after)
        return self._frames[role]

    def reply_ids(self, reply: Reply, turn_ids: list[int]) -> list[int]:
        if not self.chat:
            text = f"\n{reply.content}\n"
        else:
            before, after = self.frame(reply.role)
            if turn_ids and turn_ids[-1] in self.special:
                closing = self.tokenizer.decode(turn_ids[-1:])
                if before.startswith(closing):
                    before = before[len(closing) :]
            return self._ids(before) + self._ids(reply.content, literal=True) + self._ids(after)
        return self._ids(text, literal=True)

    def _ids(self, text: str, literal: bool = False) -> list[int]:
        """`text`'s ids. `literal`: text from the environment (which may echo the model), where a
        special token's spelling is text, never the token: only the template's markers are markers."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=literal)["input_ids"])


# --------------------------------------------------------------------------- the episode loop


@dataclass(frozen=True)
class Budgets:
    max_turns: int  # model turns
    max_turn_tokens: int  # new tokens per model turn
    max_episode_tokens: int  # model and environment tokens after the prompt
    tool_timeout_s: float


# sample_turn(context ids, max new tokens, turn number) -> the model's turn as a one-row Rollout
SampleTurn = Callable[[list[int], int, int], Awaitable[Rollout]]


def _shown_episode(turns: list[EpisodeTurn]) -> str:
    text = " | ".join(f"{t.role}: {t.text}" for t in turns)
    return repr(text if len(text) <= 300 else text[:300] + "...")


class _Stepper:
    """Runs one episode's environment steps, each in a daemon thread of its own, within a time limit.

    A step past its limit cannot be stopped (Python cannot kill a thread), so it is left to finish
    in the background: as a daemon thread it never keeps the process from exiting, it holds no
    shared executor's worker (the loop's default executor serves file transfers too), and until it
    returns the environment is not called again (its state is the stuck call's): the model is told
    the tool is busy instead.
    """

    def __init__(self, env, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self.stuck: concurrent.futures.Future | None = None

    async def step(self, text: str) -> Reply | BaseException:
        """The step's Reply, or what it raised; a TimeoutError of our own when it ran out of time."""
        if self.stuck is not None and not self.stuck.done():
            return TimeoutError(f"the tool is still busy with an earlier call (over {self.timeout_s:g} s)")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.env.step(text))
            except BaseException as exc:  # noqa: BLE001 -- SystemExit from a tool is the tool's error too
                future.set_exception(exc)

        threading.Thread(target=run, name="grpo_flyte-env-step", daemon=True).start()
        waiting = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waiting}, timeout=self.timeout_s)
        if not done:
            self.stuck = future
            return TimeoutError(f"the tool took longer than {self.timeout_s:g} s")
        return waiting.exception() or waiting.result()


_REPLY_TYPES = {"content": str, "role": str, "done": bool, "tool_call": bool, "error": bool}


def _checked_reply(env, reply: object, turns: list[EpisodeTurn]) -> Reply:
    """The step's Reply, or EpisodeError (a bug in the environment: the task fails, the episode shown)."""
    problem = None
    if not isinstance(reply, Reply):
        problem = f"returned {type(reply).__name__} {quoted(reply, 80)}; expected a grpo_flyte.Reply"
    elif bad := [f"{name}={getattr(reply, name)!r}" for name, kind in _REPLY_TYPES.items() if not isinstance(getattr(reply, name), kind)]:
        problem = f"returned a Reply with {', '.join(bad)}; expected text content and role, and true/false flags"
    elif reply.reward is not None and not (
        isinstance(reply.reward, (int, float)) and not isinstance(reply.reward, bool) and math.isfinite(reply.reward)
    ):
        problem = f"returned reward {reply.reward!r}; expected a finite number or None"
    if problem:
        raise EpisodeError(f"{type(env).__name__}.step {problem} (episode so far: {_shown_episode(turns)})")
    return reply


async def _env_step(stepper: _Stepper, text: str, turns: list[EpisodeTurn]) -> tuple[Reply, bool]:
    """The environment's reply and whether it failed: a step that raises or runs past the time
    limit becomes an error message to the model, counted in tool_errors."""
    outcome = await stepper.step(text)
    if isinstance(outcome, asyncio.CancelledError):
        raise outcome
    if isinstance(outcome, BaseException):
        detail = str(outcome) if isinstance(outcome, TimeoutError) and not outcome.__traceback__ else f"{type(outcome).__name__}: {outcome}"
        return Reply(f"error: {detail}", role="tool", error=True), True
    reply = _checked_reply(stepper.env, outcome, turns)
    return reply, reply.error


async def run_episode(env, prompt_ids: list[int], sample_turn: SampleTurn, splicer: Splicer, budgets: Budgets) -> Rollout:
    """One episode from the prompt: the model's turns and the environment's replies, as one Rollout
    whose `model_mask` marks the model's tokens."""
    tokenizer = splicer.tokenizer
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[bool] = []
    turns: list[EpisodeTurn] = []
    tool_calls = tool_errors = tool_malformed = 0
    reward: float | None = None
    end = "done"
    stepper = _Stepper(env, budgets.tool_timeout_s)
    model_turns = 0
    while True:
        if model_turns >= budgets.max_turns:
            end = "turns"
            break
        room = budgets.max_episode_tokens - len(ids)
        want = min(budgets.max_turn_tokens, room)
        turn = await sample_turn(prompt_ids + ids, want, len(turns))
        ids += turn.completion_ids
        logprobs += turn.sampling_logprobs
        mask += [True] * len(turn.completion_ids)
        text = tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
        turns.append(EpisodeTurn(role="model", text=text, num_tokens=len(turn.completion_ids)))
        model_turns += 1
        if turn.finish_reason == "length":
            end = "turn_tokens" if want == budgets.max_turn_tokens else "episode_tokens"
            break
        raw = tokenizer.decode(turn.completion_ids, skip_special_tokens=False) if getattr(env, "keep_special_tokens", False) else text
        reply, failed = await _env_step(stepper, raw, turns)
        if isinstance(reply, ToolReply):  # several calls in one turn, counted one by one
            tool_calls, tool_errors, tool_malformed = tool_calls + reply.calls, tool_errors + reply.errors, tool_malformed + reply.malformed
        else:
            tool_calls += reply.tool_call
            tool_errors += failed
        if reply.done:
            reward = float(reply.reward) if reply.reward is not None else None
            break
        if model_turns >= budgets.max_turns:
            end = "turns"  # no model turn would read the reply
            break
        reply_ids = splicer.reply_ids(reply, turn.completion_ids)
        if len(ids) + len(reply_ids) >= budgets.max_episode_tokens:
            end = "episode_tokens"  # no room for the reply and a model token after it
            break
        ids += reply_ids
        logprobs += [0.0] * len(reply_ids)
        mask += [False] * len(reply_ids)
        shown = "\n".join(r.content for r in reply.results) if isinstance(reply, ToolReply) and reply.results else reply.content
        turns.append(EpisodeTurn(role=reply.role, text=shown, num_tokens=len(reply_ids)))
    episode = Episode(turns=turns, tool_calls=tool_calls, tool_errors=tool_errors, tool_malformed=tool_malformed, end=end, reward=reward)
    return Rollout(
        completion_ids=ids,
        sampling_logprobs=logprobs,
        finish_reason="stop" if end == "done" else "length",
        text=transcript(turns),
        model_mask=mask,
        episode=episode,
    )


def transcript(turns: list[EpisodeTurn]) -> str:
    """An episode as text to read (reports, held-out answers): the model's turns as written, each
    environment turn on its own line after its role."""
    return "\n".join(t.text if t.role == "model" else f"[{t.role}] {t.text}" for t in turns)


def new_environment(cls: type, example: Example):
    """A fresh environment for one episode, reset for its dataset row; EpisodeError (naming the
    class and the row) when either fails: a bug in the environment or a row it cannot play."""
    try:
        env = cls()
        reset = getattr(env, "reset", None)
        if callable(reset):
            reset(example)
    except Exception as exc:  # noqa: BLE001 -- user code fails in its own ways; each is reported alike
        raise EpisodeError(
            f"{cls.__name__} cannot start an episode for the row {example.question[:80]!r} (answer {example.answer[:40]!r}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return env


# --------------------------------------------------------------------------- a group's episodes


async def play_episodes(
    key: EngineKey,
    adapter_path: str,
    env: str,
    example: Example,
    prompt_ids: list[int],
    request: SamplingRequest,
    episode: EpisodeConfig,
    prompt: PromptConfig,
) -> list[Rollout]:
    """`request.group_size` episodes of environment `env` from one prompt, played concurrently.

    Every model turn of every episode goes through the replica's batcher on its own, so the turns
    of episodes that are not waiting on their environment decode together, with other groups'.
    Each turn is sampled with its own seed (`sampling.sub_seed`): an episode does not depend on
    which others it was batched with. A turn continues its episode's context: the transformers
    engine keeps the turn's cache, so the next turn computes only the environment's reply.
    """
    cls = multiturn.load_environment(env)
    engine = await run_on_torch_thread(cache.get_engine, key)
    splicer = Splicer(engine.tokenizer, is_chat(example, prompt), prompt.template_kwargs)
    budgets = Budgets(episode.max_turns, request.max_new_tokens, episode.max_episode_tokens, episode.tool_timeout_s)
    return await play_group(
        key, adapter_path, lambda: new_environment(cls, example), prompt_ids, request, splicer, budgets, multiturn.stop_strings(cls)
    )


async def play_group(
    key: EngineKey,
    adapter_path: str,
    new_env: Callable[[], object],
    prompt_ids: list[int],
    request: SamplingRequest,
    splicer: Splicer,
    budgets: Budgets,
    stop: tuple[str, ...],
) -> list[Rollout]:
    """`request.group_size` episodes from one prompt, each with an environment from `new_env`,
    played concurrently (`play_episodes`)."""

    async def play(row: int) -> Rollout:
        async def sample_turn(context: list[int], max_new_tokens: int, turn: int) -> Rollout:
            one = request.model_copy(
                update={
                    "prompt_ids": context,
                    "group_size": 1,
                    "max_new_tokens": max_new_tokens,
                    "seed": sub_seed(request.seed, row, turn),
                    "stop": tuple(dict.fromkeys((*request.stop, *stop))),  # the environment's and generation_kwargs' own
                    "continues": True,
                }
            )
            [[rollout]] = await batching.generate_groups(key, adapter_path, [one])
            return rollout

        return await run_episode(new_env(), prompt_ids, sample_turn, splicer, budgets)

    return await batching.all_or_none([play(row) for row in range(request.group_size)])
