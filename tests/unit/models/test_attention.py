"""The grouped attention kernel against transformers' eager attention, on hand-made tensors.

How the generator and the trainer use it (prefill in chunks, the same rows decoded either way) is
tested with the engine in tests/unit/engine/test_decoding.py and with the trainer in tests/unit/test_trainer.py.
"""

import torch


def test_grouped_attention_is_eager_attention_without_the_repeated_cache():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from grpo_flyte.models.attention import grouped_attention

    class Module:
        num_key_value_groups, training = 3, False

    torch.manual_seed(0)
    batch, kv_heads, queries, keys, dim = 2, 2, 4, 7, 5
    query = torch.randn(batch, kv_heads * 3, queries, dim, dtype=torch.float64)
    key, value = (torch.randn(batch, kv_heads, keys, dim, dtype=torch.float64) for _ in range(2))
    mask = torch.zeros(batch, 1, queries, keys, dtype=torch.float64)
    mask[0, :, :, :2] = torch.finfo(torch.float64).min  # row 0's first two keys are padding
    ours, our_weights = grouped_attention(Module(), query, key, value, mask, scaling=0.4)
    theirs, their_weights = eager_attention_forward(Module(), query, key, value, mask, scaling=0.4)
    assert ours.shape == theirs.shape == (batch, queries, kv_heads * 3, dim) and our_weights.shape == their_weights.shape
    assert torch.allclose(ours, theirs, atol=1e-12) and torch.allclose(our_weights, their_weights, atol=1e-12)
    assert our_weights[0, :, :, :2].abs().max() == 0


def test_grouped_attention_takes_sdpas_masks_and_hands_long_calls_to_the_fused_kernel(monkeypatch):
    """transformers builds sdpa's boolean mask for it, or none where the causal flag says it all
    (no (queries x keys) mask for a long prefill); past GROUPED_SCORES_LIMIT scores a row goes
    through torch's fused kernel, which never holds them. Eager attention's numbers either way."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from grpo_flyte.models import attention

    class Module:
        num_key_value_groups, training, is_causal = 3, False, True

    torch.manual_seed(0)
    query = torch.randn(2, 6, 5, 4, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(2))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal.expand(2, 1, 5, 5).clone()
    mask[0, :, :, 4] = False  # row 0's last key is padding (right-padded, as the trainer pads)

    def additive(m):
        return torch.where(m, torch.tensor(0.0, dtype=torch.float64), torch.finfo(torch.float64).min)

    padded = eager_attention_forward(Module(), query, key, value, additive(mask), scaling=0.4)[0]
    plain = eager_attention_forward(Module(), query, key, value, additive(causal.expand(2, 1, 5, 5)), scaling=0.4)[0]
    assert torch.allclose(attention.grouped_attention(Module(), query, key, value, mask, scaling=0.4)[0], padded, atol=1e-12)
    assert torch.allclose(attention.grouped_attention(Module(), query, key, value, None, scaling=0.4)[0], plain, atol=1e-12)
    monkeypatch.setattr(attention, "GROUPED_SCORES_LIMIT", 0)
    fused, weights = attention.grouped_attention(Module(), query, key, value, mask, scaling=0.4)
    # the fused CPU kernel sums in float32 whatever the type
    assert weights is None and torch.allclose(fused, padded, atol=1e-6)
    assert torch.allclose(attention.grouped_attention(Module(), query, key, value, None, scaling=0.4)[0], plain, atol=1e-6)
