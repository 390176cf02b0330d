"""The generate tasks in Flyte local mode: concurrent calls share one engine batch on a replica."""

from __future__ import annotations

import asyncio

import flyte
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.cache import EngineCache, EngineKey
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.engine.interface import sampling_request
from grpo_flyte.envs import rollout_env
from grpo_flyte.learning.policy import peft_model, reset_lora, save_adapter
from grpo_flyte.rollout import generate
from grpo_flyte.runtime.torch_thread import on_torch_thread
from grpo_flyte.trainer import init_adapter
from grpo_flyte.types import Example, RolloutGroup

fanout_env = flyte.TaskEnvironment(name="grpo_flyte-test-fanout", depends_on=[rollout_env])


@fanout_env.task
async def one_iteration(config: RunConfig, base_model: Dir, questions: list[str]) -> list[RolloutGroup]:
    """What the driver does for one iteration's generation: one generate task per prompt, all at once."""
    adapter = await init_adapter(config.base, config.lora, config.seed, base_model)
    return await asyncio.gather(*[
        generate(config.base, config.engine, config.prompt, config.sampling, config.episode, base_model, adapter, Example(question=q, answer="1"), i, 100 + i)
        for i, q in enumerate(questions)
    ])  # fmt: skip


def test_eight_concurrent_generate_calls_decode_in_one_engine_batch(tiny_model_dir, monkeypatch):
    """In local mode, through Flyte's task machinery and the real transformers engine (tiny model),
    the 8 generate calls of an iteration are one `generate_many` call of 8 groups."""
    batches: list[list[int]] = []
    original = HFGenerator.generate_many

    def spy(self, requests, adapter_path):
        batches.append([r.seed for r in requests])
        return original(self, requests, adapter_path)

    monkeypatch.setattr(HFGenerator, "generate_many", spy)
    config = RunConfig(group_size=3, max_new_tokens=4, backend="hf")
    questions = [f"What is {i} + {i}?" for i in range(8)]
    run = flyte.with_runcontext(mode="local").run(
        one_iteration, config=config, base_model=Dir(path=str(tiny_model_dir)), questions=questions
    )
    groups = run.outputs()[0]
    assert batches == [[100 + i for i in range(8)]]
    assert [g.index for g in groups] == list(range(8))
    assert all(len(g.rollouts) == 3 and all(r.completion_ids for r in g.rollouts) for g in groups)


def test_a_group_does_not_depend_on_its_batch_mates(tiny_model_dir, tmp_path):
    """The same group (prompt, seed) decoded alone and in a batch of others gives the same tokens:
    each row samples from its own stream (float32, so padding cannot flip a near-tie)."""
    key = EngineKey("hf", str(tiny_model_dir), "float32", 4, 0, 0)
    config = RunConfig(group_size=3, max_new_tokens=6, dtype="float32")

    def build_adapter() -> None:
        peft = peft_model(config.base, config.lora, str(tiny_model_dir))
        reset_lora(peft, seed=0)
        save_adapter(peft, None, 0, tmp_path / "v0")

    on_torch_thread(build_adapter)

    async def decode(examples: list[Example]):
        prompts = await cache.tokenize(key, examples, config.prompt)
        requests = [sampling_request(config.sampling, ids, seed=7 + i) for i, ids in enumerate(prompts)]
        return await batching.generate_groups(key, str(tmp_path / "v0"), requests)

    target = Example(question="What is 2 + 3?", answer="5")
    others = [Example(question=f"Please compute {i} * {i} and explain every step in detail.", answer="1") for i in range(3)]
    alone = asyncio.run(decode([target]))[0]
    together = asyncio.run(decode([target, *others]))[0]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in together]


