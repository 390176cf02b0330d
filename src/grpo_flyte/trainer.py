"""`init_adapter` and `train_step`: PEFT LoRA on a frozen base, one GRPO iteration per call.

The base model loads once per warm train replica (cached); everything that defines the result,
the adapter weights and the AdamW state, comes in through the task's inputs and goes out in the
new adapter directory. Token ids come from `generate`; nothing is re-tokenized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flyte.io import Dir

from grpo_flyte import grpo
from grpo_flyte.config import LoraConfig, ModelConfig, SamplingConfig, TrainConfig
from grpo_flyte.envs import train_dist_env, train_env
from grpo_flyte.errors import AdapterError, GrpoFlyteError, failed_workers, input_errors_not_retried
from grpo_flyte.models import ALL_LINEAR, best_device, load_base, quiet_bitsandbytes, resolve_dtype, shareable_base
from grpo_flyte.storage import from_payload, is_remote, node_cache, publish_dir, replica_cache
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, AdapterRef, ScoredGroup, StepStats, TrainStepResult

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _peft_model(
    model_path: str,
    dtype: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets: tuple[str, ...],
    load_in_4bit: bool = False,
    embeddings_in_4bit: bool = False,
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
    modules = ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets)
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.config.use_cache = False
    return model


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
    )


def _trainable(model) -> list:
    return [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]) if p.requires_grad]


def _optimizer(model, train: TrainConfig):
    import torch

    return torch.optim.AdamW(_trainable(model), lr=train.learning_rate, weight_decay=train.weight_decay)


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


def _checkpointing_api(model) -> tuple[bool, Callable, Callable]:
    """(on now, enable, disable) of the base model's gradient checkpointing: transformers >= 5.23
    calls it activation checkpointing (the old names warn); earlier releases have only the old ones."""
    base = model.get_base_model()
    if hasattr(base, "activation_checkpointing_enable"):
        return base.is_activation_checkpointing, base.activation_checkpointing_enable, base.activation_checkpointing_disable
    return base.is_gradient_checkpointing, base.gradient_checkpointing_enable, base.gradient_checkpointing_disable


def _set_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing on or off for this step (the model is cached across steps and runs)."""
    active, enable, disable = _checkpointing_api(model)
    if on and not active:
        # non-reentrant: works with frozen base weights without forcing gradients on the inputs
        enable({"use_reentrant": False})
    elif not on and active:
        disable()


def _set_hyperparameters(optimizer, train: TrainConfig) -> None:
    for group in optimizer.param_groups:
        group["lr"] = train.learning_rate
        group["weight_decay"] = train.weight_decay


def save_adapter(model, optimizer, version: int, out: Path) -> None:
    import torch

    model.save_pretrained(str(out))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    (out / STATE_FILE).write_text(json.dumps({"version": version}))


def record_base(out: Path, model: str) -> None:
    """Name the base model in the saved adapter's config as others can load it (PEFT writes the
    local folder the trainer loaded, a cache path on a pod): see models.shareable_base."""
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
        """`files`: `_files_of` the adapter folder as written, for a local one (None: an object-store path)."""
        self.model, self.adapter, self.optimizer, self.files = model, adapter, optimizer, files

    def take(self, model, adapter: str, local_dir: str, train: TrainConfig):
        """The kept optimizer if `adapter` is the one kept, its folder unchanged since (a local
        folder can be edited; an object-store path is written once), and `model` still holds its
        weights; else None."""
        same = self.model is model and self.adapter == adapter and (self.files is None or self.files == _files_of(local_dir))
        optimizer = self.optimizer if same else None
        self.clear()  # taken or stale: either way the model is about to change
        if optimizer is not None:
            _set_hyperparameters(optimizer, train)  # the config, not the cache, sets them
        return optimizer


