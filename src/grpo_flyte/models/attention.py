"""This module chooses the attention a loaded model generates and trains with: our grouped eager
kernel on a CPU for models with a plain cache, transformers' 'sdpa' elsewhere.
"""

from __future__ import annotations


def attention_for(device: str, plain: bool) -> str:
    """The transformers attention a model generates and trains with: on a CPU,
    `grouped_attention` (eager attention that never copies the keys and values per query
    head, and hands long calls, a long context's prefill or a long sequence's training, to torch's
    fused kernel); 'sdpa', transformers' default, elsewhere. On a CPU it makes both a decode step and
    a train step faster than sdpa (docs/measurements.md#benchmarks): torch's fused CPU attention is
    slow for one query a row, and its backward is slow.

    Only for models with a plain cache (`plain_cache`: full attention in every layer, no
    sliding window, no logit soft-capping), whose arithmetic is eager attention's. The generator
    prefills such contexts one at a time: left padding fed through eager-style attention gives the
    padded positions no key to attend to, and their NaNs reach every row (the fused kernel returns
    zeros there). The trainer pads on the right, so every position has a key."""
    return register_grouped_attention() if device == "cpu" and plain else "sdpa"


def set_attention(model, device: str) -> None:
    """Switch a loaded transformers model to `attention_for` its device and cache."""
    if (attention := attention_for(device, plain_cache(model))) != model.config._attn_implementation:
        model.set_attn_implementation(attention)


def plain_cache(model) -> bool:
    """Whether the model's cache is one growing (keys, values) pair per layer, which rows can be cut
    out of and put together again (not sliding windows, not recurrent states)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


# The name transformers knows `grouped_attention` by (`register_grouped_attention`).
GROUPED_ATTENTION = "grpo_flyte_grouped"


# Attention scores (query heads x queries x keys) one row's call may hold in `grouped_attention`'s
# own arithmetic; a call past it (a long context's prefill, a long sequence's training) goes through
# torch's fused attention. Counted per row, not per batch: a decode step (one query a row) stays
# below it up to ~116,000 keys on the embedded model, however many rows decode together.
GROUPED_SCORES_LIMIT = 2**20


def grouped_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' eager attention without repeating the keys and values for every query head.

        query (B, Hq, Q, D), key and value (B, Hkv, K, D), Hq = g x Hkv: the g query heads of a key
        head are one (g x Q)-row matmul against it: (B, Hkv, g x Q, D) @ (B, Hkv, D, K).

    The eager path copies the whole key/value cache g times per layer and token (`repeat_kv`) to
    make its shapes match; a decode step then moves the cache more than it computes. Same
    arithmetic otherwise: scores scaled, plus the additive mask, softmax in float32, times the
    values; returns (B, Q, Hq, D) and the weights, as the eager function does.

    `attention_mask`: sdpa's (B, 1, Q, K) boolean mask (True: attended; the mask transformers
    builds for this attention), an additive float one, or None (causal without padding, or one
    query). A row past GROUPED_SCORES_LIMIT scores goes through transformers' sdpa attention
    instead: torch's fused kernel works through the scores in blocks and keeps none for the
    backward pass, so its memory grows with the tokens, not with their square (the scores of a
    7,000-token context are 9 x 7,000 x 7,000 numbers per layer on the embedded model, ~4 GB).
    """
    import torch

    batch, num_heads, num_queries, dim = query.shape
    num_kv, num_keys = key.shape[1], key.shape[2]
    if num_heads * num_queries * num_keys > GROUPED_SCORES_LIMIT:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if attention_mask is None and num_queries > 1:  # causal; sdpa_mask left it to the fused kernel's flag
        attention_mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device).tril(num_keys - num_queries)
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # additive, as transformers' eager_mask makes it
        zero = torch.tensor(0.0, dtype=query.dtype, device=query.device)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    groups = num_heads // num_kv
    q = query.reshape(batch, num_kv, groups * num_queries, dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # (B, Hkv, g*Q, K)
    if attention_mask is not None:
        scores = (scores.view(batch, num_kv, groups, num_queries, -1) + attention_mask[..., None, :, :]).view_as(scores)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).view(batch, num_heads, num_queries, dim)
    return out.transpose(1, 2).contiguous(), weights.view(batch, num_heads, num_queries, -1)


def register_grouped_attention() -> str:
    """Make `grouped_attention` an attention implementation transformers models can be set to
    (with sdpa's boolean mask, which transformers leaves out where the causal flag says it all:
    no (queries x keys) mask is built for a long context's prefill); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_ATTENTION, sdpa_mask)
    return GROUPED_ATTENTION
