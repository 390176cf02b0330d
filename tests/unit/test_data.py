"""Unit tests for grpo_flyte.data: the arithmetic task, GSM8K and file loading, sampling, prompt rendering."""

from __future__ import annotations

import json
import operator
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from grpo_flyte.config.constants import ANSWER_INSTRUCTION, SYSTEM_PROMPT
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import (
    ARITHMETIC_EVAL_SIZE,
    DatasetError,
    Example,
    _arithmetic_problems,
    arithmetic_split,
    gold_answer,
    load_file,
    load_gsm8k,
    load_jsonl,
    load_rows,
    sample_prompts,
    topup_prompts,
    train_eval_split,
)
from grpo_flyte.engine.prompts import PLAIN_TEMPLATE, render_prompt

_QUESTION = re.compile(r"What is (\d+) ([+\-*]) (\d+)\?")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.fixture(scope="module")
def splits():
    return arithmetic_split("train"), arithmetic_split("eval")


# --------------------------------------------------------------------------- arithmetic task


def test_arithmetic_split_sizes_and_disjoint(splits):
    train, evals = splits
    assert ARITHMETIC_EVAL_SIZE == 500
    assert len(evals) == 500
    # a+b and a-b for 1 <= a, b <= 99: 2 * 99 * 99 = 19602; a*b for 2 <= a, b <= 20: 19 * 19 = 361
    assert len(train) + len(evals) == 19602 + 361
    train_q = {e.question for e in train}
    eval_q = {e.question for e in evals}
    assert len(train_q) == len(train)
    assert len(eval_q) == len(evals)
    assert train_q.isdisjoint(eval_q)


def test_arithmetic_answers_are_correct(splits):
    seen_ops = Counter()
    for ex in [*splits[0], *splits[1]]:
        m = _QUESTION.fullmatch(ex.question)
        assert m, ex.question
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        seen_ops[op] += 1
        assert ex.answer == str(_OPS[op](a, b)), ex
        if op == "*":
            assert 2 <= a <= 20 and 2 <= b <= 20
        else:
            assert 1 <= a <= 99 and 1 <= b <= 99
    assert seen_ops == {"+": 99 * 99, "-": 99 * 99, "*": 19 * 19}


def test_arithmetic_split_is_deterministic_and_shuffled(splits):
    assert arithmetic_split("eval") == splits[1]
    assert arithmetic_split("train") == splits[0]
    assert arithmetic_split("train") == splits[0]
    # shuffled: the eval split is not just the first 500 generated problems (all "1 + b"/"1 - b")
    assert {_QUESTION.fullmatch(e.question).group(2) for e in splits[1]} == {"+", "-", "*"}
    assert list(_arithmetic_problems())[:500] == splits[1]


