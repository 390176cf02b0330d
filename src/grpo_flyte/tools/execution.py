"""This module runs one tool call in the sandbox (`grpo_flyte.runtime.sandbox`) within a time limit,
and turns every outcome into the text the model reads in its `tool` message.

A tool sees arguments the model wrote, so it runs as a reward does: in a worker process that is
killed when the call runs past `tool_timeout_s`, with the tools' modules imported before the
worker says it is ready (their import is no call's time). The outcomes, each answered to the model:

    returns a str                 that string
    returns None                  what it printed (Python's sys.stdout, captured), or ''
    returns anything else         its JSON (json.dumps), or str() of it when it has none
    raises                        'error: <ExceptionType>: <message>'                 (an error)
    runs past the limit           'error: the tool took longer than <t> s ...'        (an error)
    ends its worker (os._exit)    'error: ...'                                        (an error)

What a tool prints besides its return value is not its answer; output written to file descriptor
1 by C code or a subprocess goes to the run's stderr, as a reward's does. An answer longer than
MAX_ANSWER_CHARS is cut there (the episode's token budget would end it anyway).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import threading
from dataclasses import dataclass
from typing import Any

from grpo_flyte.errors import RewardError, RewardTimeout
from grpo_flyte.runtime.sandbox import WorkerPool, WorkerRaised

# Calls one process runs at once, each in a worker of its own (the episodes of the groups a warm
# generate replica plays together); workers start only when every started one is busy.
MAX_TOOL_WORKERS = 8
MAX_ANSWER_CHARS = 100_000


@dataclass(frozen=True)
class Answer:
    """The text of a tool message, and whether it reports a failure (counted in tool_errors)."""

    text: str
    error: bool = False


def answer_text(value: Any, printed: str) -> str:
    """The answer of a call that returned `value` after printing `printed` (the table above)."""
    if value is None:
        text = printed
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= MAX_ANSWER_CHARS else text[:MAX_ANSWER_CHARS] + f"... [cut at {MAX_ANSWER_CHARS} characters]"


def _run_tool(spec: str, arguments: dict[str, Any]) -> str:
    """In the worker: the tool `spec` names called with `arguments`, its answer as text. What it
    raises is the worker's reply (`WorkerRaised` in the parent)."""
    module, name = spec.split(":")
    fn = getattr(importlib.import_module(module), name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        value = fn(**arguments)
    return answer_text(value, printed.getvalue())


_pools: dict[tuple[str, ...], WorkerPool] = {}
_pools_lock = threading.Lock()


def _pool(specs: tuple[str, ...]) -> WorkerPool:
    """The workers of one set of tools (a process keeps one pool per set: a sweep's configs may name others)."""
    with _pools_lock:
        if specs not in _pools:
            modules = tuple(dict.fromkeys(spec.split(":")[0] for spec in specs))
            _pools[specs] = WorkerPool(MAX_TOOL_WORKERS, preload=(__name__, *modules))
        return _pools[specs]


def call_tool(specs: tuple[str, ...], spec: str, arguments: dict[str, Any], timeout_s: float) -> Answer:
    """`spec`'s tool called with `arguments` in a worker of `specs`' pool, within `timeout_s` seconds."""
    name = spec.split(":")[1]
    try:
        text = _pool(specs).call(f"{__name__}:_run_tool", (spec, arguments), timeout_s, f"the tool {name!r}")
    except WorkerRaised as exc:
        return Answer(f"error: {exc.kind}: {exc}", error=True)
    except RewardTimeout:
        return Answer(f"error: the tool took longer than {timeout_s:g} s and was stopped", error=True)
    except RewardError as exc:  # the call ended its worker, or its reply was no reply
        return Answer(f"error: {exc}", error=True)
    return Answer(text)
