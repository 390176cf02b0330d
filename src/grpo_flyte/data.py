"""Datasets: the built-in arithmetic task, .jsonl files, and deterministic prompt sampling.

Prompt sampling depends only on (seed, iteration), so a resumed run, or a retried driver, sees
exactly the prompts the first attempt saw.
"""

from __future__ import annotations

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
PLAIN_TEMPLATE = "Question: {question}\nEnd your reply with '#### <integer>'.\nAnswer:"

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
    problems = []
    for a in range(1, 100):
        for b in range(1, 100):
            problems.append(Example(question=f"What is {a} + {b}?", answer=str(a + b)))
            problems.append(Example(question=f"What is {a} - {b}?", answer=str(a - b)))
    for a in range(2, 21):
        for b in range(2, 21):
            problems.append(Example(question=f"What is {a} * {b}?", answer=str(a * b)))
    random.Random(_ARITHMETIC_SPLIT_SEED).shuffle(problems)
    return problems


def arithmetic_split(split: str) -> list[Example]:
    """The 'train' or 'eval' split of the arithmetic task (disjoint by construction)."""
    problems = arithmetic_problems()
    if split == "eval":
        return problems[:ARITHMETIC_EVAL_SIZE]
    if split == "train":
        return problems[ARITHMETIC_EVAL_SIZE:]
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


def render_prompt(question: str, prompt_format: str, tokenizer) -> str:
    """The prompt text for one question; token ids come from the generator's tokenizer."""
    if prompt_format == "plain":
        return PLAIN_TEMPLATE.format(question=question)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "prompt_format='chat' but the model's tokenizer has no chat template: use --prompt-format plain"
        )
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
