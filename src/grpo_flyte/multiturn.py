"""Multi-turn episodes: the environment interface, the two built-in environments, and the episode
loop that splices the environment's replies into the model's token sequence.

An environment is a class with `step(text) -> Reply` (and optionally `reset(example)` and `stop`).
One instance plays one episode, so its attributes are the episode's state: no globals. The loop:

    context = prompt ids
    repeat: the model samples a turn (up to max_new_tokens, or until EOS or one of `stop`)
            env.step(turn text) -> Reply: done (with a reward, or None to leave scoring to the
            configured rewards), or a reply that is tokenized once, with the chat template's turn
            markers, and appended to the context
    until done or a budget runs out (turns, tokens per turn, tokens per episode)

The trainer gets exactly these ids: the model's sampled tokens (with their sampling log-probs) and
the environment's tokens, which a mask keeps out of the loss. The text is never re-rendered.

Pure Python (the tokenizer is passed in, the model is behind `sample_turn`); the rollout task runs
the loop next to its engine, `grpo_flyte.engines` batches the turns of concurrent episodes.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import functools
import hashlib
import inspect
import math
import operator
import random
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from grpo_flyte.errors import EnvironmentSpecError, EpisodeError, import_user_attribute
from grpo_flyte.types import Episode, EpisodeTurn, Example, Message, Rollout

NO_ENV = "none"
_CUSTOM = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class Reply:
    """What the environment answers to one model turn.

    `content` is appended to the conversation as a `role` message ('user', or 'tool' for a tool's
    output) unless `done`. At the end (`done=True`), `reward` is the episode's reward (the `env`
    reward), or None to leave scoring to the configured rewards. `tool_call` and `error` count the
    turn in the tool_calls and tool_errors metrics.
    """

    content: str = ""
    done: bool = False
    reward: float | None = None
    role: str = "user"
    tool_call: bool = False
    error: bool = False


class Environment:
    """Subclass this (or write any class with the same methods): one instance plays one episode.

    `stop`: strings that end the model's turn besides its end-of-turn token (a tool call's closing
    tag), kept in the turn. `reset` gets the dataset row; `step` gets the text of the model's turn.
    """

    stop: tuple[str, ...] = ()

    def reset(self, example: Example) -> None:
        """Start an episode for this dataset row (the model's prompt is the row's prompt)."""

    def step(self, text: str) -> Reply:
        raise NotImplementedError


# --------------------------------------------------------------------------- the calculator

_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 64
_MAX_DIGITS = 60


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError
    for anything else. Python's own evaluation of the parsed tree, never `eval` of model text."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            result = _OPS[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            result = _OPS[type(node.op)](value(node.operand))
        else:
            raise ValueError(f"unsupported: {ast.unparse(node)[:40]!r}")
        if isinstance(result, complex) or (isinstance(result, int) and len(str(abs(result))) > _MAX_DIGITS):
            raise ValueError("result out of range")
        return result

    text = expression.strip().replace("\u00d7", "*").replace("^", "**").replace(",", "")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression.strip()[:40]!r}") from None
    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result out of range") from None
    if isinstance(result, float) and not math.isfinite(result):
        raise ValueError("result out of range")
    return result


def shown_number(number: int | float) -> str:
    if isinstance(number, float) and number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return str(number) if isinstance(number, int) else f"{number:.10g}"


class Calculator(Environment):
    """Arithmetic with a calculator tool: `<calc>374*829</calc>` ends the model's turn and the
    environment answers with the value (a 'tool' message); a turn without a tool call ends the
    episode, scored by the configured rewards (`correct`: the '#### <integer>' answer)."""

    stop = ("</calc>",)

    def step(self, text: str) -> Reply:
        calls = _CALC.findall(text)
        if not calls:
            return Reply(done=True)
        try:
            return Reply(shown_number(evaluate(calls[-1])), role="tool", tool_call=True)
        except ValueError as exc:
            return Reply(f"error: {exc}", role="tool", tool_call=True, error=True)


CALCULATOR_SYSTEM = (
    "You solve arithmetic problems. You have a calculator: write <calc>EXPRESSION</calc> and its result comes "
    "back in the next message. End your reply with the final answer as '#### <integer>'."
)
# One worked exchange before the question: without it the embedded model calls the tool in ~5% of
# its first turns, with it in ~50% (48 samples each, measured 2026-11-23), which leaves RL room to act.
CALCULATOR_DEMO = (
    Message(role="user", content="What is 12 * 34?"),
    Message(role="assistant", content="<calc>12*34</calc>"),
    Message(role="tool", content="408"),
    Message(role="assistant", content="#### 408"),
)
CALCULATOR_EVAL_SIZE = 500
_CALC_SEED = 20_261_123


@dataclass(frozen=True)
class _Split:
    train: tuple[Example, ...]
    eval: tuple[Example, ...]


def _calculator_split() -> _Split:
    """3-digit by 3-digit products: a small model gets almost none right without the tool."""
    rng = random.Random(_CALC_SEED)
    pairs = sorted({(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(8000)})
    rng.shuffle(pairs)
    rows = tuple(
        Example(
            question=f"What is {a} * {b}?",
            answer=str(a * b),
            prompt=[Message(role="system", content=CALCULATOR_SYSTEM), *CALCULATOR_DEMO, Message(role="user", content=f"What is {a} * {b}?")],
        )
        for a, b in pairs
    )
    return _Split(train=rows[CALCULATOR_EVAL_SIZE:], eval=rows[:CALCULATOR_EVAL_SIZE])


# --------------------------------------------------------------------------- guess the number

GUESS_LOW, GUESS_HIGH = 1, 20
GUESS_SYSTEM = (
    f"We play a guessing game. I have picked a secret whole number from {GUESS_LOW} to {GUESS_HIGH}. "
    "Each of your replies is one guess: a single number. I answer 'higher' or 'lower' until you find it."
)
_GUESS_SEED = 20_261_124
_INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """A dialogue: the model guesses, the environment says 'higher' or 'lower'. The reward is 1 for
    finding the number, less 0.1 for each extra guess (at least 0.5); 0 if the turns run out."""

    def reset(self, example: Example) -> None:
        self.secret = int(example.answer)
        self.guesses = 0

    def step(self, text: str) -> Reply:
        numbers = _INTEGER.findall(text)
        if not numbers:
            return Reply(f"Please reply with one number from {GUESS_LOW} to {GUESS_HIGH}.")
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            return Reply(done=True, reward=max(0.5, 1.0 - 0.1 * (self.guesses - 1)))
        return Reply("Higher." if guess < self.secret else "Lower.")


def _guess_split() -> _Split:
    rng = random.Random(_GUESS_SEED)
    prompt = [Message(role="system", content=GUESS_SYSTEM), Message(role="user", content="Your first guess?")]

    def row(secret: int) -> Example:
        return Example(question=f"Guess the secret number ({secret})", answer=str(secret), prompt=prompt)

    held_out = [row(s) for s in range(GUESS_LOW, GUESS_HIGH + 1) for _ in range(5)]
    rng.shuffle(held_out)
    return _Split(train=tuple(row(rng.randint(GUESS_LOW, GUESS_HIGH)) for _ in range(2000)), eval=tuple(held_out))


BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": Calculator, "guess": GuessNumber}
# Each built-in environment's own dataset (same name), and its rewards when none are given.
_DATASETS: dict[str, Callable[[], _Split]] = {"calculator": _calculator_split, "guess": _guess_split}
ENV_DEFAULT_REWARDS: dict[str, dict[str, float]] = {"calculator": {"correct": 1.0, "format": 0.2}, "guess": {"env": 1.0}}
BUILTIN_DATASETS = tuple(_DATASETS)


def builtin_split(dataset: str, split: str) -> list[Example]:
    """The 'train' or 'eval' rows of a built-in environment's dataset (disjoint, the same every run)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    parts = _split_of(dataset)
    return list(parts.train if split == "train" else parts.eval)


