"""This module runs one GRPO iteration on the policy: `num_iterations` passes of `updates_per_iter` optimizer steps.

`build_sequences` turns scored groups into training sequences with their advantages (the
generator's token ids, never re-tokenized); `grpo_step` computes the reference and old log-probs
once (`_reference_pass`), then per minibatch sums the micro-batch losses (`_micro_batch_loss`, the
formulas in `grpo_flyte.learning.losses`) and takes an optimizer step. Data-parallel, each process forwards its share of every minibatch and
the LoRA gradients are summed over the processes (`grpo_flyte.learning.data_parallel` starts them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from grpo_flyte.config.generation import SamplingConfig
from grpo_flyte.config.training import TrainConfig
from grpo_flyte.learning import distribution, grpo, losses
from grpo_flyte.learning.policy import trainable
from grpo_flyte.runtime import allocator
from grpo_flyte.types import ScoredGroup, StepStats


def advantages(scored: list[ScoredGroup], train: TrainConfig, reward_weights: dict[str, float] | None = None) -> list[list[float]]:
    """Each rollout's advantage in the train step, per group in group-index order.

    `grpo.batch_advantages` of the training rewards (`grpo.training_rewards`: the truncation policy
    applied) by scale_rewards, over all the groups of the iteration; with normalize_then_sum,
    `grpo.normalized_sums` of each completion's per-reward scores (`reward_weights`: the run's
    rewards), the truncation floor applied to those sums, then `grpo.batch_normalized`.
    """
    ordered = sorted(scored, key=lambda s: s.group.index)
    if train.multi_objective_aggregation == "normalize_then_sum":
        if not reward_weights:
            raise ValueError("multi_objective_aggregation='normalize_then_sum' needs the rewards' weights")
        sums = []
        for sg in ordered:
            group = grpo.normalized_sums([p.scores for p in sg.rewards], reward_weights, train.advantage_eps, train.advantage_std)
            scorable = [i for i, v in enumerate(group) if v is not None]
            floored = grpo.training_rewards([group[i] for i in scorable], [sg.truncated[i] for i in scorable], train.truncated)
            for i, v in zip(scorable, floored, strict=True):
                group[i] = v
            sums.append(group)
        return grpo.batch_normalized(sums, train.advantage_eps, train.advantage_std)
    rewards = [grpo.training_rewards(sg.reward_values, sg.truncated, train.truncated) for sg in ordered]
    return grpo.batch_advantages(rewards, train.advantage_eps, train.scale_rewards, train.advantage_std)


def build_sequences(
    scored: list[ScoredGroup], train: TrainConfig, reward_weights: dict[str, float] | None = None
) -> tuple[list[grpo.TrainSequence], int]:
    """Every rollout as a training sequence (an agent's episode: one per branch too), in a
    deterministic order, and the rollout count.

    Advantages: `advantages`, over all the groups of the iteration.
    Zero-advantage and masked rollouts are kept: they count in the loss normalizer
    (`losses.LossNormalizer`); `grpo.in_loss` decides which go through the forward pass. Only an
    empty completion (nothing to train on) is left out here.
    """
    sequences = []
    total = 0
    ordered = sorted(scored, key=lambda s: s.group.index)
    for sg, group_advantages in zip(ordered, advantages(scored, train, reward_weights), strict=True):
        for rollout, adv, cut in zip(sg.group.rollouts, group_advantages, sg.truncated, strict=True):
            total += 1
            masked = train.truncated == "mask" and cut
            # an agent's episode: its own prompt, and its other sequences with the same advantage
            for part in (rollout, *rollout.branches):
                if not part.completion_ids or (part.model_mask is not None and not any(part.model_mask)):
                    continue
                mask = None if part.model_mask is None else tuple(part.model_mask)
                sampled = part.sampling_logprobs
                if mask is not None:  # the trainer asks log-probs of the model's tokens only
                    sampled = [lp for lp, own in zip(sampled, mask, strict=True) if own]
                prompt_ids = part.prompt_ids or sg.group.prompt_ids
                sequences.append(grpo.TrainSequence(prompt_ids, part.completion_ids, adv, sampled, masked, mask))
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
    under the sampling distribution (temperature, repetition penalty, min-p, top-k and top-p:
    `grpo_flyte.learning.distribution`; a position's context for the penalty is its row's prompt
    and completion before the token)."""
    device = next(model.parameters()).device
    batch = grpo.pad_batch(sequences, pad_id=0)
    logits = _completion_logits(model, batch)  # (N, V)
    targets = batch.targets.to(device)[batch.predict_mask.to(device)]
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = distribution.SeenTokens.of_batch(
            batch.input_ids.to(device), batch.attention_mask.to(device), batch.predict_mask.to(device), logits.shape[-1]
        )
    logprobs, entropy = grpo.token_logprobs_and_entropy(
        logits, targets, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty, seen
    )
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
        for local in grpo.plan_micro_batches([sequences[i].length for i in todo], train.token_budget(next(model.parameters()).device.type)):
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
        self.is_max = self.lr = self.weight_sum = self.weight_square_sum = self.phi_sum = 0.0
        self.tokens = self.clipped = self.kl_tokens = self.is_tokens = self.is_cut = self.updates = 0
        self.off_masked = self.phi_tokens = 0
        self.step_entropy = [0.0, 0]  # the current optimizer step's entropy sum and tokens (adaptive control)

    def all_reduce(self, device) -> None:
        """Sum the sums (and take the maximum ratio) over the data-parallel processes, as tensors on
        `device` (NCCL reduces GPU tensors only). The updates, the learning rate and the gradient
        norm (taken after the gradients' all-reduce) are the same in every process already."""
        import torch
        import torch.distributed as dist

        names = ("loss", "kl", "entropy", "is_sum", "weight_sum", "weight_square_sum", "phi_sum",
                 "tokens", "clipped", "kl_tokens", "is_tokens", "is_cut", "off_masked", "phi_tokens")  # fmt: skip
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
            is_ess=losses.effective_sample_size(self.weight_sum, self.weight_square_sum, self.is_tokens),
            is_clipped_fraction=self.is_cut / self.is_tokens if self.is_tokens else 0.0,
            off_policy_masked_fraction=self.off_masked / self.tokens,
            vespo_phi_mean=self.phi_sum / self.phi_tokens if self.phi_tokens else None,
            lr=self.lr,
        )


