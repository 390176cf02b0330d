"""This module is the transformers backend's batched decode loop: one batch of rows sampled step by
step, each row leaving the batch once it ends.

Why not `model.generate`: on the CPU this loop is faster for the same tokens
(docs/measurements.md#the-race-against-trl-2026-11-25), for three reasons.
- The prompt pass computes logits for the last position only, through a contiguous copy of it.
  `generate` asks for `logits_to_keep=1`, a strided slice that torch's matmul turns into a batched
  product against one copy of the vocabulary matrix per row.
- A token is drawn by inverting the cumulative distribution with one uniform number per row
  (`sampling.choose_tokens`), not by `torch.multinomial`.
- Finished rows leave the batch (and the KV cache), so the last rambling row decodes alone
  instead of dragging every finished one through each step.

With a `PrefixCache` the batch starts from its contexts' stored caches (`prefix_cache.prefill_contexts`),
and a row may be held to a regular expression (`grammar.regex_matcher`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grpo_flyte.engine.grammar import allowed_tokens
from grpo_flyte.engine.prefix_cache import PrefixCache, kv_bytes, per_row_adapters, prefill_contexts
from grpo_flyte.engine.sampling import Sampling, choose_tokens, hits_stop, row_stream
from grpo_flyte.models.attention import plain_cache


@dataclass(frozen=True)
class DecodeCall:
    """What one `decode` call needs beyond the model and its prompts: every row's seed, the settings
    the batch shares, and the optional parts.

    `seeds[i]` is (request seed, row within the request) for row i. `tokenizer` decodes a row's
    tail to see its stop strings (needed with `sampling.stop`). With `prefixes` (and a model with a
    plain cache), contexts start from their longest stored prefix, and the rows in `continued`
    store theirs (prompt and completion) for a later call to extend. `matchers[i]`
    (`grammar.regex_matcher`, or None) holds row i to its regex. `adapter_names[i]` (a PEFT adapter
    of the model) is row i's adapter, for a batch of several (`prefix_cache.per_row_adapters`).
    """

    seeds: list[tuple[int, int]]
    sampling: Sampling
    eos_ids: set[int]
    pad_id: int
    tokenizer: object = None
    prefixes: PrefixCache | None = None
    continued: frozenset[int] = frozenset()
    matchers: list | None = None
    adapter_names: list[str] | None = None

    def rows(self, indices: list[int]) -> DecodeCall:
        """The call for rows `indices` of this one (in that order): their seeds, matchers and
        adapters, which of them continue, and the settings the batch shares."""
        return replace(
            self,
            seeds=[self.seeds[i] for i in indices],
            continued=frozenset(j for j, i in enumerate(indices) if i in self.continued),
            matchers=None if self.matchers is None else [self.matchers[i] for i in indices],
            adapter_names=None if self.adapter_names is None else [self.adapter_names[i] for i in indices],
        )


def decode(model, prompts: list[list[int]], call: DecodeCall) -> list[tuple[list[int], list[float]]]:
    """Sample a completion for each prompt in one batch; returns (token ids, log-probs) per row.

    A row ends at its first end-of-sequence token or one of `call.sampling.stop_token_ids` (kept),
    at the token that completes one of `call.sampling.stop` (kept) or after `max_new_tokens`. A row held to a regex has the tokens its
    matcher does not allow masked out of every step's logits before the draw, and its matcher is
    fed each token drawn.
    """
    sampling, tokenizer, matchers, adapter_names = call.sampling, call.tokenizer, call.matchers, call.adapter_names
    prefixes, continued = call.prefixes, call.continued
    if sampling.stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer")
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]  # a row's columns of the cache before its first token
    if prefixes is not None and plain_cache(model):
        cache, input_ids, mask, positions = prefill_contexts(model, prompts, prefixes, adapter_names)
        last = torch.tensor([0], device=device)
    else:
        prefixes, continued = None, frozenset()
        # Left padding: every row's last prompt token sits at position width - 1.
        input_ids = torch.tensor([[call.pad_id] * pad + p for p, pad in zip(prompts, pads, strict=True)], device=device)
        mask = torch.tensor([[0] * pad + [1] * len(p) for p, pad in zip(prompts, pads, strict=True)], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        last = torch.tensor([width - 1], device=device)  # a tensor index, so the kept hidden state is a copy
    streams = [row_stream(seed, row) for seed, row in call.seeds]
    eos_list = sorted(call.eos_ids | set(sampling.stop_token_ids))
    eos = torch.tensor(eos_list, device=device)
    out_ids: list[list[int]] = [[] for _ in prompts]
    out_lps: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))  # batch row -> output row
    seen = None  # with a repetition penalty: (batch rows, V) the tokens in each row's context

    def store(batch_rows: list[int]) -> None:
        """The rows' cache (context and every sampled token but the last, never fed) for a later call."""
        for b in batch_rows:
            r = active[b]
            held = [(layer.keys[b, :, pads[r] :], layer.values[b, :, pads[r] :]) for layer in cache.layers]  # views
            if r in continued and prefixes.fits(kv_bytes(held)):  # else no copy made only to be refused
                kv = [
                    (layer.keys[b : b + 1, :, pads[r] :].clone(), layer.values[b : b + 1, :, pads[r] :].clone()) for layer in cache.layers
                ]
                prefixes.put((prompts[r] + out_ids[r])[: kv[0][0].shape[2]], kv)

    for step in range(sampling.max_new_tokens):
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=last,
            **per_row_adapters([adapter_names[r] for r in active] if adapter_names else None),
        ).logits[:, -1]
        if matchers is not None:
            allowed = allowed_tokens([matchers[r] for r in active], logits.shape[-1]).to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        uniforms = None if sampling.greedy else torch.tensor([streams[r].random() for r in active], dtype=torch.float64)
        banned = eos_list if step < sampling.min_new_tokens else None
        if sampling.repetition_penalty != 1.0 and seen is None:  # each row's context: its prompt, then its tokens
            seen = torch.zeros((len(active), logits.shape[-1]), dtype=torch.bool, device=logits.device)
            for b, r in enumerate(active):
                seen[b, torch.tensor(prompts[r], dtype=torch.long, device=logits.device)] = True
        tokens, logprobs = choose_tokens(logits, sampling, uniforms, banned, seen)
        if seen is not None:
            seen[torch.arange(len(active), device=seen.device), tokens] = True
        for r, t, lp in zip(active, tokens.tolist(), logprobs.tolist(), strict=True):
            out_ids[r].append(t)
            out_lps[r].append(lp)
            if matchers is not None and matchers[r] is not None:
                matchers[r].consume_token(t)
        finished = torch.isin(tokens, eos)
        if sampling.stop:
            stopped = [hits_stop(tokenizer, out_ids[r], sampling.stop) for r in active]
            finished |= torch.tensor(stopped, device=device)
        if finished.any():
            store(finished.nonzero().squeeze(-1).tolist())
            keep_rows = (~finished).nonzero().squeeze(-1)
            if keep_rows.numel() == 0:
                break
            cache.batch_select_indices(keep_rows)
            active = [active[i] for i in keep_rows.tolist()]
            tokens, mask, positions = tokens[keep_rows], mask[keep_rows], positions[keep_rows]
            if seen is not None:
                seen = seen[keep_rows]
        input_ids = tokens.unsqueeze(-1)
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        last = torch.tensor([0], device=device)
    else:
        store(list(range(len(active))))
    return list(zip(out_ids, out_lps, strict=True))
