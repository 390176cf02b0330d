"""Datasets: the built-in arithmetic task, .jsonl files, and deterministic prompt sampling.

Prompt sampling depends only on (seed, iteration), so a resumed run, or a retried driver, sees
exactly the prompts the first attempt saw.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from grpo_flyte.config import ARITHMETIC_DATASET

SYSTEM_PROMPT = (
    "You are a careful assistant that solves arithmetic problems. Think briefly, then end your "
    "reply with the final answer on its own line as '#### <integer>'."
)
# Appended to the question in the user turn: a small model follows an instruction there more
# often than one in the system prompt (measured in the README's learning section).
ANSWER_INSTRUCTION = "End your reply with '#### <integer>'."
PLAIN_TEMPLATE = "Question: {question}\n" + ANSWER_INSTRUCTION + "\nAnswer:"

# Size of the held-out split of the arithmetic task; it never overlaps the train split.
ARITHMETIC_EVAL_SIZE = 500
# The arithmetic problem space is shuffled with a fixed seed so the split is the same in every run.
_ARITHMETIC_SPLIT_SEED = 20_241_122


_INTEGER = re.compile(r"-?\d+")


class Example(BaseModel):
    """One prompt and its ground-truth answer."""

    model_config = ConfigDict(frozen=True)

    question: str
    answer: str


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""


def arithmetic_problems() -> list[Example]:
    """Every problem of the built-in task: a+b and a-b for 1 <= a, b <= 99, a*b for 2 <= a, b <= 20."""
    return list(_arithmetic_problems())


@functools.cache
def _arithmetic_problems() -> tuple[Example, ...]:
    # Built once per process (the CLI checks the split, then the driver uses it); Example is frozen.
    problems = []
    for a in range(1, 100):
        for b in range(1, 100):
            problems.append(Example(question=f"What is {a} + {b}?", answer=str(a + b)))
            problems.append(Example(question=f"What is {a} - {b}?", answer=str(a - b)))
    for a in range(2, 21):
        for b in range(2, 21):
            problems.append(Example(question=f"What is {a} * {b}?", answer=str(a * b)))
    random.Random(_ARITHMETIC_SPLIT_SEED).shuffle(problems)
    return tuple(problems)


def arithmetic_split(split: str) -> list[Example]:
    """The 'train' or 'eval' split of the arithmetic task (disjoint by construction)."""
    problems = _arithmetic_problems()
    if split == "eval":
        return list(problems[:ARITHMETIC_EVAL_SIZE])
    if split == "train":
        return list(problems[ARITHMETIC_EVAL_SIZE:])
    raise ValueError(f"split={split!r}: expected 'train' or 'eval'")


def load_jsonl(path: str | Path) -> list[Example]:
    """Read a .jsonl file of {"question": str, "answer": str|int} objects, validating every line."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"--dataset {str(p)!r}: no such file (expected 'arithmetic' or a .jsonl file)")
    examples = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DatasetError(f"--dataset {str(p)!r}: not UTF-8 text (byte {exc.start})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--dataset {str(p)!r} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object with 'question' and 'answer'")
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{where}: 'question' must be a non-empty string, got {question!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int)) or not _INTEGER.fullmatch(str(answer).strip()):
            raise DatasetError(f"{where}: 'answer' must be an integer (the reward compares integers), got {answer!r}")
        examples.append(Example(question=question, answer=str(answer).strip()))
    if not examples:
        raise DatasetError(f"--dataset {str(p)!r}: the file has no examples")
    return examples


def load_train_examples(dataset: str) -> list[Example]:
    if dataset == ARITHMETIC_DATASET:
        return arithmetic_split("train")
    return load_jsonl(dataset)


# File datasets hold out a seeded sample of their rows for evaluation, the same in every run.
_HOLDOUT_SEED = "grpo_flyte-holdout"


def train_eval_split(dataset: str, examples: list[Example] | None, eval_size: int) -> tuple[list[Example], list[Example]]:
    """The training examples and the first `eval_size` held-out questions of a dataset.

    'arithmetic' has its own held-out split. A file dataset (or `examples` passed in its place)
    holds out `eval_size` rows chosen with a fixed seed; the rest are the training set.
    """
    if examples is None and dataset == ARITHMETIC_DATASET:
        held_out = arithmetic_split("eval")
        if eval_size > len(held_out):
            raise DatasetError(
                f"--eval-size={eval_size}: the arithmetic task holds out {len(held_out)} questions; "
                f"expected at most {len(held_out)}"
            )
        return arithmetic_split("train"), held_out[:eval_size]
    rows = examples if examples is not None else load_jsonl(dataset)
    if eval_size == 0:
        return list(rows), []
    if eval_size >= len(rows):
        raise DatasetError(
            f"--eval-size={eval_size}: the dataset {dataset!r} has {len(rows)} examples, which leaves none "
            f"to train on; expected an eval size below {len(rows)} (or 0 for no evaluation)"
        )
    order = list(range(len(rows)))
    random.Random(_HOLDOUT_SEED).shuffle(order)
    held = set(order[:eval_size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in order[:eval_size]]


def topup_prompts(examples: list[Example], *, seed: int, iteration: int, round_: int, num: int) -> list[Example]:
    """Fresh prompts to top up one iteration's batch: a function of (seed, iteration, round) only."""
    rng = random.Random(f"{seed}:topup:{iteration}:{round_}")
    return [examples[i] for i in rng.sample(range(len(examples)), min(num, len(examples)))]


def sample_prompts(examples: list[Example], *, seed: int, iteration: int, num: int) -> list[Example]:
    """The prompts of one iteration: consecutive slices of a seeded permutation, epoch after epoch.

    Each example is seen once per epoch, and the result depends only on (seed, iteration, num).
    """
    if not examples:
        raise ValueError("cannot sample prompts from an empty dataset")
    n = len(examples)
    orders: dict[int, list[int]] = {}
    picked = []
    for k in range(iteration * num, (iteration + 1) * num):
        epoch, pos = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = list(range(n))
            random.Random(f"{seed}:{epoch}").shuffle(orders[epoch])
        picked.append(examples[orders[epoch][pos]])
    return picked


def render_prompt(question: str, prompt_format: str, tokenizer, enable_thinking: str = "auto") -> str:
    """The prompt text for one question; token ids come from the generator's tokenizer.

    enable_thinking 'on'/'off' is passed to the chat template (Qwen3's switch); 'auto' passes nothing.
    """
    if prompt_format == "plain":
        return PLAIN_TEMPLATE.format(question=question)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "prompt_format='chat' but the model's tokenizer has no chat template: use --prompt-format plain"
        )
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{question} {ANSWER_INSTRUCTION}"},
    ]
    extra = {} if enable_thinking == "auto" else {"enable_thinking": enable_thinking == "on"}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