def _micro_batch_loss(
    model,
    seqs,
    ref: list,
    old: list | None,
    norm: losses.LossNormalizer,
    train: TrainConfig,
    sampling: SamplingConfig,
    totals: _Totals,
    threshold: float | None = None,
    coef: float = 0.0,
):
    """The loss of one micro-batch (its share of the minibatch loss); adds its metrics to `totals`.

    ref/old: per sequence of `seqs`, the reference and old log-probs (ref None where not computed;
    old None: the old policy is the current one, detached, as in the first minibatch of the first
    pass). threshold: the minibatch's entropy threshold (top_entropy_quantile < 1; None: every
    token); coef: the entropy bonus's coefficient this step.
    """
    import torch

    device = next(model.parameters()).device
    logprobs, entropy, rows = _completion_logprobs(model, seqs, sampling)
    old_lp = torch.cat(old) if old is not None else logprobs.detach()
    lengths = torch.tensor([s.num_trained for s in seqs], device=device)
    advantages = torch.tensor([s.advantage for s in seqs], device=device)[rows]
    ref_lp = None
    if any(r is not None for r in ref):
        missing = torch.full((1,), float("nan"), device=device)
        ref_lp = torch.cat([r if r is not None else missing.expand(s.num_trained) for r, s in zip(ref, seqs, strict=True)])
    samp = None
    if all(s.sampling_logprobs is not None for s in seqs):
        samp = torch.tensor([x for s in seqs for x in s.sampling_logprobs], device=device)
    out = losses.objective(logprobs, entropy, old_lp, advantages, rows, lengths, train, norm, samp, ref_lp, threshold, coef)
    if out.kl is not None:
        totals.kl += float(out.kl.detach().sum())
        totals.kl_tokens += int((~torch.isnan(ref_lp)).sum())
    if out.rho is not None:
        totals.is_sum += float(out.rho.sum())
        totals.is_max = max(totals.is_max, float(out.rho.max()))
        totals.is_tokens += out.rho.numel()
        totals.weight_sum += float(out.weights.sum())
        totals.weight_square_sum += float(out.weights.square().sum())
        totals.is_cut += int((out.weights != out.rho).sum())
    if out.stays is not None:
        totals.off_masked += int((~out.stays).sum())
    if train.entropy_bonus:
        measured = entropy.detach() if out.high is None else entropy.detach()[out.high]
        totals.step_entropy[0] += float(measured.sum())
        totals.step_entropy[1] += measured.numel()
    if out.terms.phi is not None:
        totals.phi_sum += float(out.terms.phi.sum())
        totals.phi_tokens += out.terms.phi.numel()
    totals.entropy += float(entropy.detach().sum())
    totals.clipped += int(out.terms.clipped.sum())
    totals.tokens += logprobs.numel()
    return out.loss


