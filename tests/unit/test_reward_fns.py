"""The reward functions and their weighted composition, against hand-computed values."""

from __future__ import annotations

import itertools

import pytest

from grpo_flyte import reward_fns as rewards
from grpo_flyte.config.errors import make_config
from grpo_flyte.errors import ConfigError, RewardError, RewardSpecError
from grpo_flyte.reward_fns import (
    DEFAULT_REWARDS,
    answer_span,
    extract_answer,
    format_reward,
    gold_is_usable,
    is_correct,
    length_reward,
    resolve_reward,
    tags_reward,
)
from grpo_flyte.scoring.compose import Group, score_completions

# --------------------------------------------------------------------------- extract_answer (integer fallback)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 is 7, so\n#### 7", "7"),
        ("#### 12 and then 99 more words", "12"),  # the number right after the marker wins
        ("first #### 3 then #### 5", "5"),  # the last marker wins
        ("I think it is 41, no, 42.", "42"),  # no marker: last integer
        ("#### -17", "-17"),
        ("#### 1,234", "1234"),
        ("#### 007", "7"),
        ("#### -0", "0"),
        ("The answer is 42 ####", "42"),  # marker with no number after it: fall back
        ("", None),
        ("####", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# --------------------------------------------------------------------------- answer_span and is_correct


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 5 + 7 = 12\n#### 12", "12"),
        ("#### 12. Then 99 more words", "12"),  # the first token after the marker, punctuation dropped
        ("first #### 3 then #### 5", "5"),
        ("#### 13 + 14 = 27", "27"),  # the result of what follows the marker, not its first number
        ("#### 12\nHope this helps!", None),  # a marker before the final line is working, not the answer
        ("#### 12\n\n  \n", "12"),  # blank lines after it change nothing
        ("<reasoning>2 and 2</reasoning><answer> 4 </answer>", "4"),
        ("<answer>1</answer> #### 2", "1"),  # the answer tag wins over the marker
        ("no marker, 42", None),
        ("#### ", None),
    ],
)
def test_answer_span(text, expected):
    assert answer_span(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("5 + 7 = 12\n#### 12", "12", True),
        ("#### 72.0", "72", True),  # numeric equivalence
        ("#### 1,000", "1000", True),
        ("<answer>1/2</answer>", "0.5", True),  # symbolic equivalence
        ("#### \\frac{3}{4}", "0.75", True),
        ("#### $18.00", "18", True),
        ("#### 3", "3.5", False),  # no integer truncation
        ("#### 13", "12", False),
        ("#### -5", "5", False),  # the sign matters
        ("#### 12 and then 99 more words", "12", True),
        ("it is 42.", "42", True),  # no marked answer: the final line's last number
        # One rule for the graded answer and the format credit: the final line. The answer marked
        # '#### 13 + 14 = 27' is 27 (graded 13 before, with full format credit); the base model's
        # own '13 + 14 = 27' states 27 too.
        ("#### 13 + 14 = 27", "27", True),
        ("#### 13 + 14 = 27", "13", False),
        ("the sum is 27\nI hope this helps!", "27", False),  # the final line states no answer
        ("#### 27\nThat is 26 + 1", "27", False),  # the final line's number is 1
        ("13 + 14 = 26\n#### 27", "27", True),
        ("The answer is 42 ####", "42", True),
        ("no idea", "42", False),
        # restating the question is not answering it: the last number is 14, not 13 + 14
        ("13 + 14 =", "27", False),
        ("What is 13 + 14?", "27", False),
        ("13 + 14 = 27", "27", True),
        # scientific notation, as gold or as the stated answer (math-verify alone reads 1e3 as 1)
        ("#### 1000", "1e3", True),
        ("#### 1e3", "1000", True),
        ("#### 1", "1e3", False),
        ("the answer is 2.5e-1", "0.25", True),
        # digits of other scripts compare as numbers (Arabic-Indic 27)
        ("#### \u0662\u0667", "27", True),
        ("#### 27", "\u0662\u0667", True),
        ("#### \u0662\u0668", "27", False),
    ],
)
def test_is_correct(completion, answer, expected):
    assert is_correct(completion, answer) is expected


@pytest.mark.parametrize(("gold", "usable"), [("1e3", True), ("\u0662\u0667", True), ("27", True), ("", False), ("  ", False)])
def test_gold_answers_in_scientific_notation_or_other_scripts_are_usable(gold, usable):
    assert gold_is_usable(gold) is usable


