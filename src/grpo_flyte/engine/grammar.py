"""This module holds a row to a regular expression on the transformers backend (the LLM judge's
reply), as vLLM's structured outputs hold it.

llguidance computes each step's allowed tokens, and `decode_loop.decode` masks the others out of
the step's logits. Chosen over the other structured-output libraries vLLM uses (it is vLLM's own
fallback backend): one wheel with no dependencies, where xgrammar brings triton and TVM's FFI into
a CPU install; it builds its view of a local tokenizer object (outlines-core's vocabulary comes
from a Hub name); and it masks lazily from the regex, nothing compiled per regex over the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GRAMMAR_INSTALL = "pip install 'grpo-flyte[local]'"


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: set[int]):
    """llguidance's view of a transformers tokenizer, for `regex_matcher` (built once per engine:
    docs/measurements.md#an-llm-judge-as-a-reward-2026-11-25). `vocab_size` is the model's logits
    width (it may exceed the tokenizer's)."""
    try:
        import llguidance.hf
    except ImportError as exc:
        raise ImportError(f"a constrained reply (the LLM judge) on the transformers backend needs llguidance: {GRAMMAR_INSTALL}") from exc
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))


def regex_matcher(grammar_tokenizer, regex: str):
    """A matcher that allows, token by token, only text matching `regex` in full, then an
    end-of-sequence token (llguidance.LLMatcher; fed each sampled token by `decode`)."""
    import llguidance

    matcher = llguidance.LLMatcher(grammar_tokenizer, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
    if matcher.is_error():
        raise ValueError(f"regex {regex!r} cannot constrain decoding: {matcher.get_error()}")
    return matcher


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool: the tokens each row's matcher allows next (every token where it has none)."""
    import torch

    allowed = torch.ones(len(matchers), vocab_size, dtype=torch.bool)
    for row, matcher in enumerate(matchers):
        if matcher is None:
            continue
        bias = matcher.compute_logit_bias()  # one byte per token: 0 (not allowed) or 200
        if matcher.is_error():
            raise RuntimeError(f"the token constraint failed: {matcher.get_error()}")
        allowed[row] = False
        allowed[row, : len(bias)] = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[:vocab_size] > 0
    return allowed
