"""This module keeps a replica's engines: the one a call needs (`EngineKey`) is built on first use
and kept warm, and the least recently used is freed first.

One engine for a run, one per base model for a sweep over bases (at most `MAX_BASES`). Past that,
or past the GPU share vLLM engines may reserve together (`VLLM_MEMORY_BUDGET`), the least recently
used is freed before the new one is built (a vLLM engine holds most of the GPU). The LLM judge
(grpo_flyte.judge) has a cache of its own: a judge engine serves the model without an adapter, and
a local run, one process, holds it beside the policy's.

An engine whose process died (vLLM's EngineDeadError) would fail every later call of the replica:
`engine_call` drops it, so that the next call builds a new one, and raises `EngineDiedError`,
which Flyte retries.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from grpo_flyte.config.constants import MAX_BASES, VLLM_MEMORY_BUDGET
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.engine.interface import Generator
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.engine.vllm_generator import VLLMGenerator, adapter_rank, engine_died, vllm_max_lora_rank
from grpo_flyte.runtime.closing_lru import ClosingLRU
from grpo_flyte.runtime.device import check_driver, cuda_available
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.types import Example

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDiedError(RuntimeError):
    """A call whose engine died under it. The engine is dropped from the replica's cache; a
    RuntimeError, so Flyte retries the task (not one of errors.DETERMINISTIC): the retry, on this
    replica or another, builds a new engine."""


def resolve_backend(backend: str) -> str:
    """'auto' picks vLLM when it imports and a GPU is visible, else the transformers backend. An
    explicit 'vllm' gets the same old-driver check (`check_driver`, which leaves CUDA untouched)."""
    if backend == "vllm":
        check_driver()
    if backend != "auto":
        return backend
    cuda = cuda_available()  # where a GPU was given, no usable CUDA is an error here
    return "vllm" if cuda and importlib.util.find_spec("vllm") is not None else "hf"


@dataclass(frozen=True)
class EngineKey:
    """What an engine is built from. Sampling settings and seeds are per request, not part of it."""

    backend: Literal["hf", "vllm"]
    model_path: str
    dtype: str
    max_adapters: int
    max_lora_rank: int  # vLLM only (0 for hf)
    max_model_len: int  # vLLM only (0 for hf)
    memory_fraction: float = 0.85  # vLLM only: gpu_memory_utilization
    # Which of the process's engine caches holds it: the judge's engine never evicts the policy's
    # (one process runs both in a local run).
    slot: Literal["generate", "judge"] = "generate"

    def build(self) -> Generator:
        logger.info("building the %s generator for %s (once per replica)", self.backend, self.model_path)
        if self.backend == "vllm":
            return VLLMGenerator(
                self.model_path, self.dtype, self.max_adapters, self.max_lora_rank, self.max_model_len, self.memory_fraction
            )
        return HFGenerator(self.model_path, self.dtype, self.max_adapters)


class EngineCache(ClosingLRU[EngineKey, Generator]):
    """A replica's engines, one per key, built on first use; the least recently used is freed
    (before the new one is built) past `capacity` engines, or where a new vLLM engine's share of
    the GPU would take the vLLM engines held past `VLLM_MEMORY_BUDGET`. A run uses one key; a sweep
    over base models one per base, which `config.grid` keeps within both bounds, so that calls that
    interleave the bases never rebuild an engine.
    Two vLLM engines cannot be on one GPU at once: `ClosingLRU` frees before it builds.
    """

    @property
    def engines(self) -> OrderedDict[EngineKey, Generator]:
        return self.held

    def get(self, key: EngineKey) -> Generator:  # type: ignore[override]
        return super().get(key, key.build)

    def fits(self, key: EngineKey) -> bool:
        if len(self.held) >= self.capacity:
            return False
        reserved = sum(k.memory_fraction for k in self.held if k.backend == "vllm")
        return key.backend != "vllm" or reserved + key.memory_fraction <= VLLM_MEMORY_BUDGET

    def describe(self, key: EngineKey) -> str:
        return f"the {key.backend} generator for {key.model_path}"


_engines = EngineCache(MAX_BASES)
_judge_engines = EngineCache(1)  # a sweep shares its judge (config.grid refuses judge_model)


def engine_key(
    model_path: str,
    dtype: str,
    backend: str,
    max_adapters: int,
    adapter_path: str | None,
    max_model_len: int,
    memory_fraction: float = 0.85,
) -> EngineKey:
    """The engine for these settings; vLLM's LoRA capacity comes from the adapter's own rank (no
    adapter, `adapter_path` None: an engine that serves none)."""
    resolved = resolve_backend(backend)
    if resolved == "vllm":
        rank = vllm_max_lora_rank(adapter_rank(adapter_path)) if adapter_path is not None else 0
        return EngineKey("vllm", model_path, dtype, max_adapters, rank, max_model_len, memory_fraction)
    return EngineKey("hf", model_path, dtype, max_adapters, 0, 0)


def judge_engine_key(model_path: str, dtype: str, backend: str, max_model_len: int, memory_fraction: float = 0.85) -> EngineKey:
    """The judge's engine: the model as it is, no adapter, in the judge's cache."""
    resolved = resolve_backend(backend)
    if resolved == "vllm":
        return EngineKey("vllm", model_path, dtype, 0, 0, max_model_len, memory_fraction, slot="judge")
    return EngineKey("hf", model_path, dtype, 0, 0, 0, slot="judge")


def _cache_of(key: EngineKey) -> EngineCache:
    return _judge_engines if key.slot == "judge" else _engines


def get_engine(key: EngineKey) -> Generator:
    """This replica's engine for `key` (call on the torch thread)."""
    return _cache_of(key).get(key)


def engine_call(key: EngineKey, use: Callable[[Generator], T]) -> T:
    """`use(engine)` with this replica's engine for `key` (call on the torch thread). Where the
    engine died under the call (`vllm_generator.engine_died`), it leaves the cache, so that the next
    call builds a new one, and the call raises EngineDiedError, which is retried."""
    engine = get_engine(key)
    try:
        return use(engine)
    except Exception as exc:
        if not engine_died(exc):
            raise
        _cache_of(key).drop(key)
        raise EngineDiedError(
            f"the {key.backend} engine for {key.model_path} died ({type(exc).__name__}: {' '.join(str(exc).split())}); "
            "it is dropped, and the next call builds a new one"
        ) from exc


async def tokenize(key: EngineKey, examples: list[Example], prompt: PromptConfig) -> list[list[int]]:
    """The prompt token ids of each example, with the engine's tokenizer (the engine is built if needed)."""
    engine = await run_on_torch_thread(get_engine, key)
    return [tokenize_prompt(engine.tokenizer, example, prompt) for example in examples]
