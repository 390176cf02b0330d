"""The `generate` task: one group of completions for one prompt, on a warm, reusable replica.

The engine (vLLM on a GPU, transformers + PEFT otherwise) is built once per replica and cached;
the LoRA adapter named by the task's input is attached per request. Warm state is only a cache:
the same inputs give the same rollouts on any replica (the sampling seed is an input).

Each rollout carries the prompt and completion token ids and the per-token sampling log-probs, so
the trainer never re-tokenizes text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Literal, Protocol

from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte.config import RunConfig
from grpo_flyte.data import Example, render_prompt
from grpo_flyte.decoding import Sampling
from grpo_flyte.envs import rollout_env
from grpo_flyte.faults import inject
from grpo_flyte.models import cache_root, torch_dtype
from grpo_flyte.torch_thread import on_torch_thread

logger = logging.getLogger(__name__)


class AdapterError(ValueError):
    """An adapter directory that cannot be used; the message names it."""


class AdapterRef(BaseModel):
    """A LoRA adapter version: PEFT files plus the optimizer state that produced it."""

    version: int
    dir: Dir


class Rollout(BaseModel):
    completion_ids: list[int]
    sampling_logprobs: list[float]  # log softmax(logits / temperature) of each sampled token
    finish_reason: Literal["stop", "length"]
    text: str


class RolloutGroup(BaseModel):
    """All completions of one prompt; `index` is the prompt's position within its iteration."""

    index: int
    example: Example
    adapter_version: int
    prompt_ids: list[int]
    rollouts: list[Rollout]
    generate_s: float


class SamplingRequest(BaseModel):
    prompt_ids: list[int]
    group_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    greedy: bool = False  # evaluation: the most likely token at every step
    min_new_tokens: int = 0  # no end-of-sequence before this many tokens (benchmarks: fixed-length work)

    def sampling(self) -> Sampling:
        """The settings a batch shares: requests batch together only when these are equal."""
        return Sampling(self.temperature, self.top_p, self.max_new_tokens, self.greedy, self.min_new_tokens)


class Generator(Protocol):
    tokenizer: object

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str) -> list[list[Rollout]]: ...


def resolve_backend(backend: str) -> str:
    """'auto' picks vLLM when it imports and a GPU is visible, else the transformers backend."""
    if backend != "auto":
        return backend
    if importlib.util.find_spec("vllm") is None:
        return "hf"
    import torch

    return "vllm" if torch.cuda.is_available() else "hf"


def cut_at_eos(token_ids: list[int], logprobs: list[float], eos_ids: set[int]) -> tuple[list[int], list[float], str]:
    """Keep tokens up to and including the first EOS; what follows is padding."""
    for i, tok in enumerate(token_ids):
        if tok in eos_ids:
            return token_ids[: i + 1], logprobs[: i + 1], "stop"
    return token_ids, logprobs, "length"


class HFGenerator:
    """transformers + PEFT generation; one adapter active at a time, a few kept loaded."""

    def __init__(self, model_path: str, dtype: str, max_adapters: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_flyte.models import best_device

        self.device = best_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype))
        self.base = model.to(self.device).eval()
        self.model = None  # the PeftModel, once the first adapter is loaded
        self.adapters: OrderedDict[str, str] = OrderedDict()  # adapter path -> PEFT adapter name
        self.max_adapters = max_adapters
        self._next_name = 0
        eos = self.base.generation_config.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, list) else [eos] if eos is not None else []), self.tokenizer.eos_token_id}
        self.eos_ids.discard(None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)

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

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str) -> list[list[Rollout]]:
        """One batched decode for several groups sharing an adapter and sampling settings."""
        import torch

        from grpo_flyte.decoding import decode

        self._activate(adapter_path)
        prompts = [r.prompt_ids for r in requests for _ in range(r.group_size)]
        seeds = [(r.seed, row) for r in requests for row in range(r.group_size)]
        with torch.inference_mode():
            rows = decode(self.model, prompts, seeds, requests[0].sampling(), self.eos_ids, self.pad_id)
        rollouts = []
        for ids, lps in rows:
            ids, lps, finish = cut_at_eos(ids, lps, self.eos_ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            rollouts.append(Rollout(completion_ids=ids, sampling_logprobs=lps, finish_reason=finish, text=text))
        groups, start = [], 0
        for r in requests:
            groups.append(rollouts[start : start + r.group_size])
            start += r.group_size
        return groups


class VLLMGenerator:
    """vLLM generation with the adapter attached per request through LoRARequest."""

    def __init__(self, model_path: str, dtype: str, max_adapters: int, max_lora_rank: int, max_model_len: int, seed: int):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("the vLLM backend needs: pip install 'grpo-flyte[gpu]'") from exc
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=1,
            max_cpu_loras=max_adapters,
            max_model_len=max_model_len,
            gpu_memory_utilization=0.85,
            seed=seed,
            # Sampling log-probs after temperature, i.e. of the distribution actually sampled
            # from, which is what the trainer computes.
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.lora_ids: OrderedDict[str, int] = OrderedDict()  # adapter path -> LoRARequest int id
        self.max_adapters = max_adapters
        self._next_id = 1  # vLLM requires ids >= 1, unique per adapter

    def _lora_request(self, adapter_path: str):
        from vllm.lora.request import LoRARequest

        if adapter_path not in self.lora_ids:
            self.lora_ids[adapter_path] = self._next_id
            self._next_id += 1
            while len(self.lora_ids) > self.max_adapters:
                _, old_id = self.lora_ids.popitem(last=False)
                self.llm.llm_engine.remove_lora(old_id)
        self.lora_ids.move_to_end(adapter_path)
        lora_id = self.lora_ids[adapter_path]
        return LoRARequest(f"adapter{lora_id}", lora_id, adapter_path)

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str) -> list[list[Rollout]]:
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
            )
            for r in requests
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": r.prompt_ids} for r in requests],
            params,
            lora_request=self._lora_request(adapter_path),
            use_tqdm=False,
        )
        return [[vllm_completion_to_rollout(c) for c in out.outputs] for out in outputs]