def test_arithmetic_split_is_the_same_in_another_process(splits):
    # Resumed and remote runs rebuild the split in a new interpreter, with another hash seed.
    code = (
        "from grpo_flyte.data import arithmetic_split, sample_prompts\n"
        "ev = arithmetic_split('eval')\n"
        "print(ev[0].question); print(ev[-1].question)\n"
        "print(sample_prompts(ev, seed=3, iteration=7, num=1)[0].question)\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    here = sample_prompts(splits[1], seed=3, iteration=7, num=1)[0].question
    assert out.stdout.splitlines() == [splits[1][0].question, splits[1][-1].question, here]


def test_arithmetic_split_unknown():
    with pytest.raises(ValueError, match="test"):
        arithmetic_split("test")


# --------------------------------------------------------------------------- sample_prompts


def _examples(n: int) -> list[Example]:
    return [Example(question=f"q{i}", answer=str(i)) for i in range(n)]


def test_sample_prompts_deterministic_in_seed_and_iteration():
    ex = _examples(50)
    a = sample_prompts(ex, seed=1, iteration=3, num=8)
    b = sample_prompts(list(ex), seed=1, iteration=3, num=8)
    assert a == b
    assert len(a) == 8
    assert sample_prompts(ex, seed=2, iteration=3, num=8) != a
    assert sample_prompts(ex, seed=1, iteration=4, num=8) != a


def test_sample_prompts_is_a_slice_of_one_permutation():
    # iteration i, num k takes positions [i*k, (i+1)*k) of the epoch's order, so two iterations of
    # 4 prompts equal one "iteration" of 8.
    ex = _examples(20)
    first = sample_prompts(ex, seed=5, iteration=0, num=4) + sample_prompts(ex, seed=5, iteration=1, num=4)
    assert first == sample_prompts(ex, seed=5, iteration=0, num=8)


def test_sample_prompts_each_example_once_per_epoch():
    ex = _examples(5)
    # num=2 over 5 examples: iterations 0..4 draw positions 0..9 = exactly two epochs; iteration 2
    # straddles the boundary (positions 4 and 5).
    picks = [e for it in range(5) for e in sample_prompts(ex, seed=9, iteration=it, num=2)]
    assert len(picks) == 10
    assert sorted(e.question for e in picks[:5]) == [f"q{i}" for i in range(5)]
    assert sorted(e.question for e in picks[5:]) == [f"q{i}" for i in range(5)]
    # a larger num than the dataset still covers each example once per epoch
    big = sample_prompts(ex, seed=9, iteration=0, num=10)
    assert Counter(e.question for e in big) == {f"q{i}": 2 for i in range(5)}


def test_sample_prompts_epochs_are_reshuffled():
    ex = _examples(30)
    epoch0 = sample_prompts(ex, seed=0, iteration=0, num=30)
    epoch1 = sample_prompts(ex, seed=0, iteration=1, num=30)
    assert sorted(e.question for e in epoch0) == sorted(e.question for e in epoch1)
    assert epoch0 != epoch1


def test_sample_prompts_empty_dataset():
    with pytest.raises(ValueError):
        sample_prompts([], seed=0, iteration=0, num=1)


# --------------------------------------------------------------------------- load_jsonl


def _write(tmp_path, name: str, lines: list[str]):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p


def test_load_jsonl_ok_with_blank_lines_and_integer_answers(tmp_path):
    p = _write(
        tmp_path,
        "ok.jsonl",
        [
            json.dumps({"question": "What is 2 + 2?", "answer": "4"}),
            "",
            "   ",
            json.dumps({"question": "What is 3 - 5?", "answer": -2}),
            json.dumps({"question": "Big?", "answer": " 1000 ", "extra": "ignored"}),
        ],
    )
    examples = load_jsonl(p)
    assert examples == [
        Example(question="What is 2 + 2?", answer="4"),
        Example(question="What is 3 - 5?", answer="-2"),
        Example(question="Big?", answer="1000", columns={"extra": "ignored"}),  # other columns go to the rewards
    ]
    assert load_file(str(p)) == examples


def test_load_jsonl_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError) as exc:
        load_jsonl(missing)
    assert str(missing) in str(exc.value)
    assert "no such file" in str(exc.value)


def test_load_jsonl_bad_json_names_file_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "1"})
    p = _write(tmp_path, "bad.jsonl", [good, good, '{"question": "q", "answer": '])
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    msg = str(exc.value)
    assert str(p) in msg
    assert "line 3" in msg
    assert "\n" not in msg


def test_load_jsonl_line_numbers_count_blank_lines(tmp_path):
    good = json.dumps({"question": "q", "answer": "1"})
    p = _write(tmp_path, "blank.jsonl", [good, "", "not json"])
    with pytest.raises(DatasetError, match="line 3"):
        load_jsonl(p)


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"question": "q"}, "answer"),
        ({"question": "q", "answer": "four"}, "answer"),
        ({"question": "q", "answer": "Work shown, no marked result ####"}, "answer"),
        ({"question": "q", "answer": ""}, "answer"),
        ({"question": "q", "answer": True}, "answer"),
        ({"question": "q", "answer": None}, "answer"),
        ({"question": "", "answer": "1"}, "question"),
        ({"answer": "1"}, "question"),
        (["q", "1"], "JSON object"),
    ],
)
def test_load_jsonl_bad_rows(tmp_path, row, what):
    p = _write(tmp_path, "rows.jsonl", [json.dumps({"question": "fine", "answer": "2"}), json.dumps(row)])
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    msg = str(exc.value)
    assert str(p) in msg and "line 2" in msg and what in msg


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_load_jsonl_empty_file(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    assert str(p) in str(exc.value)
    assert "no examples" in str(exc.value)


# --------------------------------------------------------------------------- render_prompt


class FakeChatTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
        self.calls.append((messages, tokenize, add_generation_prompt))
        self.kwargs = kwargs
        return "<chat>" + "|".join(f"{m['role']}:{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize(("setting", "kwargs"), [("auto", {}), ("on", {"enable_thinking": True}), ("off", {"enable_thinking": False})])
def test_render_prompt_passes_enable_thinking_only_when_set(setting, kwargs):
    tok = FakeChatTokenizer()
    render_prompt("What is 2 + 3?", "chat", tok, PromptConfig(enable_thinking=setting).template_kwargs)
    assert tok.kwargs == kwargs


def test_chat_template_kwargs_reach_the_template_with_the_thinking_switch():
    tok = FakeChatTokenizer()
    prompt = PromptConfig(enable_thinking="off", chat_template_kwargs={"reasoning_effort": "low", "enable_thinking": False})
    render_prompt("What is 2 + 3?", "chat", tok, prompt.template_kwargs)
    assert tok.kwargs == {"reasoning_effort": "low", "enable_thinking": False}
    # the template's own switch given as a kwarg, with --enable-thinking left at 'auto'
    render_prompt("Q?", "chat", tok, PromptConfig(chat_template_kwargs={"enable_thinking": True}).template_kwargs)
    assert tok.kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"enable_thinking": "on", "chat_template_kwargs": {"enable_thinking": False}}, "contradicts enable_thinking='on'"),
        ({"chat_template_kwargs": {"tokenize": True}}, "key 'tokenize' is apply_chat_template's own argument"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "key 'add_generation_prompt'"),
    ],
)
def test_chat_template_kwargs_that_conflict_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PromptConfig(**settings)


