"""This module fills in RunConfig's defaults that depend on other options, before validation: a
pipelined run keeps more adapters, and a built-in multi-turn environment brings its dataset and
rewards (unless the config names others)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grpo_flyte.multiturn import BUILTIN_DATASETS, ENV_DEFAULT_REWARDS


def staleness_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """With max_staleness K, the adapters kept on disk and in a generate replica default to at
    least K + 1 and K + 2 (the versions in flight, and the one being trained)."""
    k = values.get("max_staleness")
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        return values
    values.setdefault("adapters_to_keep", max(3, k + 1))
    engine = values.get("engine")
    given = engine.model_dump(exclude_unset=True) if isinstance(engine, BaseModel) else dict(engine or {})
    if "adapter_cache_size" not in given:
        values["engine"] = {**given, "adapter_cache_size": max(4, k + 2)}
    return values


def env_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """A built-in multi-turn environment brings its dataset and rewards unless the config names others."""
    episode = values.get("episode")
    env = episode.env if isinstance(episode, BaseModel) else (episode or {}).get("env")
    if env not in BUILTIN_DATASETS:
        return values
    for part, name, default in (("data", "dataset", env), ("scoring", "rewards", ENV_DEFAULT_REWARDS[env])):
        given = values.get(part)
        given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else dict(given or {})
        if name not in given:
            values[part] = {**given, name: default}
    return values