def test_is_correct_falls_back_to_the_integer_match_when_math_verify_finds_nothing(monkeypatch):
    monkeypatch.setattr(rewards, "_parse_math", lambda text: [])
    is_correct.cache_clear()
    try:
        assert is_correct("so #### 1,024", "1024") is True
        assert is_correct("so #### 1,025", "1024") is False
        assert is_correct("#### 0.5", "1/2") is False  # no integer gold: no fallback match
    finally:
        is_correct.cache_clear()


# --------------------------------------------------------------------------- built-in rewards


def test_format_and_tags_rewards():
    texts = [
        "#### 4",
        "<reasoning>2+2</reasoning>\n<answer>4</answer>",  # exact structure
        "<reasoning>2+2</reasoning> and then <answer>4</answer>",  # all four tags, extra text
        "<reasoning>2+2</reasoning>",  # two of four tags
        "<answer>4</answer><answer>5</answer>",  # repeated tags earn nothing
    ]
    assert format_reward(texts) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert tags_reward(texts) == [0.0, 1.0, 1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("completion", "credited"),
    [
        ("#### 27", True),
        ("13 + 14 = 27\n#### 27", True),  # working above a well-formed final line
        ("#### 27.", True),
        ("#### -3.5", True),
        ("#### \\frac{3}{4}", True),
        ("#### 27\n\n", True),
        ("#### 13 + 14 = 27", False),  # the marker anywhere is not a well-formed answer line
        ("#### 27 is the answer", False),
        ("The answer: #### 27", False),
        ("#### 27\nI hope this helps", False),  # the marker, then more text
        ("####", False),
        ("13 + 14 = 27", False),
    ],
)
def test_format_credits_only_a_well_formed_final_answer_line(completion, credited):
    assert format_reward([completion]) == [float(credited)]
    assert _score([completion], answer="27")[0].format is credited  # the format metric is the same rule


def test_length_reward_is_a_soft_penalty_over_the_last_quarter():
    # max_new_tokens=64: the window is 16 tokens, from 48 to 64
    assert length_reward(["x"] * 5, num_tokens=[10, 48, 52, 56, 64], max_new_tokens=64) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert length_reward(["x"], num_tokens=[3], max_new_tokens=3) == [-1.0]  # window of at least one token


# --------------------------------------------------------------------------- composition


def _score(completions, weights=DEFAULT_REWARDS, on_error="fail", answer="12"):
    return score_completions(
        completions,
        Group(question="What is 5 + 7?", answer=answer, max_new_tokens=64, num_tokens=[len(c) for c in completions]),
        weights=weights,
        on_error=on_error,
    )


def test_the_default_reward_pays_for_a_right_answer_only_and_form_is_a_metric():
    parts = _score(["5 + 7 = 12\n#### 12", "5 + 7 = 12", "#### 13", "it is 13", "#### 5 + 7 = 13"])
    assert [p.reward for p in parts] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [p.correct for p in parts] == [True, True, False, False, False]
    assert [p.format for p in parts] == [True, False, True, False, False]
    assert parts[0].scores == {"correct": 1.0}


def test_a_format_term_gated_on_the_answer_never_pays_form_alone():
    """With format=0.2 one well-formed wrong answer in a group of 8 gets the advantage of one right
    answer (the group's std scaling erases the weight: [2.47, -0.35 x 7] either way); correct_format
    pays only a right answer on a well-formed line."""
    group = ["#### 13"] + ["it is 13"] * 7
    with_format = [p.reward for p in _score(group, weights={"correct": 1.0, "format": 0.2})]
    assert with_format == pytest.approx([0.2] + [0.0] * 7)  # a wrong answer paid for its form
    gated = [p.reward for p in _score(group, weights={"correct": 1.0, "correct_format": 0.2})]
    assert gated == [0.0] * 8  # nothing to learn from form alone
    right = [p.reward for p in _score(["#### 12", "5 + 7 = 12", "#### 13"], weights={"correct": 1.0, "correct_format": 0.2})]
    assert right == pytest.approx([1.2, 1.0, 0.0])


_counter = itertools.count()


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """Write a module of reward functions and return its (unique) importable name."""

    def write(source: str) -> str:
        name = f"user_rewards_{next(_counter)}"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