def test_render_prompt_plain_needs_no_tokenizer():
    text = render_prompt("What is 2 + 3?", "plain", tokenizer=None)
    assert text.startswith("Question: What is 2 + 3?\n")
    assert "####" in text
    assert text.endswith("Answer:")
    assert "{question}" in PLAIN_TEMPLATE
    assert render_prompt("Q?", "plain", None, instruction="") == "Question: Q?\nAnswer:"


def test_render_prompt_takes_the_configured_wording():
    tok = FakeChatTokenizer()
    text = render_prompt("Q?", "chat", tok, system_prompt="Use tags.", instruction="Answer in <answer></answer>.")
    assert text == "<chat>system:Use tags.|user:Q? Answer in <answer></answer>.<assistant>"
    assert render_prompt("Q?", "chat", tok, system_prompt="", instruction="") == "<chat>user:Q?<assistant>"


def test_render_prompt_chat_uses_the_template_with_system_prompt():
    tok = FakeChatTokenizer()
    text = render_prompt("What is 2 + 3?", "chat", tok)
    assert tok.calls == [
        (
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"What is 2 + 3? {ANSWER_INSTRUCTION}"},
            ],
            False,
            True,
        )
    ]
    assert text == f"<chat>system:{SYSTEM_PROMPT}|user:What is 2 + 3? {ANSWER_INSTRUCTION}<assistant>"
    assert "####" in SYSTEM_PROMPT


@pytest.mark.parametrize("template", [None, ""])
def test_render_prompt_chat_without_template(template):
    tok = FakeChatTokenizer()
    tok.chat_template = template
    with pytest.raises(ValueError, match="prompt_format='plain'"):
        render_prompt("What is 1 + 1?", "chat", tok)
    assert tok.calls == []


def test_load_jsonl_not_utf8_is_a_dataset_error(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    assert str(p) in str(exc.value)


# --------------------------------------------------------------------------- GSM8K format, parquet, csv, columns

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k_sample.jsonl"


def test_gsm8k_format_answers_are_the_text_after_the_marker():
    examples = load_file(SAMPLE)
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(examples) == len(rows) == 60
    for example, row in zip(examples, rows, strict=True):
        assert example.question == row["question"]
        assert example.answer == row["answer"].rsplit("####", 1)[1].strip()
        assert "<<" in row["answer"] and example.answer.replace(",", "").isdigit()
    assert gold_answer("Work: 2+2=<<2+2=4>>4\n#### 1,200") == "1,200"
    assert gold_answer(7) == "7" and gold_answer(" 0.5 ") == "0.5"


def _tables(tmp_path, rows: list[dict]) -> list[Path]:
    import pandas as pd

    frame = pd.DataFrame(rows)
    parquet, csv = tmp_path / "data.parquet", tmp_path / "data.csv"
    frame.to_parquet(parquet)
    frame.to_csv(csv, index=False)
    return [parquet, csv]


def test_parquet_and_csv_read_through_datasets_with_configured_columns(tmp_path):
    rows = [
        {"id": i, "problem": f"What is {i} + {i}?", "solution": f"{i}+{i}=<<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"} for i in range(1, 6)
    ]
    for path in _tables(tmp_path, rows):
        examples = load_file(path, question_column="problem", answer_column="solution")
        assert examples == [Example(question=f"What is {i} + {i}?", answer=str(2 * i), columns={"id": i}) for i in range(1, 6)]
        with pytest.raises(DatasetError, match=rf"{path.name}.*no column 'question' \(columns: id, problem, solution\)"):
            load_file(path)


def test_a_table_row_without_a_usable_answer_is_named(tmp_path):
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + 2?", "answer": "four, I think"}]
    for path in _tables(tmp_path, rows):
        with pytest.raises(DatasetError, match=rf"{path.name}' row 2: no usable answer in 'answer' \(got 'four, I think'\)"):
            load_file(path)


def test_an_unreadable_table_is_one_dataset_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"broken.parquet'?: could not be read through the datasets library"):
        load_file(path)


