"""This module keeps the key/value caches of contexts a later call extends, and prefills a decode
batch from them.

Every distinct context is prefilled once, on its own and without padding (models whose cache is
plain keys and values per layer, `models.attention.plain_cache`): the rows of a group share their
prompt's pass, and a multi-turn episode's next turn starts from the key/value cache its last turn
left, so only the environment's reply is new work. Rows are then left-padded in the cache, not in
the input. A long context is prefilled in chunks, so that a pass's activations and attention mask
are a chunk's, whatever the context's length.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Per layer, (keys, values) of one context: each (1, kv heads, its tokens, head dim).
KV = list[tuple["torch.Tensor", "torch.Tensor"]]


class PrefixCache:
    """The key/value cache of contexts a later call may extend, by their token ids; bounded in bytes.

    A cache only: a context found here decodes as it would from scratch (same tokens, log-probs
    equal to float rounding). An entry is dropped once used (the turn that extends it stores its
    own), when the adapter changes (`use`), and oldest first past `max_bytes`; a finished episode's
    last entry waits for one of the latter two. An entry larger than `max_bytes` is not stored (nor
    copied out of the batch to be): that context is recomputed by the turn that extends it.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.num_bytes = 0
        self.adapter: str | None = None

    def use(self, adapter: str) -> None:
        """Entries are the adapter's: another adapter's computation would not be a cache."""
        if adapter != self.adapter:
            self.entries.clear()
            self.num_bytes = 0
            self.adapter = adapter

    def longest(self, ids: list[int]) -> tuple[tuple[int, ...], KV]:
        """The longest stored context that `ids` starts with, and its cache (((), []) if none)."""
        best: tuple[tuple[int, ...], KV] = ((), [])
        for key, kv in self.entries.items():
            if len(best[0]) < len(key) <= len(ids) and ids[len(key) - 1] == key[-1] and tuple(ids[: len(key)]) == key:
                best = (key, kv)
        return best

    def fits(self, num_bytes: int) -> bool:
        """Whether an entry of `num_bytes` can be stored (a longer context is recomputed, not kept)."""
        return num_bytes <= self.max_bytes

    def put(self, ids: list[int], kv: KV) -> None:
        size = kv_bytes(kv)
        key = tuple(ids)
        if not self.fits(size) or key in self.entries:
            return
        self.entries[key] = kv
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self.discard(next(iter(self.entries)))

    def discard(self, key: tuple[int, ...]) -> None:
        kv = self.entries.pop(key, None)
        if kv is not None:
            self.num_bytes -= kv_bytes(kv)


def kv_bytes(kv: KV) -> int:
    return sum(t.numel() * t.element_size() for pair in kv for t in pair)


def kv_bytes_per_token(model) -> int:
    """What one token of context holds in the model's key/value cache: keys and values of every
    layer and key/value head."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()


# A context's new tokens are prefilled this many at a time: the pass's activations (a chunk's
# hidden states and MLP products) and its attention mask (chunk x context) stay a chunk's, whatever
# the context's length, while the key/value cache grows by each chunk.
PREFILL_CHUNK_TOKENS = 1024


def context_kv(model, ids: list[int], prefixes: PrefixCache, adapter_name: str | None = None) -> tuple[KV, tuple[int, ...]]:
    """The cache of `ids` (one context, no padding): its longest stored prefix, extended by passes
    over the rest, PREFILL_CHUNK_TOKENS at a time; also the key of the entry used."""
    import torch
    from transformers import DynamicCache

    key, kv = prefixes.longest(ids)
    rest = ids[len(key) :]
    if not rest:
        return kv, key
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    for start in range(0, len(rest), PREFILL_CHUNK_TOKENS):
        chunk = rest[start : start + PREFILL_CHUNK_TOKENS]
        positions = torch.arange(len(key) + start, len(key) + start + len(chunk), device=device).unsqueeze(0)
        last = torch.tensor([len(chunk) - 1], device=device)  # no logits wanted; one row's is the least
        model(
            input_ids=torch.tensor([chunk], device=device),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=last,
            **per_row_adapters([adapter_name] if adapter_name else None),
        )
    return [(layer.keys, layer.values) for layer in cache.layers], key


def per_row_adapters(names: list[str] | None) -> dict:
    """The forward's keyword for a batch whose rows use different LoRA adapters (PEFT's mixed
    adapter batches: `adapter_names`, one per row); none for a batch of one adapter."""
    return {"adapter_names": names} if names else {}


def prefill_contexts(model, prompts: list[list[int]], prefixes: PrefixCache, adapter_names: list[str] | None = None):
    """The batch's cache of every row's context but its last token, one pass per distinct context
    (and adapter, with `adapter_names` per row), left-padded to a common width; returns (cache,
    last tokens (B, 1), mask (B, width), positions (B, 1))."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    names = adapter_names or [None] * len(prompts)
    unique: dict[tuple, KV] = {}
    used = []
    for p, name in zip(prompts, names, strict=True):
        if (context := (name, tuple(p[:-1]))) not in unique:
            unique[context], key = context_kv(model, list(context[1]), prefixes, name)
            used.append(key)
    for key in used:  # after every lookup: two contexts may extend one entry
        prefixes.discard(key)
    width = max(len(p) for p in prompts)
    cache = DynamicCache(config=model.config)
    if width > 1:
        rows = [unique[(name, tuple(p[:-1]))] for p, name in zip(prompts, names, strict=True)]
        for layer in range(len(cache.layers)):
            like = next(kv[layer][0] for kv in rows if kv)
            keys, values = zip(*(_left_padded(kv, layer, width - 1, like) for kv in rows), strict=True)
            cache.update(torch.cat(keys), torch.cat(values), layer)
    last = torch.tensor([[p[-1]] for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = torch.tensor([[len(p) - 1] for p in prompts], device=device)
    return cache, last, mask, positions


def _left_padded(kv: KV, layer: int, width: int, like):
    """One row's (keys, values) of `layer`, zeros on the left up to `width` tokens (masked out)."""
    import torch

    n = kv[layer][0].shape[2] if kv else 0
    pad = like.new_zeros(1, like.shape[1], width - n, like.shape[3])
    if not kv:
        return pad, pad
    return tuple(torch.cat([pad, t], dim=2) for t in kv[layer])