def _files_of(folder: str) -> tuple:
    """(name, size, modification time) of each file of an adapter folder: what changes if it is edited."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()))


_warm = WarmOptimizer()
_model_dirs = replica_cache("train-models", capacity=1)
_payload_dirs = replica_cache("train-payloads", capacity=1)
_adapter_dirs = replica_cache("train-adapters", capacity=2)
# The processes of a data-parallel step (one pod, one per GPU) share one download of each folder.
_node_dirs = node_cache("train-step")


@train_env.task(retries=2)
async def init_adapter(model: ModelConfig, lora: LoraConfig, seed: int, base_model: Dir) -> AdapterRef:
    """Version 0: a freshly initialized LoRA adapter (equal to the base model) and no optimizer state."""
    model_path = await _model_dirs.get(base_model)

    def build(out: Path) -> None:
        peft = peft_model(model, lora, model_path)
        _warm.clear()
        reset_lora(peft, seed)
        save_adapter(peft, None, 0, out)
        record_base(out, model.model)

    with input_errors_not_retried():  # e.g. a GPU pod whose CUDA is unusable
        folder, _ = await publish_dir(build, "v0000")
    return AdapterRef(version=0, dir=folder)


def build_sequences(scored: list[ScoredGroup], train: TrainConfig) -> tuple[list[grpo.TrainSequence], int]:
    """Every rollout as a training sequence, in a deterministic order, and the rollout count.

    Zero-advantage and masked rollouts are kept: they count in the loss normalizer
    (`grpo.LossNormalizer`); `grpo.in_loss` decides which go through the forward pass. Only an
    empty completion (nothing to train on) is left out here.
    """
    sequences = []
    total = 0
    scale_by_std = train.scale_rewards == "group"
    for sg in sorted(scored, key=lambda s: s.group.index):
        rewards = grpo.training_rewards(sg.reward_values, sg.truncated, train.truncated)
        advantages = grpo.group_advantages(rewards, train.advantage_eps, scale_by_std, train.advantage_std)
        for rollout, adv, cut in zip(sg.group.rollouts, advantages, sg.truncated, strict=True):
            total += 1
            if rollout.num_model_tokens:
                masked = train.truncated == "mask" and cut
                mask = None if rollout.model_mask is None else tuple(rollout.model_mask)
                sampled = rollout.sampling_logprobs
                if mask is not None:  # the trainer asks log-probs of the model's tokens only
                    sampled = [lp for lp, own in zip(sampled, mask, strict=True) if own]
                sequences.append(grpo.TrainSequence(sg.group.prompt_ids, rollout.completion_ids, adv, sampled, masked, mask))
    return sequences, total


def num_contributing(sequences: list[grpo.TrainSequence]) -> int:
    """Rollouts whose surrogate has a gradient: unmasked, with a nonzero advantage."""
    return sum(1 for s in sequences if not s.masked and s.advantage != 0.0)


def head_is_the_forward(model) -> bool:
    """Whether the output layer applied to the decoder's hidden states gives the model's logits.

    Some architectures change the logits after the output layer (Gemma 2/3 soft-capping,
    Granite's logits scaling, Cohere's logit scale). The trainer then has to use the model's own
    forward to differentiate the distribution the generator sampled from. Checked once per model
    on a few tokens, in eval mode and without gradients; the answer is kept on the model.
    """
    import torch

    known = getattr(model, "_grpo_flyte_head_is_forward", None)
    if known is not None:
        return known
    inner = model.get_base_model()
    device = next(model.parameters()).device
    ids = torch.arange(1, 6, device=device).unsqueeze(0) % inner.config.vocab_size
    was_training = model.training
    model.eval()
    with torch.no_grad():
        direct = inner.get_output_embeddings()(inner.get_decoder()(input_ids=ids).last_hidden_state).float()
        full = inner(input_ids=ids).logits.float()
    model.train(was_training)
    same = bool(torch.allclose(direct, full, rtol=1e-3, atol=1e-3 * float(full.abs().max().clamp(min=1.0))))
    model._grpo_flyte_head_is_forward = same
    return same


def _completion_logits(model, batch: grpo.PaddedBatch):
    """(N, V) logits at the positions that predict completion tokens, in `predict_mask` order."""
    device = next(model.parameters()).device
    inner = model.get_base_model()
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    mask = batch.predict_mask.to(device)
    if head_is_the_forward(model):
        # Only the positions that predict completion tokens go through the vocabulary projection:
        # prompt and padding positions would be most of the work and none of the loss.
        hidden = inner.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return inner.get_output_embeddings()(hidden[mask])
    # The model's own forward (its logit post-processing included), on the columns any row needs.
    columns = mask.any(dim=0).nonzero().squeeze(-1)
    logits = inner(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=columns).logits
    return logits[mask[:, columns]]


def _completion_logprobs(model, sequences: list[grpo.TrainSequence], sampling: SamplingConfig):
    """Forward one micro-batch: (log-probs, entropies) of its completion tokens, row after row,
    under the sampling distribution (temperature, and the top-p nucleus when top_p < 1)."""
    device = next(model.parameters()).device
    batch = grpo.pad_batch(sequences, pad_id=0)
    logits = _completion_logits(model, batch)  # (N, V)
    targets = batch.targets.to(device)[batch.predict_mask.to(device)]
    logprobs, entropy = grpo.token_logprobs_and_entropy(logits, targets, sampling.temperature, sampling.top_p)
    return logprobs, entropy, batch.row_of_token.to(device)


# With beta = 0 the KL only feeds the `kl` metric: the reference pass then runs on a few sequences,
# every `kl_monitor_every` iterations.
KL_MONITOR_SEQUENCES = 8


def kl_measured(train: TrainConfig, iteration: int) -> bool:
    """Whether iteration `iteration` (1-based) computes reference log-probs: always with beta > 0
    (the KL is in the loss), else every `kl_monitor_every` iterations."""
    if train.beta > 0:
        return True
    every = train.kl_monitor_every
    return every > 0 and iteration % every == 0


def _reference_pass(
    model,
    sequences: list[grpo.TrainSequence],
    trained: list[int],
    need_old: set[int],
    train: TrainConfig,
    sampling: SamplingConfig,
    iteration: int,
    mine: set[int] | None = None,
):
    """Once per iteration, without gradients: per sequence, the reference log-probs (the adapter
    disabled: no second copy of the model) and, for the sequences in `need_old`, the old ones.
    `mine`: the sequences this process forwards (data-parallel), None for all.

    Reference log-probs are computed for every trained sequence when beta > 0, for an evenly
    spread sample of KL_MONITOR_SEQUENCES of them on the iterations `kl_measured` names, and for
    none otherwise (None for the rest).
    """
    import torch

    n = len(trained)
    if not kl_measured(train, iteration):
        with_ref: set[int] = set()
    elif train.beta > 0 or n <= KL_MONITOR_SEQUENCES:
        with_ref = set(trained)
    else:
        with_ref = {trained[i * n // KL_MONITOR_SEQUENCES] for i in range(KL_MONITOR_SEQUENCES)}
    if mine is not None:  # the sample is chosen over all processes' sequences, each computes its own
        with_ref, need_old = with_ref & mine, need_old & mine
    ref: list = [None] * len(sequences)
    old: list = [None] * len(sequences)
    todo = sorted(with_ref | need_old)
    with torch.no_grad():
        for local in grpo.plan_micro_batches([sequences[i].length for i in todo], train.micro_batch_tokens):
            ids = [todo[k] for k in local]
            for wanted, out, adapter_off in ((with_ref, ref, True), (need_old, old, False)):
                chosen = [i for i in ids if i in wanted]
                if not chosen:
                    continue
                with model.disable_adapter() if adapter_off else contextlib.nullcontext():
                    lp, _, _ = _completion_logprobs(model, [sequences[i] for i in chosen], sampling)
                for i, x in zip(chosen, lp.split([sequences[i].num_trained for i in chosen]), strict=True):
                    out[i] = x
    return ref, old


class _Totals:
    """Sums over the micro-batches of one iteration, turned into StepStats at the end."""

    def __init__(self) -> None:
        self.loss = self.grad_norm = self.kl = self.entropy = self.is_sum = 0.0
        self.is_max = self.lr = self.weight_sum = self.weight_square_sum = 0.0
        self.tokens = self.clipped = self.kl_tokens = self.is_tokens = self.is_cut = self.updates = 0

    def all_reduce(self, device) -> None:
        """Sum the sums (and take the maximum ratio) over the data-parallel processes, as tensors on
        `device` (NCCL reduces GPU tensors only). The updates, the learning rate and the gradient
        norm (taken after the gradients' all-reduce) are the same in every process already."""
        import torch
        import torch.distributed as dist

        names = (
            "loss",
            "kl",
            "entropy",
            "is_sum",
            "weight_sum",
            "weight_square_sum",
            "tokens",
            "clipped",
            "kl_tokens",
            "is_tokens",
            "is_cut",
        )
        sums = torch.tensor([float(getattr(self, n)) for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        for n, value in zip(names, sums.tolist(), strict=True):
            setattr(self, n, type(getattr(self, n))(value))
        most = torch.tensor([float(self.is_max)], dtype=torch.float64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self.is_max = float(most)

    def stats(self) -> StepStats:
        return StepStats(
            loss=self.loss / self.updates,
            grad_norm=self.grad_norm / self.updates,
            num_updates=self.updates,
            num_tokens=self.tokens,
            kl=self.kl / self.kl_tokens if self.kl_tokens else None,
            clip_fraction=self.clipped / self.tokens,
            entropy=self.entropy / self.tokens,
            is_ratio_mean=self.is_sum / self.is_tokens if self.is_tokens else 1.0,
            is_ratio_max=self.is_max if self.is_tokens else 1.0,
            is_ess=grpo.effective_sample_size(self.weight_sum, self.weight_square_sum, self.is_tokens),
            is_clipped_fraction=self.is_cut / self.is_tokens if self.is_tokens else 0.0,
            lr=self.lr,
        )


def _micro_batch_loss(
    model, seqs, ref: list, old: list | None, norm: grpo.LossNormalizer, train: TrainConfig, sampling: SamplingConfig, totals: _Totals
):
    """The loss of one micro-batch (its share of the minibatch loss); adds its metrics to `totals`.

    ref/old: per sequence of `seqs`, the reference and old log-probs (ref None where not computed;
    old None: the old policy is the current one, detached, as in the first minibatch).
    """
    import torch

    device = next(model.parameters()).device
    logprobs, entropy, rows = _completion_logprobs(model, seqs, sampling)
    old_lp = torch.cat(old) if old is not None else logprobs.detach()
    kl = None
    if any(r is not None for r in ref):
        has_ref = torch.cat([torch.full((s.num_trained,), r is not None) for r, s in zip(ref, seqs, strict=True)]).to(device)
        ref_lp = torch.cat([r if r is not None else torch.zeros(s.num_trained, device=device) for r, s in zip(ref, seqs, strict=True)])
        kl = grpo.kl_k3(logprobs, ref_lp) * has_ref
        totals.kl += float(kl.detach().sum())
        totals.kl_tokens += int(has_ref.sum())
    weights = None
    if all(s.sampling_logprobs is not None for s in seqs):
        samp = torch.tensor([x for s in seqs for x in s.sampling_logprobs], device=device)
        corrected, rho = grpo.importance_weights(old_lp, samp, rows, train.is_cap, train.is_mode)
        weights = corrected if train.is_correction else None
        totals.is_sum += float(rho.sum())
        totals.is_max = max(totals.is_max, float(rho.max()))
        totals.is_tokens += rho.numel()
        totals.weight_sum += float(corrected.sum())
        totals.weight_square_sum += float(corrected.square().sum())
        totals.is_cut += int((corrected != rho).sum())
    advantages = torch.tensor([s.advantage for s in seqs], device=device)[rows]
    token_loss, clipped = grpo.grpo_token_loss(logprobs, old_lp, advantages, train.epsilon, train.epsilon_high, weights, kl, train.beta)
    lengths = torch.tensor([s.num_trained for s in seqs], device=device)
    loss = grpo.aggregate_loss(token_loss, rows, lengths, train.loss_type, norm)
    totals.entropy += float(entropy.sum())
    totals.clipped += int(clipped.sum())
    totals.tokens += logprobs.numel()
    return loss


def grpo_step(
    model,
    optimizer,
    sequences: list[grpo.TrainSequence],
    train: TrainConfig,
    sampling: SamplingConfig,
    steps: tuple[int, int] = (0, 0),
    rank: int = 0,
    world_size: int = 1,
) -> StepStats:
    """`updates_per_iter` clipped GRPO optimizer steps over minibatches of the sequences.

    `steps`: (the run's optimizer step this call starts at, the run's total; 0: unknown), for the
    learning-rate schedule (`grpo.scheduled_lr`); minibatch k is step first + k.

    Data-parallel (`world_size` > 1, in a torch.distributed process group): every process is given
    all the sequences and forwards its share of each minibatch's (`grpo.rank_share`); the loss
    normalizer counts the whole minibatch, so the LoRA gradients summed over the processes
    (all-reduce) are the one-process gradients, and every process takes the same optimizer step.

    Every sequence is dealt into a minibatch and counts in its normalizer; only those
    `grpo.in_loss` keeps are forwarded, in length-grouped micro-batches whose losses sum to the
    minibatch loss (`grpo.aggregate_loss`). A minibatch with none is no optimizer step. The
    reference log-probs, and the old ones of the minibatches after the first, are computed once
    before the first step; the first minibatch's old policy is the current one, detached.
    """
    import torch

    minibatches = grpo.split_minibatches(len(sequences), train.updates_per_iter) if sequences else []
    trained = [[i for i in mb if grpo.in_loss(sequences[i], train.beta)] for mb in minibatches]
    shares = [[mb[j] for j in grpo.rank_share([sequences[i].length for i in mb], rank, world_size)] for mb in trained]
    iteration = steps[0] // train.updates_per_iter + 1  # 1-based, for the KL monitor
    mine = {i for share in shares for i in share} if world_size > 1 else None
    ref, old = _reference_pass(
        model, sequences, [i for mb in trained for i in mb], {i for mb in trained[1:] for i in mb}, train, sampling, iteration, mine
    )
    model.train()
    _set_checkpointing(model, train.gradient_checkpointing)
    totals = _Totals()
    for k, (minibatch, forward, share) in enumerate(zip(minibatches, trained, shares, strict=True)):
        if not forward:  # the same in every process
            continue
        optimizer.zero_grad(set_to_none=True)
        norm = grpo.LossNormalizer(
            num_sequences=len(minibatch),
            num_tokens=sum(sequences[i].num_trained for i in minibatch if not sequences[i].masked),
            max_completion_tokens=sampling.max_new_tokens,
        )
        for local in grpo.plan_micro_batches([sequences[i].length for i in share], train.micro_batch_tokens):
            ids = [share[j] for j in local]
            loss = _micro_batch_loss(
                model,
                [sequences[i] for i in ids],
                [ref[i] for i in ids],
                [old[i] for i in ids] if k > 0 else None,
                norm,
                train,
                sampling,
                totals,
            )
            loss.backward()
            totals.loss += loss.item()
        if world_size > 1:
            _all_reduce_gradients(model)
        totals.grad_norm += float(torch.nn.utils.clip_grad_norm_(_trainable(model), train.max_grad_norm))
        lr = grpo.scheduled_lr(steps[0] + k, steps[1], train.learning_rate, train.lr_scheduler_type, train.warmup_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        totals.lr = lr
        optimizer.step()
        totals.updates += 1
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    if world_size > 1:
        totals.all_reduce(next(model.parameters()).device)
    return totals.stats().model_copy(update={"world_size": world_size}) if totals.updates else StepStats(world_size=world_size)


def _all_reduce_gradients(model) -> None:
    """Sum each LoRA gradient over the data-parallel processes (a process that forwarded nothing
    adds zeros), in one flat buffer."""
    import torch
    import torch.distributed as dist

    params = _trainable(model)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = chunk.view_as(p).clone()


@train_env.task(retries=2)
async def train_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir] = [],  # noqa: B006 (Flyte copies inputs; an optional list would hide the content hash)
    total_iterations: int = 0,
) -> TrainStepResult:
    """One iteration of GRPO (`updates_per_iter` optimizer steps) on the scored groups; returns the
    next adapter. A batch too large to pass inline comes as `scored_payload` (`storage.as_payload`)."""
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    scored = await from_payload(scored, scored_payload, ScoredGroup, _payload_dirs)
    sequences, num_rollouts = build_sequences(scored, train)
    version = adapter.version + 1

    steps = (adapter.version * train.updates_per_iter, total_iterations * train.updates_per_iter)
    job = RankJob(model_path, adapter_path, model, lora, train, sampling, sequences, steps, version)

    def build(out: Path) -> tuple[Any, Any, StepStats, tuple]:
        if train.train_processes > 1:
            _warm.clear()  # the processes hold the new weights, not this one's model
            return None, None, launch_ranks(job, out, train.train_processes), ()
        peft = peft_model(model, lora, model_path)
        optimizer = _warm.take(peft, adapter.dir.path, adapter_path, train)
        restore_s = 0.0
        if optimizer is None:
            restored = time.perf_counter()
            optimizer = load_adapter_state(peft, adapter_path, train)
            restore_s = time.perf_counter() - restored
        stats = grpo_step(peft, optimizer, sequences, train, sampling, steps)
        save_adapter(peft, optimizer, version, out)
        record_base(out, model.model)
        return peft, optimizer, stats.model_copy(update={"restore_s": restore_s}), _files_of(str(out))

    with input_errors_not_retried():  # e.g. a damaged adapter stays damaged
        new_dir, (peft, optimizer, stats, files) = await publish_dir(build, f"v{version:04d}")
    if peft is not None:
        _warm.keep(peft, new_dir.path, optimizer, None if is_remote(new_dir.path) else files)
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=new_dir),
        num_rollouts=num_rollouts,
        num_contributing=num_contributing(sequences),
        stats=stats,
        train_s=time.perf_counter() - started,
    )


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every process of a data-parallel train step is given: the same inputs (each takes its
    own share of the work, `grpo.rank_share`)."""

    model_path: str
    adapter_path: str
    model: ModelConfig
    lora: LoraConfig
    train: TrainConfig
    sampling: SamplingConfig
    sequences: list[grpo.TrainSequence]
    steps: tuple[int, int]
    version: int


def train_rank(job: RankJob, out: str) -> StepStats | None:
    """One process of a data-parallel train step, started by torch.distributed's launcher (its
    RANK, WORLD_SIZE, LOCAL_RANK and rendezvous variables set): load the base, restore the adapter
    and optimizer state from their folder (a fresh process has nothing warm), take the step with the
    gradients all-reduced, and rank 0 alone writes the new adapter into `out`. Rank 0 returns the
    step's statistics, the others None."""
    import os

    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    cuda = best_device() == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # the processes share the cores: one OpenMP team each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank = dist.get_rank()
        peft = peft_model(job.model, job.lora, job.model_path)
        restored = time.perf_counter()
        optimizer = load_adapter_state(peft, job.adapter_path, job.train)
        restore_s = time.perf_counter() - restored
        stats = grpo_step(peft, optimizer, job.sequences, job.train, job.sampling, job.steps, rank=rank, world_size=world_size)
        if rank == 0:
            save_adapter(peft, optimizer, job.version, Path(out))
            record_base(Path(out), job.model.model)
        dist.barrier()  # the adapter is whole before any process reports the step done
    finally:
        dist.destroy_process_group()
    return stats.model_copy(update={"restore_s": restore_s}) if rank == 0 else None