def test_gsm8k_loads_both_splits_from_the_hub_dataset(monkeypatch, tmp_path):
    import datasets

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        # The Hub is out of reach here: serve GSM8K's format from the local sample, split 50/10.
        calls.append((path, name, split))
        part = rows[:50] if split == "train" else rows[50:]
        return datasets.Dataset.from_list(part)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, held_out = train_eval_split(RunConfig(dataset="gsm8k", eval_size=4))
    assert calls == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "train")]
    assert len(train) == 50 and held_out == [Example(question=r["question"], answer=r["answer"].split("#### ")[1]) for r in rows[50:54]]
    with pytest.raises(DatasetError, match=r"eval_size 11: GSM8K's test split holds out 10 questions"):
        train_eval_split(RunConfig(dataset="gsm8k", eval_size=11))


def test_gsm8k_without_hub_access_says_what_to_do(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DatasetError, match=r"dataset gsm8k \(openai/gsm8k, split 'train'\): could not be read .*ConnectionError"):
        load_gsm8k("train")


# --------------------------------------------------------------------------- train/eval split, top-up


def test_arithmetic_eval_split_is_the_held_out_prefix():
    train, held_out = train_eval_split(RunConfig(eval_size=7))
    assert held_out == arithmetic_split("eval")[:7]
    assert train == arithmetic_split("train")


def test_arithmetic_eval_size_above_the_held_out_split_is_named():
    with pytest.raises(DatasetError, match=r"eval_size 501.*at most 500"):
        train_eval_split(RunConfig(eval_size=501))


def test_file_dataset_holds_out_a_fixed_sample(tmp_path):
    rows = [Example(question=f"q{i}", answer=str(i)) for i in range(20)]
    config = RunConfig(dataset="data.jsonl", eval_size=5)
    train, held_out = train_eval_split(config, rows)
    assert len(held_out) == 5 and len(train) == 15
    assert not set(train) & set(held_out) and set(train) | set(held_out) == set(rows)
    assert train_eval_split(config, rows) == (train, held_out)  # the same in every run
    assert held_out != rows[:5]  # a seeded sample, not the head of the file
    assert train_eval_split(RunConfig(**{**config.flat(), "eval_size": 0}), rows) == (rows, [])


def test_file_dataset_too_small_for_eval_size(tmp_path):
    rows = [Example(question=f"q{i}", answer=str(i)) for i in range(4)]
    with pytest.raises(DatasetError, match=r"eval_size 4.*4 examples.*below 4"):
        train_eval_split(RunConfig(dataset="data.jsonl", eval_size=4), rows)


def test_topup_prompts_depend_on_seed_iteration_and_round_only():
    examples = [Example(question=f"q{i}", answer=str(i)) for i in range(50)]
    a = topup_prompts(examples, seed=1, iteration=3, round_=0, num=4)
    assert a == topup_prompts(examples, seed=1, iteration=3, round_=0, num=4)
    assert len(a) == 4 and len(set(a)) == 4
    assert a != topup_prompts(examples, seed=1, iteration=3, round_=1, num=4)
    assert a != topup_prompts(examples, seed=1, iteration=4, round_=0, num=4)
    assert len(topup_prompts(examples[:3], seed=1, iteration=0, round_=0, num=10)) == 3


# --------------------------------------------------------------------------- TRL's dataset format


