"""`init_adapter` and `train_step`: PEFT LoRA on a frozen base, one GRPO step per call.

The base model loads once per warm train replica (cached); everything that defines the result,
the adapter weights and the AdamW state, comes in through the task's inputs and goes out in the
new adapter directory. Token ids come from `generate`; nothing is re-tokenized.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import flyte
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte import grpo
from grpo_flyte.config import RunConfig
from grpo_flyte.envs import train_env
from grpo_flyte.files import build_dir_atomic
from grpo_flyte.models import best_device, cache_root, torch_dtype
from grpo_flyte.reward import ScoredGroup
from grpo_flyte.rollout import AdapterRef, LocalDirCache

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "grpo_state.json"


class TrainStepResult(BaseModel):
    adapter: AdapterRef
    loss: float
    num_rollouts: int
    num_contributing: int  # rollouts with a nonzero advantage
    num_tokens: int  # completion tokens in the loss
    grad_norm: float
    train_s: float


class AdapterError(ValueError):
    """An adapter directory that cannot be used."""


# One PEFT model per replica; the lock serializes steps (locally every task shares one process).
_train_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _peft_model(model_path: str, dtype: str, rank: int, alpha: float, dropout: float, targets: tuple[str, ...]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    logger.info("loading the base model for training from %s (once per replica)", model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype)).to(best_device())
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.config.use_cache = False
    return model


def peft_model(config: RunConfig, model_path: str):
    return _peft_model(
        model_path,
        config.torch_dtype_name,
        config.lora_rank,
        config.lora_alpha,
        config.lora_dropout,
        tuple(config.lora_target_modules),
    )


def _trainable(model) -> list:
    return [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]) if p.requires_grad]


def _optimizer(model, config: RunConfig):
    import torch

    return torch.optim.AdamW(_trainable(model), lr=config.learning_rate, weight_decay=config.weight_decay)


def reset_lora(model, seed: int) -> None:
    """Fresh LoRA weights (A random, B zero, so the adapter starts as the base), seeded."""
    import torch
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for name, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if isinstance(module, LoraLayer):
            module.reset_lora_parameters("default", True)


def load_adapter_state(model, adapter_path: str, config: RunConfig):
    """Load LoRA weights and AdamW state from an adapter directory; return the optimizer."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(adapter_path) / "adapter_model.safetensors"
    try:
        state = load_file(str(weights))
        result = set_peft_model_state_dict(model, state)
    except Exception as exc:
        raise AdapterError(f"adapter {adapter_path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
    missing_lora = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing_lora:
        raise AdapterError(f"adapter {adapter_path!r} lacks {len(missing_lora)} LoRA tensors, e.g. {missing_lora[0]}")
    optimizer = _optimizer(model, config)
    opt_file = Path(adapter_path) / OPTIMIZER_FILE
    if opt_file.is_file():
        saved = torch.load(opt_file, map_location=best_device(), weights_only=True)
        optimizer.load_state_dict(saved)
        for group in optimizer.param_groups:  # the config, not the file, sets the hyper-parameters
            group["lr"] = config.learning_rate
            group["weight_decay"] = config.weight_decay
    return optimizer


def save_adapter(model, optimizer, version: int, out: Path) -> None:
    import torch

    model.save_pretrained(str(out))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    (out / STATE_FILE).write_text(json.dumps({"version": version}))


async def publish_dir(build, name: str) -> Dir:
    """Write a directory with `build(path)` and return it as a Dir, never half-written.

    Locally (raw data on disk) it is built in a staging folder beside its final place and renamed;
    on a cluster it is built in a temp folder and uploaded.
    """
    ctx = flyte.ctx()
    raw = ctx.raw_data_path.path if ctx and ctx.raw_data_path else None
    if raw and "://" not in raw:
        # Replaces a folder left by an attempt that died before the checkpoint.
        final = await asyncio.to_thread(build_dir_atomic, Path(raw) / "adapters" / name, build)
        return await Dir.from_local(str(final))
    with tempfile.TemporaryDirectory() as tmp:
        await asyncio.to_thread(build, Path(tmp))
        return await Dir.from_local(tmp)


_model_dirs = LocalDirCache(cache_root() / "replica" / f"train-models-{os.getpid()}", capacity=1)
_adapter_dirs = LocalDirCache(cache_root() / "replica" / f"train-adapters-{os.getpid()}", capacity=2)


@train_env.task(retries=2)
async def init_adapter(config: RunConfig, base_model: Dir) -> AdapterRef:
    """Version 0: a freshly initialized LoRA adapter (equal to the base model) and no optimizer state."""
    model_path = await _model_dirs.get(base_model)

    def build(out: Path) -> None:
        with _train_lock:
            model = peft_model(config, model_path)
            reset_lora(model, config.seed)
            save_adapter(model, None, 0, out)

    return AdapterRef(version=0, dir=await publish_dir(build, "v0000"))


def build_sequences(scored: list[ScoredGroup], eps: float) -> tuple[list[grpo.TrainSequence], int]:
    """Training sequences with nonzero advantage, in a deterministic order, and the rollout count."""
    sequences = []
    total = 0
    for sg in sorted(scored, key=lambda s: s.group.index):
        advantages = grpo.group_advantages([r.reward for r in sg.rewards], eps)
        for rollout, adv in zip(sg.group.rollouts, advantages, strict=True):
            total += 1
            if adv != 0.0 and rollout.completion_ids:
                sequences.append(grpo.TrainSequence(sg.group.prompt_ids, rollout.completion_ids, adv))
    return sequences, total


def grpo_step(model, optimizer, sequences: list[grpo.TrainSequence], config: RunConfig) -> tuple[float, float, int]:
    """One optimizer step over all sequences in length-grouped micro-batches: (loss, grad norm, tokens)."""
    import torch

    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    num_tokens = 0
    inner = model.get_base_model()
    decoder, lm_head = inner.get_decoder(), inner.get_output_embeddings()
    for batch_ids in grpo.plan_micro_batches([s.length for s in sequences], config.micro_batch_tokens):
        batch_seqs = [sequences[i] for i in batch_ids]
        batch = grpo.pad_batch(batch_seqs, pad_id=0)
        hidden = decoder(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
        ).last_hidden_state  # (B, T, H)
        # The vocabulary projection only at positions that predict completion tokens: prompt and
        # padding positions would be most of the work and none of the loss.
        mask = batch.predict_mask.to(device)
        logits = lm_head(hidden[mask])  # (N, V)
        logprobs = grpo.token_logprobs(logits, batch.targets.to(device)[mask], config.temperature)
        loss = grpo.policy_gradient_loss(
            logprobs,
            batch.row_of_token.to(device),
            torch.tensor([s.advantage for s in batch_seqs], device=device),
            torch.tensor([len(s.completion_ids) for s in batch_seqs], device=device),
            num_sequences=len(sequences),
        )
        loss.backward()
        total_loss += loss.item()
        num_tokens += int(mask.sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(_trainable(model), config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return total_loss, float(grad_norm), num_tokens


@train_env.task(retries=2)
async def train_step(config: RunConfig, base_model: Dir, adapter: AdapterRef, scored: list[ScoredGroup]) -> TrainStepResult:
    """One GRPO step on the scored groups; returns the next adapter version."""
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    sequences, num_rollouts = build_sequences(scored, config.advantage_eps)
    version = adapter.version + 1
    stats: dict[str, float] = {}

    def build(out: Path) -> None:
        with _train_lock:
            model = peft_model(config, model_path)
            optimizer = load_adapter_state(model, adapter_path, config)
            if sequences:
                stats["loss"], stats["grad_norm"], stats["tokens"] = grpo_step(model, optimizer, sequences, config)
            save_adapter(model, optimizer, version, out)

    new_dir = await publish_dir(build, f"v{version:04d}")
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=new_dir),
        loss=stats.get("loss", 0.0),
        num_rollouts=num_rollouts,
        num_contributing=len(sequences),
        num_tokens=int(stats.get("tokens", 0)),
        grad_norm=stats.get("grad_norm", 0.0),
        train_s=time.perf_counter() - started,
    )
