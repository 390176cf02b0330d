"""This module defines the answers a run keeps to show and to compare: each held-out question's answer
(`EvalAnswer`, greedy or the means of sampled completions), the iteration's best completion for the
report, and the sample --log-completions writes. The loop's checkpoint holds them (loop.state).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_serializer

from grpo_flyte.types import EpisodeTurn, TaskValue


class EvalCompletion(TaskValue):
    """One sampled completion of a held-out question and its scores (a multi-turn episode: its turns
    and tool calls too)."""

    completion: str
    reward: float
    correct: bool
    format: bool
    scores: dict[str, float]
    tool_calls: int | None = None
    turns: list[EpisodeTurn] | None = None


class EvalAnswer(TaskValue):
    """One held-out question, the model's greedy answer and its scores (a multi-turn episode: its
    turns and tool calls too).

    With num_generations_eval, `completions` holds each sampled completion with its scores;
    `completion`, `tool_calls` and `turns` are the first one's, and `reward`, `correct`, `format`
    and `scores` the question's means over them (`correct`: the share of its completions that are
    correct). A greedy answer has no `completions` key, as before the option existed.
    """

    question: str
    answer: str
    completion: str
    reward: float
    correct: bool | float
    format: bool | float
    scores: dict[str, float]
    tool_calls: int | None = None
    turns: list[EpisodeTurn] | None = None
    completions: list[EvalCompletion] | None = None

    @model_serializer(mode="wrap")
    def _greedy_as_before(self, handler: Any) -> dict[str, Any]:
        # a greedy answer dumps (checkpoint, eval files) exactly as before num_generations_eval
        data = handler(self)
        if self.completions is None:
            data.pop("completions", None)
        return data


class BestCompletion(TaskValue):
    question: str
    answer: str
    completion: str
    reward: float
    turns: list[EpisodeTurn] | None = None  # a multi-turn episode, turn by turn
    # With the 'judge' reward: the judge's score of every completion of the best one's group (the
    # best at `index`), and the start of each completion's text.
    judge_scores: list[float] | None = None
    group_texts: list[str] | None = None
    index: int | None = None


class CompletionSample(TaskValue):
    """One completion of an iteration's sample (--log-completions): its prompt's question and
    answer, the completion (an episode's transcript), its reward and its advantage in the train step."""

    iteration: int
    group: int  # the prompt's position in its iteration
    question: str
    answer: str
    completion: str
    reward: float
    advantage: float
    scores: dict[str, float]
    finish_reason: Literal["stop", "length"]
