"""Generation engines and the per-replica batching in front of them.

- `HFGenerator` (transformers + PEFT, our own decode loop) and `VLLMGenerator` (vLLM, the LoRA
  adapter attached per request) share one interface: `generate_many(requests, adapter_path)`
  decodes several groups that share an adapter and sampling settings in one batch, and
  `generate_mixed(requests, adapter_paths)` several groups each with its own adapter.
- `EngineCache` holds a replica's engines, one per `EngineKey`, each built on first use: one for
  a run, one per base model for a sweep over bases (at most `MAX_BASES`). Past that, or past the
  GPU share vLLM engines may reserve together (`VLLM_MEMORY_BUDGET`), the least recently used is
  freed before the new one is built (a vLLM engine holds most of the GPU). The LLM judge
  (grpo_flyte.judge) has a cache of its own: a judge engine serves the model without an adapter,
  its replies held to a regex (vLLM's structured outputs; on transformers a logits mask per step,
  grpo_flyte.engine.decoding), and a local run, one process, holds it beside the policy's.
- `generate_group` sends one group through a `flyte.extras.DynamicBatcher`: concurrent `generate`
  calls on one replica (local mode, or a reusable pool with `concurrency > 1`) land in one engine
  batch, even when their adapters differ (a sweep's configs, a pipelined run's versions; each row
  with its own adapter: PEFT's mixed adapter batches on transformers, a LoRARequest per prompt on
  vLLM). Every row draws from its own random stream seeded by (request seed, row), so a completion
  does not depend on its batch mates, and a batch's failure reaches every group in it (a batch of
  several adapters is decoded again one adapter at a time, so a damaged one fails alone). Identical
  groups are decoded once (`identical_calls`: the same request with adapters of the same content,
  e.g. a sweep's configs before their first train step), each caller getting its own copy.

Heavy libraries are imported inside the engines; importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from async_lru import alru_cache
from flyte.extras import DynamicBatcher
from pydantic import BaseModel

from grpo_flyte import multiturn
from grpo_flyte.config.constants import MAX_BASES, VLLM_MEMORY_BUDGET
from grpo_flyte.config.generation import EpisodeConfig, PromptConfig, SamplingConfig
from grpo_flyte.engine import episodes, mixed_lora
from grpo_flyte.engine.decoding import Sampling, sub_seed
from grpo_flyte.engine.prompts import is_chat, tokenize_prompt
from grpo_flyte.errors import AdapterError
from grpo_flyte.models.attention import set_attention
from grpo_flyte.runtime.device import best_device, cuda_available, torch_dtype
from grpo_flyte.runtime.files import files_of
from grpo_flyte.runtime.torch_thread import run_on_torch_thread, until_idle
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, Example, Rollout

logger = logging.getLogger(__name__)
T = TypeVar("T")
TRAINER_FILES = frozenset({OPTIMIZER_FILE, STATE_FILE})  # in an adapter's folder, for the trainer only

# How long the batcher waits for more groups once one arrived (the groups of one iteration arrive
# within milliseconds of each other), and the most completion rows one engine batch decodes.
BATCH_WINDOW_S = 0.05
MAX_BATCH_ROWS = 4096
# The transformers engine's store of multi-turn contexts' key/value caches (decoding.PrefixCache): about
# the embedded model's own size (fp32), ~11,000 context tokens of it (46 KB each: 30 layers x K and V
# x 3 heads x 64 x 4 bytes); past it the oldest contexts are recomputed, not kept.
PREFIX_CACHE_BYTES = 512 * 2**20
# The key/value cache one decode batch of the transformers engine may hold (rows x their longest
# context and new tokens): rows past it decode in further batches, one after another, so that the
# memory of generation is this bound, not the batch's (64 episodes of 7,000-token contexts hold
# 10 GB on the embedded model in bfloat16). Runs of short contexts (an iteration of a default run
# is ~17,000 tokens, 0.4 GB) decode in one batch as before.
DECODE_BATCH_KV_BYTES = 2**30
# The prefix cache's owner while a batch mixes adapters: no context is kept across it.
MIXED_ADAPTERS = "<several adapters>"
# The LoRA ranks vLLM's `max_lora_rank` accepts; an adapter of a smaller rank runs on the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The most adapters one vLLM engine step computes (its `max_loras`, bounded by `adapter_cache_size`):
# a sweep's configs or a pipelined run's versions; more wait for a slot (vllm_lora_slots).
VLLM_MAX_LORA_SLOTS = 8
# How many adapter folders' content digests a replica keeps (identical_calls): a sweep's configs
# times the versions each has in flight, with room to spare.
ADAPTER_DIGESTS = 256


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
    # transformers backend masks each step's logits to it, decoding.regex_matcher).
    regex: str | None = None

    def sampling(self) -> Sampling:
        """The settings a batch shares: requests batch together only when these are equal."""
        return Sampling(self.temperature, self.top_p, self.max_new_tokens, self.greedy, self.min_new_tokens, self.stop)


class Generator(Protocol):
    tokenizer: object

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]: ...

    def generate_mixed(self, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]: ...

    def close(self) -> None: ...


def resolve_backend(backend: str) -> str:
    """'auto' picks vLLM when it imports and a GPU is visible, else the transformers backend."""
    if backend != "auto":
        return backend
    cuda = cuda_available()  # where a GPU was given, no usable CUDA is an error here
    return "vllm" if cuda and importlib.util.find_spec("vllm") is not None else "hf"


def cut_at_eos(token_ids: list[int], logprobs: list[float], eos_ids: set[int]) -> tuple[list[int], list[float], str]:
    """Keep tokens up to and including the first EOS; what follows is padding."""
    for i, tok in enumerate(token_ids):
        if tok in eos_ids:
            return token_ids[: i + 1], logprobs[: i + 1], "stop"
    return token_ids, logprobs, "length"


class HFGenerator:
    """transformers + PEFT generation; one adapter active at a time, a few kept loaded, and the
    cache of the current adapter's unfinished multi-turn contexts."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        max_adapters: int,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        batch_kv_bytes: int = DECODE_BATCH_KV_BYTES,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_flyte.engine.decoding import PrefixCache

        self.device = best_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype))
        set_attention(model, self.device)
        self.base = model.to(self.device).eval()
        self.model = None  # the PeftModel, once the first adapter is loaded
        self.adapters: OrderedDict[str, str] = OrderedDict()  # adapter path -> PEFT adapter name
        self.max_adapters = max_adapters
        self._next_name = 0
        eos = self.base.generation_config.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, list) else [eos] if eos is not None else []), self.tokenizer.eos_token_id}
        self.eos_ids.discard(None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self.batch_kv_bytes = batch_kv_bytes
        self._grammar_tokenizer = None  # built on the first request with a regex (the judge's)

    def _matchers(self, regexes: list[str | None]) -> list | None:
        """Each batch row's `decoding.regex_matcher`, or None where a row has no regex (None: no row has one)."""
        from grpo_flyte.engine.decoding import grammar_tokenizer, regex_matcher

        if all(r is None for r in regexes):
            return None
        if self._grammar_tokenizer is None:
            vocab_size = self.base.get_output_embeddings().weight.shape[0]
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, vocab_size, self.eos_ids)
        return [None if r is None else regex_matcher(self._grammar_tokenizer, r) for r in regexes]

    def close(self) -> None:
        import gc

        del self.model, self.base, self.prefixes
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _activate(self, adapter_path: str) -> None:
        from peft import PeftModel

        if adapter_path in self.adapters:
            self.adapters.move_to_end(adapter_path)
            self.model.set_adapter(self.adapters[adapter_path])
            return
        name = f"adapter{self._next_name}"
        self._next_name += 1
        try:
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, adapter_path, adapter_name=name, is_trainable=False)
            else:
                self.model.load_adapter(adapter_path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # noqa: BLE001 -- a missing, truncated or foreign adapter fails in many ways
            if self.model is not None and name in self.model.peft_config:
                self.model.delete_adapter(name)  # nothing half-loaded stays in the warm engine
            raise AdapterError(f"adapter {adapter_path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
        self.model.set_adapter(name)
        self.model.eval()
        self.adapters[adapter_path] = name
        while len(self.adapters) > self.max_adapters:
            _, old = self.adapters.popitem(last=False)
            self.model.delete_adapter(old)
        mixed_lora.install(self.model)  # mixed batches in two matmuls a layer; drops stale stacks

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]:
        """One batched decode for several groups sharing an adapter (None: the base model, e.g.
        the judge) and sampling settings."""
        return self.generate_mixed(requests, [adapter_path] * len(requests))

    def generate_mixed(self, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]:
        """One batched decode for several groups sharing sampling settings, each with its own
        adapter (`adapter_paths[i]` for `requests[i]`): with several, PEFT's mixed adapter batches
        run every row's base layers in one batch and its LoRA layers with its adapter. Several
        adapters need at most `max_adapters` of them, no multi-turn context to keep and no regex."""
        import contextlib

        import torch

        from grpo_flyte.engine.decoding import decode, hits_stop, kv_bytes_per_token
        from grpo_flyte.learning.grpo import plan_micro_batches

        distinct = list(dict.fromkeys(adapter_paths))
        mixed = len(distinct) > 1
        if mixed:
            assert None not in distinct and len(distinct) <= self.max_adapters, "a mixed batch's adapters must fit the engine"
            assert not any(r.continues or r.regex for r in requests), "multi-turn contexts and regexes batch per adapter"
            for path in distinct:
                self._activate(path)
        adapter_path = distinct[0] if not mixed else None
        if adapter_path is not None:
            self._activate(adapter_path)
        model = self.model if mixed or adapter_path is not None else self.base
        # the base model's layers hold the loaded adapters (PEFT injects them): off for a None adapter
        no_adapter = adapter_path is None and not mixed and self.model is not None
        base_only = self.model.disable_adapter() if no_adapter else contextlib.nullcontext()
        # None: the base model's contexts; a mixed batch keeps none (they would be another adapter's)
        self.prefixes.use(MIXED_ADAPTERS if mixed else adapter_path)
        names = (
            [self.adapters[path] for r, path in zip(requests, adapter_paths, strict=True) for _ in range(r.group_size)] if mixed else None
        )
        prompts = [r.prompt_ids for r in requests for _ in range(r.group_size)]
        seeds = [(r.seed, row) for r in requests for row in range(r.group_size)]
        owners = [r for r in requests for _ in range(r.group_size)]  # each batch row's request
        continued = frozenset(i for i, r in enumerate(owners) if r.continues)
        sampling = requests[0].sampling()
        matchers = self._matchers([r.regex for r in owners])
        rows: list = [None] * len(prompts)
        token_bytes = kv_bytes_per_token(self.base)
        lengths = [len(p) + sampling.max_new_tokens for p in prompts]
        with torch.inference_mode(), base_only:
            # within the cache bound, in batches of similar lengths (the trainer's micro-batch plan)
            for part in plan_micro_batches(lengths, max(1, self.batch_kv_bytes // token_bytes)):
                part.sort()
                decoded = decode(
                    model,
                    [prompts[i] for i in part],
                    [seeds[i] for i in part],
                    sampling,
                    self.eos_ids,
                    self.pad_id,
                    self.tokenizer,
                    self.prefixes,
                    frozenset(j for j, i in enumerate(part) if i in continued),
                    None if matchers is None else [matchers[i] for i in part],
                    None if names is None else [names[i] for i in part],
                )
                for i, row in zip(part, decoded, strict=True):
                    rows[i] = row
        rollouts = []
        for ids, lps in rows:
            ids, lps, finish = cut_at_eos(ids, lps, self.eos_ids)
            if finish == "length" and hits_stop(self.tokenizer, ids, sampling.stop):
                finish = "stop"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            rollouts.append(Rollout(completion_ids=ids, sampling_logprobs=lps, finish_reason=finish, text=text))
        groups, start = [], 0
        for r in requests:
            groups.append(rollouts[start : start + r.group_size])
            start += r.group_size
        return groups


class VLLMGenerator:
    """vLLM generation with the adapter attached per request through LoRARequest: up to
    `max_adapters` adapters kept loaded, and as many of them (at most `VLLM_MAX_LORA_SLOTS`) in
    one batch of the engine's, each row computed with its own."""

    def __init__(
        self, model_path: str, dtype: str, max_adapters: int, max_lora_rank: int, max_model_len: int, memory_fraction: float = 0.85
    ):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("the vLLM backend needs: pip install 'grpo-flyte[gpu]'") from exc
        # max_lora_rank 0: an engine that serves no adapter (the judge)
        lora = {
            "enable_lora": True,
            "max_lora_rank": max_lora_rank,
            "max_loras": vllm_lora_slots(max_adapters),
            "max_cpu_loras": max_adapters,
        }
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            **(lora if max_lora_rank else {}),
            max_model_len=max_model_len,
            gpu_memory_utilization=memory_fraction,
            # Sampling log-probs after temperature, i.e. of the distribution actually sampled
            # from, which is what the trainer computes.
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.lora_ids: OrderedDict[str, int] = OrderedDict()  # adapter path -> LoRARequest int id, oldest use first
        self.max_adapters = max_adapters
        self._next_id = 1  # vLLM requires ids >= 1, unique per adapter

    def _lora_requests(self, adapter_paths: list[str | None]) -> list:
        """Each row's LoRARequest (None: the base model). A batch's adapters are loaded before it
        runs, evicting only adapters it does not use (least recently used first); one that cannot be
        loaded raises AdapterError naming it, and the engine goes on (vLLM would otherwise load it
        inside a decode step, whose failure ends the engine)."""
        from vllm.lora.request import LoRARequest

        distinct = [path for path in dict.fromkeys(adapter_paths) if path is not None]
        assert len(distinct) <= self.max_adapters, "a batch's adapters must fit the engine"
        for path in distinct:  # the batch's resident adapters first: the newest, so none is evicted below
            if path in self.lora_ids:
                self.lora_ids.move_to_end(path)
        requests = {}
        for path in distinct:
            lora_id = self.lora_ids.get(path)
            if lora_id is not None:
                requests[path] = LoRARequest(f"adapter{lora_id}", lora_id, path)
                continue
            while len(self.lora_ids) >= self.max_adapters:
                _, old_id = self.lora_ids.popitem(last=False)
                self.llm.llm_engine.remove_lora(old_id)
            lora_id, self._next_id = self._next_id, self._next_id + 1
            requests[path] = LoRARequest(f"adapter{lora_id}", lora_id, path)
            try:
                self.llm.llm_engine.add_lora(requests[path])
            except Exception as exc:  # noqa: BLE001 -- a missing, truncated or foreign adapter fails in many ways
                raise AdapterError(f"adapter {path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
            self.lora_ids[path] = lora_id
        return [None if path is None else requests[path] for path in adapter_paths]

    def close(self) -> None:
        """Give the GPU memory back (vLLM keeps it after `del`: vllm#1908)."""
        import gc

        del self.llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        except ImportError:
            return
        cleanup_dist_env_and_memory()

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]:
        """One `LLM.generate` for several groups sharing an adapter (None: the base model, e.g. the judge)."""
        return self.generate_mixed(requests, [adapter_path] * len(requests))

    def generate_mixed(self, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]:
        """One `LLM.generate` for several groups, each with its own adapter (`adapter_paths[i]` for
        `requests[i]`) and settings: vLLM takes a LoRARequest per prompt and schedules up to its
        `max_loras` adapters in one step. At most `max_adapters` adapters."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=r.group_size,
                temperature=0.0 if r.greedy else r.temperature,
                top_p=r.top_p,
                top_k=-1,
                max_tokens=r.max_new_tokens,
                min_tokens=r.min_new_tokens,
                logprobs=0,
                seed=r.seed,
                stop=list(r.stop) or None,
                include_stop_str_in_output=True,
                structured_outputs=structured_outputs(r.regex),
            )
            for r in requests
        ]
        loras = self._lora_requests(adapter_paths)
        outputs = self.llm.generate(
            [{"prompt_token_ids": r.prompt_ids} for r in requests],
            params,
            lora_request=None if all(lora is None for lora in loras) else loras,
            use_tqdm=False,
        )
        return [[vllm_completion_to_rollout(c) for c in out.outputs] for out in outputs]


def vllm_lora_slots(max_adapters: int) -> int:
    """vLLM's `max_loras`: how many of the loaded adapters one engine step computes. Each slot holds
    GPU buffers of `max_lora_rank` for every adapted layer (~80 MB at rank 16 on a 7B model, taken
    from the KV cache), so the adapters past `VLLM_MAX_LORA_SLOTS` wait for a slot within the same
    `LLM.generate` instead."""
    return max(1, min(max_adapters, VLLM_MAX_LORA_SLOTS))


def structured_outputs(regex: str | None):
    """vLLM's constraint that the completion match `regex` (its structured outputs), or None."""
    if regex is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex)


def vllm_completion_to_rollout(completion) -> Rollout:
    """A vLLM CompletionOutput -> Rollout; the sampled token's log-prob is in each step's dict."""
    ids = list(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(ids)} tokens; was logprobs=0 set?")
    logprobs = [float(step[tok].logprob) for step, tok in zip(steps, ids, strict=True)]
    finish = "stop" if completion.finish_reason == "stop" else "length"
    return Rollout(completion_ids=ids, sampling_logprobs=logprobs, finish_reason=finish, text=completion.text)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise AdapterError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}", field="lora_rank")


def adapter_rank(adapter_path: str) -> int:
    """The LoRA rank `r` recorded in an adapter folder's adapter_config.json."""
    path = Path(adapter_path) / "adapter_config.json"
    try:
        return int(json.loads(path.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterError(
            f"adapter {adapter_path!r} has no readable LoRA rank in adapter_config.json ({type(exc).__name__}: {exc})"
        ) from None


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


class EngineCache:
    """A replica's engines, one per key, built on first use; the least recently used is freed
    (before the new one is built) past `capacity` engines, or where a new vLLM engine's share of
    the GPU would take the vLLM engines held past `VLLM_MEMORY_BUDGET`. A run uses one key; a sweep
    over base models one per base, which `sweep_grid` keeps within both bounds, so that calls that
    interleave the bases never rebuild an engine.

    Hand-written rather than `functools.lru_cache`: that evicts after building the new entry, and
    two vLLM engines cannot be on one GPU at once. Used only on the torch thread, which serializes
    every use; warm state is a cache: any engine built from the same key produces the same rollouts.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.engines: OrderedDict[EngineKey, Generator] = OrderedDict()

    def get(self, key: EngineKey) -> Generator:
        if key in self.engines:
            self.engines.move_to_end(key)
            return self.engines[key]
        while self.engines and not self._fits(key):
            old_key, old = self.engines.popitem(last=False)
            logger.info("freeing the %s generator for %s, least recently used, for %s", old_key.backend, old_key.model_path, key.model_path)
            old.close()
        self.engines[key] = engine = key.build()
        return engine

    def _fits(self, key: EngineKey) -> bool:
        if len(self.engines) >= self.capacity:
            return False
        reserved = sum(k.memory_fraction for k in self.engines if k.backend == "vllm")
        return key.backend != "vllm" or reserved + key.memory_fraction <= VLLM_MEMORY_BUDGET

    def clear(self) -> None:
        while self.engines:
            _, engine = self.engines.popitem(last=False)
            engine.close()


_engines = EngineCache(MAX_BASES)
_judge_engines = EngineCache(1)  # a sweep shares its judge (sweep_grid refuses judge_model)


def engine_key(
    model_path: str, dtype: str, backend: str, max_adapters: int, adapter_path: str, max_model_len: int, memory_fraction: float = 0.85
) -> EngineKey:
    """The engine for these settings; vLLM's LoRA capacity comes from the adapter's own rank."""
    resolved = resolve_backend(backend)
    if resolved == "vllm":
        rank = vllm_max_lora_rank(adapter_rank(adapter_path))
        return EngineKey("vllm", model_path, dtype, max_adapters, rank, max_model_len, memory_fraction)
    return EngineKey("hf", model_path, dtype, max_adapters, 0, 0)


def judge_engine_key(model_path: str, dtype: str, backend: str, max_model_len: int, memory_fraction: float = 0.85) -> EngineKey:
    """The judge's engine: the model as it is, no adapter, in the judge's cache."""
    resolved = resolve_backend(backend)
    if resolved == "vllm":
        return EngineKey("vllm", model_path, dtype, 0, 0, max_model_len, memory_fraction, slot="judge")
    return EngineKey("hf", model_path, dtype, 0, 0, 0, slot="judge")


def get_engine(key: EngineKey) -> Generator:
    """This replica's engine for `key` (call on the torch thread)."""
    return (_judge_engines if key.slot == "judge" else _engines).get(key)


def sampling_request(sampling: SamplingConfig, prompt_ids: list[int], seed: int, greedy: bool = False) -> SamplingRequest:
    """The generation settings of one prompt: a group of `group_size`, or one greedy answer."""
    return SamplingRequest(
        prompt_ids=prompt_ids,
        group_size=1 if greedy else sampling.group_size,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        seed=seed,
        greedy=greedy,
    )


def batch_order(request: SamplingRequest) -> tuple[int, list[int]]:
    """Where a request sits in an engine batch: by seed, then prompt (not by arrival)."""
    return request.seed, request.prompt_ids


@dataclass(frozen=True)
class EngineCall:
    """One group for the batcher: which engine and adapter, and what to sample."""

    key: EngineKey
    adapter_path: str | None  # None: the model without an adapter (the judge)
    request: SamplingRequest

    def mixes(self) -> bool:
        """Whether this group may share an engine batch with other adapters' groups (a sweep's
        configs, a pipelined run's versions): on vLLM any adapter's group (a LoRARequest per
        prompt); on transformers, where mixed batches pay (`mixed_batches_pay`), one without a
        multi-turn context to keep or a regex (PEFT's mixed adapter batches)."""
        if self.adapter_path is None:
            return False
        if self.key.backend == "vllm":
            return True
        return mixed_batches_pay(self.key.backend) and not self.request.continues and self.request.regex is None

    def batches_with(self) -> tuple:
        """Calls decode in one engine batch when these are equal."""
        if self.mixes():
            return self.key, self.request.sampling()
        return self.key, self.adapter_path, self.request.sampling()


def mixed_batches_pay(backend: str) -> bool:
    """Whether one engine batch of several adapters' rows decodes faster than one batch per adapter.
    On transformers, on a CPU only: PEFT's mixed batches run each LoRA layer once per adapter, on
    its rows. On a CPU the shared base layers' larger matmuls win (4 adapters' rows in one batch:
    0.51-0.54x the CPU time of 4 batches); on a GPU the extra small kernels lose (an H200: 1.6-2.0x
    the time, benchmarks/device_check_h200.json), so there the batcher keeps one adapter a batch."""
    return backend == "hf" and best_device() == "cpu"


def identical_calls(calls: list[EngineCall], contents: list[str | None]) -> tuple[list[EngineCall], list[int]]:
    """The calls to decode, one for each set of identical ones, and for each call the index of the
    one decoded for it. `contents[i]` identifies the content of `calls[i]`'s adapter (`adapter_content`).

    Identical: the same engine, adapter content and request (a sweep's configs that differ only in
    what they train start from the same adapter and sample the same prompts with the same seeds).
    A multi-turn turn (`continues`) is its own: the engine keeps its context per adapter path. An
    adapter's content is decoded under one of its paths, the least (whichever batch it is in), so
    the engine loads it once."""
    canonical: dict[str | None, str] = {}
    for call, content in zip(calls, contents, strict=True):
        if call.adapter_path is not None and not call.request.continues:
            canonical[content] = min(canonical.get(content, call.adapter_path), call.adapter_path)
    decoded: list[EngineCall] = []
    index: dict[object, int] = {}
    owners: list[int] = []
    for i, (call, content) in enumerate(zip(calls, contents, strict=True)):
        same = i if call.request.continues else (call.key, content, call.request.model_dump_json())
        if same not in index:
            index[same] = len(decoded)
            path = call.adapter_path if call.request.continues else canonical.get(content, call.adapter_path)
            decoded.append(replace(call, adapter_path=path))
        owners.append(index[same])
    return decoded, owners


@functools.lru_cache(maxsize=ADAPTER_DIGESTS)
def _folder_digest(path: str, files: tuple) -> str:
    """The sha256 of a folder's files (names and bytes). `files` (`files.files_of`) is part of the
    cache's key: a folder replaced at the same path (a train step's retry) is hashed again."""
    digest = hashlib.sha256()
    for name, *_ in files:
        with open(Path(path) / name, "rb") as f:
            digest.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return "sha256:" + digest.hexdigest()


def adapter_content(path: str | None) -> str | None:
    """What identifies an adapter's content: the digest of its folder's files an engine loads, the
    trainer's own (`TRAINER_FILES`: the optimizer state holds the config's learning rate) left out
    (None: no adapter). A folder that cannot be read is identified by its path: it fails on its
    own, as it would have."""
    if path is None:
        return None
    try:
        return _folder_digest(path, tuple(f for f in files_of(path) if f[0] not in TRAINER_FILES))
    except OSError:
        return path


async def _contents(calls: list[EngineCall]) -> list[str | None]:
    """Each call's `adapter_content`; a batch with one adapter path (every flush of a lone run)
    needs no digest, its path says it, and no hop to a thread to read files."""
    paths = [call.adapter_path for call in calls]
    if len(set(paths) - {None}) < 2:
        return paths
    return await asyncio.to_thread(lambda: [adapter_content(path) for path in paths])


async def _process(calls: list[EngineCall]) -> list[list[Rollout] | BaseException]:
    """The batcher's function: the calls of one batch, identical ones decoded once
    (`identical_calls`; each caller gets its own copy), one engine batch per shared settings."""
    decoded, owners = identical_calls(calls, await _contents(calls))
    results = await _decode_calls(decoded)
    answers: list[list[Rollout] | BaseException] = []
    answered: set[int] = set()
    for j in owners:
        shared = j in answered and not isinstance(results[j], BaseException)
        # a deep copy for each caller after the first: what one caller changes stays its own
        answers.append([rollout.model_copy(deep=True) for rollout in results[j]] if shared else results[j])
        answered.add(j)
    return answers


async def _decode_calls(calls: list[EngineCall]) -> list[list[Rollout] | BaseException]:
    """The calls of one batch, decoded one engine batch per shared settings.

    A failing engine batch fails every group in it (its exception is each one's result) and no other.
    """
    results: list[list[Rollout] | BaseException | None] = [None] * len(calls)
    batches: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        batches.setdefault(call.batches_with(), []).append(i)
    for members in batches.values():
        # Sorted, so the batch does not depend on arrival order: the same groups give the same rollouts.
        members.sort(key=lambda i: (batch_order(calls[i].request), calls[i].adapter_path or ""))
        for chunk in _adapter_chunks(members, calls):
            paths = [calls[i].adapter_path for i in chunk]
            if len(set(paths)) > 1:
                try:
                    out = await run_on_torch_thread(_decode_mixed, calls[chunk[0]].key, [calls[i].request for i in chunk], paths)
                    for i, rollouts in zip(chunk, out, strict=True):
                        results[i] = rollouts
                    continue
                except Exception:  # noqa: BLE001 -- e.g. one config's damaged adapter: decoded per adapter below, so it fails alone
                    logger.warning("a batch of %d adapters failed; decoding it one adapter at a time", len(set(paths)))
            for path in dict.fromkeys(paths):
                await _decode_into(results, calls, [i for i in chunk if calls[i].adapter_path == path])
    return results  # type: ignore[return-value]


async def _decode_into(results: list, calls: list[EngineCall], members: list[int]) -> None:
    """One engine batch of calls that share an adapter; its failure is every member's result."""
    first = calls[members[0]]
    try:
        out = await run_on_torch_thread(_decode, first.key, [calls[i].request for i in members], first.adapter_path)
    except Exception as exc:  # noqa: BLE001 -- handed to every group of this engine batch, raised there
        out = [exc] * len(members)
    for i, rollouts in zip(members, out, strict=True):
        results[i] = rollouts


def _adapter_chunks(members: list[int], calls: list[EngineCall]) -> list[list[int]]:
    """The engine batches of one batch's calls: as many adapters in each as the engine holds at once."""
    chunks: list[list[int]] = []
    adapters: set[str | None] = set()
    for i in members:
        path = calls[i].adapter_path
        if not chunks or (path not in adapters and len(adapters) >= max(1, calls[i].key.max_adapters)):
            chunks.append([])
            adapters = set()
        chunks[-1].append(i)
        adapters.add(path)
    return chunks


def _decode(key: EngineKey, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]:
    return get_engine(key).generate_many(requests, adapter_path)


def _decode_mixed(key: EngineKey, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]:
    return get_engine(key).generate_mixed(requests, adapter_paths)


@alru_cache(maxsize=1)
async def replica_batcher() -> DynamicBatcher:
    """The replica's one DynamicBatcher, started on first use: every generate call on this replica
    submits its groups here, and only its consumer drives the engine."""
    batcher = DynamicBatcher(
        _process,
        cost_estimator=lambda call: call.request.group_size,
        target_batch_cost=MAX_BATCH_ROWS,
        max_batch_size=MAX_BATCH_ROWS,
        batch_timeout_s=BATCH_WINDOW_S,
    )
    await batcher.start()
    return batcher


async def generate_groups(key: EngineKey, adapter_path: str | None, requests: list[SamplingRequest]) -> list[list[Rollout]]:
    """Each request's group of rollouts, through the replica's batcher (so they batch with others')."""
    batcher = await replica_batcher()
    await until_idle()  # the calls that arrive while the engine's thread works join one batch
    futures = [await batcher.submit(EngineCall(key, adapter_path, r)) for r in requests]
    results = await asyncio.gather(*futures)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def play_episodes(
    key: EngineKey,
    adapter_path: str,
    env: str,
    example: Example,
    prompt_ids: list[int],
    request: SamplingRequest,
    episode: EpisodeConfig,
    prompt: PromptConfig,
) -> list[Rollout]:
    """`request.group_size` episodes of environment `env` from one prompt, played concurrently.

    Every model turn of every episode goes through the replica's batcher on its own, so the turns
    of episodes that are not waiting on their environment decode together, with other groups'.
    Each turn is sampled with its own seed (`decoding.sub_seed`): an episode does not depend on
    which others it was batched with. A turn continues its episode's context: the transformers
    engine keeps the turn's cache, so the next turn computes only the environment's reply.
    """
    cls = multiturn.load_environment(env)
    engine = await run_on_torch_thread(get_engine, key)
    splicer = episodes.Splicer(engine.tokenizer, is_chat(example, prompt), prompt.enable_thinking)
    budgets = episodes.Budgets(episode.max_turns, request.max_new_tokens, episode.max_episode_tokens, episode.tool_timeout_s)
    stop = multiturn.stop_strings(cls)

    async def play(row: int) -> Rollout:
        async def sample_turn(context: list[int], max_new_tokens: int, turn: int) -> Rollout:
            one = request.model_copy(
                update={
                    "prompt_ids": context,
                    "group_size": 1,
                    "max_new_tokens": max_new_tokens,
                    "seed": sub_seed(request.seed, row, turn),
                    "stop": stop,
                    "continues": True,
                }
            )
            [[rollout]] = await generate_groups(key, adapter_path, [one])
            return rollout

        return await episodes.run_episode(episodes.new_environment(cls, example), prompt_ids, sample_turn, splicer, budgets)

    return await all_or_none([play(row) for row in range(request.group_size)])


async def all_or_none(coroutines: list[Awaitable[T]]) -> list[T]:
    """Every coroutine's result, run concurrently; when one fails, the others are cancelled (not
    left running on a failed task's behalf) and its exception is raised as it is."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except BaseExceptionGroup as failed:
        first = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


async def tokenize(key: EngineKey, examples: list[Example], prompt: PromptConfig) -> list[list[int]]:
    """The prompt token ids of each example, with the engine's tokenizer (the engine is built if needed)."""
    engine = await run_on_torch_thread(get_engine, key)
    return [tokenize_prompt(engine.tokenizer, example, prompt) for example in examples]
