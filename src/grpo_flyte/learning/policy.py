"""This module holds the policy the train pool trains: a PEFT LoRA adapter on a frozen base, its
AdamW optimizer, and the adapter folder both are saved to and restored from.

The PEFT model loads once per warm train replica and base model (`peft_model`, cached);
`WarmOptimizer` keeps the optimizer of the adapter a replica wrote last, so the run's next step
goes on from memory. Both are caches: an adapter folder holds everything that defines the policy.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from grpo_flyte.config.constants import MAX_BASES
from grpo_flyte.config.generation import ModelConfig
from grpo_flyte.config.training import LoraConfig, TrainConfig
from grpo_flyte.errors import AdapterError
from grpo_flyte.learning.losses import EntropyControl
from grpo_flyte.models.folders import ALL_LINEAR, shareable_base
from grpo_flyte.models.loading import load_base, quiet_bitsandbytes, share_frozen_weights
from grpo_flyte.runtime.device import best_device, resolve_dtype
from grpo_flyte.runtime.files import files_of
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE

logger = logging.getLogger(__name__)


# One loaded base per base model a sweep trains (a run: one), the least recently used dropped past
# MAX_BASES (config/grid.py refuses more bases). Dropped after the next one loads: only a process
# that ran other bases before (a local one) gets there, never a sweep's replica.
@functools.lru_cache(maxsize=MAX_BASES)
def _peft_model(
    model_path: str,
    dtype: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets: tuple[str, ...],
    load_in_4bit: bool = False,
    embeddings_in_4bit: bool = False,
    disable_dropout: bool = False,
):
    quiet_bitsandbytes()
    from peft import LoraConfig, get_peft_model

    bits = " in 4 bits, embeddings included" if embeddings_in_4bit else " in 4 bits" if load_in_4bit else ""
    logger.info("loading the base model for training from %s%s (once per replica)", model_path, bits)
    # No peft.prepare_model_for_kbit_training on a 4-bit base: it would cast the embeddings and norms
    # to float32 (on a small model the embeddings are a fifth of the weights: memory the 4-bit base
    # is meant to save) and turn on reentrant gradient checkpointing, which --gradient-checkpointing
    # already controls (non-reentrant: frozen inputs need no gradient).
    base = load_base(model_path, dtype, load_in_4bit, embeddings_in_4bit)
    # the generator's copy in a local run (a 4-bit base: its 16-bit embeddings, norms and output layer)
    share_frozen_weights(base, model_path, dtype)
    modules = ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets)
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.config.use_cache = False
    if disable_dropout:
        _without_dropout(model)
    return model


def _without_dropout(model) -> None:
    """Every torch dropout layer of `model` set to drop nothing (TRL's disable_dropout)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def peft_model(model: ModelConfig, lora: LoraConfig, model_path: str):
    return _peft_model(
        model_path,
        resolve_dtype(model.dtype),
        lora.lora_rank,
        lora.lora_alpha,
        lora.lora_dropout,
        tuple(lora.lora_target_modules),
        lora.load_in_4bit,
        lora.embeddings_in_4bit,
        lora.disable_dropout,
    )


def trainable(model) -> list:
    """The LoRA parameters, in name order."""
    return [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]) if p.requires_grad]


def _optimizer(model, train: TrainConfig):
    import torch

    return torch.optim.AdamW(trainable(model), lr=train.learning_rate, weight_decay=train.weight_decay)


def reset_lora(model, seed: int) -> None:
    """Fresh LoRA weights (A random, B zero, so the adapter starts as the base), seeded."""
    import torch
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for _, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if isinstance(module, LoraLayer):
            module.reset_lora_parameters("default", True)