def test_weighted_mix_with_a_custom_reward_keeps_each_score(custom_module):
    module = custom_module(
        "def brevity(completions, *, num_tokens, max_new_tokens, question, answer, **kwargs):\n"
        "    return [1 - n / max_new_tokens for n in num_tokens]\n"
    )
    weights = {"correct": 1.0, "format": 0.5, f"{module}:brevity": 2.0}
    parts = _score(["#### 12" + " " * 25, "#### 13"], weights)  # 32 and 7 "tokens" here
    assert parts[0].scores == {"correct": 1.0, "format": 1.0, f"{module}:brevity": 0.5}
    assert parts[0].reward == pytest.approx(1.0 + 0.5 + 2.0 * 0.5)
    assert parts[1].reward == pytest.approx(0.0 + 0.5 + 2.0 * (1 - 7 / 64))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "_oops() if any('bad' in c for c in completions) else [1.0] * len(completions)",
            r"raised KeyError: 'oops' on completion 2 of 3, which starts 'bad answer #### 12",
        ),
        ("[float('nan') if 'bad' in c else 1.0 for c in completions]", r"returned nan; expected a finite number on completion 2 of 3"),
        ("['high' if 'bad' in c else 1.0 for c in completions]", r"returned 'high'; expected a number"),
        # what user code may raise that is not an Exception, and an int too large for a float
        (
            "_interrupt() if any('bad' in c for c in completions) else [1.0] * len(completions)",
            r"raised KeyboardInterrupt: .* on completion 2 of 3",
        ),
        ("_exit() if any('bad' in c for c in completions) else [1.0] * len(completions)", r"raised SystemExit: 3 on completion 2 of 3"),
        (
            "[10 ** 400 if 'bad' in c else 1 for c in completions]",
            r"returned an integer of about 401 digits; expected a number that fits a float, or None on completion 2",
        ),
    ],
)
def test_a_failing_reward_names_itself_and_the_completion(custom_module, body, message):
    module = custom_module(
        "import sys\n\ndef _oops():\n    raise KeyError('oops')\n\ndef _interrupt():\n    raise KeyboardInterrupt('stop')\n\n"
        f"def _exit():\n    sys.exit(3)\n\ndef judge(completions, **kwargs):\n    return {body}\n"
    )
    texts = ["#### 12", "bad answer #### 12 " + "x" * 300, "#### 11"]
    with pytest.raises(RewardError, match=f"reward '{module}:judge' {message}") as info:
        _score(texts, {"correct": 1.0, f"{module}:judge": 1.0})
    assert "x" * 200 not in str(info.value)  # only the start of the completion is shown
    parts = _score(texts, {"correct": 1.0, f"{module}:judge": 1.0}, on_error="zero")
    assert [p.reward for p in parts] == [2.0, 1.0, 1.0]
    assert [p.errors for p in parts] == [[], [f"{module}:judge"], []]
    assert parts[1].scores[f"{module}:judge"] == 0.0


def test_a_reward_returning_the_wrong_count(custom_module):
    module = custom_module("def short(completions, **kwargs):\n    return [1.0]\n")  # right only for one
    with pytest.raises(RewardError, match=rf"reward '{module}:short' returned 1 scores for 2 completions"):
        _score(["#### 12", "#### 11"], {f"{module}:short": 1.0})
    # scored one by one it is right, so 'zero' keeps those scores and counts no failure
    parts = _score(["#### 12", "#### 11"], {f"{module}:short": 1.0}, on_error="zero")
    assert [(p.reward, p.errors) for p in parts] == [(1.0, []), (1.0, [])]


def test_a_reward_returning_a_scalar(custom_module):
    module = custom_module("def scalar(completions, **kwargs):\n    return 1.0\n")
    with pytest.raises(RewardError, match=rf"reward '{module}:scalar' returned float; expected a list of 1 numbers"):
        _score(["#### 12"], {f"{module}:scalar": 1.0})


def test_resolve_reward_errors(custom_module):
    module = custom_module("VALUE = 3\n")
    with pytest.raises(RewardSpecError, match=rf"module '{module}' has no function 'missing'"):
        resolve_reward(f"{module}:missing")
    with pytest.raises(RewardSpecError, match=rf"module '{module}' has no function 'VALUE'"):
        resolve_reward(f"{module}:VALUE")
    with pytest.raises(RewardSpecError, match=r"cannot import module 'no_such_module_here' \(ModuleNotFoundError"):
        resolve_reward("no_such_module_here:fn")
    assert resolve_reward("tags") is tags_reward


