"""This module loads the tools of `--tools module:fn,...` and gives each its JSON schema.

A tool is a plain Python function with type hints and a Google-style docstring (a summary, then
`Args:` with a line per argument), as TRL's `tools=` takes it. Its schema is transformers' own
(`transformers.utils.get_json_schema`), the one chat templates render with `tools=`. Every problem
is a ToolSpecError naming the value, raised before a run starts (`grpo_flyte.launch.preflight`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_flyte.errors import ToolSpecError, import_user_attribute, is_user_attribute


@dataclass(frozen=True)
class Tool:
    """One tool: its `--tools` value ('module:fn'), the name the model calls it by (the function's
    name) and its JSON schema ({'type': 'function', 'function': {name, description, parameters}})."""

    spec: str
    name: str
    schema: dict[str, Any]


def tool_names(value: Any) -> Any:
    """A comma-separated string or a list of 'module:fn' values as a tuple, blanks and repeats
    dropped, each checked (`check_tool_name`); other types are left for pydantic to refuse."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)):
        return value
    names = tuple(dict.fromkeys(str(v).strip() for v in value if str(v).strip()))
    for spec in names:
        check_tool_name(spec)
    return names


def check_tool_name(spec: str) -> None:
    """ValueError unless `spec` has the shape module:function."""
    if not is_user_attribute(spec):
        raise ValueError(f"{spec!r}: expected 'module:function', a function importable where the run's tasks run")


def load_tool(spec: str) -> Tool:
    """The tool `spec` names, with its schema; ToolSpecError naming `spec` when its module does not
    import, it names no function, or transformers cannot make a schema of it (no docstring, an
    argument without a type hint or without its line under 'Args:')."""
    try:
        check_tool_name(spec)
    except ValueError as exc:
        raise ToolSpecError(str(exc)) from None
    fn = import_user_attribute(spec, ToolSpecError)
    module_name, attr = spec.split(":")
    if fn is None:
        raise ToolSpecError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}; expected a function")
    if not inspect.isfunction(fn):
        raise ToolSpecError(f"{spec!r} is {type(fn).__name__}, not a function; expected a plain (def) function")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ToolSpecError(f"{spec!r} is an async or generator function; expected a plain function returning its answer")
    return Tool(spec=spec, name=fn.__name__, schema=_schema(spec, fn))


def _schema(spec: str, fn: Callable) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 -- transformers raises its own kinds for each missing part
        raise ToolSpecError(
            f"{spec!r}: no JSON schema from its signature and docstring ({type(exc).__name__}: {exc}); expected type hints on "
            "every argument and a docstring with a summary and an 'Args:' section naming each argument"
        ) from None
    schema["function"].pop("return", None)  # what chat templates render is the call's shape
    return schema


def load_tools(specs: tuple[str, ...]) -> list[Tool]:
    """The tools `specs` name, in order; ToolSpecError when two share a function name (the model
    calls a tool by that name)."""
    tools = [load_tool(spec) for spec in specs]
    seen: dict[str, str] = {}
    for tool in tools:
        if tool.name in seen:
            raise ToolSpecError(f"{tool.spec!r} and {seen[tool.name]!r} are both called {tool.name!r}; expected distinct function names")
        seen[tool.name] = tool.spec
    return tools
