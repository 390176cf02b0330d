"""A 2-layer random Llama for fast real runs in the tests, the drills and the soak benchmark."""

from __future__ import annotations

from pathlib import Path


def build_tiny_model(out: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer, 32-wide random Llama sharing `tokenizer_dir`'s tokenizer and chat template.

    It generates noise, fast: the tests and the failure drills run the real loop on it.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
