"""This module gives every field of TRL's `GRPOConfig` (beyond `TrainingArguments`) a fate here.

A field either works under TRL's name (a field of `RunConfig` with the same name, a rename in
`TRL_ALIASES`, or a translation in `from_trl_names`), from Python, in config files and (all but the
translations) as flags; or it is refused with the one-line reason in `TRL_REFUSED`, which says why
it has no meaning here and what to use instead. `from_trl_names` turns TRL's names into this
config's before validation. docs/coming-from-trl.md lists every field with its fate, and a test
fails on a field of the installed TRL that has none.
"""

from __future__ import annotations

from typing import Any

from grpo_flyte.errors import shown
from grpo_flyte.reward_fns import DEFAULT_REWARDS

# TRL's names (GRPOConfig, and the ModelConfig of its scripts) for options both have: accepted from
# Python, in config files and as flags, and translated before validation.
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "max_prompt_length": "max_prompt_tokens",
    "model_name_or_path": "model",
    "lora_r": "lora_rank",
    "vllm_importance_sampling_correction": "is_correction",
    "vllm_importance_sampling_cap": "is_cap",  # TRL < 1.16's name for the cap
    "vllm_importance_sampling_clip_max": "is_cap",
    "vllm_importance_sampling_clip_min": "is_clip_min",
    "vllm_importance_sampling_mode": "is_mode",
    "vllm_gpu_memory_utilization": "vllm_memory_fraction",
    "hub_model_id": "push_to_hub",
    "num_completions_to_print": "num_completions_to_log",  # nothing is printed: they are logged
}

# TRL's names whose values are translated, not only renamed (config files and Python; the flag is ours).
TRL_TRANSLATED: dict[str, str] = {
    "mask_truncated_completions": "truncated",  # true: 'mask', false: 'keep'
    "reward_funcs": "rewards",  # with reward_weights: one name=weight mapping
    "reward_weights": "rewards",
    "use_vllm": "backend",  # true: 'vllm', false: 'hf'
    "generation_batch_size": "prompts_per_iter",  # completions per generation: prompts_per_iter x group_size
}

# The importance weight's largest cap here (TrainConfig.is_cap's bound): TRL's clip_max None, no bound.
IS_CAP_MAX = 1000.0

_POOLS = "generation runs on its own warm pool of GPUs (docs/cluster.md), not beside the trainer"

# TRL's fields with no meaning here: (the values that ask for nothing: TRL's default and what TRL's
# __post_init__ turns it into; the one-line reason and what to use instead). A field at one of those
# values asks for nothing TRL would do differently (a dumped GRPOConfig holds every field): it is
# dropped; any other value is refused with the reason.
TRL_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "model_init_kwargs": ((None,), "the pools load the model themselves; --dtype sets its dtype and --load-in-4bit its quantization"),
    "trust_remote_code": (
        (False,),
        "the pools run only architectures transformers and vLLM ship: remote code would run unreviewed on every pod",
    ),
    "router_aux_loss_coef": (
        (None,),
        (
            "the trainer adds no mixture-of-experts router loss: under LoRA the router's weights are frozen, so there is no "
            "router to balance unless --lora-target-modules names it"
        ),
    ),
    "cast_lm_head_to_fp32": (
        (False,),
        (
            "the trainer's log-softmax is already float32, and the output layer's product stays in the model's dtype as the "
            "generator's does (casting one side only would skew the importance ratio); --dtype float32 makes both float32"
        ),
    ),
    "ds3_gather_for_generation": ((True,), f"DeepSpeed ZeRO-3 plumbing: {_POOLS}, with the whole model"),
    "pad_to_multiple_of": (
        ("auto", None),
        "micro-batches are grouped by length and padded to their longest row; --micro-batch-tokens sizes them",
    ),
    "steps_per_generation": (
        (None, 1),
        "each generation batch is split into --updates-per-iter optimizer steps (and trained --num-iterations times)",
    ),
    "cache_implementation": (
        (None,),
        "the transformers backend decodes with its own KV cache (shared prompt prefixes), vLLM with its paged one",
    ),
    "vllm_mode": (("colocate",), f"'colocate' and 'server' are replaced by the generate pool: {_POOLS}"),
    "vllm_model_impl": (
        ("vllm",),
        "the generate pool runs vLLM's own implementation of the model (transformers' is the hf backend: --backend hf)",
    ),
    "vllm_enable_sleep_mode": ((False,), f"{_POOLS}, so there is no trainer memory to free by putting vLLM to sleep"),
    "vllm_structured_outputs_regex": (
        (None,),
        (
            "the policy's samples are not constrained: the trainer could not recompute the masked distribution, so the "
            "importance ratio would be biased (the LLM judge's replies are held to their JSON)"
        ),
    ),
    "vllm_server_base_url": ((None,), f"no vLLM server: {_POOLS} and is called as a Flyte task"),
    "vllm_server_host": (("0.0.0.0",), f"no vLLM server: {_POOLS} and is called as a Flyte task"),
    "vllm_server_port": ((8000,), f"no vLLM server: {_POOLS} and is called as a Flyte task"),
    "vllm_server_timeout": ((240.0,), f"no vLLM server: {_POOLS}; Flyte retries a generate call that fails (docs/cluster.md)"),
    "vllm_group_port": ((51216,), f"no weight-sync process group: {_POOLS}, and each call loads the adapter version it is given"),
    "vllm_max_model_length": (
        (None,),
        "vLLM's context is sized from --max-prompt-tokens + --max-new-tokens, the longest sequence a run makes",
    ),
    "vllm_tensor_parallel_size": (
        (1,),
        "a generate replica holds the model on one GPU; more throughput is more replicas (docs/cluster.md)",
    ),
    "sync_ref_model": (
        (False,),
        (
            "the reference is the base model with the adapter switched off (no second copy in memory); a synced reference "
            "would need a second model. --beta 0 (the default) needs no reference"
        ),
    ),
    "ref_model_mixup_alpha": ((0.6,), "applies to sync_ref_model, which is refused: the reference is the base model with the adapter off"),
    "ref_model_sync_steps": ((512,), "applies to sync_ref_model, which is refused: the reference is the base model with the adapter off"),
    "use_transformers_continuous_batching": (
        (False,),
        ("the hf backend decodes with its own batched loop (per-row seeded sampling, shared prompt prefixes, adapters per row)"),
    ),
    "transformers_continuous_batching_config": (
        (None,),
        "the hf backend decodes with its own batched loop, not transformers' continuous batching",
    ),
    "log_completions_hub_repo": (
        (None,),
        (
            "the logged completions are written to <run-dir>/completions/ every iteration (and to the trackers' tables); "
            "upload that folder as a dataset: huggingface-cli upload --repo-type dataset REPO <run-dir>/completions"
        ),
    ),
    "log_multimodal": ((True,), "grpo_flyte trains on text only: there are no images to log"),
    "use_transformers_paged": (
        (False,),
        "the hf backend decodes with its own batched loop and KV cache, not transformers' paged attention",
    ),
}


