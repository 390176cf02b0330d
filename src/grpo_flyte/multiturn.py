"""This module defines multi-turn environments: the interface (`MultiTurnEnv`, `Reply`), the two
built-in environments with their datasets, and the registry that turns an `env` name into a class.

(RL environments, not Flyte's: the task environments the tasks run in are `grpo_flyte.envs`.)

An environment is a class with `step(text) -> Reply` (and optionally `reset(example)` and `stop`).
One instance plays one episode, so its attributes are the episode's state: no globals. The episode
loop (`grpo_flyte.engine.episodes`):

    context = prompt ids
    repeat: the model samples a turn (up to max_new_tokens, or until EOS or one of `stop`)
            env.step(turn text) -> Reply: done (with a reward, or None to leave scoring to the
            configured rewards), or a reply that is tokenized once, with the chat template's turn
            markers, and appended to the context
    until done or a budget runs out (turns, tokens per turn, tokens per episode)

The trainer gets exactly these ids: the model's sampled tokens (with their sampling log-probs) and
the environment's tokens, which a mask keeps out of the loss. The text is never re-rendered.

"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import math
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_flyte.errors import EnvironmentSpecError, import_user_attribute, is_user_attribute
from grpo_flyte.types import Example, Message

NO_ENV = "none"


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


@dataclass(frozen=True)
class ToolResult:
    """One tool call's answer: the tool's name and the text of its `tool` message."""

    name: str
    content: str


@dataclass(frozen=True)
class ToolReply(Reply):
    """A turn's tool calls answered, one `tool` message each (`results`, in the calls' order; the
    chat template renders them together, as it renders consecutive tool messages), with the turn's
    counts for the tool_calls, tool_errors and tool_malformed metrics (`tool_call` and `error` are
    not read). Played by `grpo_flyte.engine.tool_episodes` for --tools."""

    results: tuple[ToolResult, ...] = ()
    calls: int = 0
    errors: int = 0
    malformed: int = 0


class MultiTurnEnv:
    """Subclass this (or write any class with the same methods): one instance plays one episode.

    `stop`: strings that end the model's turn besides its end-of-turn token (a tool call's closing
    tag), kept in the turn. `reset` gets the dataset row; `step` gets the text of the model's turn,
    without its special tokens unless `keep_special_tokens` (a tool call's markers may be special
    tokens: Mistral's [TOOL_CALLS], Llama's <|python_tag|>).
    """

    stop: tuple[str, ...] = ()
    keep_special_tokens: bool = False

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


class Calculator(MultiTurnEnv):
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
# One worked exchange before the question: with it the embedded model calls the tool in many more of
# its first turns, which leaves RL room to act (docs/measurements.md#multi-turn-is-the-calculator-learned).
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
            prompt=[
                Message(role="system", content=CALCULATOR_SYSTEM),
                *CALCULATOR_DEMO,
                Message(role="user", content=f"What is {a} * {b}?"),
            ],
        )
        for a, b in pairs
    )
    return _Split(train=rows[CALCULATOR_EVAL_SIZE:], eval=rows[:CALCULATOR_EVAL_SIZE])


# The calculator's questions for --tools (a `calculator(expression)` Python function, as in
# examples/tools_calculator.py): the same products and held-out split, the worked exchange in the
# <tool_call> format (Hermes, and the fallback of a template without tools), each question asked
# in one of four phrasings in turn. Asked only as the worked exchange asks ("What is a * b?"), the
# untrained embedded model calls the tool in nearly every greedy episode, which leaves no room to
# show learning; asked otherwise, in fewer (a greedy probe on held-out questions: 'What is' 22 of
# 24, 'Multiply' 6 of 16, 'times' 6 of 16, 'the product of' 2 of 16).
CALCULATOR_TOOLS_SYSTEM = (
    "You solve arithmetic problems. You have a calculator tool: call it with the expression and its result comes back in "
    "the next message. End your reply with the final answer as '#### <integer>'."
)
CALCULATOR_TOOLS_DEMO = (
    Message(role="user", content="What is 12 * 34?"),
    Message(role="assistant", content='<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'),
    Message(role="tool", content="408"),
    Message(role="assistant", content="#### 408"),
)


CALCULATOR_TOOLS_PHRASINGS = ("What is {a} * {b}?", "Multiply {a} by {b}.", "{a} times {b} = ?", "Compute the product of {a} and {b}.")


def _calculator_tools_split() -> _Split:
    def row(i: int, example: Example) -> Example:
        a, b = _PRODUCT.fullmatch(example.question).groups()
        question = CALCULATOR_TOOLS_PHRASINGS[i % len(CALCULATOR_TOOLS_PHRASINGS)].format(a=a, b=b)
        prompt = [Message(role="system", content=CALCULATOR_TOOLS_SYSTEM), *CALCULATOR_TOOLS_DEMO, Message(role="user", content=question)]
        return example.model_copy(update={"question": question, "prompt": prompt})

    parts = _split_of("calculator")
    return _Split(train=tuple(itertools.starmap(row, enumerate(parts.train))), eval=tuple(itertools.starmap(row, enumerate(parts.eval))))


_PRODUCT = re.compile(r"What is (\d+) \* (\d+)\?")


# --------------------------------------------------------------------------- guess the number

GUESS_LOW, GUESS_HIGH = 1, 20
GUESS_SYSTEM = (
    f"We play a guessing game. I have picked a secret whole number from {GUESS_LOW} to {GUESS_HIGH}. "
    "Each of your replies is one guess: a single number. I answer 'higher' or 'lower' until you find it."
)
_GUESS_SEED = 20_261_124
_INTEGER = re.compile(r"-?\d+")


class GuessNumber(MultiTurnEnv):
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


BUILTIN_ENVIRONMENTS: dict[str, type[MultiTurnEnv]] = {"calculator": Calculator, "guess": GuessNumber}
# Each built-in environment's own dataset (same name), and its rewards when none are given.
_DATASETS: dict[str, Callable[[], _Split]] = {
    "calculator": _calculator_split,
    "guess": _guess_split,
    "calculator_tools": _calculator_tools_split,
}
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
    if name != NO_ENV and name not in BUILTIN_ENVIRONMENTS and not is_user_attribute(name):
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