def test_trl_prompt_rows_text_and_chat_keep_every_other_column(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    p = _write(tmp_path, "trl.jsonl", [
        json.dumps({"prompt": "Write a haiku about rain.", "level": 1}),
        json.dumps({"prompt": chat, "solution": "2", "tags": ["math"]}),
    ])  # fmt: skip
    first, second = load_jsonl(p, need_answers=False)
    assert (first.question, first.prompt, first.answer, first.columns) == (
        "Write a haiku about rain.",
        "Write a haiku about rain.",
        "",
        {"level": 1},
    )
    assert [m.model_dump() for m in second.prompt] == chat
    assert second.question == "Name a prime."  # shown in reports: the last user turn
    assert second.columns == {"solution": "2", "tags": ["math"]}
    # the 'correct' reward needs a gold answer in --answer-column: named with its line
    with pytest.raises(DatasetError, match=r"trl.jsonl' line 1: no usable answer in 'answer' \(got None\)"):
        load_jsonl(p)
    assert load_jsonl(p, answer_column="solution", need_answers=False)[1].answer == "2"


@pytest.mark.parametrize("prompt", ["", [], [{"role": "user"}], {"role": "user", "content": "hi"}, 3])
def test_a_bad_trl_prompt_is_named_with_its_line(tmp_path, prompt):
    p = _write(tmp_path, "bad.jsonl", [json.dumps({"prompt": "fine"}), json.dumps({"prompt": prompt})])
    with pytest.raises(DatasetError, match=r"bad.jsonl' line 2: 'prompt' must be non-empty text or a list of chat messages"):
        load_jsonl(p, need_answers=False)


def test_a_dataset_folder_is_read_with_load_dataset_and_its_split(tmp_path):
    """Any `datasets.load_dataset` argument works: here a local folder of parquet splits (a Hub id
    goes the same way, downloaded once, where a network is reachable)."""
    import pandas as pd

    folder = tmp_path / "my_dataset" / "data"
    folder.mkdir(parents=True)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(1, 8)]
    pd.DataFrame(rows[:5]).to_parquet(folder / "train-00000-of-00001.parquet")
    pd.DataFrame(rows[5:]).to_parquet(folder / "test-00000-of-00001.parquet")
    config = RunConfig(dataset=str(tmp_path / "my_dataset"), rewards={"correct": 1.0}, eval_size=2)
    train = load_rows(config)
    assert [e.question for e in train] == [f"What is {i} + {i}?" for i in range(1, 6)] and train[0].answer == "2"
    test = load_rows(config.model_copy(update={"data": config.data.model_copy(update={"dataset_split": "test"})}))
    assert [e.answer for e in test] == ["12", "14"]
    with pytest.raises(DatasetError, match=r"'.*no_such_dataset' \(split 'train'\): could not be read through the datasets library"):
        load_rows(RunConfig(dataset=str(tmp_path / "no_such_dataset")))


def test_a_byte_order_mark_is_accepted_in_jsonl_and_csv(tmp_path):
    """Spreadsheet tools start their UTF-8 files with one; the first column must keep its name."""
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(
        b"\xef\xbb\xbf" + b'{"question": "What is 1 + 1?", "answer": "2"}\r\n{"question": "What is 2 + 2?", "answer": "4"}\r\n'
    )
    csv = tmp_path / "bom.csv"
    csv.write_bytes(b"\xef\xbb\xbfquestion,answer\r\nWhat is 1 + 1?,2\r\nWhat is 2 + 2?,4\r\n")
    expected = [Example(question="What is 1 + 1?", answer="2"), Example(question="What is 2 + 2?", answer="4")]
    assert load_file(jsonl) == expected
    assert load_file(csv) == expected


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"bad.csv'?: the file is empty; expected a header line"),
        (b" \n\n", r"bad.csv'?: the file is empty"),
        ("question,answer\nQu'est-ce que 1 + 1 ?,2\n".encode("latin-1").replace(b"'", b"\xe9"), r"bad.csv'?: not UTF-8 text \(byte 18\)"),
    ],
)
def test_an_empty_or_non_utf8_csv_is_said_in_our_words(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=message) as info:
        load_file(path)
    assert "datasets library" not in str(info.value)


def test_duplicate_prompts_are_dropped_before_the_split_with_a_warning(tmp_path, caplog):
    """Otherwise a held-out question can also be a training row and inflate held-out figures."""
    path = tmp_path / "dups.jsonl"
    rows = [{"question": f"What is {i % 4} + 1?", "answer": str(i % 4 + 1)} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    config = RunConfig(dataset=str(path), eval_size=2)
    with caplog.at_level("WARNING"):
        examples = load_rows(config)
    assert [e.question for e in examples] == [f"What is {i} + 1?" for i in range(4)]
    assert "8 duplicate prompts dropped" in caplog.text and "4 rows left" in caplog.text
    listed = [Example(question=r["question"], answer=r["answer"]) for r in rows]  # rows passed from Python
    train, held_out = train_eval_split(config, listed)
    assert len(train) == 2 and len(held_out) == 2 and not set(train) & set(held_out)


def test_sample_prompts_without_shuffling_walks_the_dataset_in_its_order():
    ex = _examples(5)
    picked = [sample_prompts(ex, seed=s, iteration=i, num=2, shuffle=False) for s, i in ((0, 0), (7, 1), (0, 2))]
    assert [[e.question for e in batch] for batch in picked] == [["q0", "q1"], ["q2", "q3"], ["q4", "q0"]]
