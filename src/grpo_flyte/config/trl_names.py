"""This module accepts TRL's names for the options both have (GRPOConfig, and the ModelConfig of its
scripts) from Python, in config files and (the plain renames) as flags, and turns them into this
config's names before validation (`from_trl_names`)."""

from __future__ import annotations

from typing import Any

from grpo_flyte.errors import shown
from grpo_flyte.reward_fns import DEFAULT_REWARDS

# TRL's names (GRPOConfig, and the ModelConfig of its scripts) for options both have: accepted from
# Python, in config files and (the plain renames) as flags, and translated before validation.
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "max_prompt_length": "max_prompt_tokens",
    "model_name_or_path": "model",
    "lora_r": "lora_rank",
    "vllm_importance_sampling_correction": "is_correction",
    "vllm_importance_sampling_cap": "is_cap",
    "vllm_importance_sampling_mode": "is_mode",
    "hub_model_id": "push_to_hub",
}
NUM_ITERATIONS_REFUSED = (
    "'num_iterations' is ambiguous, so it is refused: in TRL it is how many times each generated batch is "
    "trained on (not a setting here; --updates-per-iter splits a batch into that many optimizer steps), and "
    "in grpo_flyte before 2026-11 it was the loop's length, now 'iterations' (--iterations)"
)


def from_trl_names(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with TRL's names turned into this config's (see TRL_ALIASES, plus
    mask_truncated_completions -> truncated, reward_funcs/reward_weights -> rewards); ValueError
    for 'num_iterations' and for a TRL name that disagrees with its counterpart given alongside."""
    out = dict(values)
    if "num_iterations" in out:
        raise ValueError(NUM_ITERATIONS_REFUSED)
    renamed = {trl: ours for trl, ours in TRL_ALIASES.items() if trl in out}
    if "mask_truncated_completions" in out:
        masked = out.pop("mask_truncated_completions")
        if not isinstance(masked, bool):
            raise ValueError(f"mask_truncated_completions={shown(masked)}: expected true or false")
        out["mask_truncated_completions"] = "mask" if masked else "keep"
        renamed["mask_truncated_completions"] = "truncated"
    if "reward_weights" in out or "reward_funcs" in out:
        funcs = out.pop("reward_funcs", None)
        weights = out.pop("reward_weights", None)
        names = list(funcs) if funcs is not None else list(out.get("rewards") or DEFAULT_REWARDS)
        weights = [1.0] * len(names) if weights is None else list(weights)
        if len(weights) != len(names):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(names)} rewards ({', '.join(map(str, names))})")
        out["reward_funcs"] = dict(zip(names, weights, strict=True))
        renamed["reward_funcs"] = "rewards"
    for trl, ours in renamed.items():
        value = out.pop(trl)
        if ours in out and out[ours] != value:
            raise ValueError(f"{trl} (TRL's name for {ours}) is {shown(value)} but {ours} is {shown(out[ours])}; give one of them")
        out[ours] = value
    return out
