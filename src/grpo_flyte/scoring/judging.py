"""This module holds the LLM judge's pure parts: its prompt, the JSON it answers with, splitting a
group to fit its context, and its metrics (no Flyte, no torch; the task is grpo_flyte.judge, and
grpo_flyte.scoring.compose adds its scores to a group's rewards).

Group-relative scoring as OpenPipe's RULER does it: one judge prompt holds the question once and
every completion of the group, numbered; the judge answers `{"scores": [s1, ..., sN]}`, one score in
[0, 1] per completion, each relative to its siblings. The reply is started for the judge (the
prompt ends with `{"scores": [`), and both backends constrain the rest to `scores_regex(n)`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_flyte.types import ScoredGroup

REPLY_PREFIX = '{"scores": ['
REPLY_END = "}"  # no score holds one: the first closes the reply's object
# A score as the judge writes one: 0, 0.5, 0.75, 1, 1.0 (two decimals at most).
SCORE_PATTERN = r"(0(\.[0-9]{1,2})?|1(\.0{1,2})?)"
# Reply tokens: the closing brackets, then a score and its separator per completion. The regex
# holds a score to two decimals ('0.75, ' is at most 6 tokens); the margin is for an engine that
# does not constrain (a small judge left alone writes scores like 0.7856530388620062).
REPLY_BASE_TOKENS = 8
REPLY_TOKENS_PER_SCORE = 16
# Each completion's header in the prompt ('\n\nAnswer 12:\n'), in tokens at most.
HEADER_TOKENS = 8
# The judge sees this much of each completion's text in a report (the scores table).
SHOWN_CHARS = 160

INSTRUCTIONS = (
    "You are a strict judge. {rubric}\n\n"
    "You will see a question and {n} numbered answers to it. Reply with JSON only, in this form: "
    '{{"scores": [s1, ..., s{n}]}}: one score between 0 and 1 per answer, in the answers\' order, '
    "with at most two decimals."
)


# The judge's rubric unless --judge-rubric gives another (the judge scores every completion of a
# group against it, each relative to its siblings).
DEFAULT_RUBRIC = (
    "Score each answer by whether it is a correct, helpful answer to the question: a correct final "
    "answer, reached by sound steps and stated clearly, scores near 1; a wrong, missing or "
    "irrelevant answer scores near 0. Compare the answers with each other: a better answer gets a "
    "higher score."
)
# A --judge-rubric value that names an existing file is that file, whatever its extension (refusing
# rubric.rst or a file without one would only make the user rename it). Rubric text is sentences: a
# value without spaces holding a '/' or ending in an extension is a file's name, and names no file
# when it is missing (a typo is an error, not the rubric).
RUBRIC_FILE_NAME = re.compile(r"\S*(/\S*|\.[A-Za-z0-9]{1,8})")
MAX_RUBRIC_CHARS = 20_000


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system: text
        return False


def read_rubric(rubric: str) -> str:
    """The rubric a --judge-rubric value stands for: a file's text (so a cluster's pods, which cannot
    read this machine's files, get the text), or the value itself; ValueError for a file that
    cannot be its rubric."""
    candidate = rubric.strip()
    if "\n" in candidate:
        return rubric
    path = Path(candidate).expanduser()
    if not _exists(path) and not RUBRIC_FILE_NAME.fullmatch(candidate):
        return rubric
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"rubric file {candidate!r} cannot be read ({reason}); expected rubric text or a readable UTF-8 file") from None
    if not text.strip():
        raise ValueError(f"rubric file {candidate!r} is empty; expected the rubric's text in it")
    if len(text) > MAX_RUBRIC_CHARS:
        raise ValueError(f"rubric file {candidate!r} has {len(text)} characters; expected at most {MAX_RUBRIC_CHARS}")
    return text.strip()


def judge_messages(rubric: str, question: str, completions: Sequence[str]) -> list[dict[str, str]]:
    """The judge's chat: the rubric and the reply format, then the question once and every answer numbered."""
    answers = "".join(f"\n\nAnswer {i}:\n{text}" for i, text in enumerate(completions, start=1))
    return [
        {"role": "system", "content": INSTRUCTIONS.format(rubric=rubric.strip(), n=len(completions))},
        {"role": "user", "content": f"Question:\n{question}{answers}"},
    ]


