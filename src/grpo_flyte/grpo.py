"""The GRPO math: advantages, micro-batching, masking, log-prob gathering and the loss.

Pure functions, separate from orchestration, unit-tested on hand-computed values. torch is
imported inside the functions that need it so that importing this module stays cheap.

Notation, per completion token t of rollout i (all log-probs at the sampling temperature):
    logp     the trainer's log-prob now (the only term with a gradient)
    old      the trainer's log-prob at the start of the iteration (`updates_per_iter` steps reuse it)
    samp     the generator's sampling log-prob, returned by `generate`
    ref      the reference policy: the same base model with the LoRA adapter disabled
    A_i      the rollout's advantage (`group_advantages`)

The per-token loss is `grpo_token_loss`, the aggregation over tokens and rollouts is
`aggregate_loss` (one formula per `loss_type`); each formula is written once, in the docstring of
the function that computes it.

Rollouts with zero advantage (e.g. every member of their group scored alike) are dropped before
the forward pass: their surrogate gradient is zero, and with beta > 0 they would only pull towards
the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: Sequence[float], eps: float, scale_by_std: bool = True) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps), with the population std over one group.

    With `scale_by_std=False` (Dr. GRPO) A_i = r_i - mean(r): no division by the std, which
    would up-weight groups that are nearly all right or all wrong.
    A group whose rewards are all equal carries no signal: every advantage is exactly 0.
    """
    if len(rewards) == 0:
        return []
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    if not scale_by_std:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: prompt and completion token ids, its advantage, and the generator's
    sampling log-prob of each completion token (None when unknown: no IS correction then)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampling_logprobs: list[float] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


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


@dataclass
class PaddedBatch:
    """Tensors for one micro-batch, right-padded.

    input_ids, attention_mask, predict_mask, targets: (B, T).
    predict_mask[b, t] is True where position t predicts completion token targets[b, t]:
    t in [P_b - 1, P_b + C_b - 1) for prompt length P_b and completion length C_b. Prompt and
    padding positions are False; the last completion token (EOS when the model stopped) is kept.
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
        ids = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        p, n = len(s.prompt_ids), len(ids)
        input_ids[b, :n] = ids
        attention_mask[b, :n] = 1
        targets[b, : n - 1] = ids[1:]
        predict_mask[b, p - 1 : n - 1] = True
    row_of_token = torch.nonzero(predict_mask, as_tuple=True)[0]
    return PaddedBatch(input_ids, attention_mask, predict_mask, targets, row_of_token)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[target] per position: (N, V), (N,) -> (N,), computed in float32."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy H_t = -sum_v p_v log p_v of softmax(logits / T) per
    position, from one log-softmax: (N, V), (N,) -> (N,), (N,). The entropy is detached."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def split_minibatches(num_sequences: int, num_minibatches: int) -> list[list[int]]:
    """Deal sequence indices round-robin into at most `num_minibatches` non-empty minibatches.

    Sequences arrive ordered by prompt group, so dealing them out spreads every group across the
    minibatches; fewer sequences than minibatches gives one sequence per minibatch.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    k = min(num_minibatches, num_sequences)
    return [list(range(j, num_sequences, k)) for j in range(k)]


def truncated_is_weights(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights for the generator/trainer mismatch: (weights, raw ratios).

        rho_t = exp(old_t - samp_t),   w_t = min(rho_t, cap)

    The generator (vLLM, or batched KV-cached decoding) and the trainer (a full forward pass) give
    slightly different log-probs for the same token; w_t re-weights each token's surrogate towards
    the trainer's policy, and the cap bounds the variance. Both are detached.
    """
    import torch

    if cap < 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    rho = torch.exp(old_logprobs.detach().float() - sampling_logprobs.float())
    return torch.clamp(rho, max=cap), rho


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, the non-negative "k3" estimator:

        kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

    Unbiased for KL(pi || pi_ref) when the tokens are sampled from pi, and 0 where they agree.
    """
    delta = ref_logprobs - logprobs
    return delta.exp() - delta - 1.0


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    is_weights: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped per-token loss and which tokens were clipped: (loss (N,), clipped (N,) bool).

        r_t    = exp(logp_t - old_t)
        loss_t = -w_t * min(r_t * A, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl_t

    `advantages` holds each token's rollout advantage A; w_t are the importance weights (1 when
    None) and kl_t the per-token KL (`kl_k3`; required when beta > 0). A token is clipped when the
    clipped branch wins and so carries no gradient: r_t < 1 - epsilon with A < 0, or
    r_t > 1 + epsilon_high with A > 0.
    """
    import torch

    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    loss = -surrogate if is_weights is None else -is_weights * surrogate
    if beta != 0.0:
        if kl is None:
            raise ValueError("beta != 0 needs the per-token KL")
        loss = loss + beta * kl
    with torch.no_grad():
        clipped = ((ratio < 1.0 - epsilon) & (advantages < 0)) | ((ratio > 1.0 + epsilon_high) & (advantages > 0))
    return loss, clipped


@dataclass(frozen=True)
class LossNormalizer:
    """The sizes of one optimizer step's minibatch that `aggregate_loss` divides by."""

    num_sequences: int  # S: rollouts in the minibatch
    num_tokens: int  # T: completion tokens in the minibatch
    max_completion_tokens: int  # L: the completion length limit (max_new_tokens)


def aggregate_loss(
    token_loss: torch.Tensor,
    row_of_token: torch.Tensor,
    completion_lengths: torch.Tensor,
    loss_type: str,
    norm: LossNormalizer,
) -> torch.Tensor:
    """Reduce per-token losses l_it of one micro-batch to its share of the minibatch loss.

        grpo:     L = (1/S) * sum_i (1/|o_i|) * sum_t l_it    per-sequence mean, then mean over sequences
        dr_grpo:  L = 1/(S*L) * sum_i sum_t l_it               sum over tokens / a constant (S x length limit)
        dapo:     L = (1/T) * sum_i sum_t l_it                 token-level mean over the minibatch

    S, T and L come from `norm` and count the whole minibatch, so summing this over its
    micro-batches gives the minibatch loss. row_of_token: (N,) the row of each token;
    completion_lengths: (B,) |o_i| per row of the micro-batch.
    """
    if loss_type == "grpo":
        per_token = 1.0 / (completion_lengths[row_of_token].to(token_loss.dtype) * norm.num_sequences)
        return (token_loss * per_token).sum()
    if loss_type == "dr_grpo":
        return token_loss.sum() / (norm.num_sequences * norm.max_completion_tokens)
    if loss_type == "dapo":
        return token_loss.sum() / norm.num_tokens
    raise ValueError(f"loss_type={loss_type!r}: expected 'grpo', 'dr_grpo' or 'dapo'")
