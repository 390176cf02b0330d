"""A custom reward: credit for arithmetic steps that are right.

Name it in the config as `module:function` with a weight, next to the built-in rewards:

    rewards:
      correct: 1.0
      format: 0.2
      examples.custom_reward:shows_work: 0.3

A reward function scores one prompt's group of completions and returns one number per completion.
It gets the gold `answer`, the `question`, each completion's `num_tokens` and `max_new_tokens` as
keyword arguments; `**kwargs` takes the ones it does not use. The module must be importable where
the reward task runs: from the working directory in a local run, from your package or image on a
cluster.
"""

from __future__ import annotations

import re

# "12 + 30 = 42", "7*6=42", "100 - 58 = 42": two numbers, an operator, a result.
_STEP = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x×])\s*(-?\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)")  # noqa: RUF001 -- models write the multiplication sign
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "x": lambda a, b: a * b,
    "×": lambda a, b: a * b,  # noqa: RUF001
    "/": lambda a, b: a / b if b else float("nan"),
}


def shows_work(completions: list[str], **kwargs) -> list[float]:
    """The fraction of 'a op b = c' steps in each completion whose arithmetic is right (0 with none)."""
    scores = []
    for text in completions:
        steps = _STEP.findall(text.replace(",", ""))
        right = sum(abs(_OPS[op](float(a), float(b)) - float(c)) < 1e-9 for a, op, b, c in steps)
        scores.append(right / len(steps) if steps else 0.0)
    return scores