def _rank_main() -> None:
    """A train process of `launch_ranks`: `python -c ... JOB_FILE OUT STATS_FILE`. Its error is
    recorded for the launcher (torch elastic's `record`: the step fails with it, not with an exit
    code only); rank 0 writes the step's statistics to STATS_FILE."""
    import pickle
    import sys

    from torch.distributed.elastic.multiprocessing.errors import record

    job_file, out, stats_file = sys.argv[1:4]
    try:
        stats = record(train_rank)(pickle.loads(Path(job_file).read_bytes()), out)
    except GrpoFlyteError:
        sys.exit(1)  # recorded: the step raises it, and the run says it in one line (a bug's traceback is shown)
    if stats is not None:
        Path(stats_file).write_text(stats.model_dump_json())


# How often the launcher looks at its train processes.
RANK_POLL_S = 0.1


def launch_ranks(job: RankJob, out: Path, processes: int) -> StepStats:
    """The train step in `processes` local processes (gloo on a CPU): each started as torchrun
    starts one, by torch elastic's `start_processes`, with a session of its own (a terminal's
    Ctrl-C reaches the run, which ends them: `child_processes`), meeting at a TCP store this
    process hosts on a free port; rank 0's statistics.

    Not torch's `elastic_launch`: its agent adds restarts and rendezvous across nodes, which one
    node with no restarts does not use, and it stops its processes only on a signal in the main
    thread, while this runs on the torch thread (a Ctrl-C left them running the step)."""
    import os
    import pickle
    import sys
    import tempfile

    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from grpo_flyte import child_processes

    with tempfile.TemporaryDirectory(prefix="grpo_flyte-train-") as tmp:
        job_file, stats_file = Path(tmp) / "job.pkl", Path(tmp) / "stats.json"
        job_file.write_bytes(pickle.dumps(job))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: a free one
        common = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # the processes join this store, none hosts one
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        envs = {rank: {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(processes)}
        # Its warnings (no signal handlers off the main thread: `child_processes` ends the processes;
        # the others ended once one failed) and its error line (the step raises the failure) say
        # nothing the run does not.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        command = ("-c", "from grpo_flyte.trainer import _rank_main; _rank_main()", str(job_file), str(out), str(stats_file))
        with child_processes.starting() as started:
            ranks = start_processes(
                "grpo-flyte-train", sys.executable, dict.fromkeys(range(processes), command), envs, DefaultLogsSpecs(log_dir=tmp)
            )
            for pid in ranks.pids().values():
                started(pid)
        try:
            result = ranks.wait(period=RANK_POLL_S)  # once one fails, it ends the others
        finally:
            ranks.close()
            for pid in ranks.pids().values():
                child_processes.ended(pid)
        if result.is_failed():
            raise failed_workers(result.failures, processes)  # e.g. a damaged adapter: the AdapterError
        return StepStats.model_validate_json(stats_file.read_text())


async def _distributed_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir],
    total_iterations: int,
) -> TrainStepResult | None:
    """One process of the cluster's data-parallel train step (train_step_distributed): rank 0
    uploads the new adapter and answers for all."""
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = await rank_step(model, lora, train, sampling, base_model, adapter, scored, scored_payload, total_iterations, Path(out))
        if result is None:  # not rank 0: only its answer is the task's
            return None
        new_dir = await Dir.from_local(out)
    return result.model_copy(
        update={"adapter": AdapterRef(version=adapter.version + 1, dir=new_dir), "train_s": time.perf_counter() - started}
    )