def load_adapter_state(model, adapter_path: str, train: TrainConfig):
    """Load LoRA weights and AdamW state from an adapter directory; return the optimizer."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(adapter_path) / "adapter_model.safetensors"
    try:
        state = load_file(str(weights))
        result = set_peft_model_state_dict(model, state)
    except Exception as exc:  # noqa: BLE001 -- safetensors and peft raise many types; all mean a bad adapter
        raise AdapterError(f"adapter {adapter_path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
    missing_lora = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing_lora:
        raise AdapterError(f"adapter {adapter_path!r} lacks {len(missing_lora)} LoRA tensors, e.g. {missing_lora[0]}")
    optimizer = _optimizer(model, train)
    opt_file = Path(adapter_path) / OPTIMIZER_FILE
    if opt_file.is_file():
        try:
            optimizer.load_state_dict(torch.load(opt_file, map_location=best_device(), weights_only=True))
        except Exception as exc:  # noqa: BLE001 -- a truncated or foreign file fails in many ways
            raise AdapterError(
                f"adapter {adapter_path!r}: optimizer state {OPTIMIZER_FILE} cannot be loaded ({type(exc).__name__}: {exc})"
            ) from None
        _set_hyperparameters(optimizer, train)  # the config, not the file, sets them
    return optimizer


def _set_hyperparameters(optimizer, train: TrainConfig) -> None:
    for group in optimizer.param_groups:
        group["lr"] = train.learning_rate
        group["weight_decay"] = train.weight_decay


def save_adapter(model, optimizer, version: int, out: Path, control: EntropyControl | None = None) -> None:
    """The adapter folder: LoRA weights, AdamW state, and the state file (version; the entropy
    coefficient's state when given, see `entropy_control`)."""
    import torch

    model.save_pretrained(str(out))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    state: dict = {"version": version}
    if control is not None:
        state.update(entropy_coef=control.coef, last_entropy=control.last_entropy)
    (out / STATE_FILE).write_text(json.dumps(state))


def entropy_control(adapter_path: str, train: TrainConfig) -> EntropyControl:
    """The entropy coefficient's state a step starts from: with use_adaptive_entropy the one saved
    in the adapter folder's state file (TRL's entropy_ctrl_state.json), else, or when the folder
    has none (a fresh adapter), entropy_coef and no measured entropy."""
    file = Path(adapter_path) / STATE_FILE
    if not train.use_adaptive_entropy or not file.is_file():
        return EntropyControl(train.entropy_coef)
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {adapter_path!r}: {STATE_FILE} cannot be read ({type(exc).__name__}: {exc})") from None
    if "entropy_coef" not in state:
        return EntropyControl(train.entropy_coef)
    return EntropyControl(float(state["entropy_coef"]), state.get("last_entropy"))


def control_after(stats, train: TrainConfig) -> EntropyControl | None:
    """The entropy coefficient's state a step's statistics (`StepStats`) end with, to be saved with
    the adapter; None without use_adaptive_entropy (nothing to carry: the adapter folder stays as
    it was before the option existed)."""
    return EntropyControl(stats.entropy_coef, stats.entropy_last) if train.use_adaptive_entropy else None


def record_base(out: Path, model: str) -> None:
    """Name the base model in the saved adapter's config as others can load it (PEFT writes the
    local folder the trainer loaded, a cache path on a pod): see models.folders.shareable_base."""
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = shareable_base(model)
    config_file.write_text(json.dumps(config, indent=2))


class WarmOptimizer:
    """The AdamW state of the adapter this replica produced last, kept with the model that holds
    its weights: the next step of the run (which starts from that adapter) goes on from memory
    instead of reading both back. A cache only: the adapter folder holds the same weights and
    state, any other adapter is loaded from its folder, and the result is the same either way."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.model = self.adapter = self.optimizer = self.files = None

    def keep(self, model, adapter: str, optimizer, files: tuple | None) -> None:
        """`files`: `files_of` the adapter folder as written, for a local one (None: an object-store path)."""
        self.model, self.adapter, self.optimizer, self.files = model, adapter, optimizer, files

    def take(self, model, adapter: str, local_dir: str, train: TrainConfig):
        """The kept optimizer if `adapter` is the one kept, its folder unchanged since (a local
        folder can be edited; an object-store path is written once), and `model` still holds its
        weights; else None."""
        same = self.model is model and self.adapter == adapter and (self.files is None or self.files == files_of(local_dir))
        optimizer = self.optimizer if same else None
        self.clear()  # taken or stale: either way the model is about to change
        if optimizer is not None:
            _set_hyperparameters(optimizer, train)  # the config, not the cache, sets them
        return optimizer


def release_models() -> None:
    """Free the cached PEFT model (GPU memory a merge needs); the next step loads it again, as a
    cold replica would. A `WarmOptimizer` that holds it must be cleared first."""
    import gc

    _peft_model.cache_clear()
    gc.collect()
    if best_device() == "cuda":
        import torch

        torch.cuda.empty_cache()
