"""This module expands a sweep's `--sweep KEY=V1,V2` flags (or a config file's `sweep:` section) into
one `RunConfig` per combination (or per entry of a list), each named by what it changes.

Everything is checked here, before any task starts: an unknown key, a value its option refuses, a
key also given as a flag, two configs with one name, and a key whose values would keep the configs
from sharing the warm pools they share (one generate engine and one loaded base on the train side
per base model, one judge engine), or, on vLLM, give a shared engine two context lengths
(`_check_contexts`). Each error is one line naming `--sweep`, the key and the value.

The base model (`model`, `dtype`) may vary: each base gets its own engine and loaded base on every
replica, which hold `MAX_BASES` at most; on vLLM the bases' engines share a replica's GPU, so their
`vllm_memory_fraction`s together must fit in `VLLM_MEMORY_BUDGET` (refused before starting, not
split: the fraction is the user's to choose, and a lone run of a config takes the same).

From Python: `expand_sweep(RunConfig(...).flat() or {}, {"learning_rate": [1e-4, 2e-4], "seed": [0, 1]})`.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import logging
import re
import time
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from grpo_flyte.config.constants import MAX_BASES, MAX_REWARD_MODELS, VLLM_MEMORY_BUDGET
from grpo_flyte.config.episode import context_length
from grpo_flyte.config.errors import make_config
from grpo_flyte.config.run import RunConfig, leaf_index
from grpo_flyte.config.trl_names import TRL_ALIASES
from grpo_flyte.errors import ConfigError, flag
from grpo_flyte.reward_fns import reward_model_ref

# Keys whose values would give the configs different pools: each config would need its own engine
# or its own loaded base, which a sweep on one warm pool exists to share. (The base model may vary:
# BASE_KEYS.)
POOL_KEYS = {
    "backend": "the generate engine",
    "adapter_cache_size": "the generate engine",
    "vllm_memory_fraction": "the generate engine",
    "lora_rank": "the train pool's loaded base (its LoRA layers)",
    "lora_alpha": "the train pool's loaded base (its LoRA layers)",
    "lora_dropout": "the train pool's loaded base (its LoRA layers)",
    "lora_target_modules": "the train pool's loaded base (its LoRA layers)",
    "load_in_4bit": "the train pool's loaded base",
    "embeddings_in_4bit": "the train pool's loaded base",
    "train_processes": "the train pool's processes",
    "judge_model": "the judge's engine",
    "reward_workers": "the reward pool's workers",
}
# Keys that choose the base model: each value its own engine and loaded base per replica.
BASE_KEYS = ("model", "dtype")
# Keys that set a vLLM engine's context length (max_model_len): the generate engine's
# (`episode.context_length`) and the judge's. A replica keeps one generate engine per base and
# the judge's pool one engine, so configs of different lengths would rebuild it at every switch
# between them: refused on vLLM (`_check_contexts`); transformers engines do not depend on it.
CONTEXT_KEYS = ("max_prompt_tokens", "max_new_tokens", "max_episode_tokens", "env")
JUDGE_CONTEXT_KEYS = ("judge_context_tokens",)
# A sweep's configs at most: each is a run of its own (a local sweep's all in one process, a cluster
# sweep's all at once on the pools); a larger grid is much more often a mistyped value list than a
# plan. docs/configuration.md#sweeps.
MAX_CONFIGS = 256
# Seconds between the lines that say how far a long check of a sweep's configs has come.
CHECK_PROGRESS_S = 2.0

logger = logging.getLogger(__name__)


class CheckProgress:
    """Says how far a check of many configs has come: a line at most every CHECK_PROGRESS_S seconds
    ('checking the sweep's configs: 40 of 110'), and one when a check that said anything ends;
    nothing for a check that takes less."""

    def __init__(self, what: str, total: int, clock: typing.Callable[[], float] = time.monotonic):
        self.what, self.total, self.clock = what, total, clock
        self.started = self.last = clock()
        self.said = False

    def step(self, done: int) -> None:
        now = self.clock()
        if now - self.last >= CHECK_PROGRESS_S and done < self.total:
            logger.info("%s: %d of %d", self.what, done, self.total)
            self.last, self.said = now, True
        elif done == self.total and self.said:
            logger.info("%s: %d of %d in %.0f s", self.what, done, self.total, now - self.started)


class SweepMember(BaseModel):
    """One config of a sweep: its name (also its run folder's), what it changes, the whole config."""

    name: str
    overrides: dict[str, Any]
    config: RunConfig


def option_name(key: str) -> str:
    """A sweep key as the option it names (`learning-rate`, TRL's `num_generations`), or a one-line error."""
    name = key.strip().replace("-", "_")
    name = TRL_ALIASES.get(name, name)
    index = leaf_index()
    if name not in index:
        close = difflib.get_close_matches(name, index, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; expected an option's name (see --help)"
        raise ConfigError(f"{key!r}: unknown option{hint}", field="sweep")
    return name


def parse_sweep_flag(text: str) -> tuple[str, list[str]]:
    """`KEY=V1,V2,...` as (option, values). Values are split on `;` when there is one (for values
    with commas in them, e.g. `rewards=correct=1;correct=1,format=0.1`), else on `,`."""
    key, eq, rest = text.partition("=")
    if not eq or not key.strip() or not rest.strip():
        raise ConfigError(f"{text!r}: expected KEY=VALUE1,VALUE2,... (e.g. --sweep learning_rate=1e-4,2e-4)", field="sweep")
    values = [v.strip() for v in rest.split(";" if ";" in rest else ",")]
    if any(not v for v in values):
        raise ConfigError(f"{text!r}: an empty value; expected KEY=VALUE1,VALUE2,...", field="sweep")
    name = option_name(key)
    return name, [from_text(name, v) for v in values]


def sweep_grid(flags: list[str], section: Any = None) -> dict[str, list[Any]] | list[dict[str, Any]]:
    """The sweep the user asked for: `--sweep` flags, or a config file's `sweep:` section (a mapping
    of option -> list of values, a grid; or a list of mappings, one config each). Flags and a
    section together are refused (which one wins would be a guess)."""
    if flags and section:
        raise ConfigError("is given both as flags and in the --config file's 'sweep:' section; expected one of them", field="sweep")
    if flags:
        grid: dict[str, list[Any]] = {}
        for text in flags:
            name, values = parse_sweep_flag(text)
            if name in grid:
                raise ConfigError(f"{text!r}: {name} is swept twice; expected each key once", field="sweep")
            grid[name] = values
        return grid
    if section is None:
        return {}
    if isinstance(section, dict):
        grid = {}
        for key, values in section.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"'sweep.{key}': expected a non-empty list of values, got {values!r}", field="config")
            name = option_name(str(key))
            grid[name] = [from_text(name, v) for v in values]
        return grid
    if isinstance(section, list) and section and all(isinstance(entry, dict) and entry for entry in section):
        return [{(name := option_name(str(k))): from_text(name, v) for k, v in entry.items()} for entry in section]
    raise ConfigError(f"'sweep': expected a mapping of option -> list of values, or a list of mappings; got {section!r}", field="config")


def from_text(name: str, value: Any) -> Any:
    """A flag's text as its option takes it where pydantic would not: `a=1,b=2` for a mapping
    (`rewards`), `a,b` for a tuple (`lora_target_modules`); anything else as it is."""
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(leaf_index()[name][1].annotation)
    if origin is dict:
        pairs = [part.partition("=") for part in value.split(",")]
        if any(not eq or not k.strip() for k, eq, _ in pairs):
            raise ConfigError(f"{name}={value}: expected NAME=WEIGHT,... (e.g. correct=1,format=0.1)", field="sweep")
        return {k.strip(): v.strip() for k, _, v in pairs}
    if origin is tuple:
        return tuple(part.strip() for part in value.split(","))
    return value


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def member_name(overrides: dict[str, Any], short_paths: bool = True) -> str:
    """A config's name from what it changes, usable as a folder name: `learning_rate=1e-4_seed=0`;
    with `short_paths`, a local model folder by its own name (`model=qwen-ft`), not its path."""

    def shown(key: str, value: Any) -> str:
        if short_paths and key == "model" and isinstance(value, str) and Path(value).expanduser().is_dir():
            return Path(value).expanduser().resolve().name
        return _shown(value)

    text = "_".join(f"{key}={shown(key, value)}" for key, value in overrides.items())
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", text)[:120] or "base"


def _may_use_vllm(config: RunConfig, local: bool) -> bool:
    """Whether the generate engines may be vLLM's: named, or 'auto' on a cluster's GPUs or on
    this machine where it would pick vLLM (engine.cache.resolve_backend: vLLM installed and a GPU)."""
    backend = config.engine.backend
    if backend != "auto":
        return backend == "vllm"
    if not local:
        return True
    from grpo_flyte.runtime.device import cuda_available

    return importlib.util.find_spec("vllm") is not None and cuda_available()


def _check_shares_pools(name: str, values: list[Any], configs: list[RunConfig], local: bool) -> None:
    if len({repr(config.flat()[name]) for config in configs}) < 2:
        return
    if name in POOL_KEYS:
        raise ConfigError(
            f"{name}={_shown(values)}: changes {POOL_KEYS[name]}, which every config of a sweep shares; "
            "expected keys that leave it alone (learning_rate, seed, rewards, model, ...): one sweep per value of it",
            field="sweep",
        )


def _check_bases(members: list[SweepMember], local: bool) -> None:
    """The base models (model, dtype) of a sweep fit on each replica: `MAX_BASES` at most, and on
    vLLM one engine each, their GPU shares (`vllm_memory_fraction`) within `VLLM_MEMORY_BUDGET`."""
    bases = {(m.config.base.model, m.config.base.dtype) for m in members}
    if len(bases) < 2:
        return
    swept = dict.fromkeys(key for m in members for key in m.overrides if key in BASE_KEYS)
    what = " ".join(f"{key}={_shown(list(dict.fromkeys(getattr(m.config.base, key) for m in members)))}" for key in swept)
    if len(bases) > MAX_BASES:
        raise ConfigError(
            f"{what}: {len(bases)} base models, each its own engine and loaded base on every replica; "
            f"expected at most {MAX_BASES} in one sweep: one sweep per {MAX_BASES} of them",
            field="sweep",
        )
    fraction = members[0].config.engine.vllm_memory_fraction
    if _may_use_vllm(members[0].config, local) and len(bases) * fraction > VLLM_MEMORY_BUDGET + 1e-9:
        raise ConfigError(
            f"{what}: {len(bases)} base models, each its own vLLM engine on a generate replica's GPU, at "
            f"--vllm-memory-fraction {fraction:g} each ({len(bases) * fraction:.2f} of it); expected "
            f"--vllm-memory-fraction at most {VLLM_MEMORY_BUDGET / len(bases):.2f} to sweep them (or --backend hf)",
            field="sweep",
        )


def _check_contexts(members: list[SweepMember], local: bool) -> None:
    """On vLLM, the configs of a base model share its generate engine, whose max_model_len is
    `context_length` (prompt + completion, or prompt + episode), and the judged configs the judge's
    engine (max_model_len judge_context_tokens): refused when either would take more than one
    length. (An engine per length would need its own share of the GPU, as a second base does,
    shrinking every config's KV cache: one sweep per value keeps each at the full share.)"""
    if not _may_use_vllm(members[0].config, local):
        return
    generate = {}
    for m in members:
        generate.setdefault((m.config.base.model, m.config.base.dtype), []).append(m)
    for group in generate.values():
        lengths = {context_length(m.config.prompt, m.config.sampling, m.config.episode) for m in group}
        _one_length(group, lengths, CONTEXT_KEYS, "the vLLM engine's", "the configs of a base model")
    judged = [m for m in members if m.config.judging]
    lengths = {m.config.judge.judge_context_tokens for m in judged}
    _one_length(judged, lengths, JUDGE_CONTEXT_KEYS, "the judge's vLLM engine", "the configs of a sweep")


def _one_length(group: list[SweepMember], lengths: set[int], keys: tuple[str, ...], engine: str, sharing: str) -> None:
    """A one-line error naming the swept keys (`keys` among them, else all) when the `group` of
    configs sharing an engine would give it more than one of `lengths`."""
    if len(lengths) < 2:
        return
    flat = [m.config.flat() for m in group]
    swept = [k for k in dict.fromkeys(k for m in group for k in m.overrides) if len({repr(f[k]) for f in flat}) > 1]
    named = [k for k in swept if k in keys] or swept
    what = " ".join(f"{k}={_shown(list({repr(f[k]): f[k] for f in flat}.values()))}" for k in named)
    raise ConfigError(
        f"{what}: changes {engine} context length (max_model_len {', '.join(map(str, sorted(lengths)))}), which {sharing} share: "
        "it would be rebuilt at every switch between them; expected one sweep per value, or --backend hf to sweep it",
        field="sweep",
    )


def _check_reward_models(members: list[SweepMember]) -> None:
    """The configs' reward models together fit a reward-model replica, which holds each one loaded."""
    models = list(dict.fromkeys(reward_model_ref(name)[0] for m in members for name in m.config.scoring.model_rewards))
    if len(models) > MAX_REWARD_MODELS:
        raise ConfigError(
            f"rewards: the configs name {len(models)} reward models together ({', '.join(models)}); expected at most "
            f"{MAX_REWARD_MODELS}, which a reward-model replica holds at once",
            field="sweep",
        )


def expand_sweep(
    values: dict[str, Any], grid: dict[str, list[Any]] | list[dict[str, Any]], explicit: set[str] = frozenset(), local: bool = True
) -> list[SweepMember]:
    """One checked config per combination of `grid` (or per entry of a list), on top of `values`
    (the flags and config file: flat option values). `explicit`: the options given as flags or in
    the config file, which a sweep key must not repeat."""
    entries = grid if isinstance(grid, list) else [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
    keys = list(dict.fromkeys(k for entry in entries for k in entry))
    for key in keys:
        if key in explicit:
            raise ConfigError(
                f"{key}: {flag(key)} is also set (a flag or the config file); expected it swept or set, not both", field="sweep"
            )
        swept = list({repr(e[key]): e[key] for e in entries if key in e}.values())
        configs = []
        for value in swept:  # each value alone first, so the error names it
            try:
                configs.append(make_config(**{**values, key: value}))
            except ConfigError as exc:
                raise ConfigError(f"{key}={value}: {exc}", field="sweep") from None
        _check_shares_pools(key, swept, configs, local)
    if not entries or len(entries) > MAX_CONFIGS:
        raise ConfigError(f"expands to {len(entries)} configs; expected 1 to {MAX_CONFIGS}", field="sweep")
    members = []
    names = [member_name(entry) for entry in entries]
    if len(set(names)) < len(names):  # model folders of one name: named by their paths
        names = [member_name(entry, short_paths=False) for entry in entries]
    progress = CheckProgress("checking the sweep's configs", len(entries))
    for entry, name in zip(entries, names, strict=True):
        try:
            config = make_config(**{**values, **entry})
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}", field="sweep") from None
        flat = config.flat()
        members.append(SweepMember(name=name, overrides={key: flat[key] for key in entry}, config=config))
        progress.step(len(members))
    _check_bases(members, local)
    _check_contexts(members, local)
    _check_reward_models(members)
    names = [m.name for m in members]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"two configs are both named {twice!r}; expected different values", field="sweep")
    return members