async def rank_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir],
    total_iterations: int,
    out: Path,
) -> TrainStepResult | None:
    """Everything one process of a data-parallel train step does but the upload: read the inputs,
    take the step (`train_rank`); rank 0 writes the adapter into `out` and returns the result
    (its adapter names `out`), the others None."""
    started = time.perf_counter()
    model_path = await _node_dirs.get(base_model)
    fetched = time.perf_counter()
    adapter_path = await _node_dirs.get(adapter.dir)
    download_s = time.perf_counter() - fetched
    scored = await from_payload(scored, scored_payload, ScoredGroup, _node_dirs)
    sequences, num_rollouts = build_sequences(scored, train)
    version = adapter.version + 1
    steps = (adapter.version * train.updates_per_iter, total_iterations * train.updates_per_iter)
    stats = train_rank(RankJob(model_path, adapter_path, model, lora, train, sampling, sequences, steps, version), str(out))
    if stats is None:
        return None
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=Dir(path=str(out))),
        num_rollouts=num_rollouts,
        num_contributing=num_contributing(sequences),
        # reading the adapter folder back is part of restoring it (the base's download is not)
        stats=stats.model_copy(update={"restore_s": stats.restore_s + download_s}),
        train_s=time.perf_counter() - started,
    )


if train_dist_env is not None:

    @train_dist_env.task(retries=2)
    def train_step_distributed(
        model: ModelConfig,
        lora: LoraConfig,
        train: TrainConfig,
        sampling: SamplingConfig,
        base_model: Dir,
        adapter: AdapterRef,
        scored: list[ScoredGroup],
        scored_payload: list[Dir] = [],  # noqa: B006 (as train_step)
        total_iterations: int = 0,
    ) -> TrainStepResult | None:
        """train_step over the train GPUs: the Elastic plugin runs this in one process per GPU (a
        sync function, as the plugin calls it), each with torch.distributed's variables set. A
        process's error is recorded for the launcher (torch elastic's `record`), so that the task
        fails with it, not with exit codes only (envs.train_dist_env's plugin)."""
        import asyncio

        from torch.distributed.elastic.multiprocessing.errors import record

        def step() -> TrainStepResult | None:
            with input_errors_not_retried():
                return asyncio.run(
                    _distributed_step(model, lora, train, sampling, base_model, adapter, scored, scored_payload, total_iterations)
                )

        return record(step)()

    DISTRIBUTED_STEP = train_step_distributed
