"""Reward functions and their weighted composition (pure: no Flyte, no torch).

A reward function scores a batch of completions of one prompt and returns one number per
completion (or None: "does not apply", left out of the sum and of that reward's mean). Two
signatures are accepted:

- TRL's, unchanged: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`,
  every argument a list with one entry per completion. `columns` are the dataset row's other
  columns (and `answer`, the gold answer, when the row has none of that name). For chat-message
  prompts, prompts and completions are message lists, as TRL passes them. It is used when the
  dataset is in TRL's format (a `prompt` column) or the function has a parameter named `prompts`.
- The original one: `f(completions, *, answer, **kwargs) -> list[float]`, with keyword arguments
  `answer` (the gold answer), `question`, `num_tokens` (each completion's length in tokens) and
  `max_new_tokens`, one value per group; accept `**kwargs` for the ones you do not use.

Multi-turn episodes: the completion is the model's last turn; TRL-style functions with chat data
get the whole episode as messages; every function also gets `episodes` (each episode's messages)
and `env_rewards` (the environment's own reward of each, or None).

The config's `rewards` maps names to weights: the built-in `correct`, `format`, `tags`, `length`
and `env` (the environment's reward), `judge` (an LLM judge on its own pool, grpo_flyte.judge:
not called here), or `module:function` for your own. The reward of a completion is the weighted sum;
every reward's own score is kept for the metrics.

Rewards see untrusted model output, so a failing reward is reported with the reward's name and the
start of the completion that broke it; with `on_reward_error='zero'` it scores 0 and is counted.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from grpo_flyte.errors import RewardError, RewardSpecError, RewardTimeout, import_user_attribute, is_user_attribute, quoted
from grpo_flyte.runtime.sandbox import WorkerPool, WorkerRaised

if TYPE_CHECKING:
    from grpo_flyte.types import RewardParts

MARKER = "####"
# Model output is shown in error messages up to this many characters.
SHOWN_CHARS = 120

_INTEGER = re.compile(r"-?\d[\d,]*")
# A number as a model states one: 27, -3, 1,000, 2.5, 1e3 (the last number of a completion that
# marks no answer is its answer).
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SCIENTIFIC = re.compile(r"[-+]?\d+(?:\.\d+)?[eE][-+]?\d+")
_ANY_DIGIT = re.compile(r"\d")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGGED = re.compile(r"\s*<reasoning>.+?</reasoning>\s*<answer>.+?</answer>\s*", re.DOTALL)
_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
# The final line of a completion that marks its answer well: '#### 27', '#### -3.5.', '#### \\frac{3}{4}'.
_WELL_FORMED = re.compile(r"####[ \t]*[^\s=]+?\.?")

RewardFn = Callable[..., Sequence[float]]


# --------------------------------------------------------------------------- answers


def extract_answer(text: str) -> str | None:
    """The integer after the last '####', else the last integer in the text; None if there is none.

    The integer fallback of `is_correct`, applied to the answer a completion states (`final_answer`)."""
    if MARKER in text:
        match = _INTEGER.search(text.rsplit(MARKER, 1)[1])
        if match:
            return normalize_integer(match.group(0))
    numbers = _INTEGER.findall(text)
    return normalize_integer(numbers[-1]) if numbers else None


def normalize_integer(number: str) -> str:
    number = number.replace(",", "")
    sign = "-" if number.startswith("-") else ""
    digits = number.lstrip("-").lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def ascii_digits(text: str) -> str:
    """Decimal digits of every script as ASCII: '٢٧' (Arabic-Indic) -> '27', so they compare as numbers."""
    return _ANY_DIGIT.sub(lambda m: str(unicodedata.decimal(m.group(0))), text) if not text.isascii() else text


def plain_number(text: str) -> str:
    """Scientific notation written out ('1e3' -> '1000', '2.5e-1' -> '0.25'); anything else as is.

    math-verify reads '1e3' as 1 (and '$1e3$' as 1*e*3), so such a gold answer or stated answer
    is turned into a plain decimal first."""
    text = text.strip()
    if _SCIENTIFIC.fullmatch(text):
        value = Decimal(text)
        return format(value.to_integral_value() if value == value.to_integral_value() else value.normalize(), "f")
    return text


def final_line(completion: str) -> str:
    """The completion's last line that is not blank, stripped ('' for a blank completion)."""
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def answer_span(completion: str) -> str | None:
    """Where a completion marks its answer: the last <answer>...</answer>; else the final line's
    '####' answer (see `final_answer`); None when it marks none.

    Only the final line counts: '#### 5' followed by more text is not the answer the completion
    ends on, and a marker earlier in the text is working, not the answer."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged and tagged[-1].strip():
        return tagged[-1].strip()
    line = final_line(completion)
    if MARKER not in line:
        return None
    # '#### 13 + 14 = 27' states 27: the result of what follows the marker, not its first number
    tail = line.rsplit(MARKER, 1)[1].rsplit("=", 1)[-1].split()
    if tail and tail[0].rstrip(".,;:!"):
        return tail[0].rstrip(".,;:!")
    return None


def final_answer(completion: str) -> str | None:
    """The answer a completion states, by one rule: its `answer_span` (the <answer> tag, or the
    final line's '####' answer), else the last number of its final line; None if neither.

    The final line, never the whole text: a completion that ends on a restated question
    ('13 + 14 =') states no result, and its last number (14) is what it is judged on; one that ends
    on other words ('Hope this helps!') states none."""
    span = answer_span(completion)
    if span is not None:
        return span
    numbers = _NUMBER.findall(final_line(completion))
    return numbers[-1].rstrip(",") if numbers else None


def well_formed(completion: str) -> bool:
    """Whether the completion ends on a well-formed answer line: '#### <answer>' and nothing else
    on its final line (a trailing period allowed), the line `final_answer` reads."""
    return _WELL_FORMED.fullmatch(final_line(completion)) is not None


def _parse_math(text: str) -> list:
    from math_verify import parse

    # parsing_timeout=None: math-verify's timeout uses signal.alarm, which only works in the main
    # thread, and Flyte runs tasks off it. Inputs are short: a gold answer or one completion.
    return parse(text, parsing_timeout=None)


def gold_is_usable(answer: str) -> bool:
    """Whether a gold answer can be compared: math-verify parses it, or it is an integer."""
    answer = plain_number(ascii_digits(answer))
    if not answer:
        return False
    if _INTEGER.fullmatch(answer):
        return True
    return bool(_parse_math(answer))


@functools.lru_cache(maxsize=16_384)
def is_correct(completion: str, answer: str) -> bool:
    """Whether the answer the completion states equals the gold answer.

    The stated answer is `final_answer`'s: the <answer> tag, else the final line's '####' answer,
    else the final line's last number; a completion that states none is wrong. math-verify compares it
    numerically and symbolically: 72 = 72.0, 0.5 = 1/2 = \\frac{1}{2}, 1,000 = 1000, 1e3 = 1000;
    digits of other scripts count as digits. When math-verify finds no expression on either side,
    the plain integer match decides.
    """
    from math_verify import verify

    span = final_answer(ascii_digits(completion))
    if span is None:
        return False
    span, gold_text = plain_number(span), plain_number(ascii_digits(answer))
    gold, predicted = _parse_math(gold_text), _parse_math(span)
    if gold and predicted:
        return bool(verify(gold, predicted, timeout_seconds=None))
    found = extract_answer(span)
    return found is not None and _INTEGER.fullmatch(gold_text) is not None and found == normalize_integer(gold_text)


# --------------------------------------------------------------------------- built-in rewards


def correct_reward(completions: list[str], *, answer: str, **_: Any) -> list[float]:
    """1 when the answer is right (math-verify, integer fallback), else 0."""
    return [float(is_correct(c, answer)) for c in completions]


def format_reward(completions: list[str], **_: Any) -> list[float]:
    """1 when the completion ends on a well-formed '#### <answer>' line (`well_formed`), else 0.

    Form alone, right or wrong: weighted beside 'correct' it pays a wrong but well-formed answer
    (docs/rewards-and-environments.md says why the default leaves it out)."""
    return [float(well_formed(c)) for c in completions]


def correct_format_reward(completions: list[str], *, answer: str, **_: Any) -> list[float]:
    """1 when the answer is right and stated on a well-formed '#### <answer>' final line, else 0:
    a format term that only a right answer earns, so form alone never pays."""
    return [float(well_formed(c) and is_correct(c, answer)) for c in completions]


def tags_reward(completions: list[str], **_: Any) -> list[float]:
    """1 for exactly '<reasoning>...</reasoning><answer>...</answer>'; otherwise 0.25 for each of
    the four tags that appears exactly once (partial credit that the model can climb)."""
    return [1.0 if _TAGGED.fullmatch(c) else 0.25 * sum(c.count(tag) == 1 for tag in _TAGS) for c in completions]


def length_reward(completions: list[str], *, num_tokens: Sequence[int], max_new_tokens: int, **_: Any) -> list[float]:
    """A soft penalty near the token limit: 0 up to 3/4 of max_new_tokens, then falling linearly to
    -1 at the limit (DAPO's overlong shaping)."""
    window = max(1, max_new_tokens // 4)
    start = max_new_tokens - window
    return [-min(1.0, max(0, n - start) / window) for n in num_tokens]


def env_reward(completions: list[str], *, env_rewards: Sequence[float | None] = (), **_: Any) -> list[float]:
    """Multi-turn: the reward the environment gave at the end of each episode (0 when an episode
    ended without one, e.g. its turns ran out)."""
    given = list(env_rewards) or [None] * len(completions)
    return [0.0 if r is None else float(r) for r in given]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "correct": correct_reward,
    "format": format_reward,
    "correct_format": correct_format_reward,
    "tags": tags_reward,
    "length": length_reward,
    "env": env_reward,
}
BUILTIN_REWARDS = tuple(REWARD_FUNCTIONS)
# The built-in rewards that compare with the gold answer: every row needs a usable one.
ANSWER_REWARDS = ("correct", "correct_format")
# The LLM judge's reward: not a function of this module but a model on a pool of its own
# (grpo_flyte.judge); the driver adds its scores to the other rewards'.
JUDGE_REWARD = "judge"
# The rewards a run scores with unless its config names others.
DEFAULT_REWARDS = {"correct": 1.0}


def check_reward_name(name: str) -> None:
    """Raise ValueError unless `name` is a built-in reward, the judge, or has the shape module:function."""
    if name not in REWARD_FUNCTIONS and name != JUDGE_REWARD and not is_user_attribute(name):
        raise ValueError(f"unknown reward {name!r}; expected one of {', '.join(REWARD_FUNCTIONS)}, {JUDGE_REWARD!r} or 'module:function'")


@functools.cache
def resolve_reward(name: str) -> RewardFn:
    """The function of a reward name: a built-in, or `module:function` imported from the path."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    try:
        check_reward_name(name)
    except ValueError as exc:
        raise RewardSpecError(str(exc), field="rewards") from None
    module_name, attr = name.split(":")
    fn = import_user_attribute(name, lambda message: RewardSpecError(message, field="rewards"))
    if not callable(fn):
        raise RewardSpecError(f"{name!r}: module {module_name!r} has no function {attr!r}", field="rewards")
    return fn


# --------------------------------------------------------------------------- calls in the sandbox

# Groups one process scores at once, each in a worker of its own (grpo_flyte.runtime.sandbox); workers
# start as needed, and math-verify loads before a worker's first timed call.
MAX_WORKERS = 8
_workers = WorkerPool(MAX_WORKERS, preload=("math_verify", __name__))


def start_workers(count: int) -> int:
    """Start `count` workers (the pool holds at most MAX_WORKERS) side by side ahead of the groups
    that will need them, so that no group waits for a worker to import math-verify; how many started now."""
    return _workers.start(count)


def limited(fn: str, args: tuple, timeout_s: float, what: str) -> Any:
    """`fn(*args)` (a function of this module, by name) in the sandbox, within `timeout_s` seconds."""
    return _workers.call(f"{__name__}:{fn}", args, timeout_s, what)


def trl_style(fn: RewardFn, trl_data: bool) -> bool:
    """Whether `fn` is called TRL's way: the data are in TRL's format, or it takes `prompts`."""
    return trl_data or _takes_prompts(fn)


@functools.cache
def _takes_prompts(fn: RewardFn) -> bool:
    # once per function and worker process: the worker calls it for every group
    try:
        return "prompts" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def trl_arguments(
    completions: list[str], completion_ids: list[list[int]], context: Mapping[str, Any], row: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments TRL passes a reward function, for one group: lists, one entry per completion."""
    n = len(completions)
    prompt = row.get("prompt")
    chat = isinstance(prompt, list)
    columns = {"answer": context["answer"], **row.get("columns", {})}
    if chat:  # a multi-turn episode is its messages, as TRL passes a conversation
        episodes = context.get("episodes") or [[{"role": "assistant", "content": c}] for c in completions]
    return {
        "prompts": [prompt if prompt is not None else context["question"]] * n,
        "completions": episodes if chat else list(completions),
        "completion_ids": [list(ids) for ids in completion_ids],
        **{name: [value] * n for name, value in columns.items()},
        **{name: list(context[name]) for name in ("episodes", "env_rewards") if name in context},
    }


def _call_reward(
    name: str, completions: list[str], num_tokens: list[int], completion_ids: list[list[int]], context: dict[str, Any], row: dict[str, Any]
) -> Any:
    fn = resolve_reward(name)
    if name not in REWARD_FUNCTIONS and trl_style(fn, row.get("prompt") is not None):
        values = fn(**trl_arguments(completions, completion_ids, context, row))
    else:
        values = fn(completions, num_tokens=num_tokens, **context)
    return _plain_scores(values)


def _plain_scores(values: Any) -> Any:
    """A reward's return value as the parent can check it without numpy or torch: a list or a
    1-D array or tensor (TRL takes those) becomes a list of Python numbers, 0-d items their number;
    an array of another shape its `ArrayShape`."""
    if hasattr(values, "tolist") and hasattr(values, "ndim"):
        if values.ndim != 1:
            return ArrayShape(type(values).__name__, tuple(values.shape))
        return values.tolist()
    if isinstance(values, (list, tuple)):
        return [v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v for v in values]
    return values


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """What the parent hears of a returned array that is not one-dimensional."""

    kind: str
    shape: tuple[int, ...]


def _correct_flags(completions: list[str], answer: str) -> list[bool]:
    return [is_correct(c, answer) for c in completions]


def _flags_within(fn: str, items: list, rest: tuple, timeout_s: float, what: str) -> list[bool]:
    """`fn(items, *rest)` (a list of flags) in the worker within the time limit; if the batch runs
    out of time, each item alone, an item that still does counting False."""
    try:
        return limited(fn, (items, *rest), timeout_s, what)
    except RewardTimeout:
        flags = []
        for item in items:
            try:
                flags.append(limited(fn, ([item], *rest), timeout_s, what)[0])
            except RewardTimeout:
                flags.append(False)
        return flags


def correct_flags(completions: list[str], answer: str, timeout_s: float) -> list[bool]:
    """Which completions state the gold answer (the accuracy metric), each within the time limit;
    a completion whose check runs out of time is not counted correct."""
    return _flags_within("_correct_flags", completions, (answer,), timeout_s, "the accuracy check")


def _usable_many(answers: list[str]) -> list[bool]:
    # Comparing a completion with the gold answer must finish too: math-verify reads `10**10**10`
    # at once but never finishes comparing anything with it. The probe's outcome does not matter.
    return [gold_is_usable(a) and (is_correct(f"{MARKER} 1", a) or True) for a in answers]


def usable_golds(answers: list[str], timeout_s: float, chunk: int = 256) -> list[bool]:
    """`gold_is_usable` for many gold answers, each read within the reward time limit: an answer
    math-verify cannot read in time (`10**10**10`) is not usable. Integers need no worker."""
    flags = [bool(_INTEGER.fullmatch(ascii_digits(a).strip())) for a in answers]
    todo = [i for i, ok in enumerate(flags) if not ok]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        found = _flags_within("_usable_many", [answers[i] for i in part], (), timeout_s, "reading gold answers")
        for i, ok in zip(part, found, strict=True):
            flags[i] = ok
    return flags


# --------------------------------------------------------------------------- composition


def _show(text: str) -> str:
    return repr(text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else ""))


def _checked(name: str, values: Any, count: int) -> list[float | None]:
    """The scores as floats (None: does not apply), or RewardError unless they are `count` finite
    numbers or None."""
    if isinstance(values, ArrayShape):
        raise RewardError(
            f"reward {name!r} returned a {values.kind} of shape {values.shape}; expected a list or 1-D array of {count} numbers"
        )
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardError(f"reward {name!r} returned {type(values).__name__}; expected a list of {count} numbers")
    if len(values) != count:
        raise RewardError(f"reward {name!r} returned {len(values)} scores for {count} completions")
    scores = []
    for value in values:
        if value is None:
            scores.append(None)
            continue
        try:
            score = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
            raise RewardError(
                f"reward {name!r} returned {quoted(value, SHOWN_CHARS)}; expected a number that fits a float, or None"
            ) from None
        if not math.isfinite(score):
            raise RewardError(f"reward {name!r} returned {score}; expected a finite number")
        scores.append(score)
    return scores


@dataclasses.dataclass(frozen=True)
class Group:
    """What the rewards see of one prompt group besides the completions' text."""

    question: str
    answer: str
    max_new_tokens: int
    num_tokens: Sequence[int]
    completion_ids: Sequence[Sequence[int]] = ()
    prompt: str | list[dict[str, str]] | None = None  # TRL's format (see the module docstring)
    columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Multi-turn: each episode's reward from the environment, and its turns as chat messages.
    env_rewards: Sequence[float | None] = ()
    episodes: Sequence[Sequence[Mapping[str, str]]] = ()

    def only(self, i: int) -> Group:
        """The same group reduced to completion `i`."""

        def one(values: Sequence) -> list:
            return [values[i]] if values else []

        return dataclasses.replace(
            self,
            num_tokens=[self.num_tokens[i]],
            completion_ids=one(self.completion_ids),
            env_rewards=one(self.env_rewards),
            episodes=one(self.episodes),
        )


def _call(name: str, completions: list[str], group: Group, timeout_s: float) -> list[float | None]:
    """One reward call in the worker, within the time limit; its scores checked."""
    context = {"question": group.question, "answer": group.answer, "max_new_tokens": group.max_new_tokens}
    if group.episodes:
        context["env_rewards"] = list(group.env_rewards)
        context["episodes"] = [[dict(m) for m in e] for e in group.episodes]
    row = {"prompt": group.prompt, "columns": dict(group.columns)}
    ids = [list(x) for x in group.completion_ids] or [[] for _ in completions]
    args = (name, list(completions), list(group.num_tokens), ids, context, row)
    try:
        values = limited("_call_reward", args, timeout_s, f"reward {name!r}")
    except WorkerRaised as exc:
        detail = str(exc) if len(str(exc)) <= SHOWN_CHARS else str(exc)[:SHOWN_CHARS] + "..."
        raise RewardError(f"reward {name!r} raised {exc.kind}: {detail}") from None
    return _checked(name, values, len(completions))


def run_reward(
    name: str, completions: list[str], group: Group, on_error: str, timeout_s: float = 10.0
) -> tuple[list[float | None], list[bool]]:
    """One reward's scores for a group, and which completions it failed on.

    The group is scored in one call. If that fails, each completion is scored alone to find the
    ones that break it: with on_error='fail' the first is reported (the reward's name, the problem
    and the start of the completion); with 'zero' they score 0 and are flagged.
    """
    resolve_reward(name)  # a name that does not resolve is a spec error here, not a reward error
    try:
        return _call(name, completions, group, timeout_s), [False] * len(completions)
    except RewardError as batch_error:
        scores: list[float | None] = []
        failed = []
        for i, completion in enumerate(completions):
            try:
                scores.append(_call(name, [completion], group.only(i), timeout_s)[0])
                failed.append(False)
            except RewardError as exc:
                if on_error != "zero":
                    raise RewardError(
                        f"{exc} on completion {i + 1} of {len(completions)}, which starts {_show(completion)} "
                        "(on_reward_error='zero' scores such completions 0 and counts them instead)"
                    ) from exc.__cause__
                scores.append(0.0)
                failed.append(True)
        if not any(failed) and on_error != "zero":
            # Each completion scores alone but the batch call did not: a batch-size bug.
            raise RewardError(f"{batch_error} (first completion starts {_show(completions[0])})") from batch_error.__cause__
        return scores, failed


def score_completions(
    completions: list[str], group: Group, weights: Mapping[str, float], on_error: str = "fail", timeout_s: float = 10.0
) -> list[RewardParts]:
    """Every completion's weighted reward, its per-reward scores, and its correct/format flags;
    each reward call and the accuracy check within `timeout_s` seconds. A score of None (the
    reward does not apply) adds nothing and is left out of that reward's scores."""
    # Imported here: every reward worker imports this module, and grpo_flyte.types brings in Flyte
    # (half of a worker's start-up).
    from grpo_flyte.types import RewardParts

    scores: dict[str, list[float | None]] = {}
    failures: dict[str, list[bool]] = {}
    for name in weights:
        scores[name], failures[name] = run_reward(name, completions, group, on_error, timeout_s)
    # without a gold answer (data for custom rewards only) nothing is counted correct
    correct = correct_flags(list(completions), group.answer, timeout_s) if group.answer else [False] * len(completions)
    parts = []
    for i, c in enumerate(completions):
        applied = {name: scores[name][i] for name in weights if scores[name][i] is not None}
        parts.append(
            RewardParts(
                reward=sum(weights[name] * score for name, score in applied.items()),
                correct=correct[i],
                format=well_formed(c),
                scores=applied,
                errors=[name for name in weights if failures[name][i]],
            )
        )
    return parts


# math-verify warns on every call that its timeout is off; it is off on purpose (see _parse_math).
logging.getLogger("math_verify").setLevel(logging.ERROR)
