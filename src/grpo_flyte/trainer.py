"""`init_adapter` and `train_step`: PEFT LoRA on a frozen base, one GRPO iteration per call.

The base model loads once per warm train replica (cached); everything that defines the result,
the adapter weights and the AdamW state, comes in through the task's inputs and goes out in the
new adapter directory. Token ids come from `generate`; nothing is re-tokenized.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import flyte
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte import grpo
from grpo_flyte.config import RunConfig
from grpo_flyte.envs import train_env
from grpo_flyte.faults import inject
from grpo_flyte.files import build_dir_atomic
from grpo_flyte.models import best_device, cache_root, torch_dtype
from grpo_flyte.reward import ScoredGroup
from grpo_flyte.rollout import AdapterError, AdapterRef, LocalDirCache
from grpo_flyte.torch_thread import run_on_torch_thread

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "grpo_state.json"


class StepStats(BaseModel):
    """What one iteration's optimizer steps measured (means over updates or tokens)."""

    loss: float = 0.0  # mean over the optimizer steps
    grad_norm: float = 0.0  # mean pre-clip gradient norm over the optimizer steps
    num_updates: int = 0
    num_tokens: int = 0  # completion tokens in the loss
    kl: float = 0.0  # mean per-token k3 KL to the reference (adapter disabled)
    clip_fraction: float = 0.0  # tokens whose clipped branch won, over all updates
    entropy: float = 0.0  # mean per-token entropy of the trainer's policy
    is_ratio_mean: float = 1.0  # exp(old - samp) per token, before truncation
    is_ratio_max: float = 1.0