def test_a_gpu_pod_without_usable_cuda_fails_at_once_not_retried(tiny_model_dir, monkeypatch):
    """On a pool given a GPU (envs sets GRPO_FLYTE_REQUIRE_CUDA=1) a node whose driver is too old
    for torch's CUDA 13 would otherwise generate and train on its CPU, silently and slowly."""
    import flyte.errors
    import pytest

    from grpo_flyte.errors import DeviceError
    from grpo_flyte.learning import policy
    from grpo_flyte.runtime.device import best_device

    assert best_device() == "cpu"  # this machine: no GPU, none required
    monkeypatch.setenv("GRPO_FLYTE_REQUIRE_CUDA", "1")
    # a fresh pod: no engine and no base model loaded yet (earlier tests left theirs in this process)
    monkeypatch.setattr(cache, "_engines", EngineCache(1))
    policy._peft_model.cache_clear()
    with pytest.raises(
        DeviceError, match=r"CUDA is not usable: torch .*; the image's CUDA 13 needs NVIDIA driver >= 580 \(this node's driver: "
    ):
        best_device()
    config = RunConfig(group_size=2, max_new_tokens=4)
    adapter_dir = Dir(path=str(tiny_model_dir))  # never read: the engine is refused first
    from grpo_flyte.types import AdapterRef

    with pytest.raises(flyte.errors.NonRecoverableError, match="needs NVIDIA driver >= 580"):
        asyncio.run(
            generate(config.base, config.engine, config.prompt, config.sampling, config.episode, Dir(path=str(tiny_model_dir)),
                     AdapterRef(version=0, dir=adapter_dir), Example(question="What is 1 + 1?", answer="2"), 0, 1)
        )  # fmt: skip
    with pytest.raises(flyte.errors.NonRecoverableError, match="needs NVIDIA driver >= 580"):
        asyncio.run(init_adapter(config.base, config.lora, config.seed, Dir(path=str(tiny_model_dir))))


def test_ten_adapters_in_flight_on_one_replica_from_remote_paths_all_generate(tiny_model_dir, tmp_path, monkeypatch):
    """A sweep of 10 configs (or a pipelined run's versions) sends one replica generate calls with
    10 distinct adapters at once, each a remote folder the replica downloads. The replica's folder
    cache keeps 8: it must not delete a folder a call still needs (the call would fail with a
    not-retried AdapterError). The download stands in for an object store: it copies a local
    adapter into the cache's target folder."""
    import shutil

    from grpo_flyte import envs, rollout
    from grpo_flyte.config.constants import MAX_STALENESS
    from grpo_flyte.runtime.storage import LocalDirCache
    from grpo_flyte.types import AdapterRef

    config = RunConfig(group_size=2, max_new_tokens=3, backend="hf")

    def build_adapter() -> None:
        peft = peft_model(config.base, config.lora, str(tiny_model_dir))
        reset_lora(peft, seed=0)
        save_adapter(peft, None, 0, tmp_path / "v0")

    on_torch_thread(build_adapter)
    downloads: list[str] = []

    async def download(self, local_path: str, **_) -> str:
        downloads.append(self.path)
        await asyncio.to_thread(shutil.copytree, tmp_path / "v0", local_path)
        return local_path

    monkeypatch.setattr(Dir, "download", download)
    monkeypatch.setattr(cache, "_engines", EngineCache(1))
    # the replica's cache holds rollout_concurrency folders; 8 here, fewer than the calls in flight
    assert rollout._adapter_dirs.capacity >= envs.settings.rollout_concurrency
    monkeypatch.setattr(rollout, "_adapter_dirs", LocalDirCache(tmp_path / "replica-adapters", MAX_STALENESS + 2))
    adapters = [AdapterRef(version=i, dir=Dir(path=f"s3://bucket/sweep/config-{i}/adapters/v1")) for i in range(10)]

    async def calls():
        return await asyncio.gather(*[
            generate(config.base, config.engine, config.prompt, config.sampling, config.episode, Dir(path=str(tiny_model_dir)),
                     adapter, Example(question=f"What is {i} + 1?", answer=str(i + 1)), i, 100 + i)
            for i, adapter in enumerate(adapters)
        ])  # fmt: skip

    groups = asyncio.run(calls())
    assert [g.adapter_version for g in groups] == list(range(10))
    assert all(len(g.rollouts) == 2 for g in groups)
    assert sorted(downloads) == sorted(a.dir.path for a in adapters)  # each downloaded once
    # the calls done, the cache is back within its bound, on disk too
    kept = rollout._adapter_dirs
    assert len(kept.entries) <= kept.capacity
    assert sum(1 for p in kept.root.iterdir() if p.is_dir()) == len(kept.entries)
