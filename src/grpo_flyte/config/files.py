"""This module reads config files: a YAML or JSON mapping of options, flat or nested by part, with
errors that name the file (and the key), within limits on its size and on what its YAML aliases
expand to."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from grpo_flyte.config.errors import misplaced
from grpo_flyte.config.run import PARTS, leaf_index
from grpo_flyte.config.trl_names import from_trl_names
from grpo_flyte.errors import ConfigError


def flatten(values: dict[str, Any]) -> dict[str, Any]:
    """A config mapping with its parts' fields pulled up to flat names (a nested config file).

    A field nested under a part it does not belong to is an error naming its part (lifting it
    anyway would hide a mistaken layout); an unknown name is left to validation."""
    flat = {k: v for k, v in values.items() if k not in PARTS or not isinstance(v, dict)}
    for part in PARTS:
        if isinstance(values.get(part), dict):
            for name, value in values[part].items():
                if (problem := misplaced(part, str(name))) is not None:
                    raise ConfigError(problem, field="config")
                flat.setdefault(name, value)
    return flat


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of config fields (flat or nested), with errors that name the file.
    A `sweep:` section (`grpo_flyte.config.grid`) comes back as it is, under `SWEEP_SECTION`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{str(p)!r}: no such file (expected a YAML or JSON file of config fields)", field="config")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{str(p)!r}: {p.stat().st_size} bytes; expected a config file under {MAX_CONFIG_BYTES} bytes", field="config")
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            # A few hundred bytes of nested aliases expand to gigabytes ("billion laughs"): count
            # the values the document expands to on its node graph (shared, so cheap) first.
            size = _expanded_size(yaml.compose(text, Loader=yaml.SafeLoader), {})
            if size > MAX_CONFIG_VALUES:
                raise ConfigError(
                    f"{str(p)!r}: expands to {size} values (YAML aliases); expected at most {MAX_CONFIG_VALUES}", field="config"
                )
            data = yaml.safe_load(text)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError
        detail = " ".join(str(exc).split())  # parser messages span lines; ours is one
        raise ConfigError(f"{str(p)!r}: not valid {p.suffix.lstrip('.') or 'YAML'}: {detail}", field="config") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{str(p)!r}: expected a mapping of config fields, got {type(data).__name__}", field="config")
    sweep = data.pop(SWEEP_SECTION, None)
    try:
        values = from_trl_names(flatten(data))
    except ValueError as exc:
        raise ConfigError(f"{str(p)!r}: {exc}", field="config") from None
    _check_known_keys(p, data, values)
    if sweep is not None:
        values[SWEEP_SECTION] = sweep
    return values


def _check_known_keys(p: Path, data: dict[str, Any], values: dict[str, Any]) -> None:
    """A ConfigError naming the file and the path in it of the first key that is no option (a
    misspelling says what it was probably meant to be), never blamed on a command-line flag."""
    index = leaf_index()
    for key in values:
        if key in index:
            continue
        nested = next((part for part in PARTS if isinstance(data.get(part), dict) and key in data[part]), None)
        where = f"{nested}.{key}" if nested and key not in data else str(key)
        close = difflib.get_close_matches(str(key), index, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; see --help or docs/configuration.md for the options"
        raise ConfigError(f"{str(p)!r}: unknown key {where!r}{hint}", field="config")


SWEEP_SECTION = "sweep"
MAX_CONFIG_BYTES = 1_000_000
MAX_CONFIG_VALUES = 100_000  # YAML scalars, lists and mappings once aliases are expanded


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """How many values a composed YAML node stands for with every alias expanded (memoized on the
    shared nodes, so linear in the file)."""
    if node is None:
        return 0
    if id(node) not in memo:
        memo[id(node)] = 1  # a cycle counts once
        children = node.value if isinstance(node.value, list) else []
        total = 1
        for child in children:
            total += sum(_expanded_size(n, memo) for n in child) if isinstance(child, tuple) else _expanded_size(child, memo)
        memo[id(node)] = total
    return memo[id(node)]
