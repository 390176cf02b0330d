"""This module chooses each token for the transformers backend: derived seeds, a row's random stream,
the draw, and stop strings.

The choice is a pure function of the step's logits and one uniform number per row, drawn from the
row's own stream, seeded by (request seed, row): a row's tokens do not depend on which other rows
shared its batch or when they finished. The draw inverts the cumulative distribution with that one
number instead of `torch.multinomial`, which draws an exponential variate for every vocabulary
entry (docs/measurements.md#the-race-against-trl-2026-11-25).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_flyte.learning.distribution import Rules, kept_count, penalize

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
    top_k: int = 0  # 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # a row also ends at one of these tokens (kept), as at its end of sequence

    @property
    def rules(self) -> Rules:
        """The rules of the distribution tokens are drawn from (`learning.distribution`)."""
        return Rules(self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty)


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
    logits: torch.Tensor,
    sampling: Sampling,
    uniforms: torch.Tensor | None,
    banned: list[int] | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (token ids, their log-probs), both of shape (rows,).

    The distribution is `learning.distribution`'s: the repetition penalty on the tokens `seen`
    (rows, V) bool, each row's prompt and tokens so far; softmax(logits / temperature); then
    min-p, top-k and top-p keep the most likely tokens (`distribution.kept_count`). The draw
    returns the first token whose cumulative probability exceeds u * total, for u in [0, 1) from
    `uniforms` (rows,), over the kept tokens in descending order when a rule truncates, else over
    the vocabulary in order. The log-prob is that of the distribution the token was drawn from,
    the one the trainer recomputes (`learning.grpo.token_logprobs_and_entropy`): log softmax at the
    token, minus the log of the kept mass when a rule truncates (as vLLM's processed log-probs).
    `banned` shapes the draw only. Greedy takes the argmax and reports its log-prob before truncation.
    """
    import torch

    rules = sampling.rules
    logits = logits.float()
    if rules.penalizes:
        if seen is None:
            raise ValueError("a repetition penalty needs the tokens each row has seen; got seen=None")
        logits = penalize(logits, seen, rules.repetition_penalty)
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
        order = None
        if rules.truncates:
            ordered, order = draw.sort(dim=-1, descending=True)
            kept = torch.arange(ordered.shape[-1], device=ordered.device) < kept_count(ordered, rules).unsqueeze(-1)
            probs = ordered.exp().double().masked_fill(~kept, 0.0)
        else:
            probs = draw.exp().double()
        cdf = probs.cumsum(dim=-1)
        targets = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
        if order is not None:
            tokens = order.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            return tokens, chosen - cdf[:, -1].log().to(chosen.dtype)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