def vllm_completion_to_rollout(completion) -> Rollout:
    """A vLLM CompletionOutput -> Rollout; the sampled token's log-prob is in each step's dict."""
    ids = list(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(ids)} tokens; was logprobs=0 set?")
    logprobs = [float(step[tok].logprob) for step, tok in zip(steps, ids)]
    finish = "stop" if completion.finish_reason == "stop" else "length"
    return Rollout(completion_ids=ids, sampling_logprobs=logprobs, finish_reason=finish, text=completion.text)


# One engine per replica. The lock serializes use: in local mode every task shares one process,
# and neither an HF model nor vLLM's LLM may be driven from several threads at once. The engine is
# built and driven on the process's torch thread (see torch_thread), with the lock held around it.
_engine_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _engine(backend: str, model_path: str, dtype: str, max_adapters: int, max_lora_rank: int, max_model_len: int, seed: int) -> Generator:
    logger.info("building the %s generator for %s (once per replica)", backend, model_path)
    if backend == "vllm":
        return VLLMGenerator(model_path, dtype, max_adapters, max_lora_rank, max_model_len, seed)
    return HFGenerator(model_path, dtype, max_adapters)


def get_engine(config: RunConfig, model_path: str) -> Generator:
    return _engine(
        resolve_backend(config.backend),
        model_path,
        config.torch_dtype_name,
        config.adapter_cache_size,
        config.lora_rank,
        config.max_prompt_tokens + config.max_new_tokens,
        config.seed,
    )


class LocalDirCache:
    """Remote directories downloaded once per replica, newest `capacity` kept on disk.

    A directory that is already local (local mode) is used in place and never deleted.
    """

    def __init__(self, root: Path, capacity: int):
        self.root = root
        self.capacity = capacity
        self.entries: OrderedDict[str, str] = OrderedDict()
        self._lock = asyncio.Lock()

    async def get(self, d: Dir) -> str:
        if "://" not in d.path:
            return d.path
        async with self._lock:
            if d.path in self.entries:
                self.entries.move_to_end(d.path)
                return self.entries[d.path]
            target = self.root / hashlib.sha256(d.path.encode()).hexdigest()[:16]
            shutil.rmtree(target, ignore_errors=True)
            local = await d.download(str(target))
            self.entries[d.path] = local
            while len(self.entries) > self.capacity:
                _, old = self.entries.popitem(last=False)
                shutil.rmtree(old, ignore_errors=True)
            return local


_model_dirs = LocalDirCache(cache_root() / "replica" / f"models-{os.getpid()}", capacity=1)
_adapter_dirs = LocalDirCache(cache_root() / "replica" / f"adapters-{os.getpid()}", capacity=8)


def tokenize_prompt(tokenizer, example: Example, config: RunConfig) -> list[int]:
    text = render_prompt(
        example.question, config.prompt_format, tokenizer, config.enable_thinking, config.system_prompt, config.answer_instruction
    )
    # The chat template already wrote the special tokens; the plain template gets the tokenizer's.
    ids = tokenizer(text, add_special_tokens=config.prompt_format == "plain")["input_ids"]
    if len(ids) > config.max_prompt_tokens:
        raise ValueError(
            f"prompt of {len(ids)} tokens exceeds max_prompt_tokens={config.max_prompt_tokens}: "
            f"{example.question[:80]!r}"
        )
    return list(ids)


def sampling_request(config: RunConfig, prompt_ids: list[int], seed: int, greedy: bool = False) -> SamplingRequest:
    """The generation settings of one prompt: a group of `group_size`, or one greedy answer."""
    return SamplingRequest(
        prompt_ids=prompt_ids,
        group_size=1 if greedy else config.group_size,
        temperature=config.temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        seed=seed,
        greedy=greedy,
    )


class _Pending:
    """A group waiting for the engine; whichever thread gets the engine first generates for all."""

    def __init__(self, engine: Generator, request: SamplingRequest, adapter_path: str):
        self.engine, self.request, self.adapter_path = engine, request, adapter_path
        self.result: list[Rollout] | None = None
        self.error: BaseException | None = None

    def batches_with(self, other: _Pending) -> bool:
        return (
            self.engine is other.engine
            and self.adapter_path == other.adapter_path
            and self.request.sampling() == other.request.sampling()
        )


