"""The LLM judge's pure parts: its prompt, parsing its JSON reply, the regex vLLM holds it to,
splitting a group to fit its context, and adding its scores to a group's rewards."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from grpo_flyte.scoring.compose import with_judge
from grpo_flyte.scoring.judging import (
    HEADER_TOKENS,
    REPLY_PREFIX,
    REPLY_TOKENS_PER_SCORE,
    busy_seconds,
    chunk_indices,
    judge_messages,
    judge_metrics,
    parse_scores,
    render_judge_prompt,
    scores_regex,
)
from grpo_flyte.types import Example, JudgeVerdict, RewardParts, Rollout, RolloutGroup, ScoredGroup

# --------------------------------------------------------------------------- the prompt


def test_the_prompt_holds_the_rubric_the_question_once_and_every_answer_numbered():
    messages = judge_messages("Be fair.", "What is 2+3?", ["5", "#### 6", "five"])
    system, user = messages
    assert system["role"] == "system" and user["role"] == "user"
    assert system["content"].startswith("You are a strict judge. Be fair.")
    assert "3 numbered answers" in system["content"] and '{"scores": [s1, ..., s3]}' in system["content"]
    assert user["content"] == "Question:\nWhat is 2+3?\n\nAnswer 1:\n5\n\nAnswer 2:\n#### 6\n\nAnswer 3:\nfive"
    assert user["content"].count("What is 2+3?") == 1


def test_a_chat_template_renders_the_prompt_and_the_reply_is_started(embedded_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    text, chat = render_judge_prompt(tokenizer, "Be fair.", "What is 2+3?", ["5", "6"])
    assert chat
    assert text.endswith("<|im_start|>assistant\n" + REPLY_PREFIX)  # SmolLM2's template, the assistant's turn opened
    assert text.count("What is 2+3?") == 1 and "Answer 2:\n6" in text


def test_a_tokenizer_without_a_chat_template_gets_plain_text():
    class Plain:
        chat_template = None

    text, chat = render_judge_prompt(Plain(), "Be fair.", "Q?", ["a"])
    assert not chat
    assert text.startswith("You are a strict judge. Be fair.")
    assert text.endswith("Question:\nQ?\n\nAnswer 1:\na\n\nJudge:\n" + REPLY_PREFIX)


# --------------------------------------------------------------------------- the reply


@pytest.mark.parametrize(
    ("reply", "n", "expected"),
    [
        ("0.9, 0.1, 1]}", 3, [0.9, 0.1, 1.0]),
        ("0, 1]}", 2, [0.0, 1.0]),
        ("0.5]}\nThe first answer is better.", 1, [0.5]),  # talk after the JSON is ignored
        ('0.25, 0.75], "why": "the second shows work"}', 2, [0.25, 0.75]),  # other keys are ignored
    ],
)
def test_a_reply_parses_to_its_scores(reply, n, expected):
    assert parse_scores(reply, n) == expected


@pytest.mark.parametrize(
    ("reply", "n"),
    [
        ("0.9, 0.1]}", 3),  # too few scores
        ("0.9, 0.1, 0.5, 0.2]}", 3),  # too many
        ("1.5, 0.1]}", 2),  # out of [0, 1]
        ("-0.1, 0.1]}", 2),
        ("NaN, 0.1]}", 2),  # json reads NaN; not a score
        ("true, false]}", 2),  # booleans are not scores
        ('"0.5", "0.1"]}', 2),  # strings are not scores
        ("0.9, 0.1", 2),  # cut off before the closing brackets
        ("", 2),
        ("Answer 1 is correct.", 1),
        ("[0.5]]}", 1),  # a nested list
    ],
)
def test_a_malformed_reply_parses_to_none(reply, n):
    assert parse_scores(reply, n) is None


def test_the_regex_admits_exactly_n_scores_in_0_1():
    pattern = re.compile(scores_regex(3))
    for reply in ("0.9, 0.1, 1]}", "0, 0, 0]}", "1.0, 0.05, 0.75]}", "1.00, 0, 0.5]}"):
        assert pattern.fullmatch(reply), reply
    for reply in ("0.9, 0.1]}", "0.9, 0.1, 1, 0]}", "1.5, 0, 0]}", "0.123, 0, 0]}", "0.9,0.1,1]}", "0.9, 0.1, 1]", ".5, 0, 0]}"):
        assert not pattern.fullmatch(reply), reply
    assert re.fullmatch(scores_regex(1), "0.5]}")
    with pytest.raises(ValueError):
        scores_regex(0)


def test_every_reply_the_regex_admits_parses():
    """What vLLM's constrained decoding can produce always parses: random walks through the regex's choices."""
    rng = random.Random(0)
    for n in (1, 2, 5, 16):
        pattern = re.compile(scores_regex(n))
        for _ in range(50):
            scores = [rng.choice(["0", "1", "1.0", "1.00", f"0.{rng.randrange(10)}", f"0.{rng.randrange(100):02d}"]) for _ in range(n)]
            reply = ", ".join(scores) + "]}"
            assert pattern.fullmatch(reply)
            assert parse_scores(reply, n) == [float(s) for s in scores]


# --------------------------------------------------------------------------- chunking


def test_a_group_that_fits_is_one_prompt():
    assert chunk_indices(100, [10, 20, 30], budget=1000) == [[0, 1, 2]]


def test_a_group_that_does_not_fit_is_split_in_order_and_covers_every_completion():
    per = HEADER_TOKENS + REPLY_TOKENS_PER_SCORE  # tokens besides the completion's own
    # budget 100 + 2 * (30 + per): two completions of 30 fit, a third does not
    assert chunk_indices(100, [30, 30, 30, 30, 30], budget=100 + 2 * (30 + per)) == [[0, 1], [2, 3], [4]]
    assert chunk_indices(100, [200 - 100 - 3 * per - 2, 1, 1], budget=200) == [[0, 1, 2]]  # exactly at the budget
    assert chunk_indices(100, [200 - 100 - 3 * per - 1, 1, 1], budget=200) == [[0, 1], [2]]  # one token over it
    sizes = [5, 80, 3, 40, 40, 7, 60]
    chunks = chunk_indices(50, sizes, budget=160)
    assert list(itertools.chain(*chunks)) == list(range(len(sizes)))
    for chunk in chunks:
        assert len(chunk) == 1 or 50 + sum(sizes[i] + per for i in chunk) <= 160


def test_a_completion_too_long_even_alone_gets_a_prompt_of_its_own():
    assert chunk_indices(100, [10, 500, 10], budget=200) == [[0], [1], [2]]


# --------------------------------------------------------------------------- stage seconds, rewards, metrics


def test_busy_seconds_count_overlapping_calls_once():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert busy_seconds([(1.0, 4.0), (2.0, 3.0)]) == pytest.approx(3.0)  # one inside another


def _scored(rewards: list[float]) -> ScoredGroup:
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=f"c{i}") for i in range(len(rewards))]
    group = RolloutGroup(
        index=0, example=Example(question="q", answer="1"), adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0
    )
    parts = [RewardParts(reward=r, correct=r > 0, format=False, scores={"correct": r}) for r in rewards]
    return ScoredGroup(group=group, rewards=parts)


def test_the_judges_scores_are_added_by_weight_and_failures_named():
    verdict = JudgeVerdict(scores=[0.5, 0.0, 1.0], failed=[False, True, False], calls=2, retries=1, invalid=1, chunks=2)
    out = with_judge(_scored([1.0, 0.0, 0.0]), verdict, weight=2.0)
    assert [p.reward for p in out.rewards] == [2.0, 0.0, 2.0]
    assert [p.scores for p in out.rewards] == [
        {"correct": 1.0, "judge": 0.5},
        {"correct": 0.0, "judge": 0.0},
        {"correct": 0.0, "judge": 1.0},
    ]
    assert [p.errors for p in out.rewards] == [[], ["judge"], []]
    assert out.judge == verdict
    with pytest.raises(ValueError, match="scored 2 completions of a group of 3"):
        with_judge(_scored([1.0, 0.0, 0.0]), verdict.model_copy(update={"scores": [0.1, 0.2], "failed": [False, False]}), 1.0)


def test_judge_metrics_sum_over_the_groups():
    verdicts = [
        JudgeVerdict(scores=[1.0, 0.0], failed=[False, False], calls=1),
        JudgeVerdict(scores=[0.0, 0.0], failed=[True, True], calls=3, retries=2, invalid=1, chunks=3),
    ]
    scored = [with_judge(_scored([0.0, 0.0]), v, 1.0) for v in verdicts]
    assert judge_metrics(scored, 1.5) == {"judge_s": 1.5, "judge_calls": 4, "judge_retries": 2, "judge_invalid": 1, "judge_split_groups": 1}
    assert judge_metrics([_scored([0.0, 1.0])], 0.0) == {}