def _entropy_threshold(model, sequences, population: list[int], train: TrainConfig, sampling: SamplingConfig, rank: int, world_size: int):
    """The minibatch's entropy threshold (`losses.entropy_threshold`) over the trained tokens of
    every unmasked rollout of `population` (zero-advantage ones included, as TRL's mask does), at
    the current policy, and how many tokens it keeps: one forward pass without gradients, each
    process over its share, the entropies gathered from all."""
    import torch

    share = [population[j] for j in grpo.rank_share([sequences[i].length for i in population], rank, world_size)]
    found = []
    with torch.no_grad():
        for local in grpo.plan_micro_batches(
            [sequences[i].length for i in share], train.token_budget(next(model.parameters()).device.type)
        ):
            _, entropy, _ = _completion_logprobs(model, [sequences[share[j]] for j in local], sampling)
            found.append(entropy.float().cpu())
    entropies = torch.cat(found) if found else torch.zeros(0)
    if world_size > 1:
        import torch.distributed as dist

        every: list = [None] * world_size
        dist.all_gather_object(every, entropies.tolist())
        entropies = torch.tensor([h for part in every for h in part])
    threshold = float(losses.entropy_threshold(entropies, train.top_entropy_quantile))
    return threshold, int((entropies >= threshold).sum())


def _measured_entropy(totals: _Totals, world_size: int, device) -> float:
    """The mean entropy over the tokens the bonus acted on in this optimizer step, all processes."""
    total, count = totals.step_entropy
    if world_size > 1:
        import torch
        import torch.distributed as dist

        both = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        total, count = both.tolist()
    return total / max(1.0, count)


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


def checkpointed(train: TrainConfig, lengths: list[int], budget: int) -> bool:
    """Whether a micro-batch of sequences of `lengths` recomputes its activations in the backward
    pass: always with gradient_checkpointing, and for a sequence longer than `budget` (the step's
    `TrainConfig.token_budget`), which trains alone (a sequence is never split): its activations would grow with it, while
    checkpointed only each layer's input and one layer's activations at a time stay live, a small
    fraction of that (docs/measurements.md#long-observations-issue-40-2026-11-26)."""
    return train.gradient_checkpointing or len(lengths) * max(lengths) > budget


def grpo_step(
    model,
    optimizer,
    sequences: list[grpo.TrainSequence],
    train: TrainConfig,
    sampling: SamplingConfig,
    steps: tuple[int, int] = (0, 0),
    rank: int = 0,
    world_size: int = 1,
    control: losses.EntropyControl | None = None,
) -> StepStats:
    """`num_iterations` passes of `updates_per_iter` GRPO optimizer steps over minibatches of the sequences.

    `steps`: (the run's optimizer step this call starts at, the run's total; 0: unknown), for the
    learning-rate schedule (`grpo.scheduled_lr`); minibatch k of pass p is step first + p x
    updates_per_iter + k. `control`: the entropy coefficient's state, from the adapter folder
    (None: entropy_coef); the state after the step comes back in the stats (entropy_coef, entropy_last).

    Data-parallel (`world_size` > 1, in a torch.distributed process group): every process is given
    all the sequences and forwards its share of each minibatch's (`grpo.rank_share`); the loss
    normalizer counts the whole minibatch, so the LoRA gradients summed over the processes
    (all-reduce) are the one-process gradients, and every process takes the same optimizer step.

    Every sequence is dealt into a minibatch and counts in its normalizer; only those
    `grpo.in_loss` keeps are forwarded, in length-grouped micro-batches whose losses sum to the
    minibatch loss (`losses.aggregate_loss`). A minibatch with none is no optimizer step. The
    reference log-probs, and the old ones of every minibatch but the first pass's first, are
    computed once before the first step; that one's old policy is the current one, detached.

    A step with a sequence longer than the micro-batch budget (trained alone, checkpointed) keeps
    none of its memory once it ends (`allocator.handing_back`); the default steps keep theirs for
    the next step to reuse.
    """
    budget = train.token_budget(next(model.parameters()).device.type)
    with allocator.handing_back(any(s.length > budget for s in sequences)):
        return _grpo_step(model, optimizer, sequences, train, sampling, steps, rank, world_size, control, budget)


