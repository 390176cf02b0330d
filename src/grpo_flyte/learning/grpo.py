"""This module holds the GRPO math before the loss: advantages, micro-batching, masking and log-prob gathering.

Pure functions, separate from orchestration, unit-tested on hand-computed values. torch is
imported inside the functions that need it so that importing this module stays cheap.

Notation, per completion token t of rollout i (all log-probs at the sampling temperature):
    logp     the trainer's log-prob now (the only term with a gradient)
    old      the trainer's log-prob at the start of the iteration (`updates_per_iter` steps and
             `num_iterations` passes reuse it)
    samp     the generator's sampling log-prob, returned by `generate`
    ref      the reference policy: the same base model with the LoRA adapter disabled
    A_i      the rollout's advantage (`group_advantages`, `batch_advantages`)

With a sampling rule on (top_p, top_k, min_p, repetition_penalty) every log-prob above is that of
the processed distribution the tokens were drawn from (grpo_flyte.learning.distribution), on both
sides: the generators report it and the trainer computes it, so the importance ratio compares one
distribution with itself.

The loss itself (each loss type's per-token loss and aggregation, the importance weights, the KL,
the masks and the entropy bonus) is in grpo_flyte.learning.losses. Its normalizer counts every
rollout of the batch, as TRL does; a rollout that cannot change the loss (zero advantage, beta = 0
and no entropy bonus, or masked by the truncation policy) is then left out of the forward pass
(`in_loss`), which changes nothing but the time taken.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_flyte.learning import distribution

if TYPE_CHECKING:
    import torch


def training_rewards(rewards: Sequence[float], truncated: Sequence[bool], policy: str) -> list[float]:
    """The rewards advantages are computed from, given which completions hit the length limit.

    policy 'min_reward': a truncated completion gets the floor min(0, min(r)) over its group, so
    it is never better than any finished completion, even when rewards can be negative (stopping
    late and wrong must beat rambling to the limit). 'keep' and 'mask' leave the rewards as they
    are ('mask' takes the completions out of the loss in the trainer instead).
    """
    if len(rewards) != len(truncated):
        raise ValueError(f"{len(rewards)} rewards for {len(truncated)} truncation flags")
    if policy not in ("min_reward", "keep", "mask"):
        raise ValueError(f"truncated={policy!r}: expected 'min_reward', 'mask' or 'keep'")
    if policy != "min_reward" or not any(truncated):
        return list(rewards)
    floor = min(0.0, *rewards)
    return [floor if cut else r for r, cut in zip(rewards, truncated, strict=True)]


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's training rewards differ: a group scored all alike has zero advantages."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


def group_advantages(rewards: Sequence[float], eps: float, scale_by_std: bool = True, std: str = "sample") -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over one group.

    std 'sample' divides the squared deviations by n - 1 (TRL's and verl's choice), 'population'
    by n. With `scale_by_std=False` (Dr. GRPO) A_i = r_i - mean(r): no division by the std,
    which would up-weight groups that are nearly all right or all wrong.
    A group whose rewards are all equal carries no signal: every advantage is exactly 0.
    """
    if std not in ("sample", "population"):
        raise ValueError(f"std={std!r}: expected 'sample' or 'population'")
    if len(rewards) == 0:
        return []
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    if not scale_by_std:
        return [r - mean for r in rewards]
    dof = len(rewards) - 1 if std == "sample" else len(rewards)
    sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / dof)
    return [(r - mean) / (sd + eps) for r in rewards]


def _std(values: Sequence[float], std: str) -> float:
    """The standard deviation with n - 1 ('sample') or n ('population') in the denominator; 0 when undefined."""
    dof = len(values) - 1 if std == "sample" else len(values)
    if dof <= 0:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / dof)


