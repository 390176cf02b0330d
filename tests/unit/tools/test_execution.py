"""A tool call in the sandbox: every outcome (a return of any type, a print, a raise, a timeout,
a dead worker) is text the model reads, and only the failures are errors."""

from __future__ import annotations

import time

import pytest

from grpo_flyte.tools.execution import MAX_ANSWER_CHARS, Answer, answer_text, call_tool

FNS = "tests.support.tool_fns"
SPECS = tuple(f"{FNS}:{name}" for name in ("add", "chatty", "record", "opaque", "broken", "sleepy", "vanishing", "shout"))


def call(name: str, timeout_s: float = 30.0, **arguments) -> Answer:
    return call_tool(SPECS, f"{FNS}:{name}", arguments, timeout_s)


def test_a_return_value_is_the_answer_a_string_as_it_is_anything_else_as_json():
    assert call("add", a=2, b=3) == Answer("5")
    assert call("shout", text='say "hi"\n') == Answer('SAY "HI"\n')
    assert call("record", key="k") == Answer('{"key": "k", "values": [1, 2]}')
    assert call("opaque") == Answer("{1, 2}")  # no JSON: its str()


def test_what_a_tool_prints_is_its_answer_only_when_it_returns_nothing(capfd):
    assert call("chatty", n=3) == Answer("counted 3\n")
    assert "counted" not in capfd.readouterr().out  # never the run's stdout


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("broken", {"x": 4}, "error: KeyError: 'no entry 4'"),
        ("add", {"a": 1}, "error: TypeError: add() missing 1 required positional argument: 'b'"),
        ("add", {"a": 1, "b": 2, "c": 3}, "error: TypeError: add() got an unexpected keyword argument 'c'"),
        ("vanishing", {}, "error: the tool 'vanishing' ended its worker process (exit code 3)"),
    ],
)
def test_a_tool_that_fails_is_an_error_answer(name, arguments, expected):
    assert call(name, **arguments) == Answer(expected, error=True)


def test_a_tool_past_its_time_limit_is_stopped_and_the_next_call_runs():
    call("add", a=0, b=0)  # a worker started (its start is no call's time)
    started = time.monotonic()
    assert call("sleepy", timeout_s=1.0, seconds=60) == Answer("error: the tool took longer than 1 s and was stopped", error=True)
    assert time.monotonic() - started < 20
    assert call("sleepy", seconds=0) == Answer("awake")


def test_a_long_answer_is_cut():
    text = answer_text("x" * (MAX_ANSWER_CHARS + 5), "")
    assert text.startswith("x" * MAX_ANSWER_CHARS) and text.endswith(f"... [cut at {MAX_ANSWER_CHARS} characters]")
    assert answer_text(None, "") == "" and answer_text(2.5, "ignored") == "2.5"