def test_config_accepts_exactly_the_builtin_reward_functions():
    # the registry names its rewards; config checks a run's names with it
    for name, fn in rewards.REWARD_FUNCTIONS.items():
        assert resolve_reward(name) is fn
        rewards.check_reward_name(name)  # accepted without raising
    every = dict.fromkeys(rewards.BUILTIN_REWARDS, 1.0)
    assert make_config(rewards=every).scoring.rewards == every


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (
            {"corect": 1.0},
            r"--rewards=\{'corect': 1.0\}: unknown reward 'corect'; expected one of correct, format, correct_format, tags, length, env, 'judge', "
            r"'module:function' or a reward model \(a Hub id 'org/name', or a model folder with a '/': './my-rm'\)",
        ),
        ({}, r"--rewards=\{\}: no rewards; expected at least one name=weight"),
        ({"correct": float("nan")}, r"weight nan of reward 'correct'; expected a finite number"),
        ({"my mod:fn": 1.0}, r"unknown reward 'my mod:fn'"),
    ],
)
def test_config_rejects_bad_rewards(rewards, message):
    with pytest.raises(ConfigError, match=message):
        make_config(rewards=rewards)


def test_config_rejects_an_unknown_error_policy():
    with pytest.raises(ConfigError, match=r"--on-reward-error='skip'"):
        make_config(on_reward_error="skip")


# --------------------------------------------------------------------------- the time limit


def test_a_reward_that_never_returns_is_stopped_at_its_time_limit(custom_module):
    module = custom_module("def stuck(completions, **kwargs):\n    while True:\n        pass\n")
    texts = ["#### 12", "#### 11"]
    with pytest.raises(RewardError, match=rf"reward '{module}:stuck' took longer than 0.5 s \(reward_timeout_s\) and was stopped"):
        score_completions(texts, Group("q", "12", 8, [2, 2]), weights={f"{module}:stuck": 1.0}, timeout_s=0.5)  # fmt: skip
    parts = score_completions(texts, Group("q", "12", 8, [2, 2]), weights={"correct": 1.0, f"{module}:stuck": 1.0}, on_error="zero", timeout_s=0.5)  # fmt: skip
    assert [p.reward for p in parts] == [1.0, 0.0]  # correct scores; the stuck reward counts 0 and an error
    assert [p.errors for p in parts] == [[f"{module}:stuck"]] * 2
    # and the worker is back for the next call
    assert [p.reward for p in score_completions(texts, Group("q", "12", 8, [2, 2]), weights={"correct": 1.0}, timeout_s=5)] == [1.0, 0.0]  # fmt: skip


def test_math_verify_on_an_exponent_tower_is_a_reward_error_not_a_hang():
    texts = ["#### 12", "#### 9^9^9^9"]
    parts = score_completions(texts, Group("q", "12", 8, [2, 2]), weights={"correct": 1.0, "format": 0.2}, on_error="zero", timeout_s=1)  # fmt: skip
    assert [p.reward for p in parts] == [1.2, 0.2]
    assert [p.errors for p in parts] == [[], ["correct"]]
    assert [p.correct for p in parts] == [True, False]  # the accuracy check has the same limit


def test_a_gold_answer_that_cannot_be_read_in_time_is_refused_naming_its_line(tmp_path):
    from grpo_flyte.data import load_jsonl
    from grpo_flyte.errors import DatasetError

    path = tmp_path / "towers.jsonl"
    path.write_text('{"question": "q1", "answer": "7"}\n{"question": "q2", "answer": "10**10**10**10"}\n')
    with pytest.raises(DatasetError, match=r"line 2: no usable answer in 'answer' \(got '10\*\*10\*\*10\*\*10'\)"):
        load_jsonl(path, timeout_s=1)


# --------------------------------------------------------------------------- TRL's reward signature


