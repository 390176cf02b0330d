"""This module composes a group's rewards: each reward function's scores are checked and weighted
into one reward per completion, and the scores of the models that score on pools of their own (the
LLM judge, the reward models) are added to them.

The reward of a completion is the weighted sum of the scores that apply (a score of None does not);
every reward's own score is kept for the metrics. Each reward call runs in a sandboxed worker
(grpo_flyte.scoring.workers); a failing one is reported with the reward's name and the start of the
completion that broke it, or with `on_reward_error='zero'` scores 0 and is counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_flyte.errors import RewardError, quoted
from grpo_flyte.reward_fns import JUDGE_REWARD, resolve_reward, well_formed
from grpo_flyte.runtime.sandbox import WorkerRaised
from grpo_flyte.scoring.workers import ArrayShape, correct_flags, limited
from grpo_flyte.types import JudgeVerdict, RewardModelScores, RewardParts, ScoredGroup

# Model output is shown in error messages up to this many characters.
SHOWN_CHARS = 120


def _show(text: str) -> str:
    return repr(text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else ""))


def _checked(name: str, values: Any, count: int) -> list[float | None]:
    """The scores as floats (None: does not apply), or RewardError unless they are `count` finite
    numbers or None."""
    if isinstance(values, ArrayShape):
        raise RewardError(
            f"reward {name!r} returned a {values.kind} of shape {values.shape}; expected a list or 1-D array of {count} numbers"
        )
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardError(f"reward {name!r} returned {type(values).__name__}; expected a list of {count} numbers")
    if len(values) != count:
        raise RewardError(f"reward {name!r} returned {len(values)} scores for {count} completions")
    scores = []
    for value in values:
        if value is None:
            scores.append(None)
            continue
        try:
            score = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
            raise RewardError(
                f"reward {name!r} returned {quoted(value, SHOWN_CHARS)}; expected a number that fits a float, or None"
            ) from None
        if not math.isfinite(score):
            raise RewardError(f"reward {name!r} returned {score}; expected a finite number")
        scores.append(score)
    return scores


@dataclasses.dataclass(frozen=True)
class Group:
    """What the rewards see of one prompt group besides the completions' text."""

    question: str
    answer: str
    max_new_tokens: int
    num_tokens: Sequence[int]
    completion_ids: Sequence[Sequence[int]] = ()
    prompt: str | list[dict[str, str]] | None = None  # TRL's format (see grpo_flyte.reward_fns)
    columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Multi-turn: each episode's reward from the environment, and its turns as chat messages.
    env_rewards: Sequence[float | None] = ()
    episodes: Sequence[Sequence[Mapping[str, str]]] = ()

    def only(self, i: int) -> Group:
        """The same group reduced to completion `i`."""

        def one(values: Sequence) -> list:
            return [values[i]] if values else []

        return dataclasses.replace(
            self,
            num_tokens=[self.num_tokens[i]],
            completion_ids=one(self.completion_ids),
            env_rewards=one(self.env_rewards),
            episodes=one(self.episodes),
        )


def _call(name: str, completions: list[str], group: Group, timeout_s: float) -> list[float | None]:
    """One reward call in the worker, within the time limit; its scores checked."""
    context = {"question": group.question, "answer": group.answer, "max_new_tokens": group.max_new_tokens}
    if group.episodes:
        context["env_rewards"] = list(group.env_rewards)
        context["episodes"] = [[dict(m) for m in e] for e in group.episodes]
    row = {"prompt": group.prompt, "columns": dict(group.columns)}
    ids = [list(x) for x in group.completion_ids] or [[] for _ in completions]
    args = (name, list(completions), list(group.num_tokens), ids, context, row)
    try:
        values = limited("_call_reward", args, timeout_s, f"reward {name!r}")
    except WorkerRaised as exc:
        detail = str(exc) if len(str(exc)) <= SHOWN_CHARS else str(exc)[:SHOWN_CHARS] + "..."
        raise RewardError(f"reward {name!r} raised {exc.kind}: {detail}") from None
    return _checked(name, values, len(completions))


