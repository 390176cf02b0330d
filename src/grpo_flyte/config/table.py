"""This module shows the options as the command line and docs/configuration.md show them: an
option's default as its flag takes it (`shown_default`, in --help), and the table of every option
(docs/configuration.md), generated from RunConfig."""

from __future__ import annotations

from typing import Any

from grpo_flyte.config.run import leaf_index
from grpo_flyte.errors import flag


def shown_default(value: Any) -> str:
    """An option's default as its flag takes it: `correct=1.0,format=0.2`, `q_proj,k_proj`."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def config_table_markdown() -> str:
    """The table of every option in docs/configuration.md, generated from RunConfig (a test keeps it in sync)."""
    rows = ["| flag | part | default | description |", "| --- | --- | --- | --- |"]
    for name, (part, field) in leaf_index().items():
        default = field.get_default(call_default_factory=True)
        names = f"`{flag(name)}`, `--no-{flag(name)[2:]}`" if isinstance(default, bool) else f"`{flag(name)}`"
        rows.append(f"| {names} | {part or 'run'} | `{shown_default(default)}` | {field.description} |")
    return "\n".join(rows)