def batch_advantages(groups: Sequence[Sequence[float]], eps: float, scale: str = "group", std: str = "sample") -> list[list[float]]:
    """The advantages of every group of a batch, by TRL's scale_rewards:

        A_gi = (r_gi - mean(r_g)) / (s + eps)
        group:  s = std(r_g), the group's (`group_advantages`)
        batch:  s = std of every reward of the batch (PPO Lite)
        none:   A_gi = r_gi - mean(r_g)   (Dr. GRPO)

    A group whose rewards are all equal gets exactly 0.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale!r}: expected 'group', 'batch' or 'none'")
    if scale != "batch":
        return [group_advantages(g, eps, scale == "group", std) for g in groups]
    spread = _std([r for g in groups for r in g], std)
    centred = [group_advantages(g, eps, False, std) for g in groups]
    return [[a / (spread + eps) for a in g] for g in centred]


def normalized_sums(scores: Sequence[dict[str, float]], weights: dict[str, float], eps: float, std: str = "sample") -> list[float | None]:
    """GDPO's per-reward normalization of one group (TRL's multi_objective_aggregation='normalize_then_sum'):

        s_i = sum_k w_k * (x_ik - mean_k) / (std_k + eps)

    x_ik the unweighted score of reward k for completion i, mean_k and std_k over the group's
    completions that reward scored (one that returned None is out of its statistics and adds
    nothing to s_i; a reward with fewer than two scores in the group adds 0). None for a completion
    no reward scored. The batch-level step is `batch_normalized`.
    """
    sums: list[float | None] = [None] * len(scores)
    for name, weight in weights.items():
        scored = [i for i, x in enumerate(scores) if name in x]
        values = [scores[i][name] for i in scored]
        spread = _std(values, std) if len(values) > 1 else None
        for i, x in zip(scored, values, strict=True):
            z = 0.0 if spread is None else (x - sum(values) / len(values)) / (spread + eps)
            sums[i] = (sums[i] or 0.0) + weight * z
    return sums


def batch_normalized(groups: Sequence[Sequence[float | None]], eps: float, std: str = "sample") -> list[list[float]]:
    """A_i = (s_i - mean(s)) / (std(s) + eps) over every value of the batch (None: out of the
    statistics, advantage 0): normalize_then_sum's second step."""
    values = [v for g in groups for v in g if v is not None]
    if not values:
        return [[0.0] * len(g) for g in groups]
    mean, spread = sum(values) / len(values), _std(values, std)
    return [[0.0 if v is None else (v - mean) / (spread + eps) for v in g] for g in groups]


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: prompt and completion token ids, its advantage, and the generator's
    sampling log-prob of each trained completion token (None when unknown: no IS correction then).

    `model_mask` (multi-turn): which completion tokens the model sampled; the others are the
    RL environment's, in the context but out of the loss. None: every completion token is trained.

    `masked`: out of the loss (the 'mask' truncation policy); it still counts in the normalizer's
    number of sequences, not in its number of tokens.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampling_logprobs: list[float] | None = None
    masked: bool = False
    model_mask: tuple[bool, ...] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_trained(self) -> int:
        """The completion tokens in the loss: all of them, or a multi-turn episode's model tokens."""
        return len(self.completion_ids) if self.model_mask is None else sum(self.model_mask)


