"""One copy of a frozen base per process: the transformers engine and the trainer of a local run
share the base's tensors, and each computes what it computed with a copy of its own."""

from __future__ import annotations

import gc

import pytest
import torch

from grpo_flyte.config.run import RunConfig
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.learning import policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.learning.grpo import TrainSequence
from grpo_flyte.models import loading

ROWS = [
    TrainSequence(prompt_ids=[1, 5, 6, 7], completion_ids=[11, 12, 2], advantage=1.0),
    TrainSequence(prompt_ids=[1, 5, 6, 7], completion_ids=[13, 2], advantage=-1.0),
]


@pytest.fixture
def isolated(monkeypatch):
    """A process with no frozen base registered, and none left behind; no cached PEFT model."""
    monkeypatch.setattr(loading, "_frozen", {})
    policy._peft_model.cache_clear()
    yield
    policy._peft_model.cache_clear()
    gc.collect()


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _trained(config: RunConfig, path: str):
    model = policy.peft_model(config.base, config.lora, path)
    policy.reset_lora(model, seed=0)
    optimizer = policy._optimizer(model, config.train)
    stats = policy_update.grpo_step(model, optimizer, ROWS, config.train, config.sampling)
    return model, stats


def test_the_engine_and_the_trainer_hold_one_copy_of_the_base_and_each_computes_as_alone(tiny_model_dir, isolated):
    config = RunConfig(model=str(tiny_model_dir), dtype="float32", max_new_tokens=4)
    path = str(tiny_model_dir)
    ids = torch.tensor([[1, 5, 6, 7, 11, 12]])
    engine = HFGenerator(path, "float32", max_adapters=2)
    with torch.no_grad():
        before = engine.base(input_ids=ids).logits.clone()
    model, stats = _trained(config, path)
    base = model.get_base_model()
    frozen = {p.untyped_storage().data_ptr() for n, p in base.named_parameters() if "lora_" not in n}
    assert frozen == _storages(engine.base)  # every base tensor is the engine's own
    with torch.no_grad():
        after = engine.base(input_ids=ids).logits
    assert torch.equal(before, after)  # training the adapter left the engine's base alone

    # the same step on a base of its own (no engine in the process)
    del engine, model, base
    loading._frozen.clear()
    policy._peft_model.cache_clear()
    gc.collect()
    _, alone_stats = _trained(config, path)
    assert alone_stats.loss == stats.loss and alone_stats.grad_norm == stats.grad_norm


def test_only_the_same_folder_dtype_and_device_share_and_the_weights_outlive_their_first_holder(tiny_model_dir, isolated):
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_dir)

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))

    first, second, other = load("float32"), load("float32"), load("bfloat16")
    assert loading.share_frozen_weights(first, path, "float32") == 0  # the first gives its weights
    shared = loading.share_frozen_weights(second, path, "float32")
    assert shared == len(list(second.parameters())) and _storages(second) == _storages(first)
    assert loading.share_frozen_weights(other, path, "bfloat16") == 0 and not _storages(other) & _storages(first)
    expected = {n: p.detach().clone() for n, p in first.named_parameters()}
    del first
    gc.collect()
    assert all(torch.equal(p, expected[n]) for n, p in second.named_parameters())  # still held by the second
    third = load("float32")
    assert loading.share_frozen_weights(third, path, "float32") == 0  # the first is gone: the third starts anew


def test_a_4bit_base_on_a_cpu_holds_no_view_of_its_checkpoint_and_shares_its_16bit_weights_with_the_engine(tmp_path, llama32_dir, isolated):
    import shutil

    import bitsandbytes as bnb

    model_dir = shutil.copytree(llama32_dir, tmp_path / "model")  # a folder of its own: no other test's model maps its file
    path, checkpoint = str(model_dir), str(next(model_dir.glob("*.safetensors")))

    def mapped() -> bool:
        gc.collect()
        with open("/proc/self/maps") as maps:
            return any(checkpoint in line for line in maps)

    alone = loading.load_base(path, "float32", load_in_4bit=True)
    assert not mapped()  # quantized on a CPU, its 16-bit weights hold memory of their own
    del alone

    engine = HFGenerator(path, "float32", max_adapters=2)  # a local run builds the engine first
    run = RunConfig(model=path, dtype="float32", max_new_tokens=4, load_in_4bit=True)
    model = policy.peft_model(run.base, run.lora, path)
    frozen = [p for n, p in model.get_base_model().named_parameters() if "lora_" not in n]
    sixteen = [p for p in frozen if not isinstance(p, bnb.nn.Params4bit)]
    assert sixteen and len(sixteen) < len(frozen)  # embeddings and norms in 16 bits, the linear layers in NF4
    assert {p.untyped_storage().data_ptr() for p in sixteen} <= _storages(engine.base)  # one copy: the engine's
