"""This module reads the datasets (the built-in arithmetic task, GSM8K, local .jsonl/.parquet/.csv
files) and samples the prompts.

Prompt sampling depends only on (seed, iteration), so a resumed run, or a retried driver, sees
exactly the prompts the first attempt saw.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from pathlib import Path

from grpo_flyte.config.constants import ARITHMETIC_DATASET, DATASET_FILE_TYPES, GSM8K_DATASET, REWARD_TIMEOUT_S
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import DatasetError, quoted
from grpo_flyte.multiturn import BUILTIN_DATASETS, builtin_split
from grpo_flyte.reward_fns import ANSWER_REWARDS, MARKER
from grpo_flyte.scoring.workers import usable_golds
from grpo_flyte.types import Example, Message

logger = logging.getLogger(__name__)

# Size of the held-out split of the arithmetic task; it never overlaps the train split.
ARITHMETIC_EVAL_SIZE = 500
# The arithmetic problem space is shuffled with a fixed seed so the split is the same in every run.
_ARITHMETIC_SPLIT_SEED = 20_241_122


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


def gold_answer(value: object) -> str:
    """The gold answer in a dataset cell: the text after the last '####' (GSM8K's format), else
    the whole cell, stripped. Numbers are taken as written."""
    text = str(value)
    return (text.rsplit(MARKER, 1)[1] if MARKER in text else text).strip()


# TRL's dataset format: a `prompt` column of text or chat messages; every other column goes to the rewards.
PROMPT_COLUMN = "prompt"


def _shown(value: object) -> str:
    """repr(value) for an error message, cut to 120 characters."""
    return quoted(value, 120)


def _usable_cell(answer: object) -> bool:
    missing = answer is None or isinstance(answer, bool) or (isinstance(answer, float) and not math.isfinite(answer))
    return not missing and isinstance(answer, (str, int, float)) and bool(gold_answer(answer))


def _trl_prompt(value: object, where: str) -> str | list[Message]:
    """A `prompt` cell: non-empty text, or a non-empty list of {'role', 'content'} messages."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value:
        try:
            return [Message.model_validate(m) for m in value]
        except ValueError:
            pass
    raise DatasetError(
        f"{where}: {PROMPT_COLUMN!r} must be non-empty text or a list of chat messages "
        f"({{'role': ..., 'content': ...}}), got {_shown(value)}"
    )


def _example(row: dict, where: str, columns: tuple[str, str], need_answer: bool) -> Example:
    """One validated example from a row; DatasetError naming `where` and the column otherwise.

    A row with a `prompt` column and no question column is in TRL's format. The answer column must
    hold a usable answer when `need_answer` (the `correct` reward is weighted); otherwise an
    unusable or missing one is ''.
    """
    question_column, answer_column = columns
    answer = row.get(answer_column)
    usable = _usable_cell(answer)
    if need_answer and not usable:
        raise _no_usable_answer(where, answer_column, answer)
    gold = gold_answer(answer) if usable else ""
    if PROMPT_COLUMN in row and question_column not in row:
        prompt = _trl_prompt(row[PROMPT_COLUMN], where)
        question = (
            prompt if isinstance(prompt, str) else next((m.content for m in reversed(prompt) if m.role == "user"), prompt[-1].content)
        )
        rest = {k: v for k, v in row.items() if k != PROMPT_COLUMN}
        return Example(question=question, answer=gold, prompt=prompt, columns=rest)
    question = row.get(question_column)
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: {question_column!r} must be a non-empty string, got {question!r}")
    return Example(question=question, answer=gold, columns={k: v for k, v in row.items() if k not in columns})


def _no_usable_answer(where: str, answer_column: str, answer: object) -> DatasetError:
    return DatasetError(
        f"{where}: no usable answer in {answer_column!r} (got {_shown(answer)}); expected a number or math "
        f"expression, or text ending in '{MARKER} <answer>' as in GSM8K, that can be read within reward_timeout_s"
    )


def _check_answers(examples: list[Example], wheres: list[str], raw: list[object], answer_column: str, timeout_s: float) -> None:
    """Every gold answer readable (math-verify, within the reward time limit), or the first that is
    not named with its row."""
    for ok, where, answer in zip(usable_golds([e.answer for e in examples], timeout_s), wheres, raw, strict=True):
        if not ok:
            raise _no_usable_answer(where, answer_column, answer)


def load_jsonl(
    path: str | Path,
    question_column: str = "question",
    answer_column: str = "answer",
    timeout_s: float = REWARD_TIMEOUT_S,
    need_answers: bool = True,
) -> list[Example]:
    """Read a .jsonl file of objects (a question and an answer, or TRL's `prompt`), validating every line.

    Read line by line (not through `datasets`) so that an error names the exact line, and so that
    a column mixing integers and strings is accepted.
    """
    p = _existing(path)
    try:
        lines = p.read_text(encoding="utf-8-sig").splitlines()  # -sig: spreadsheet tools write a byte-order mark
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{str(p)!r}: not UTF-8 text (byte {exc.start})") from None
    rows, wheres = [], []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{str(p)!r} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object with {question_column!r} (or {PROMPT_COLUMN!r}) and {answer_column!r}")
        rows.append(row)
        wheres.append(where)
    if not rows:
        raise DatasetError(f"{str(p)!r}: the file has no examples")
    return _examples(rows, wheres, (question_column, answer_column), timeout_s, need_answers)


def _examples(rows: list[dict], wheres: list[str], columns: tuple[str, str], timeout_s: float, need_answers: bool) -> list[Example]:
    examples = [_example(row, where, columns, need_answers) for row, where in zip(rows, wheres, strict=True)]
    if need_answers:
        _check_answers(examples, wheres, [row.get(columns[1]) for row in rows], columns[1], timeout_s)
    return examples


def _existing(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            f"{str(p)!r}: no such file (expected '{ARITHMETIC_DATASET}', '{GSM8K_DATASET}', a "
            f"{', '.join(DATASET_FILE_TYPES)} file, or a dataset folder or Hub id that datasets.load_dataset reads)"
        )
    return p


def _rows_to_examples(
    rows, source: str, question_column: str, answer_column: str, timeout_s: float = REWARD_TIMEOUT_S, need_answers: bool = True
) -> list[Example]:
    """Examples from a `datasets.Dataset`, checking the columns and every row (numbered from 1)."""
    names = rows.column_names
    trl_format = PROMPT_COLUMN in names and question_column not in names
    needed = ([] if trl_format else [question_column]) + ([answer_column] if need_answers else [])
    missing = [c for c in needed if c not in names]
    if missing:
        raise DatasetError(
            f"{source}: no column {missing[0]!r} (columns: {', '.join(names)}); expected question_column (or TRL's "
            f"{PROMPT_COLUMN!r}) and, for the 'correct' reward, answer_column to name existing columns"
        )
    table = rows.to_list()
    if not table:
        raise DatasetError(f"{source}: no rows")
    wheres = [f"{source} row {i}" for i in range(1, len(table) + 1)]
    return _examples(table, wheres, (question_column, answer_column), timeout_s, need_answers)


def _load_with_datasets(source: str, *args, **kwargs):
    """datasets.load_dataset(*args, **kwargs), with any failure as one DatasetError line."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- parser, network and cache errors alike become one line
        detail = " ".join(str(exc).split())[:300]
        raise DatasetError(f"{source}: could not be read through the datasets library ({type(exc).__name__}: {detail})") from None


# GSM8K on the Hugging Face Hub: "question", and "answer" = worked solution ending in "#### <n>".
GSM8K_HUB = ("openai/gsm8k", "main")


def load_gsm8k(split: str, timeout_s: float = REWARD_TIMEOUT_S) -> list[Example]:
    """GSM8K's 'train' or 'test' split through the datasets library (downloaded once, then cached)."""
    source = f"gsm8k ({GSM8K_HUB[0]}, split {split!r})"
    rows = _load_with_datasets(source, *GSM8K_HUB, split=split)
    return _rows_to_examples(rows, source, "question", "answer", timeout_s)


def is_file_dataset(dataset: str) -> bool:
    """Whether `dataset` names a local file (read here, its rows sent to the driver)."""
    return dataset.lower().endswith(DATASET_FILE_TYPES)


def load_file(
    path: str | Path,
    question_column: str = "question",
    answer_column: str = "answer",
    timeout_s: float = REWARD_TIMEOUT_S,
    need_answers: bool = True,
) -> list[Example]:
    """The examples of a local dataset file, by its suffix (.parquet and .csv through the datasets
    library), every row validated; gold answers read within `timeout_s` each."""
    if str(path).lower().endswith(".jsonl"):
        return load_jsonl(path, question_column, answer_column, timeout_s, need_answers)
    p = _existing(path)
    source = f"{str(p)!r}"
    if p.suffix.lower() == ".parquet":
        rows = _load_with_datasets(source, "parquet", data_files=str(p), split="train")
    else:
        _check_csv_text(p)
        rows = _load_with_datasets(source, "csv", data_files=str(p), split="train", encoding="utf-8-sig")
    return _rows_to_examples(rows, source, question_column, answer_column, timeout_s, need_answers)


def _check_csv_text(p: Path) -> None:
    """A csv file as text: UTF-8 (a byte-order mark allowed) with a header line, else a DatasetError
    in our words rather than the csv parser's."""
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{str(p)!r}: not UTF-8 text (byte {exc.start}); expected a csv file saved as UTF-8") from None
    if not text.strip():
        raise DatasetError(f"{str(p)!r}: the file is empty; expected a header line naming the columns, then one row per example")


def load_dataset_id(
    dataset: str,
    split: str,
    question_column: str = "question",
    answer_column: str = "answer",
    timeout_s: float = REWARD_TIMEOUT_S,
    need_answers: bool = True,
) -> list[Example]:
    """The rows of `datasets.load_dataset(dataset, split=split)`: a Hub id (downloaded once, then
    cached as the datasets library does) or a local dataset folder."""
    source = f"{dataset!r} (split {split!r})"
    rows = _load_with_datasets(source, dataset, split=split)
    return _rows_to_examples(rows, source, question_column, answer_column, timeout_s, need_answers)


def load_rows(config: RunConfig) -> list[Example]:
    """The rows of the config's dataset when it is a file, a folder or a Hub id, each prompt once."""
    data, timeout_s = config.data, config.scoring.reward_timeout_s
    need = any(name in ANSWER_REWARDS for name in config.scoring.rewards)
    if is_file_dataset(data.dataset):
        rows = load_file(data.dataset, data.question_column, data.answer_column, timeout_s, need)
    else:
        rows = load_dataset_id(data.dataset, data.dataset_split, data.question_column, data.answer_column, timeout_s, need)
    return unique_prompts(rows, data.dataset)


# File datasets hold out a seeded sample of their rows for evaluation, the same in every run.
_HOLDOUT_SEED = "grpo_flyte-holdout"


def _first(held_out: list[Example], eval_size: int, name: str) -> list[Example]:
    if eval_size > len(held_out):
        raise DatasetError(
            f"{eval_size}: {name} holds out {len(held_out)} questions; expected at most {len(held_out)}",
            field="eval_size",
        )
    return held_out[:eval_size]


def train_eval_split(config: RunConfig, examples: list[Example] | None = None) -> tuple[list[Example], list[Example]]:
    """The training examples and the first `eval_size` held-out questions of the config's dataset.

    'arithmetic' has its own held-out split and 'gsm8k' its test split. A file dataset (or
    `examples` passed in its place: its rows, read by the CLI) holds out `eval_size` rows chosen
    with a fixed seed; the rest are the training set.
    """
    dataset, eval_size = config.data.dataset, config.evaluation.eval_size
    if examples is None and dataset == ARITHMETIC_DATASET:
        return arithmetic_split("train"), _first(arithmetic_split("eval"), eval_size, "the arithmetic task")
    if examples is None and dataset in BUILTIN_DATASETS:
        return builtin_split(dataset, "train"), _first(builtin_split(dataset, "eval"), eval_size, f"the {dataset} environment's data")
    timeout_s = config.scoring.reward_timeout_s
    if examples is None and dataset == GSM8K_DATASET:
        held_out = _first(load_gsm8k("test", timeout_s), eval_size, "GSM8K's test split") if eval_size else []
        return load_gsm8k("train", timeout_s), held_out
    rows = unique_prompts(examples if examples is not None else load_rows(config), dataset)
    if eval_size == 0:
        return list(rows), []
    if eval_size >= len(rows):
        raise DatasetError(
            f"{eval_size}: the dataset {dataset!r} has {len(rows)} examples, which leaves none "
            f"to train on; expected an eval size below {len(rows)} (or 0 for no evaluation)",
            field="eval_size",
        )
    order = list(range(len(rows)))
    random.Random(_HOLDOUT_SEED).shuffle(order)
    held = set(order[:eval_size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in order[:eval_size]]


def unique_prompts(rows: list[Example], source: str) -> list[Example]:
    """The rows with each prompt once (the first row kept), so that no held-out question is also a
    training row; a warning gives the count dropped."""
    seen: set[str] = set()
    unique = []
    for row in rows:
        key = json.dumps(row.model_dump(mode="json", include={"question", "prompt"}), sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    if len(unique) < len(rows):
        logger.warning(
            "%s: %d duplicate prompts dropped (the first row of each kept), %d rows left", source, len(rows) - len(unique), len(unique)
        )
    return unique


def topup_prompts(examples: list[Example], *, seed: int, iteration: int, round_: int, num: int) -> list[Example]:
    """Fresh prompts to top up one iteration's batch: a function of (seed, iteration, round) only."""
    rng = random.Random(f"{seed}:topup:{iteration}:{round_}")
    return [examples[i] for i in rng.sample(range(len(examples)), min(num, len(examples)))]


def sample_prompts(examples: list[Example], *, seed: int, iteration: int, num: int, shuffle: bool = True) -> list[Example]:
    """The prompts of one iteration: consecutive slices of a seeded permutation, epoch after epoch
    (with `shuffle=False`, of the examples in their order).

    Each example is seen once per epoch, and the result depends only on (seed, iteration, num, shuffle).
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
            if shuffle:
                random.Random(f"{seed}:{epoch}").shuffle(orders[epoch])
        picked.append(examples[orders[epoch][pos]])
    return picked