class TrainStepResult(BaseModel):
    adapter: AdapterRef
    num_rollouts: int
    num_contributing: int  # rollouts with a nonzero advantage
    stats: StepStats
    train_s: float


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
    except Exception as exc:  # noqa: BLE001 -- safetensors and peft raise many types; all mean a bad adapter
        raise AdapterError(f"adapter {adapter_path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
    missing_lora = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing_lora:
        raise AdapterError(f"adapter {adapter_path!r} lacks {len(missing_lora)} LoRA tensors, e.g. {missing_lora[0]}")
    optimizer = _optimizer(model, config)
    opt_file = Path(adapter_path) / OPTIMIZER_FILE
    if opt_file.is_file():
        try:
            optimizer.load_state_dict(torch.load(opt_file, map_location=best_device(), weights_only=True))
        except Exception as exc:  # noqa: BLE001 -- a truncated or foreign file fails in many ways
            raise AdapterError(f"adapter {adapter_path!r}: optimizer state {OPTIMIZER_FILE} cannot be loaded ({type(exc).__name__}: {exc})") from None
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

    `build` runs on the process's torch thread, which also serializes the steps that share the
    replica's one PEFT model (locally every task shares one process). Locally (raw data on disk)
    the folder is built in a staging folder beside its final place and renamed; on a cluster it is
    built in a temp folder and uploaded.
    """
    ctx = flyte.ctx()
    raw = ctx.raw_data_path.path if ctx and ctx.raw_data_path else None
    if raw and "://" not in raw:
        # Replaces a folder left by an attempt that died before the checkpoint.
        final = await run_on_torch_thread(build_dir_atomic, Path(raw) / "adapters" / name, build)
        return await Dir.from_local(str(final))
    with tempfile.TemporaryDirectory() as tmp:
        await run_on_torch_thread(build, Path(tmp))
        return await Dir.from_local(tmp)


_model_dirs = LocalDirCache(cache_root() / "replica" / f"train-models-{os.getpid()}", capacity=1)
_adapter_dirs = LocalDirCache(cache_root() / "replica" / f"train-adapters-{os.getpid()}", capacity=2)


@train_env.task(retries=2)
async def init_adapter(config: RunConfig, base_model: Dir) -> AdapterRef:
    """Version 0: a freshly initialized LoRA adapter (equal to the base model) and no optimizer state."""
    model_path = await _model_dirs.get(base_model)

    def build(out: Path) -> None:
        model = peft_model(config, model_path)
        reset_lora(model, config.seed)
        save_adapter(model, None, 0, out)

    return AdapterRef(version=0, dir=await publish_dir(build, "v0000"))


def build_sequences(scored: list[ScoredGroup], config: RunConfig) -> tuple[list[grpo.TrainSequence], int]:
    """Training sequences with nonzero advantage, in a deterministic order, and the rollout count."""
    sequences = []
    total = 0
    scale_by_std = config.loss_type != "dr_grpo"
    for sg in sorted(scored, key=lambda s: s.group.index):
        rewards = sg.training_rewards(config.truncated)
        advantages = grpo.group_advantages(rewards, config.advantage_eps, scale_by_std)
        for rollout, adv in zip(sg.group.rollouts, advantages, strict=True):
            total += 1
            masked = config.truncated == "mask" and rollout.finish_reason == "length"
            if adv != 0.0 and rollout.completion_ids and not masked:
                sequences.append(
                    grpo.TrainSequence(sg.group.prompt_ids, rollout.completion_ids, adv, rollout.sampling_logprobs)
                )
    return sequences, total


def _completion_logprobs(model, sequences: list[grpo.TrainSequence], temperature: float):
    """Forward one micro-batch: (log-probs, entropies) of its completion tokens, row after row.

    Only the positions that predict completion tokens go through the vocabulary projection:
    prompt and padding positions would be most of the work and none of the loss.
    """
    device = next(model.parameters()).device
    inner = model.get_base_model()
    batch = grpo.pad_batch(sequences, pad_id=0)
    hidden = inner.get_decoder()(
        input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
    ).last_hidden_state  # (B, T, H)
    mask = batch.predict_mask.to(device)
    logits = inner.get_output_embeddings()(hidden[mask])  # (N, V)
    logprobs, entropy = grpo.token_logprobs_and_entropy(logits, batch.targets.to(device)[mask], temperature)
    return logprobs, entropy, batch.row_of_token.to(device)


# With beta = 0 the KL only feeds the `kl` metric: the reference pass then runs on a few sequences.
KL_MONITOR_SEQUENCES = 8


def _reference_pass(model, sequences: list[grpo.TrainSequence], config: RunConfig):
    """Once per iteration, without gradients: per sequence, the reference log-probs (the adapter
    disabled: no second copy of the model) and, when several updates reuse the batch, the old ones.

    Reference log-probs are computed for every sequence when beta > 0 and for an evenly spread
    sample of KL_MONITOR_SEQUENCES otherwise (None for the rest).
    """
    import torch

    n = len(sequences)
    need_old = config.updates_per_iter > 1
    if config.beta > 0 or n <= KL_MONITOR_SEQUENCES:
        with_ref = set(range(n))
    else:
        with_ref = {i * n // KL_MONITOR_SEQUENCES for i in range(KL_MONITOR_SEQUENCES)}
    ref: list = [None] * n
    old: list = [None] * n
    todo = [i for i in range(n) if need_old or i in with_ref]
    with torch.no_grad():
        for local in grpo.plan_micro_batches([sequences[i].length for i in todo], config.micro_batch_tokens):
            ids = [todo[k] for k in local]
            splits = [len(sequences[i].completion_ids) for i in ids]
            ref_ids = [i for i in ids if i in with_ref]
            if ref_ids:
                with model.disable_adapter():
                    lp, _, _ = _completion_logprobs(model, [sequences[i] for i in ref_ids], config.temperature)
                for i, x in zip(ref_ids, lp.split([len(sequences[i].completion_ids) for i in ref_ids])):
                    ref[i] = x
            if need_old:
                lp, _, _ = _completion_logprobs(model, [sequences[i] for i in ids], config.temperature)
                for i, x in zip(ids, lp.split(splits)):
                    old[i] = x
    return ref, old


class _Totals:
    """Sums over the micro-batches of one iteration, turned into StepStats at the end."""

    def __init__(self) -> None:
        self.loss = self.grad_norm = self.kl = self.entropy = self.is_sum = 0.0
        self.is_max = 0.0
        self.tokens = self.clipped = self.kl_tokens = self.is_tokens = self.updates = 0

    def stats(self) -> StepStats:
        return StepStats(
            loss=self.loss / self.updates,
            grad_norm=self.grad_norm / self.updates,
            num_updates=self.updates,
            num_tokens=self.tokens,
            kl=self.kl / self.kl_tokens if self.kl_tokens else 0.0,
            clip_fraction=self.clipped / self.tokens,
            entropy=self.entropy / self.tokens,
            is_ratio_mean=self.is_sum / self.is_tokens if self.is_tokens else 1.0,
            is_ratio_max=self.is_max if self.is_tokens else 1.0,
        )


def _micro_batch_loss(model, seqs, ref: list, old: list | None, norm: grpo.LossNormalizer, config: RunConfig, totals: _Totals):
    """The loss of one micro-batch (its share of the minibatch loss); adds its metrics to `totals`.

    ref/old: per sequence of `seqs`, the reference and old log-probs (ref None where not computed;
    old None: a single update, so the old policy is the current one, detached).
    """
    import torch

    device = next(model.parameters()).device
    logprobs, entropy, rows = _completion_logprobs(model, seqs, config.temperature)
    old_lp = torch.cat(old) if old is not None else logprobs.detach()
    kl = None
    if any(r is not None for r in ref):
        has_ref = torch.cat([torch.full((len(s.completion_ids),), r is not None) for r, s in zip(ref, seqs)]).to(device)
        ref_lp = torch.cat([r if r is not None else torch.zeros(len(s.completion_ids), device=device) for r, s in zip(ref, seqs)])
        kl = grpo.kl_k3(logprobs, ref_lp) * has_ref
        totals.kl += float(kl.detach().sum())
        totals.kl_tokens += int(has_ref.sum())
    weights = None
    if all(s.sampling_logprobs is not None for s in seqs):
        samp = torch.tensor([x for s in seqs for x in s.sampling_logprobs], device=device)
        capped, rho = grpo.truncated_is_weights(old_lp, samp, config.is_cap)
        weights = capped if config.is_correction else None
        totals.is_sum += float(rho.sum())
        totals.is_max = max(totals.is_max, float(rho.max()))
        totals.is_tokens += rho.numel()
    advantages = torch.tensor([s.advantage for s in seqs], device=device)[rows]
    token_loss, clipped = grpo.grpo_token_loss(
        logprobs, old_lp, advantages, config.epsilon, config.epsilon_high, weights, kl, config.beta
    )
    lengths = torch.tensor([len(s.completion_ids) for s in seqs], device=device)
    loss = grpo.aggregate_loss(token_loss, rows, lengths, config.loss_type, norm)
    totals.entropy += float(entropy.sum())
    totals.clipped += int(clipped.sum())
    totals.tokens += logprobs.numel()
    return loss


def grpo_step(model, optimizer, sequences: list[grpo.TrainSequence], config: RunConfig) -> StepStats:
    """`updates_per_iter` clipped GRPO optimizer steps over minibatches of the sequences.

    The reference and (with several updates) old log-probs are computed once, before the first
    step. Each minibatch is forwarded in length-grouped micro-batches whose losses sum to the
    minibatch loss (`grpo.aggregate_loss`).
    """
    import torch

    ref, old = _reference_pass(model, sequences, config)
    reuse_old = config.updates_per_iter > 1
    model.train()
    totals = _Totals()
    for minibatch in grpo.split_minibatches(len(sequences), config.updates_per_iter):
        optimizer.zero_grad(set_to_none=True)
        norm = grpo.LossNormalizer(
            num_sequences=len(minibatch),
            num_tokens=sum(len(sequences[i].completion_ids) for i in minibatch),
            max_completion_tokens=config.max_new_tokens,
        )
        for local in grpo.plan_micro_batches([sequences[i].length for i in minibatch], config.micro_batch_tokens):
            ids = [minibatch[k] for k in local]
            loss = _micro_batch_loss(
                model,
                [sequences[i] for i in ids],
                [ref[i] for i in ids],
                [old[i] for i in ids] if reuse_old else None,
                norm,
                config,
                totals,
            )
            loss.backward()
            totals.loss += loss.item()
        totals.grad_norm += float(torch.nn.utils.clip_grad_norm_(_trainable(model), config.max_grad_norm))
        optimizer.step()
        totals.updates += 1
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return totals.stats()


@train_env.task(retries=2)
async def train_step(config: RunConfig, base_model: Dir, adapter: AdapterRef, scored: list[ScoredGroup]) -> TrainStepResult:
    """One iteration of GRPO (`updates_per_iter` optimizer steps) on the scored groups; returns the next adapter."""
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    sequences, num_rollouts = build_sequences(scored, config)
    version = adapter.version + 1
    measured: list[StepStats] = []

    def build(out: Path) -> None:
        model = peft_model(config, model_path)
        optimizer = load_adapter_state(model, adapter_path, config)
        if sequences:
            measured.append(grpo_step(model, optimizer, sequences, config))
        save_adapter(model, optimizer, version, out)
        inject("train_step")  # test-only: a failure with the new adapter half-published

    new_dir = await publish_dir(build, f"v{version:04d}")
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=new_dir),
        num_rollouts=num_rollouts,
        num_contributing=len(sequences),
        stats=measured[0] if measured else StepStats(),
        train_s=time.perf_counter() - started,
    )


def merge_into_base(model_path: str, adapter_path: str, out: Path) -> None:
    """Save base + LoRA as one plain transformers model folder (weights in the base's own dtype).

    The merge runs in float32, so a small adapter update is not lost to bfloat16 rounding before
    the single cast back at the end; the tokenizer is saved alongside.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    saved = AutoConfig.from_pretrained(model_path)
    target = getattr(saved, "dtype", None) or getattr(saved, "torch_dtype", None)
    if isinstance(target, str):
        target = getattr(torch, target, None)
    if not isinstance(target, torch.dtype):
        target = torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_path).merge_and_unload()
    merged.to(target).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(model_path).save_pretrained(str(out))


@train_env.task(retries=2)
async def merge_adapter(config: RunConfig, base_model: Dir, adapter: AdapterRef) -> Dir:
    """The adapter merged into the base: a full model folder for serving (no PEFT needed)."""
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)

    return await publish_dir(functools.partial(merge_into_base, model_path, adapter_path), f"merged-v{adapter.version:04d}")