def render_judge_prompt(tokenizer, rubric: str, question: str, completions: Sequence[str]) -> tuple[str, bool]:
    """The judge prompt's text, ending with the start of its reply, and whether the chat template
    rendered it (then it holds its special tokens already). A tokenizer without a chat template gets
    the messages as plain text."""
    messages = judge_messages(rubric, question, completions)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + REPLY_PREFIX, True
    plain = "\n\n".join(m["content"] for m in messages)
    return f"{plain}\n\nJudge:\n{REPLY_PREFIX}", False


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fixed_tokens(tokenizer, rubric: str, question: str) -> int:
    """The tokens of a judge prompt besides its completions: the instructions with the rubric, the
    question, and the reply's frame."""
    frame, _ = render_judge_prompt(tokenizer, rubric, question, [])
    return token_count(tokenizer, frame) + REPLY_BASE_TOKENS


def completion_room(fixed: int, budget: int) -> int:
    """The most tokens of one completion a judge prompt of `fixed` tokens holds in `budget`
    (with its header and its score)."""
    return budget - fixed - HEADER_TOKENS - REPLY_TOKENS_PER_SCORE


def scores_regex(n: int) -> str:
    """What may follow REPLY_PREFIX: exactly `n` scores in [0, 1], then the closing brackets
    (vLLM's structured outputs, or the transformers backend's logits mask, hold the judge to it)."""
    if n < 1:
        raise ValueError(f"n={n}: a judge prompt holds at least one completion")
    rest = f"(, {SCORE_PATTERN}){{{n - 1}}}" if n > 1 else ""
    return f"{SCORE_PATTERN}{rest}\\]\\}}"


def reply_tokens(n: int) -> int:
    """The judge's reply budget for `n` completions."""
    return REPLY_BASE_TOKENS + REPLY_TOKENS_PER_SCORE * n


def parse_scores(reply: str, n: int) -> list[float] | None:
    """The `n` scores of a reply (the text generated after REPLY_PREFIX), or None when it is not
    `{"scores": [...]}` with exactly `n` numbers in [0, 1]. Text after the JSON object is ignored
    (an unconstrained judge may go on talking)."""
    try:
        value, _ = json.JSONDecoder().raw_decode(REPLY_PREFIX + reply)
    except ValueError:
        return None
    scores = value.get("scores") if isinstance(value, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        return None
    out = []
    for score in scores:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) or not 0.0 <= score <= 1.0:
            return None
        out.append(float(score))
    return out


def chunk_indices(fixed_tokens: int, completion_tokens: Sequence[int], budget: int) -> list[list[int]]:
    """The completions (by index, in order) of each judge prompt: as many per prompt as fit in
    `budget` tokens, counting `fixed_tokens` (the rubric, the question and the reply's frame) once
    and, per completion, its tokens, its header and its score. One prompt when the whole group fits;
    a completion that does not fit even alone gets a prompt of its own (the task cuts its text)."""
    chunks: list[list[int]] = []
    used = fixed_tokens
    for i, size in enumerate(completion_tokens):
        cost = size + HEADER_TOKENS + REPLY_TOKENS_PER_SCORE
        if chunks and chunks[-1] and used + cost <= budget:
            chunks[-1].append(i)
            used += cost
        else:
            chunks.append([i])
            used = fixed_tokens + cost
    return chunks


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The seconds during which at least one of the (start, end) intervals was running (the judge
    stage's wall clock: concurrent calls are not counted twice)."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def judge_metrics(scored: Sequence[ScoredGroup], judge_s: float) -> dict[str, float | int]:
    """An iteration's judge metrics (TrainMetrics' judge_* fields), {} when no group was judged."""
    verdicts = [sg.judge for sg in scored if sg.judge is not None]
    if not verdicts:
        return {}
    return {
        "judge_s": judge_s,
        "judge_calls": sum(v.calls for v in verdicts),
        "judge_retries": sum(v.retries for v in verdicts),
        "judge_invalid": sum(v.invalid for v in verdicts),
        "judge_split_groups": sum(v.chunks > 1 for v in verdicts),
    }
