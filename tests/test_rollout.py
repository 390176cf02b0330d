"""Pure parts of grpo_flyte.rollout: EOS cutting, vLLM output conversion, backend choice, dir cache."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
from flyte.io import Dir

from grpo_flyte.rollout import (
    LocalDirCache,
    Rollout,
    cut_at_eos,
    resolve_backend,
    vllm_completion_to_rollout,
)

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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_resolve_backend_auto_without_vllm_is_hf():
    assert resolve_backend("auto") == "hf"


# --------------------------------------------------------------------------- LocalDirCache


def test_local_dir_is_used_in_place(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cache = LocalDirCache(tmp_path / "cache", capacity=1)
    assert asyncio.run(cache.get(Dir(path=str(model)))) == str(model)
    assert asyncio.run(cache.get(Dir(path=str(model)))) == str(model)
    # nothing downloaded, nothing recorded, the directory untouched
    assert not (tmp_path / "cache").exists()
    assert cache.entries == {}
    assert (model / "config.json").read_text() == "{}"


class FakeRemoteDir:
    """Stands in for a remote flyte.io.Dir: download() writes a marker file into the target."""

    downloads: ClassVar[list[str]] = []

    def __init__(self, path: str):
        self.path = path

    async def download(self, local_path: str) -> str:
        FakeRemoteDir.downloads.append(self.path)
        Path(local_path).mkdir(parents=True)
        (Path(local_path) / "from.txt").write_text(self.path)
        return local_path


def test_remote_dirs_are_downloaded_once_and_evicted(tmp_path):
    FakeRemoteDir.downloads = []
    cache = LocalDirCache(tmp_path / "cache", capacity=2)

    async def scenario():
        a1 = await cache.get(FakeRemoteDir("s3://b/a"))
        a2 = await cache.get(FakeRemoteDir("s3://b/a"))
        b = await cache.get(FakeRemoteDir("s3://b/b"))
        a3 = await cache.get(FakeRemoteDir("s3://b/a"))  # a becomes the newest
        c = await cache.get(FakeRemoteDir("s3://b/c"))  # capacity 2: evicts b, the oldest
        return a1, a2, b, a3, c

    a1, a2, b, a3, c = asyncio.run(scenario())
    assert a1 == a2 == a3
    assert Path(a1).parent == tmp_path / "cache"
    assert (Path(a1) / "from.txt").read_text() == "s3://b/a"
    assert len({a1, b, c}) == 3
    assert FakeRemoteDir.downloads == ["s3://b/a", "s3://b/b", "s3://b/c"]
    assert not Path(b).exists()
    assert Path(a1).exists() and Path(c).exists()
    assert list(cache.entries) == ["s3://b/a", "s3://b/c"]


# --------------------------------------------------------------------------- VLLMGenerator, fake engine


class _FakeLLM:
    """vLLM's LLM as VLLMGenerator uses it: generate(prompts, params, lora_request=...), a tokenizer,
    and llm_engine.remove_lora. Each completion echoes a token per request so outputs can be checked."""

    instances: list[_FakeLLM] = []  # noqa: RUF012 (records instances for the test)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list = []
        self.removed: list[int] = []
        self.llm_engine = SimpleNamespace(remove_lora=self.removed.append)
        _FakeLLM.instances.append(self)

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
    from grpo_flyte.rollout import SamplingRequest, VLLMGenerator

    gen = VLLMGenerator("/m", "bfloat16", max_adapters=2, max_lora_rank=16, max_model_len=640, seed=3)
    llm = fake_vllm.instances[0]
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    sampled = SamplingRequest(prompt_ids=[1, 7], group_size=3, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=11)
    greedy = sampled.model_copy(update={"prompt_ids": [1, 8], "group_size": 1, "greedy": True})
    groups = gen.generate_many([sampled, greedy], "/adapters/v1")
    assert [len(g) for g in groups] == [3, 1]
    assert groups[0][0].completion_ids == [7, 2] and groups[0][0].sampling_logprobs == [-0.5, -0.25]
    assert groups[1][0].text == "8"
    _, params, lora = llm.calls[0]
    assert (params[0].n, params[0].temperature, params[0].top_p, params[0].seed, params[0].logprobs) == (3, 0.7, 0.9, 11, 0)
    assert params[0].top_k == -1 and params[0].max_tokens == 16
    assert (params[1].n, params[1].temperature) == (1, 0.0)  # greedy
    assert (lora.id, lora.path) == (1, "/adapters/v1")
    # a new adapter gets a new id; the third evicts the oldest (max_adapters=2) from the engine
    gen.generate_many([sampled], "/adapters/v2")
    gen.generate_many([sampled], "/adapters/v3")
    assert [c[2].id for c in llm.calls] == [1, 2, 3]
    assert llm.removed == [1]
    gen.generate_many([sampled], "/adapters/v2")  # still loaded: same id, nothing evicted
    assert llm.calls[-1][2].id == 2 and llm.removed == [1]


# --------------------------------------------------------------------------- coalescing


class FakeEngine:
    """Records each batch generate_many is asked for; one empty rollout per completion."""

    tokenizer = None

    def __init__(self):
        self.batches: list[list[int]] = []

    def generate_many(self, requests, adapter_path):
        self.batches.append([r.seed for r in requests])
        rollout = Rollout(completion_ids=[2], sampling_logprobs=[-0.5], finish_reason="stop", text="")
        return [[rollout] * r.group_size for r in requests]


def test_concurrent_generate_calls_share_one_batch_in_seed_order(monkeypatch, tmp_path):
    """More groups than asyncio's default executor has threads (6 on a 2-core machine) still land
    in one batch, ordered by seed whatever order they arrived in."""
    from grpo_flyte import rollout
    from grpo_flyte.config import RunConfig
    from grpo_flyte.data import Example

    engine = FakeEngine()
    monkeypatch.setattr(rollout, "get_engine", lambda config, model_path: engine)
    monkeypatch.setattr(rollout, "tokenize_prompt", lambda tokenizer, example, config: [1, len(example.question)])
    config = RunConfig(group_size=2)
    adapter = rollout.AdapterRef(version=0, dir=Dir(path=str(tmp_path)))
    seeds = [50, 10, 40, 30, 20, 70, 60, 80, 90, 15, 25, 35]

    async def run_all():
        return await asyncio.gather(*[
            rollout.generate(config, Dir(path=str(tmp_path)), adapter, Example(question=f"q{i}", answer="1"), i, seed)
            for i, seed in enumerate(seeds)
        ])  # fmt: skip

    groups = asyncio.run(run_all())
    assert engine.batches == [sorted(seeds)]
    assert [g.index for g in groups] == list(range(len(seeds)))
    assert all(len(g.rollouts) == 2 for g in groups)
