"""Mixed adapter batches in two matmuls a layer (grpo_flyte.engine.mixed_lora): the math by hand, every
row's output equal to its adapter's alone and to PEFT's own mixed batch, PEFT's path kept where
the stacked one does not apply, bounded caches, and the transformers engine using it."""

from __future__ import annotations

import pytest
import torch

from grpo_flyte.engine import mixed_lora
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.engine.interface import SamplingRequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_stacked_delta_by_hand():
    """Adapter "one" (rank 1, scaling 0.5) and "two" (rank 2, scaling 2) on a 2 -> 2 layer; a row
    of each, and a row of no adapter."""
    a1, b1 = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0], [0.0]])
    a2, b2 = torch.tensor([[0.0, 1.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    a, b = mixed_lora.stacked([a1, a2], [b1, b2], [0.5, 2.0])
    assert a.tolist() == [[1, 0], [0, 1], [1, 1]]
    assert b.tolist() == [[1, 2, 0], [0, 0, 2]]  # B1 * 0.5 beside B2 * 2
    select = mixed_lora.selection(("two", "one", "__base__"), ("one", "two"), (1, 2), a)
    assert select.tolist() == [[[0, 1, 1]], [[1, 0, 0]], [[0, 0, 0]]]
    x = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 5.0]]])  # (rows, sequence 1, in 2)
    # row 0 (two): A2 x = [2, 3], B2 -> [2, 3], x 2 -> [4, 6]; row 1 (one): A1 x = 3, B1 -> [6, 0], x 0.5 -> [3, 0]
    assert mixed_lora.mixed_delta(x, a, b, select).tolist() == [[[4, 6]], [[3, 0]], [[0, 0]]]


def _peft_model(model_dir, names: list[str], **lora):
    """The tiny model as a PEFT model with one random, distinct LoRA adapter per name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    configs = [LoraConfig(r=4 + 4 * i, lora_alpha=8, target_modules=TARGETS, **lora) for i in range(len(names))]
    peft = get_peft_model(model, configs[0], adapter_name=names[0])
    for name, config in zip(names[1:], configs[1:], strict=True):
        peft.add_adapter(name, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for key, param in peft.named_parameters():
            if "lora_" in key:
                param.normal_(0.0, 0.1)
    return peft.eval()


def _logits(peft, ids, names=None):
    with torch.no_grad():
        return peft(input_ids=ids, **({"adapter_names": names} if names else {})).logits


def _lora_a_calls(peft) -> list[int]:
    calls = [0]
    for layer in mixed_lora.lora_linears(peft):
        for module in layer.lora_A.values():
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_every_row_of_a_mixed_batch_gets_its_adapters_output_in_two_matmuls(tiny_model_dir):
    """Rows of 3 adapters (ranks 4, 8, 12) and of none, interleaved: each row's logits equal its
    adapter's alone and PEFT's own mixed batch's, and no adapter's LoRA modules run one by one."""
    names = ["a", "b", "c"]
    peft = _peft_model(tiny_model_dir, names)
    ids = torch.randint(3, 1000, (5, 7), generator=torch.Generator().manual_seed(1))
    rows = ["b", "a", "__base__", "c", "a"]
    peft_mixed = _logits(peft, ids, rows)
    alone = []
    for i, name in enumerate(rows):
        if name == "__base__":
            with peft.disable_adapter():
                alone.append(_logits(peft, ids[i : i + 1])[0])
        else:
            peft.set_adapter(name)
            alone.append(_logits(peft, ids[i : i + 1])[0])
    assert mixed_lora.install(peft) == 2 * len(TARGETS)  # 2 layers of the tiny model
    calls = _lora_a_calls(peft)
    stacked = _logits(peft, ids, rows)
    assert calls[0] == 0
    torch.testing.assert_close(stacked, peft_mixed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stacked, torch.stack(alone), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(alone[0], alone[1], atol=1e-3)  # the adapters differ: the check can fail


def test_adapters_with_a_bias_keep_peft_s_own_mixed_batch(tiny_model_dir):
    """LoRA with a bias on B (`lora_bias`) is not what the stacked path computes: those layers
    take PEFT's path, with PEFT's results."""
    peft = _peft_model(tiny_model_dir, ["a", "b"], lora_bias=True)
    ids = torch.randint(3, 1000, (2, 5), generator=torch.Generator().manual_seed(2))
    expected = _logits(peft, ids, ["a", "b"])
    mixed_lora.install(peft)
    calls = _lora_a_calls(peft)
    torch.testing.assert_close(_logits(peft, ids, ["a", "b"]), expected)
    assert calls[0] > 0


def test_the_caches_are_bounded_and_forget_empties_them(tiny_model_dir, monkeypatch):
    peft = _peft_model(tiny_model_dir, ["a", "b", "c"])
    mixed_lora.install(peft)
    monkeypatch.setattr(mixed_lora, "SELECTIONS", 3)
    ids = torch.randint(3, 1000, (2, 4), generator=torch.Generator().manual_seed(3))
    for rows in (["a", "b"], ["b", "c"], ["a", "c"], ["c", "a"], ["b", "a"]):
        _logits(peft, ids, rows)
    layers = mixed_lora.lora_linears(peft)
    assert all(len(layer._grpo_flyte_stacks) == mixed_lora.STACKS_PER_LAYER for layer in layers)
    assert len(mixed_lora._selections) == 3
    mixed_lora.forget(peft)
    assert not any("_grpo_flyte_stacks" in layer.__dict__ for layer in layers) and not mixed_lora._selections


@pytest.fixture
def adapter_dirs(tmp_path, tiny_model_dir):
    peft = _peft_model(tiny_model_dir, ["a", "b"])
    dirs = []
    for name in ("a", "b"):
        peft.set_adapter(name)
        peft.save_pretrained(str(tmp_path / "saved"), selected_adapters=[name])
        dirs.append(str(tmp_path / "saved" / name))
    return dirs


def test_the_transformers_engine_decodes_a_mixed_batch_as_each_adapter_alone(tiny_model_dir, adapter_dirs):
    """HFGenerator loads two adapters, its LoRA layers take the stacked path, and a mixed batch
    gives each group the tokens and log-probs of its adapter's batch alone."""
    engine = HFGenerator(str(tiny_model_dir), "float32", max_adapters=4)
    requests = [
        SamplingRequest(prompt_ids=[1, 5, 9, 13], group_size=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=seed) for seed in (7, 8)
    ]
    alone = [engine.generate_many([r], path)[0] for r, path in zip(requests, adapter_dirs, strict=True)]
    assert all("_mixed_batch_forward" in layer.__dict__ for layer in mixed_lora.lora_linears(engine.model))
    mixed = engine.generate_mixed(requests, adapter_dirs)
    for group, lone in zip(mixed, alone, strict=True):
        assert [r.completion_ids for r in group] == [r.completion_ids for r in lone]
        for r, s in zip(group, lone, strict=True):
            assert r.sampling_logprobs == pytest.approx(s.sampling_logprobs, abs=1e-5)
