"""The GRPO math: advantages, micro-batching, masking, log-prob gathering and the loss.

Pure functions, separate from orchestration, unit-tested on hand-computed values. torch is
imported inside the functions that need it so that importing this module stays cheap.

How the loss differs from textbook GRPO (this is the "GRPO loop end to end" objective):
1. One optimizer step per iteration, so the policy that sampled is the policy being updated: the
   importance ratio is 1 and PPO clipping would be a no-op; it is left out.
2. No KL penalty to a reference model.
3. Loss per sequence is the mean over its completion tokens (EOS included), then the mean over
   the sequences of the batch.
4. Rollouts with zero advantage (e.g. every member of their group scored alike) are dropped
   before the forward pass: they contribute no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: Sequence[float], eps: float) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps), with the population std over one group.

    A group whose rewards are all equal carries no signal: every advantage is exactly 0.
    """
    if len(rewards) == 0:
        return []
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: prompt and completion token ids, and its advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float

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


def policy_gradient_loss(
    logprobs: torch.Tensor,
    row_of_token: torch.Tensor,
    advantages: torch.Tensor,
    completion_lengths: torch.Tensor,
    num_sequences: int,
) -> torch.Tensor:
    """L = -(1/S) sum_i A_i * (1/|o_i|) sum_t log pi(o_i,t | q, o_i,<t).

    logprobs: (N,) over the selected completion tokens of a micro-batch; row_of_token: (N,) their
    row; advantages, completion_lengths: (B,) per row; S = num_sequences counts every sequence of
    the whole step, so summing this over micro-batches gives the loss of the full batch.
    """
    weights = advantages[row_of_token] / completion_lengths[row_of_token].to(logprobs.dtype)
    return -(weights * logprobs).sum() / num_sequences
