"""This module runs the reward calls in the sandbox: the worker pool, and the functions its workers run.

A reward function sees untrusted model output, and math-verify can take forever on it (`9^9^9^9`),
so every call runs in a worker process of `grpo_flyte.runtime.sandbox` within a time limit. The
workers call the functions of this module by name: one reward function on a group (TRL's way or
the original one, see grpo_flyte.reward_fns), the accuracy check, and the reading of gold answers.
A worker imports this module: it stays free of Flyte and the config.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

from grpo_flyte.errors import RewardTimeout
from grpo_flyte.reward_fns import MARKER, REWARD_FUNCTIONS, RewardFn, gold_is_usable, is_correct, is_integer, resolve_reward
from grpo_flyte.runtime.sandbox import WorkerPool


def worker_count(cpus: int) -> int:
    """How many groups one process scores at once, each in a worker of its own
    (grpo_flyte.runtime.sandbox): one a CPU it may run on, at least 2 (a stuck reward holds up no
    other group) and at most 8. A worker is a Python process with math-verify loaded, ~60 MB
    resident: on a 2-core laptop 8 of them held 0.49 GB of the demo's peak for no speed, the
    built-in rewards being CPU work (docs/measurements.md#where-a-local-runs-memory-goes-issue-55-2026-11-27).
    Further groups wait for a free worker; their time limits start when they get one."""
    return max(2, min(8, cpus))


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Workers start as needed, and math-verify loads before a worker's first timed call.
MAX_WORKERS = worker_count(_cpus())
_workers = WorkerPool(MAX_WORKERS, preload=("math_verify", __name__))


def use_workers(size: int | None) -> None:
    """Score `size` groups at once from now on, each in a worker of its own (None: MAX_WORKERS, one a
    CPU): a run's --reward-workers, which every score call of a replica brings."""
    _workers.resize(size or MAX_WORKERS)


def start_workers(count: int, size: int | None = None) -> int:
    """Start `count` workers (the pool holds `size`, `use_workers`') side by side ahead of the groups
    that will need them, so that no group waits for a worker to import math-verify; how many started now."""
    use_workers(size)
    return _workers.start(count)


def limited(fn: str, args: tuple, timeout_s: float, what: str) -> Any:
    """`fn(*args)` (a function of this module, by name) in the sandbox, within `timeout_s` seconds."""
    return _workers.call(f"{__name__}:{fn}", args, timeout_s, what)


# --------------------------------------------------------------------------- one reward call


def trl_style(fn: RewardFn, trl_data: bool) -> bool:
    """Whether `fn` is called TRL's way: the data are in TRL's format, or it takes `prompts`."""
    return trl_data or _takes_prompts(fn)


@functools.cache
def _takes_prompts(fn: RewardFn) -> bool:
    # once per function and worker process: the worker calls it for every group
    try:
        return "prompts" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def trl_arguments(
    completions: list[str], completion_ids: list[list[int]], context: Mapping[str, Any], row: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments TRL passes a reward function, for one group: lists, one entry per completion."""
    n = len(completions)
    prompt = row.get("prompt")
    chat = isinstance(prompt, list)
    columns = {"answer": context["answer"], **row.get("columns", {})}
    if chat:  # a multi-turn episode is its messages, as TRL passes a conversation
        episodes = context.get("episodes") or [[{"role": "assistant", "content": c}] for c in completions]
    return {
        "prompts": [prompt if prompt is not None else context["question"]] * n,
        "completions": episodes if chat else list(completions),
        "completion_ids": [list(ids) for ids in completion_ids],
        **{name: [value] * n for name, value in columns.items()},
        **{name: list(context[name]) for name in ("episodes", "env_rewards") if name in context},
    }


def _call_reward(
    name: str, completions: list[str], num_tokens: list[int], completion_ids: list[list[int]], context: dict[str, Any], row: dict[str, Any]
) -> Any:
    fn = resolve_reward(name)
    if name not in REWARD_FUNCTIONS and trl_style(fn, row.get("prompt") is not None):
        values = fn(**trl_arguments(completions, completion_ids, context, row))
    else:
        values = fn(completions, num_tokens=num_tokens, **context)
    return _plain_scores(values)


def _plain_scores(values: Any) -> Any:
    """A reward's return value as the parent can check it without numpy or torch: a list or a
    1-D array or tensor (TRL takes those) becomes a list of Python numbers, 0-d items their number;
    an array of another shape its `ArrayShape`."""
    if hasattr(values, "tolist") and hasattr(values, "ndim"):
        if values.ndim != 1:
            return ArrayShape(type(values).__name__, tuple(values.shape))
        return values.tolist()
    if isinstance(values, (list, tuple)):
        return [v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v for v in values]
    return values


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """What the parent hears of a returned array that is not one-dimensional."""

    kind: str
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- flags, each within the limit


def _correct_flags(completions: list[str], answer: str) -> list[bool]:
    return [is_correct(c, answer) for c in completions]


def _flags_within(fn: str, items: list, rest: tuple, timeout_s: float, what: str) -> list[bool]:
    """`fn(items, *rest)` (a list of flags) in the worker within the time limit; if the batch runs
    out of time, each item alone, an item that still does counting False."""
    try:
        return limited(fn, (items, *rest), timeout_s, what)
    except RewardTimeout:
        flags = []
        for item in items:
            try:
                flags.append(limited(fn, ([item], *rest), timeout_s, what)[0])
            except RewardTimeout:
                flags.append(False)
        return flags


def correct_flags(completions: list[str], answer: str, timeout_s: float) -> list[bool]:
    """Which completions state the gold answer (the accuracy metric), each within the time limit;
    a completion whose check runs out of time is not counted correct."""
    return _flags_within("_correct_flags", completions, (answer,), timeout_s, "the accuracy check")


def _usable_many(answers: list[str]) -> list[bool]:
    # Comparing a completion with the gold answer must finish too: math-verify reads `10**10**10`
    # at once but never finishes comparing anything with it. The probe's outcome does not matter.
    return [gold_is_usable(a) and (is_correct(f"{MARKER} 1", a) or True) for a in answers]


def usable_golds(answers: list[str], timeout_s: float, chunk: int = 256) -> list[bool]:
    """`gold_is_usable` for many gold answers, each read within the reward time limit: an answer
    math-verify cannot read in time (`10**10**10`) is not usable. Integers need no worker."""
    flags = [is_integer(a) for a in answers]
    todo = [i for i, ok in enumerate(flags) if not ok]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        found = _flags_within("_usable_many", [answers[i] for i in part], (), timeout_s, "reading gold answers")
        for i, ok in zip(part, found, strict=True):
            flags[i] = ok
    return flags
