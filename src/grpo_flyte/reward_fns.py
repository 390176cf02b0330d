"""This module holds the reward functions a run can name, and says what one of your own is given
(pure: no Flyte, no torch).

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
and `env` (the multi-turn environment's reward), `judge` (an LLM judge on its own pool, grpo_flyte.judge:
not called here), `module:function` for your own, or a reward model (a name with a '/': a Hub id
or a model folder, `is_reward_model`; scored on its own pool, grpo_flyte.judge: not called here). The reward of a completion is the weighted sum;
every reward's own score is kept for the metrics.

Rewards see untrusted model output, so each call runs in a worker process within a time limit
(grpo_flyte.scoring.workers), and a failing reward is reported with the reward's name and the start
of the completion that broke it; with `on_reward_error='zero'` it scores 0 and is counted
(grpo_flyte.scoring.compose). A worker imports this module: it stays free of Flyte and the config.
"""

from __future__ import annotations

import functools
import logging
import re
import unicodedata
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from grpo_flyte.errors import RewardSpecError, import_user_attribute, is_user_attribute

MARKER = "####"

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


def is_integer(text: str) -> bool:
    """Whether `text` (spaces around it allowed, digits of any script) is an integer: '27', '-3',
    '1,000', '٢٧'. Such a gold answer is usable without math-verify."""
    return _INTEGER.fullmatch(ascii_digits(text).strip()) is not None


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
    ('13 + 14 =') states no result, and its last number (14) is what it is scored on; one that ends
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


# A reward model's label: '<model>@<label>' picks one output of a classifier of several labels.
LABEL_MARK = "@"


def is_reward_model(name: str) -> bool:
    """Whether a reward name names a reward model: one with a '/' in it, a Hub id ('org/name') or a
    model folder ('./my-rm', '/models/rm', '~/rm'), optionally with '@<label>' after it. A folder in
    the current directory is named with './' (a bare word is a reward function's name)."""
    return "/" in name and name not in REWARD_FUNCTIONS and name != JUDGE_REWARD


def reward_model_ref(name: str) -> tuple[str, str | None]:
    """A reward model's name as (the model: Hub id or folder, the label it picks or None):
    'org/rm@positive' -> ('org/rm', 'positive'); a '@' inside the path is the path's."""
    model, mark, label = name.rpartition(LABEL_MARK)
    if mark and model and label and "/" not in label:
        return model, label
    return name, None


def check_reward_name(name: str) -> None:
    """Raise ValueError unless `name` is a built-in reward, the judge, a reward model or has the
    shape module:function."""
    if name not in REWARD_FUNCTIONS and name != JUDGE_REWARD and not is_reward_model(name) and not is_user_attribute(name):
        raise ValueError(
            f"unknown reward {name!r}; expected one of {', '.join(REWARD_FUNCTIONS)}, {JUDGE_REWARD!r}, 'module:function' "
            "or a reward model (a Hub id 'org/name', or a model folder with a '/': './my-rm')"
        )


@functools.cache
def resolve_reward(name: str) -> RewardFn:
    """The function of a reward name: a built-in, or `module:function` imported from the path."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    try:
        check_reward_name(name)
    except ValueError as exc:
        raise RewardSpecError(str(exc), field="rewards") from None
    if is_reward_model(name) or name == JUDGE_REWARD:
        raise RewardSpecError(f"{name!r} is a model, not a function: it scores on its own pool (grpo_flyte.judge)", field="rewards")
    module_name, attr = name.split(":")
    fn = import_user_attribute(name, lambda message: RewardSpecError(message, field="rewards"))
    if not callable(fn):
        raise RewardSpecError(f"{name!r}: module {module_name!r} has no function {attr!r}", field="rewards")
    return fn


# math-verify warns on every call that its timeout is off; it is off on purpose (see _parse_math).
logging.getLogger("math_verify").setLevel(logging.ERROR)
