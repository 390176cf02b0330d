"""This module words RunConfig's validation errors as a user reads them: one line per problem, naming
the flag, the value given and what was expected; `make_config` raises them as one ConfigError."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from grpo_flyte.config.run import PARTS, RunConfig, leaf_index
from grpo_flyte.errors import ConfigError, flag, shown


def misplaced(part: str, name: str) -> str | None:
    """Why `name` cannot be under `part`: it is a field of another part (or of the loop); else None."""
    home = leaf_index().get(name)
    if home is None or home[0] == part:
        return None
    where = f"the {home[0]!r} part" if home[0] else "the top level (a loop field)"
    return f"'{part}.{name}': {name} belongs to {where}, not {part!r}; expected it there, or flat"


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: the flag, the value given, and what was expected."""
    index = leaf_index()
    lines = []
    for err in exc.errors():
        names = [str(part) for part in err.get("loc", ()) if not isinstance(part, int)]
        # The innermost name that is an option: ('sampling', 'group_size') -> group_size.
        name = next((n for n in reversed(names) if n in index), names[-1] if names else None)
        where = flag(name) if name else "config"
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        if err.get("type") == "value_error" and (name is None or name in PARTS):
            lines.append(msg)  # a check of several options together (a model validator): its message names their flags
            continue
        if err.get("type") == "extra_forbidden":
            loc = [str(part) for part in err.get("loc", ())]
            problem = misplaced(loc[-2], loc[-1]) if len(loc) >= 2 and loc[-2] in PARTS else None
            lines.append(f"{where}: {problem}" if problem else f"{where}: unknown option (see --help for the list)")
            continue
        if "input" in err and name:
            field = index[name][1] if name in index else None
            custom = err.get("type") == "value_error"  # our own validators already say what is expected
            hint = f" ({field.description.rstrip('.')})" if field and field.description and not custom else ""
            lines.append(f"{where}={shown(err['input'])}: {msg}{hint}")
        else:
            lines.append(f"{where}: {msg}" if name else msg)
    return "; ".join(lines)


def make_config(**values: Any) -> RunConfig:
    """Build a RunConfig from flat or nested values, turning validation errors into one ConfigError."""
    try:
        return RunConfig(**values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
