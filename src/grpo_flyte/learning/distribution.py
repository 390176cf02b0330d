"""This module defines the sampling distribution both the decoder and the trainer compute: the rules
that turn a position's logits into the distribution a token is drawn from.

In vLLM's order (vllm/v1/sample/sampler.py), for logits x over the vocabulary:

    1. repetition penalty  x_v <- x_v / r if x_v > 0 else x_v * r, for every token v already in the
                           sequence (prompt and completion so far); `penalize`
    2. temperature         z = x / T,  l = log softmax(z)
    3. min-p               drop v with p_v < min_p * max_u p_u
    4. top-k               keep the k largest (every token tied with the k-th stays)
    5. top-p               over what 3 and 4 kept, renormalized: the most likely tokens until the
                           mass before the next reaches top_p (the first always stays; tokens tied
                           with the last kept stay); `kept_count`
    log-prob of a kept token t:  l_t - log sum_{v kept} exp(l_v)

The transformers decoder (`engine.sampling.choose_tokens`) samples with these rules and reports
that log-prob; vLLM's processed log-probs are the same. The trainer computes it for the tokens it
trains (`processed_logprobs_and_entropy`), with the sampled token always counted in the kept set,
so the importance ratio compares one distribution with itself. With no rule on (top_p 1, top_k 0,
no min_p, repetition penalty 1) the distribution is softmax(x / T), which the trainer computes on
its own faster path (`grpo.token_logprobs_and_entropy`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Rows of (N, V) logits the trainer takes at a time: about 4 MB of float32 per copy, as `grpo`'s chunks.
CHUNK_ELEMENTS = 2**20


@dataclass(frozen=True)
class Rules:
    """The sampling settings that shape the distribution (the run's SamplingConfig values)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float | None = None  # None or 0: off
    repetition_penalty: float = 1.0  # 1: off

    @property
    def truncates(self) -> bool:
        """Whether some tokens are left out of the draw (min-p, top-k or top-p on)."""
        return self.top_p < 1.0 or self.top_k > 0 or bool(self.min_p)

    @property
    def penalizes(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def plain(self) -> bool:
        """softmax(logits / T) itself: no rule on."""
        return not self.truncates and not self.penalizes


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty (apply_repetition_penalties_torch): x_v * s_v with s_v = 1/r where
    token v is `seen` and x_v > 0, r where it is seen and x_v <= 0, 1 elsewhere. (rows, V) logits
    and a bool mask of the same shape; a new tensor, differentiable (d/dx_v = s_v)."""
    return logits * penalty_scale(logits, seen, penalty)


def penalty_scale(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The factors s_v of `penalize`, of the logits' shape."""
    import torch

    ones = torch.ones_like(logits)
    return torch.where(seen, torch.where(logits > 0, ones / penalty, ones * penalty), ones)


def kept_count(sorted_logp: torch.Tensor, rules: Rules) -> torch.Tensor:
    """How many of the most likely tokens min-p, top-k and top-p keep, per row: (rows, V) -> (rows,).

    `sorted_logp` holds each row's log-probs after penalty and temperature, sorted descending; the
    kept tokens are its first `kept_count`. Every rule keeps the largest down to a threshold, so
    tokens tied with the last kept one are kept too. Computed in float64.
    """
    import torch

    logp = sorted_logp.double()
    probs = logp.exp()
    rows, vocab = logp.shape
    kept = torch.full((rows,), vocab, dtype=torch.long, device=logp.device)
    if rules.min_p:
        kept = torch.minimum(kept, (probs >= rules.min_p * probs[:, :1]).sum(-1))
    if 0 < rules.top_k < vocab:
        kept = torch.minimum(kept, (logp >= logp[:, rules.top_k - 1 : rules.top_k]).sum(-1))
    if rules.top_p < 1.0:
        inside = torch.arange(vocab, device=logp.device) < kept.unsqueeze(-1)
        mass = probs * inside
        mass_before = mass.cumsum(-1) - mass
        nucleus = ((mass_before < rules.top_p * mass.sum(-1, keepdim=True)) & inside).sum(-1).clamp(min=1)
        last = logp.gather(-1, (nucleus - 1).unsqueeze(-1))
        kept = (logp >= last).sum(-1)
    return kept


def kept_cut(logp: torch.Tensor, rules: Rules) -> torch.Tensor:
    """The smallest log-prob the rules keep, per row: (rows, V) -> (rows,); token v is kept when
    logp_v >= the cut (`kept_count` over the row sorted)."""
    import torch

    with torch.no_grad():
        ordered = logp.sort(dim=-1, descending=True).values
        return ordered.gather(-1, (kept_count(ordered, rules) - 1).unsqueeze(-1)).squeeze(-1)


@dataclass
class SeenTokens:
    """Which tokens each trained position's context holds, for the repetition penalty: position
    j's context is its row's tokens up to and including the one at `positions[j]` (the prompt and
    the completion before the token it predicts).

    first[b, v]: the first position of token v in row b (a number past the row when it is absent),
    (B, V); rows, positions: (N,) each trained position's row and column.
    """

    first: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of_batch(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, predict_mask: torch.Tensor, vocab: int) -> SeenTokens:
        """From a right-padded batch (grpo.PaddedBatch's tensors): padding is never seen."""
        import torch

        rows, width = input_ids.shape
        never = width + 1
        columns = torch.arange(width, device=input_ids.device).expand(rows, width)
        columns = torch.where(attention_mask.bool(), columns, never)
        first = torch.full((rows, vocab), never, dtype=torch.long, device=input_ids.device)
        first.scatter_reduce_(1, input_ids, columns, reduce="amin")
        row, position = torch.nonzero(predict_mask, as_tuple=True)
        return cls(first, row, position)

    def mask(self, part: slice) -> torch.Tensor:
        """(len(part), V) bool: token v is in the context of trained position j, for j in `part`."""
        return self.first[self.rows[part]] <= self.positions[part].unsqueeze(-1)


def processed_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, rules: Rules, seen: SeenTokens | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-prob of each target under the processed distribution (the module's rules, the
    target counted in the kept set) and the entropy of softmax(penalized logits / T) before
    truncation: (N, V), (N,) -> (N,), (N,), both differentiable (the entropy bonus needs
    dH/dz_v = -p_v (log p_v + H)). `seen` is needed with a
    repetition penalty. Never more than a chunk of rows of (N, V) in float32 at a time."""
    if rules.penalizes and seen is None:
        raise ValueError("a repetition penalty needs the tokens each position's context holds (seen)")
    return _processed_chunks().apply(logits, targets, rules, seen)


@functools.cache
def _processed_chunks():
    """`processed_logprobs_and_entropy` as an autograd function over chunks of rows.

    Forward, per row with z = penalized logits / T: lse = logsumexp(z), l = z - lse, the cut
    (`kept_cut`), K = {v: l_v >= cut} with the target, lse_K = logsumexp over K of z, and the
    output z_t - lse_K. Backward, recomputing z: d out / d logits_v = (onehot_t - q_v) s_v / T with
    q_v = exp(z_v - lse_K) on K, 0 elsewhere, and s_v the penalty's factor (`penalty_scale`); the
    entropy's, d H / d logits_v = -p_v (log p_v + H) s_v / T with p = softmax(z).
    """
    import torch

    def chunks(n: int, vocab: int):
        rows = max(1, CHUNK_ELEMENTS // max(1, vocab))
        return [slice(start, start + rows) for start in range(0, n, rows)]

    def processed(logits, rows: slice, rules: Rules, seen: SeenTokens | None):
        """(z, s) for the rows: the penalized logits over T in float32 (at least), and the penalty's factors."""
        x = logits[rows].to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        scale = penalty_scale(x, seen.mask(rows), rules.repetition_penalty) if rules.penalizes else None
        if scale is not None:
            x.mul_(scale)
        return x.div_(rules.temperature), scale

    def kept(z, lse, cut, targets):
        keep = (z - lse.unsqueeze(-1)) >= cut.unsqueeze(-1)
        keep[torch.arange(len(targets), device=keep.device), targets] = True
        return keep

    class ProcessedChunks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets, rules, seen):
            n = logits.shape[0]
            kind = torch.promote_types(logits.dtype, torch.float32)
            chosen, entropy, lse, cut, lse_kept = (torch.empty(n, dtype=kind, device=logits.device) for _ in range(5))
            for rows in chunks(n, logits.shape[-1]):
                z, _ = processed(logits, rows, rules, seen)
                lse[rows] = torch.logsumexp(z, dim=-1)
                logp = z - lse[rows].unsqueeze(-1)
                entropy[rows] = -(logp.exp() * logp).sum(-1)
                if rules.truncates:
                    cut[rows] = kept_cut(logp, rules)
                    keep = kept(z, lse[rows], cut[rows], targets[rows])
                    lse_kept[rows] = torch.logsumexp(z.masked_fill_(~keep, float("-inf")), dim=-1)
                else:
                    cut[rows] = float("-inf")
                    lse_kept[rows] = lse[rows]
                chosen[rows] = z.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse_kept[rows]
            ctx.save_for_backward(logits, targets, lse, cut, lse_kept, entropy)
            ctx.rules, ctx.seen = rules, seen
            ctx.set_materialize_grads(False)  # an output nothing depends on gets None: no work for it
            return chosen, entropy

        @staticmethod
        def backward(ctx, grad_chosen, grad_entropy):
            logits, targets, lse, cut, lse_kept, entropy = ctx.saved_tensors
            rules = ctx.rules
            grad = torch.zeros_like(logits)
            g = None if grad_chosen is None else (grad_chosen / rules.temperature).unsqueeze(-1)
            h = None if grad_entropy is None else (grad_entropy / rules.temperature).unsqueeze(-1)
            for rows in chunks(logits.shape[0], logits.shape[-1]):
                z, scale = processed(logits, rows, rules, ctx.seen)
                part = torch.zeros_like(z)
                if h is not None:  # dH/dz_v = -p_v (log p_v + H), p = softmax(z) before truncation
                    logp = z - lse[rows].unsqueeze(-1)
                    part.sub_(logp.add(entropy[rows].unsqueeze(-1)).mul_(logp.exp()).mul_(h[rows]))
                if g is not None:
                    keep = kept(z, lse[rows], cut[rows], targets[rows])
                    q = z.sub_(lse_kept[rows].unsqueeze(-1)).exp_().masked_fill_(~keep, 0.0)
                    part.sub_(q.mul_(g[rows])).scatter_add_(-1, targets[rows].unsqueeze(-1), g[rows])
                grad[rows] = part.mul_(scale) if scale is not None else part
            return grad, None, None, None

    return ProcessedChunks