_pending: list[_Pending] = []
_pending_lock = threading.Lock()
# How long a request waits for others of the same iteration to join its batch.
COALESCE_WINDOW_S = 0.05
# Each waiting group holds a thread (the coalescing window, then the engine lock). asyncio's default
# executor has min(32, cpus + 4) threads, 6 on a 2-core machine, which split an iteration of 8
# groups into a batch of 6 and a batch of 2 that cost two full decode loops. These threads only
# wait, so the pool is sized for every group of an iteration to join one batch.
MAX_WAITING_GROUPS = 256
_generate_threads = concurrent.futures.ThreadPoolExecutor(MAX_WAITING_GROUPS, thread_name_prefix="grpo_flyte-generate")


def batch_order(request: SamplingRequest) -> tuple[int, list[int]]:
    """Where a request sits in a coalesced batch: by seed, then prompt."""
    return request.seed, request.prompt_ids


def generate_group(
    config: RunConfig, model_path: str, example: Example, adapter_path: str, seed: int
) -> tuple[list[int], list[Rollout]]:
    """Generate one group; concurrent calls in one process (local mode) share one batched generate.

    Decoding is a loop of small steps, so one batch of all groups costs little more than one
    group. Every row draws from its own random stream, seeded by (seed, row), so its sampling does
    not depend on its batch mates; only the arithmetic does (padding to the batch's longest prompt
    can flip a near-tie in bf16). The same set of groups gives the same rollouts whatever order
    they arrive in.
    """
    with _engine_lock:
        engine = on_torch_thread(get_engine, config, model_path)
        prompt_ids = tokenize_prompt(engine.tokenizer, example, config)
    request = sampling_request(config, prompt_ids, seed)
    mine = _Pending(engine, request, adapter_path)
    with _pending_lock:
        _pending.append(mine)
    time.sleep(COALESCE_WINDOW_S)
    with _engine_lock:
        with _pending_lock:
            batch = [p for p in _pending if p is mine or (mine in _pending and p.batches_with(mine))]
            for p in batch:
                _pending.remove(p)
        # Sorted, so the batch does not depend on which thread arrived first: the same groups
        # give the same rollouts.
        batch.sort(key=lambda p: batch_order(p.request))
        if batch:
            try:
                results = on_torch_thread(mine.engine.generate_many, [p.request for p in batch], adapter_path)
                for p, rollouts in zip(batch, results, strict=True):
                    p.result = rollouts
            except BaseException as exc:  # noqa: BLE001 -- handed to every waiter in the batch, re-raised there
                for p in batch:
                    p.error = exc
    if mine.error is not None:
        raise mine.error
    assert mine.result is not None
    return prompt_ids, mine.result


@rollout_env.task(retries=2)
async def generate(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, example: Example, index: int, seed: int
) -> RolloutGroup:
    """Sample `config.group_size` completions of one prompt with the given adapter."""
    inject("generate")
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    # Blocking generation runs off the event loop so a warm replica's heartbeat (and, locally, the
    # other tasks) keep running.
    call = functools.partial(contextvars.copy_context().run, generate_group, config, model_path, example, adapter_path, seed)
    prompt_ids, rollouts = await asyncio.get_running_loop().run_in_executor(_generate_threads, call)
    return RolloutGroup(
        index=index,
        example=example,
        adapter_version=adapter.version,
        prompt_ids=prompt_ids,
        rollouts=rollouts,
        generate_s=time.perf_counter() - started,
    )


def generate_greedy(config: RunConfig, model_path: str, examples: list[Example], adapter_path: str) -> list[tuple[list[int], list[Rollout]]]:
    """One greedy completion per example, all in one batch."""
    with _engine_lock:
        engine = on_torch_thread(get_engine, config, model_path)
        requests = [
            sampling_request(config, tokenize_prompt(engine.tokenizer, example, config), seed=0, greedy=True)
            for example in examples
        ]
        results = on_torch_thread(engine.generate_many, requests, adapter_path)
    return [(r.prompt_ids, rollouts) for r, rollouts in zip(requests, results, strict=True)]


@rollout_env.task(retries=2)
async def generate_eval(
    config: RunConfig, base_model: Dir, adapter: AdapterRef, examples: list[Example], first_index: int
) -> list[RolloutGroup]:
    """Greedy completions of held-out questions, one single-rollout group each, on the warm pool."""
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    answered = await asyncio.to_thread(generate_greedy, config, model_path, examples, adapter_path)
    elapsed = time.perf_counter() - started
    return [
        RolloutGroup(
            index=first_index + i,
            example=example,
            adapter_version=adapter.version,
            prompt_ids=prompt_ids,
            rollouts=rollouts,
            generate_s=elapsed,
        )
        for i, (example, (prompt_ids, rollouts)) in enumerate(zip(examples, answered, strict=True))
    ]