def run_reward(
    name: str, completions: list[str], group: Group, on_error: str, timeout_s: float = 10.0
) -> tuple[list[float | None], list[bool]]:
    """One reward's scores for a group, and which completions it failed on.

    The group is scored in one call. If that fails, each completion is scored alone to find the
    ones that break it: with on_error='fail' the first is reported (the reward's name, the problem
    and the start of the completion); with 'zero' they score 0 and are flagged.
    """
    resolve_reward(name)  # a name that does not resolve is a spec error here, not a reward error
    try:
        return _call(name, completions, group, timeout_s), [False] * len(completions)
    except RewardError as batch_error:
        scores: list[float | None] = []
        failed = []
        for i, completion in enumerate(completions):
            try:
                scores.append(_call(name, [completion], group.only(i), timeout_s)[0])
                failed.append(False)
            except RewardError as exc:
                if on_error != "zero":
                    raise RewardError(
                        f"{exc} on completion {i + 1} of {len(completions)}, which starts {_show(completion)} "
                        "(on_reward_error='zero' scores such completions 0 and counts them instead)"
                    ) from exc.__cause__
                scores.append(0.0)
                failed.append(True)
        if not any(failed) and on_error != "zero":
            # Each completion scores alone but the batch call did not: a batch-size bug.
            raise RewardError(f"{batch_error} (first completion starts {_show(completions[0])})") from batch_error.__cause__
        return scores, failed


def score_completions(
    completions: list[str], group: Group, weights: Mapping[str, float], on_error: str = "fail", timeout_s: float = 10.0
) -> list[RewardParts]:
    """Every completion's weighted reward, its per-reward scores, and its correct/format flags;
    each reward call and the accuracy check within `timeout_s` seconds. A score of None (the
    reward does not apply) adds nothing and is left out of that reward's scores."""
    scores: dict[str, list[float | None]] = {}
    failures: dict[str, list[bool]] = {}
    for name in weights:
        scores[name], failures[name] = run_reward(name, completions, group, on_error, timeout_s)
    # without a gold answer (data for custom rewards only) nothing is counted correct
    correct = correct_flags(list(completions), group.answer, timeout_s) if group.answer else [False] * len(completions)
    parts = []
    for i, c in enumerate(completions):
        applied = {name: scores[name][i] for name in weights if scores[name][i] is not None}
        parts.append(
            RewardParts(
                reward=sum(weights[name] * score for name, score in applied.items()),
                correct=correct[i],
                format=well_formed(c),
                scores=applied,
                errors=[name for name in weights if failures[name][i]],
            )
        )
    return parts


def _with_scores(
    rewards: list[RewardParts], name: str, scores: Sequence[float], failed: Sequence[bool], weight: float
) -> list[RewardParts]:
    """`rewards` with the scores of reward `name` added to each completion's reward (times
    `weight`); a failed completion's score (0) is kept and the reward named among its errors."""
    if len(scores) != len(rewards):
        raise ValueError(f"reward {name!r} scored {len(scores)} completions of a group of {len(rewards)}")
    return [
        RewardParts(
            reward=p.reward + weight * score,
            correct=p.correct,
            format=p.format,
            scores={**p.scores, name: score},
            errors=[*p.errors, name] if fail else p.errors,
        )
        for p, score, fail in zip(rewards, scores, failed, strict=True)
    ]


def with_judge(scored: ScoredGroup, verdict: JudgeVerdict, weight: float) -> ScoredGroup:
    """The group with the judge's scores added to each completion's reward (times `weight`); a
    completion the judge could not score (on_reward_error='zero') scores 0 and names the judge
    among its errors."""
    parts = _with_scores(scored.rewards, JUDGE_REWARD, verdict.scores, verdict.failed, weight)
    return scored.model_copy(update={"rewards": parts, "judge": verdict})


def with_reward_model(scored: ScoredGroup, result: RewardModelScores, weight: float) -> ScoredGroup:
    """The group with a reward model's scores added to each completion's reward (times `weight`),
    under the reward's name; a completion it failed on (on_reward_error='zero') scores 0 and names
    the reward among its errors."""
    return scored.model_copy(update={"rewards": _with_scores(scored.rewards, result.reward, result.scores, result.failed, weight)})


def checked_model_scores(name: str, values: Sequence[float], completions: Sequence[str], on_error: str) -> tuple[list[float], list[bool]]:
    """A model's scores of a group checked as a reward function's are: each a finite number. With
    on_error='fail' the first that is not is a RewardError naming the reward, the value and the
    start of its completion; with 'zero' it scores 0 and is flagged."""
    scores, failed = [], []
    for i, (value, completion) in enumerate(zip(values, completions, strict=True)):
        if math.isfinite(value):
            scores.append(float(value))
            failed.append(False)
            continue
        if on_error != "zero":
            raise RewardError(
                f"reward {name!r} returned {value}; expected a finite number on completion {i + 1} of {len(completions)}, "
                f"which starts {_show(completion)} (on_reward_error='zero' scores such completions 0 and counts them instead)"
            )
        scores.append(0.0)
        failed.append(True)
    return scores, failed