@functools.cache
def _split_of(dataset: str) -> _Split:
    # built once per process (the CLI checks the split, then the driver uses it); Example is frozen
    return _DATASETS[dataset]()


# --------------------------------------------------------------------------- loading an environment


def check_env_name(name: str) -> None:
    """ValueError unless `name` is 'none', a built-in environment or has the shape module:Class."""
    if name != NO_ENV and name not in BUILTIN_ENVIRONMENTS and not _CUSTOM.fullmatch(name):
        raise ValueError(f"unknown environment {name!r}; expected {NO_ENV!r}, {', '.join(BUILTIN_ENVIRONMENTS)} or 'module:Class'")


def load_environment(name: str) -> type:
    """The class an `env` name stands for, checked to have a callable `step` (and, if present, a
    callable `reset` and a tuple or list of strings as `stop`)."""
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    try:
        check_env_name(name)
    except ValueError as exc:
        raise EnvironmentSpecError(str(exc)) from None
    if name == NO_ENV:
        raise EnvironmentSpecError(f"{name!r} is single-turn generation, not an environment class")
    module_name, attr = name.split(":")
    cls = import_user_attribute(name, EnvironmentSpecError)
    if not inspect.isclass(cls):
        raise EnvironmentSpecError(f"{name!r}: module {module_name!r} has no class {attr!r}")
    if not callable(getattr(cls, "step", None)):
        raise EnvironmentSpecError(f"{name!r}: class {attr} has no step(self, text) method; expected one returning a Reply")
    if hasattr(cls, "reset") and not callable(cls.reset):
        raise EnvironmentSpecError(f"{name!r}: {attr}.reset is not a method; expected reset(self, example)")
    stop = getattr(cls, "stop", ())
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise EnvironmentSpecError(f"{name!r}: {attr}.stop is {stop!r}; expected a tuple of non-empty strings")
    return cls


def stop_strings(cls: type) -> tuple[str, ...]:
    return tuple(getattr(cls, "stop", ()))


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

    def __init__(self, tokenizer, chat: bool, enable_thinking: str = "auto"):
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.extra = {} if enable_thinking == "auto" else {"enable_thinking": enable_thinking == "on"}
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


def turn_seed(seed: int, row: int, turn: int) -> int:
    """The sampling seed of one turn of one episode: a function of (group seed, row, turn) only."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


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
        problem = f"returned {type(reply).__name__} {str(reply)[:80]!r}; expected a grpo_flyte.Reply"
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
    tool_calls = tool_errors = 0
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
        reply, failed = await _env_step(stepper, text, turns)
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
        turns.append(EpisodeTurn(role=reply.role, text=reply.content, num_tokens=len(reply_ids)))
    episode = Episode(turns=turns, tool_calls=tool_calls, tool_errors=tool_errors, end=end, reward=reward)
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