def refused(name: str) -> str:
    """The error for a refused TRL field: its name, why it has no meaning here, what to use instead."""
    return f"{name} (TRL's GRPOConfig) has no meaning in grpo_flyte: {TRL_REFUSED[name][1]}"


def _translate_bool(out: dict[str, Any], name: str, true: str, false: str) -> None:
    value = out.pop(name)
    if not isinstance(value, bool):
        raise ValueError(f"{name}={shown(value)}: expected true or false")
    out[name] = true if value else false


def _given(out: dict[str, Any], name: str, default: Any) -> Any:
    """The value of option `name` in `out`, flat or inside a part given as a mapping or a model
    (`sampling: {group_size: 4}`); a flat name wins, as in RunConfig."""
    if name in out:
        return out[name]
    for part in out.values():
        if isinstance(part, dict) and name in part:
            return part[name]
        if name in getattr(type(part), "model_fields", {}):
            return getattr(part, name)
    return default


def _per_prompt(out: dict[str, Any]) -> None:
    """TRL's generation_batch_size (completions per generation) as prompts per iteration."""
    size = out.pop("generation_batch_size")
    if size is None:
        return
    group = _given(out, "num_generations", _given(out, "group_size", 8))  # 8: SamplingConfig's default group_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or not isinstance(group, int) or size % group:
        raise ValueError(f"generation_batch_size={shown(size)}: expected a multiple of num_generations ({shown(group)})")
    out["generation_batch_size"] = size // group


def from_trl_names(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with TRL's names turned into this config's (TRL_ALIASES and TRL_TRANSLATED);
    ValueError for a field in TRL_REFUSED and for a TRL name that disagrees with its counterpart
    given alongside."""
    out = dict(values)
    for name in [n for n in out if n in TRL_REFUSED]:
        if out[name] not in TRL_REFUSED[name][0]:
            raise ValueError(refused(name) + f" (given {shown(out[name])})")
        del out[name]
    if "vllm_importance_sampling_cap" in out and out["vllm_importance_sampling_cap"] is None:
        del out["vllm_importance_sampling_cap"]  # TRL 1.16's default for its deprecated name: unset
    elif "vllm_importance_sampling_cap" in out:
        out.pop("vllm_importance_sampling_clip_max", None)  # TRL: the deprecated name, when given, wins
    if "vllm_importance_sampling_clip_max" in out and out["vllm_importance_sampling_clip_max"] is None:
        out["vllm_importance_sampling_clip_max"] = IS_CAP_MAX  # TRL: None is no upper bound
    renamed = {trl: ours for trl, ours in TRL_ALIASES.items() if trl in out}
    for name, true, false in (("mask_truncated_completions", "mask", "keep"), ("use_vllm", "vllm", "hf")):
        if name in out:
            _translate_bool(out, name, true, false)
            renamed[name] = TRL_TRANSLATED[name]
    if "generation_batch_size" in out:
        _per_prompt(out)
        renamed["generation_batch_size"] = "prompts_per_iter"
    if "reward_weights" in out or "reward_funcs" in out:
        funcs = out.pop("reward_funcs", None)
        weights = out.pop("reward_weights", None)
        names = list(funcs) if funcs is not None else list(_given(out, "rewards", None) or DEFAULT_REWARDS)
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