def test_a_trl_reward_function_gets_lists_one_entry_per_completion(custom_module):
    """TRL's signature: keyword lists (prompts, completions, completion_ids, every other column);
    for chat prompts, prompts and completions are message lists, as TRL passes them."""
    module = custom_module(
        "import json\n"
        "SEEN = []\n"
        "def echo(prompts, completions, completion_ids, solution, **kwargs):\n"
        "    # a TRL reward: score by the solution column, report what it was given in the score\n"
        "    assert len(prompts) == len(completions) == len(completion_ids) == len(solution)\n"
        "    assert all(p == prompts[0] for p in prompts) and all(s == '7' for s in solution)\n"
        "    assert prompts[0] == [{'role': 'user', 'content': 'What is 3 + 4?'}], prompts[0]\n"
        "    assert completions[1] == [{'role': 'assistant', 'content': 'it is 8'}], completions[1]\n"
        "    assert completion_ids == [[1, 2], [3, 4, 5]] and kwargs['level'] == ['easy', 'easy']\n"
        "    return [1.0 if c[0]['content'].endswith(s) else 0.0 for c, s in zip(completions, solution)]\n"
    )
    group = Group(
        question="What is 3 + 4?", answer="", max_new_tokens=8, num_tokens=[2, 3], completion_ids=[[1, 2], [3, 4, 5]],
        prompt=[{"role": "user", "content": "What is 3 + 4?"}], columns={"solution": "7", "level": "easy"},
    )  # fmt: skip
    parts = score_completions(["it is 7", "it is 8"], group, {f"{module}:echo": 1.0})
    assert [p.reward for p in parts] == [1.0, 0.0]
    assert [p.correct for p in parts] == [False, False]  # no gold answer: nothing counts as correct


def test_the_signature_decides_for_question_answer_data(custom_module):
    """With question/answer rows, a function that takes `prompts` is called TRL's way (answer as a
    list); one in the original form gets one answer per group, as before."""
    module = custom_module(
        "def trl(prompts, completions, answer, **kwargs):\n"
        "    return [float(a == '12' and p == 'What is 5 + 7?') for p, a in zip(prompts, answer)]\n"
        "def original(completions, *, answer, question, num_tokens, **kwargs):\n"
        "    return [float(answer == '12' and question == 'What is 5 + 7?')] * len(completions)\n"
    )
    parts = _score(["#### 12", "#### 3"], {f"{module}:trl": 1.0, f"{module}:original": 10.0})
    assert [p.reward for p in parts] == [11.0, 11.0]


def test_none_means_does_not_apply(custom_module):
    """TRL's None: left out of the weighted sum and of that reward's scores."""
    module = custom_module("def only_long(completions, **kwargs):\n    return [0.5 if len(c) > 8 else None for c in completions]\n")
    parts = _score(["#### 12 because", "#### 12"], {"correct": 1.0, f"{module}:only_long": 2.0})
    assert [p.reward for p in parts] == [2.0, 1.0]
    assert parts[1].scores == {"correct": 1.0} and parts[0].scores[f"{module}:only_long"] == 0.5


# --------------------------------------------------------------------------- arrays as scores (TRL takes them)


@pytest.mark.parametrize(
    "body",
    [
        "numpy.array([1.0 if '12' in c else 0.5 for c in completions])",
        "torch.tensor([1.0 if '12' in c else 0.5 for c in completions], requires_grad=True)",
        "[numpy.float32(1.0) if '12' in c else torch.tensor(0.5) for c in completions]",  # 0-d items
    ],
)
def test_a_1d_array_or_tensor_of_scores_is_taken_as_a_list_of_floats(custom_module, body):
    module = custom_module(f"import numpy\nimport torch\n\ndef arr(completions, **kwargs):\n    return {body}\n")
    parts = _score(["#### 12", "#### 11"], {f"{module}:arr": 1.0})
    assert [p.scores[f"{module}:arr"] for p in parts] == [1.0, 0.5]
    assert all(type(p.scores[f"{module}:arr"]) is float for p in parts)


def test_an_array_of_another_shape_is_refused_naming_its_shape(custom_module):
    module = custom_module("import numpy\n\ndef grid(completions, **kwargs):\n    return numpy.ones((len(completions), 2))\n")
    with pytest.raises(
        RewardError, match=rf"reward '{module}:grid' returned a ndarray of shape \(1, 2\); expected a list or 1-D array of 1 numbers"
    ):
        _score(["#### 12", "#### 11"], {f"{module}:grid": 1.0})