def _grpo_step(model, optimizer, sequences, train: TrainConfig, sampling, steps, rank, world_size, control, budget: int) -> StepStats:
    """`grpo_step`'s passes, with its arguments and its micro-batch token budget."""
    import torch

    control = control or losses.EntropyControl(train.entropy_coef)
    minibatches = grpo.split_minibatches(len(sequences), train.updates_per_iter) if sequences else []
    trained = [[i for i in mb if grpo.in_loss(sequences[i], train.beta, train.entropy_bonus)] for mb in minibatches]
    shares = [[mb[j] for j in grpo.rank_share([sequences[i].length for i in mb], rank, world_size)] for mb in trained]
    iteration = steps[0] // train.steps_per_iteration + 1  # 1-based, for the KL monitor
    mine = {i for share in shares for i in share} if world_size > 1 else None
    reused = trained if train.num_iterations > 1 else trained[1:]  # passes after the first reuse minibatch 0's old log-probs too
    ref, old = _reference_pass(
        model, sequences, [i for mb in trained for i in mb], {i for mb in reused for i in mb}, train, sampling, iteration, mine
    )
    model.train()
    totals = _Totals()
    device = next(model.parameters()).device
    for p in range(train.num_iterations):
        for k, (minibatch, forward, share) in enumerate(zip(minibatches, trained, shares, strict=True)):
            if not forward:  # the same in every process
                continue
            optimizer.zero_grad(set_to_none=True)
            unmasked = [i for i in minibatch if not sequences[i].masked]
            num_tokens = sum(sequences[i].num_trained for i in unmasked)
            threshold, kept = None, num_tokens
            if train.top_entropy_quantile < 1.0:
                threshold, kept = _entropy_threshold(model, sequences, unmasked, train, sampling, rank, world_size)
            norm = losses.LossNormalizer(len(minibatch), num_tokens, sampling.max_new_tokens, kept)
            coef = control.applied(train)
            totals.step_entropy = [0.0, 0]
            for local in grpo.plan_micro_batches([sequences[i].length for i in share], budget):
                ids = [share[j] for j in local]
                _set_checkpointing(model, checkpointed(train, [sequences[i].length for i in ids], budget))
                loss = _micro_batch_loss(
                    model,
                    [sequences[i] for i in ids],
                    [ref[i] for i in ids],
                    [old[i] for i in ids] if k > 0 or p > 0 else None,
                    norm,
                    train,
                    sampling,
                    totals,
                    threshold,
                    coef,
                )
                loss.backward()
                totals.loss += loss.item()
            if world_size > 1:
                _all_reduce_gradients(model)
            totals.grad_norm += float(torch.nn.utils.clip_grad_norm_(trainable(model), train.max_grad_norm))
            lr = grpo.scheduled_lr(
                steps[0] + p * train.updates_per_iter + k, steps[1], train.learning_rate, train.lr_scheduler_type, train.warmup_ratio
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            totals.lr = lr
            optimizer.step()
            totals.updates += 1
            if train.use_adaptive_entropy:
                control = control.updated(_measured_entropy(totals, world_size, device), train)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    if world_size > 1:
        totals.all_reduce(device)
    stats = totals.stats() if totals.updates else StepStats()
    return stats.model_copy(update={"world_size": world_size, "entropy_coef": control.coef, "entropy_last": control.last_entropy})


def _all_reduce_gradients(model) -> None:
    """Sum each LoRA gradient over the data-parallel processes (a process that forwarded nothing
    adds zeros), in one flat buffer."""
    import torch
    import torch.distributed as dist

    params = trainable(model)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = chunk.view_as(p).clone()