def in_loss(sequence: TrainSequence, beta: float, entropy_bonus: bool = False) -> bool:
    """Whether the sequence can change the loss: not masked, and a nonzero advantage or, with
    beta > 0, a KL term (a zero-advantage rollout still pulls towards the reference) or, with an
    entropy bonus, its tokens' entropy."""
    return not sequence.masked and (sequence.advantage != 0.0 or beta > 0.0 or entropy_bonus)


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of similar length.

    Sequences are sorted longest first and packed greedily while (rows x longest row) stays within
    `token_budget` padded tokens; a sequence longer than the budget gets a batch of its own. Sorting
    by length keeps padding, which is pure waste on CPU, small.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def rank_share(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The positions (into `lengths`) that process `rank` of `world_size` forwards, in order.

    Data-parallel training: sequences sorted longest first are dealt round-robin, so every rank
    gets a share of about the same number of tokens (ranks differ by at most one sequence, each no
    longer than the ones before it); each rank plans its own micro-batches from its share.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of a world of {world_size}: expected 0 <= rank < world_size")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(order[rank::world_size])


@dataclass
class PaddedBatch:
    """Tensors for one micro-batch, right-padded.

    input_ids, attention_mask, predict_mask, targets: (B, T).
    predict_mask[b, t] is True where position t predicts completion token targets[b, t]:
    t in [P_b - 1, P_b + C_b - 1) for prompt length P_b and completion length C_b. Prompt and
    padding positions are False; the last completion token (EOS when the model stopped) is kept.
    In a multi-turn episode only the positions that predict the model's tokens are True.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    predict_mask: torch.Tensor
    targets: torch.Tensor
    row_of_token: torch.Tensor  # (N,) batch row of each selected token, N = predict_mask.sum()


def pad_batch(sequences: Sequence[TrainSequence], pad_id: int) -> PaddedBatch:
    import torch

    width = max(s.length for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    predict_mask = torch.zeros((rows, width), dtype=torch.bool)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    for b, s in enumerate(sequences):
        if not s.prompt_ids or not s.completion_ids:
            raise ValueError("every sequence needs at least one prompt token and one completion token")
        if s.model_mask is not None and len(s.model_mask) != len(s.completion_ids):
            raise ValueError(f"model_mask has {len(s.model_mask)} entries for {len(s.completion_ids)} completion tokens")
        ids = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        p, n = len(s.prompt_ids), len(ids)
        input_ids[b, :n] = ids
        attention_mask[b, :n] = 1
        targets[b, : n - 1] = ids[1:]
        if s.model_mask is None:
            predict_mask[b, p - 1 : n - 1] = True
        else:
            predict_mask[b, p - 1 : n - 1] = torch.tensor(s.model_mask, dtype=torch.bool)
    row_of_token = torch.nonzero(predict_mask, as_tuple=True)[0]
    return PaddedBatch(input_ids, attention_mask, predict_mask, targets, row_of_token)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[target] per position: (N, V), (N,) -> (N,), computed in float32."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seen: distribution.SeenTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy H_t = -sum_v p_v log p_v of softmax(logits / T) per
    position: (N, V), (N,) -> (N,), (N,). Both are differentiable (the entropy bonus needs
    dH_t / dlogits_v = -p_v (log p_v + H_t) / T).

    With a sampling rule on (top_p < 1, top_k > 0, min_p, repetition_penalty != 1) the log-probs
    are those of the processed distribution the token was sampled from, and the entropy that of the
    penalized distribution before truncation (`distribution.processed_logprobs_and_entropy`;
    `seen`: each position's context, needed with a repetition penalty). With none (the default) it
    is `_vocab_chunks`' arithmetic, a few rows at a time.
    """
    rules = distribution.Rules(temperature, top_p, top_k, min_p, repetition_penalty)
    if rules.plain:
        return _vocab_chunks().apply(logits, targets, temperature)
    return distribution.processed_logprobs_and_entropy(logits, targets, rules, seen)


# Rows of (N, V) logits `_vocab_chunks` takes at a time: about 4 MB of float32, so that each
# chunk's passes (log-sum-exp, entropy; softmax and gradient on the way back) stay in the cache.
VOCAB_CHUNK_ELEMENTS = 2**20


@functools.cache
def _vocab_chunks():
    """The log-prob of the target and the entropy under softmax(logits / T), as an autograd function
    that never holds more than a chunk of rows in float32.

    The same numbers as log_softmax over the whole (N, V) matrix in float32, and faster on a CPU
    (docs/measurements.md#benchmarks, "The train step"): the whole-matrix form writes four float32
    copies of it (N x V is 150M numbers for 3000 completion tokens of a 49k vocabulary) and reads
    them back, forward and backward. Backward, for log p_t = x_t - logsumexp(x) with x = logits / T:
    d log p_t / d logits_v = (onehot_t - p_v) / T and dH / d logits_v = -p_v (log p_v + H) / T,
    recomputed from the saved logits, log-sum-exp and entropy.
    """
    import torch

    def chunks(n: int, vocab: int):
        rows = max(1, VOCAB_CHUNK_ELEMENTS // max(1, vocab))
        return [slice(start, start + rows) for start in range(0, n, rows)]

    def scaled(logits, rows: slice, temperature: float):
        x = logits[rows].to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # written in place
        return x.div_(temperature) if temperature != 1.0 else x

    class VocabChunks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets, temperature):
            n = logits.shape[0]
            kind = torch.promote_types(logits.dtype, torch.float32)
            chosen, entropy, lse = (torch.empty(n, dtype=kind, device=logits.device) for _ in range(3))
            for rows in chunks(n, logits.shape[-1]):
                x = scaled(logits, rows, temperature)
                lse[rows] = torch.logsumexp(x, dim=-1)
                logp = x.sub_(lse[rows].unsqueeze(-1))
                chosen[rows] = logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
                entropy[rows] = -(logp.exp() * logp).sum(-1)
            ctx.save_for_backward(logits, targets, lse, entropy)
            ctx.temperature = temperature
            ctx.set_materialize_grads(False)  # an output nothing depends on gets None: no work for it
            return chosen, entropy

        @staticmethod
        def backward(ctx, grad_chosen, grad_entropy):
            logits, targets, lse, entropy = ctx.saved_tensors
            grad = torch.empty_like(logits)
            g = None if grad_chosen is None else (grad_chosen / ctx.temperature).unsqueeze(-1)
            h = None if grad_entropy is None else (grad_entropy / ctx.temperature).unsqueeze(-1)
            for rows in chunks(logits.shape[0], logits.shape[-1]):
                logp = scaled(logits, rows, ctx.temperature).sub_(lse[rows].unsqueeze(-1))
                if h is None:
                    out = logp.exp_().mul_(-g[rows])
                else:
                    p = logp.exp()
                    out = logp.add_(entropy[rows].unsqueeze(-1)).mul_(p).mul_(-h[rows])  # -p_v (log p_v + H)
                    if g is not None:
                        out.sub_(p.mul_(g[rows]))
                if g is not None:
                    out.scatter_add_(-1, targets[rows].unsqueeze(-1), g[rows])
                grad[rows] = out
            return grad, None, None

    return VocabChunks


def scheduled_lr(step: int, total_steps: int, base_lr: float, schedule: str, warmup_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total_steps`: a linear warmup from 0
    over ceil(warmup_ratio * total_steps) steps, then `schedule` ('constant', 'linear' or 'cosine'
    decay to 0 at `total_steps`), as transformers' schedulers (TRL's) compute it. With
    total_steps 0 (unknown) the rate is `base_lr`."""
    if total_steps <= 0:
        return base_lr
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return base_lr * step / max(1, warmup)
    if schedule == "constant":
        return base_lr
    progress = (step - warmup) / max(1, total_steps - warmup)
    if schedule == "linear":
        return base_lr * max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"schedule={schedule!r}: expected 'constant', 'linear' or 'cosine'")


def split_minibatches(num_sequences: int, num_minibatches: int) -> list[list[int]]:
    """Deal sequence indices round-robin into at most `num_minibatches` non-empty minibatches.

    Sequences arrive ordered by prompt group, so dealing them out spreads every group across the
    minibatches; fewer sequences than minibatches gives one sequence per minibatch.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    k = min(num_minibatches, num_sequences)
    return [list(range(j, num_sequences, k)) for j in range(k)]
