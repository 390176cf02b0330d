"""Batched sampling for the transformers backend: the token choice as a pure function, and the loop.

Why not `model.generate`: on the CPU this loop is ~1.5x faster for the same tokens (measured on the
embedded model, 24 rows x 128 tokens: see docs/measurements.md), for three reasons.
- The prompt pass computes logits for the last position only, through a contiguous copy of it.
  `generate` asks for `logits_to_keep=1`, a strided slice that torch's matmul turns into a batched
  product against 24 copies of the vocabulary matrix (a 1.4 GB copy for SmolLM2, ~4 s).
- A token is drawn by inverting the cumulative distribution with one uniform number per row.
  `torch.multinomial` draws an exponential variate for every vocabulary entry (~40 ms a step).
- Finished rows leave the batch (and the KV cache), so the last rambling row decodes alone
  instead of dragging every finished one through each step.
Each row draws its uniforms from its own stream, seeded by (request seed, row), so a row's tokens
do not depend on which other rows shared its batch or when they finished.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sub_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed that is a function of `seed` and `parts` only: one group's (run seed,
    iteration, prompt), one episode turn's (group seed, row, turn)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    greedy: bool = False
    min_new_tokens: int = 0  # end-of-sequence tokens are not drawn before this many tokens
    stop: tuple[str, ...] = ()  # a row also ends once its text contains one of these (kept)


# A stop string is looked for in the text of a row's last tokens: at least this many, and more than
# the longest stop string has bytes (a token is at least one byte of text), so it always fits.
STOP_WINDOW = 16


def hits_stop(tokenizer, ids: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the text of the row's last tokens contains a stop string (special tokens skipped,
    as vLLM matches them)."""
    if not stop:
        return False
    window = max(STOP_WINDOW, max(len(s.encode()) for s in stop) + 1)
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in stop)


def row_stream(seed: int, row: int) -> random.Random:
    """The uniform numbers row `row` of a request seeded `seed` uses, one per decoding step."""
    return random.Random(f"grpo_flyte:{seed}:{row}")


def choose_tokens(
    logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None, banned: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (token ids, their log-probs), both of shape (rows,).

    Sampling keeps the top-p nucleus (the most likely tokens until their mass reaches `top_p`;
    the first token always stays), renormalizes, and returns the first token whose cumulative
    probability exceeds u * total, for u in [0, 1) from `uniforms` (rows,). The log-prob is that
    of the distribution the token was drawn from, the one the trainer recomputes
    (`grpo.token_logprobs_and_entropy`): log softmax(logits / temperature) at the token, minus the
    log of the nucleus' mass when top_p < 1 (as vLLM's processed log-probs). `banned` shapes the
    draw only. Greedy takes the argmax and reports its full-distribution log-prob.
    """
    import torch

    logits = logits.float()
    logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
    draw = logprobs
    if banned:
        draw = logprobs.clone()
        draw[:, banned] = float("-inf")
    if sampling.greedy:
        tokens = draw.argmax(dim=-1)
    else:
        if uniforms is None:
            raise ValueError("sampling needs one uniform number per row; got uniforms=None")
        probs = draw.exp().double()
        order = None
        if sampling.top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        cdf = probs.cumsum(dim=-1)
        targets = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
        if order is not None:
            tokens = order.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            return tokens, chosen - cdf[:, -1].log().to(chosen.dtype)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def decode(
    model, prompts: list[list[int]], seeds: list[tuple[int, int]], sampling: Sampling, eos_ids: set[int], pad_id: int, tokenizer=None
) -> list[tuple[list[int], list[float]]]:
    """Sample a completion for each prompt in one batch; returns (token ids, log-probs) per row.

    `seeds[i]` is (request seed, row within the request) for row i. A row ends at its first
    end-of-sequence token (kept), at the token that completes one of `sampling.stop` (kept; the
    tokenizer decodes the row's tail to see it) or after `max_new_tokens`.
    """
    if sampling.stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer")
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # Left padding: every row's last prompt token sits at position width - 1.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    streams = [row_stream(seed, row) for seed, row in seeds]
    eos_list = sorted(eos_ids)
    eos = torch.tensor(eos_list, device=device)
    cache = DynamicCache(config=model.config)
    out_ids: list[list[int]] = [[] for _ in prompts]
    out_lps: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))  # batch row -> output row
    last = torch.tensor([width - 1], device=device)  # a tensor index, so the kept hidden state is a copy
    for step in range(sampling.max_new_tokens):
        logits = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=last
        ).logits[:, -1]
        uniforms = None if sampling.greedy else torch.tensor([streams[r].random() for r in active], dtype=torch.float64)
        banned = eos_list if step < sampling.min_new_tokens else None
        tokens, logprobs = choose_tokens(logits, sampling, uniforms, banned)
        for r, t, lp in zip(active, tokens.tolist(), logprobs.tolist(), strict=True):
            out_ids[r].append(t)
            out_lps[r].append(lp)
        finished = torch.isin(tokens, eos)
        if sampling.stop:
            stopped = [hits_stop(tokenizer, out_ids[r], sampling.stop) for r in active]
            finished |= torch.tensor(stopped, device=device)
        if finished.any():
            keep = (~finished).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            active = [active[i] for i in keep.tolist()]
            tokens, mask, positions = tokens[keep], mask[keep], positions[keep]
        input_ids = tokens.unsqueeze(-1)
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        last = torch.tensor([0], device=device)
    return list(zip(out_ids, out_lps, strict=True))
