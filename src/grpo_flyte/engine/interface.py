"""This module defines what a group of completions asks an engine for, and the methods every engine
answers it through.

A `SamplingRequest` is one prompt's group: its token ids, its sampling settings and its seed. Both
engines (`hf_generator.HFGenerator`, `vllm_generator.VLLMGenerator`) are `Generator`s:
`generate_many(requests, adapter_path)` decodes several groups that share an adapter and sampling
settings in one batch, and `generate_mixed(requests, adapter_paths)` several groups each with its
own adapter.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from grpo_flyte.config.generation import SamplingConfig
from grpo_flyte.engine.sampling import Sampling
from grpo_flyte.types import Rollout


class SamplingRequest(BaseModel):
    prompt_ids: list[int]
    group_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    greedy: bool = False  # evaluation: the most likely token at every step
    min_new_tokens: int = 0  # no end-of-sequence before this many tokens (vLLM's min_tokens)
    stop: tuple[str, ...] = ()  # multi-turn: strings that end a model turn (kept in it)
    continues: bool = False  # multi-turn: a later turn extends this context (the transformers engine keeps its cache)
    # The judge: a regular expression the completion must match (vLLM's structured outputs; the
    # transformers backend masks each step's logits to it, grammar.regex_matcher).
    regex: str | None = None
    top_k: int = 0  # 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # also end a completion (kept), as its end-of-sequence token

    def sampling(self) -> Sampling:
        """The settings a batch shares: requests batch together only when these are equal."""
        return Sampling(
            self.temperature,
            self.top_p,
            self.max_new_tokens,
            self.greedy,
            self.min_new_tokens,
            self.stop,
            self.top_k,
            self.min_p,
            self.repetition_penalty,
            self.stop_token_ids,
        )


class Generator(Protocol):
    tokenizer: object

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]: ...

    def generate_mixed(self, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]: ...

    def close(self) -> None: ...


def sampling_request(
    sampling: SamplingConfig, prompt_ids: list[int], seed: int, greedy: bool = False, group_size: int | None = None
) -> SamplingRequest:
    """The generation settings of one prompt: a group of `group_size` (default: the run's), or one
    greedy answer."""
    return SamplingRequest(
        prompt_ids=prompt_ids,
        group_size=1 if greedy else group_size or sampling.group_size,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        seed=seed,
        greedy=greedy,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        stop=tuple(sampling.generation_options.get("stop", ())),
        stop_token_ids=tuple(sampling.generation_options.get("stop_token_ids", ())),
    )