else:
    DISTRIBUTED_STEP = None


# The merged model's largest file: saving copies one file's tensors to the CPU at a time.
MERGE_SHARD_SIZE = "2GB"


def merge_into_base(model_path: str, adapter_path: str, out: Path) -> None:
    """Save base + LoRA as one plain transformers model folder (weights in the base's own dtype).

    The base loads in its own dtype straight onto this process's device (the train pool's GPU), so
    the merge needs one copy of the 16-bit base in GPU memory and none in the pod's memory (a
    float32 copy on the CPU, 12 GB for a 3B base, did not fit the train pod). PEFT adds each
    layer's update B @ A (computed from its float32 LoRA weights) to the weight in that dtype; the
    folder is written in shards of at most `MERGE_SHARD_SIZE`, each copied to the CPU on its own.
    The tokenizer is saved alongside.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_flyte.models import load_device

    saved = AutoConfig.from_pretrained(model_path)
    dtype = getattr(saved, "dtype", None) or getattr(saved, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map={"": load_device()})
    merged = PeftModel.from_pretrained(base, adapter_path).merge_and_unload()
    merged.save_pretrained(str(out), max_shard_size=MERGE_SHARD_SIZE)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(str(out))


def release_trainer_model() -> None:
    """Free the warm training model and its optimizer state (GPU memory the merge needs); the next
    step loads them again, as a cold replica would."""
    import gc

    _warm.clear()
    _peft_model.cache_clear()
    gc.collect()
    if best_device() == "cuda":
        import torch

        torch.cuda.empty_cache()


@train_env.task(retries=2)
async def merge_adapter(base_model: Dir, adapter: AdapterRef) -> Dir:
    """The adapter merged into the base: a full model folder for serving (no PEFT needed)."""
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)

    def build(out: Path) -> None:
        release_trainer_model()  # the run's last step is done: its model would only share the GPU with the merge
        merge_into_base(model_path, adapter_path, out)

    merged, _ = await publish_dir(build, f"merged-v{adapter.version:04d}")
    return merged
