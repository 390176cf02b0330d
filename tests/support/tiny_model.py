"""A 2-layer random Llama for fast real runs in the tests, the drills and the soak benchmark (and the
same as a reward model), and a hand-made scored group to train it on."""

from __future__ import annotations

from pathlib import Path


def _tiny_config(tokenizer, hidden_size: int, max_positions: int = 1024, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def build_tiny_reward_model(out: Path, tokenizer_dir: Path, num_labels: int = 1, max_positions: int = 1024, seed: int = 0) -> Path:
    """The tiny Llama as a sequence-classification reward model (LlamaForSequenceClassification):
    `num_labels` outputs (two: labels 'wrong' and 'right'), a context of `max_positions` tokens,
    random weights drawn with `seed`, `tokenizer_dir`'s tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    labels = {"id2label": {0: "wrong", 1: "right"}, "label2id": {"wrong": 0, "right": 1}} if num_labels == 2 else {}
    config = _tiny_config(tokenizer, 32, max_positions, num_labels=num_labels, **labels)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_model(out: Path, tokenizer_dir: Path, seed: int = 0, hidden_size: int = 32) -> Path:
    """A 2-layer, 32-wide random Llama sharing `tokenizer_dir`'s tokenizer and chat template, its
    weights drawn with `seed` (another seed: another model of the same shape; another
    `hidden_size`: one whose LoRA adapters no other base loads).

    It generates noise, fast: the tests and the failure drills run the real loop on it.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _tiny_config(tokenizer, hidden_size)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def scored_pair(index: int):
    """A hand-made scored group of two rollouts with rewards 1 and 0: every rollout has an
    advantage to train on (token ids the tiny model's vocabulary holds; 2 is its EOS)."""
    from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup

    rollouts = [
        Rollout(completion_ids=[11, 12, 2], sampling_logprobs=[-1.0] * 3, finish_reason="stop", text="a"),
        Rollout(completion_ids=[13, 2], sampling_logprobs=[-1.0] * 2, finish_reason="stop", text="b"),
    ]
    group = RolloutGroup(
        index=index,
        example=Example(question="q", answer="1"),
        adapter_version=0,
        prompt_ids=[1, 5, 6, 7],
        rollouts=rollouts,
        generate_s=0.0,
    )
    parts = [RewardParts(reward=1.0, correct=True, format=False), RewardParts(reward=0.0, correct=False, format=False)]
    return ScoredGroup(group=group, rewards=parts)
