"""The GGUF writer: llama.cpp's q/k layout and its inverse, the tensors, types and metadata of a
written file read back with the gguf package, and the clear refusals (an unknown type, an
architecture or rope scaling it does not write)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grpo_flyte.errors import UserError
from grpo_flyte.models import gguf_writer
from grpo_flyte.models.gguf_writer import QUANT_TYPES, architecture_of, permute_qk, pre_tokenizer_name, quant_type


def test_q_and_k_rows_are_interleaved_per_head_and_transformers_undoes_it():
    # one head of dimension 4, one input: rows [0, 1 | 2, 3] (HF's halves) become [0, 2, 1, 3]
    assert permute_qk(np.arange(4.0).reshape(4, 1), heads=1).ravel().tolist() == [0.0, 2.0, 1.0, 3.0]
    # two heads of dimension 4: each head on its own
    assert permute_qk(np.arange(8.0).reshape(8, 1), heads=2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.random.default_rng(0).standard_normal((16, 6))  # k_proj: 2 kv heads of 8 (4 query heads)
    processor = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    back = processor.process(permute_qk(weight, heads=2), "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(back, weight)


def test_unknown_quant_architecture_and_rope_scaling_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"^--quant 'q4_k_m' is not a type the GGUF export writes; choose one of f32, f16, bf16, q8_0, "):
        quant_type("q4_k_m")
    assert [quant_type(q)[0].name for q in QUANT_TYPES] == ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]
    with pytest.raises(UserError) as refused:
        architecture_of({"architectures": ["GPT2LMHeadModel"]})
    assert str(refused.value).startswith("the GGUF export writes LlamaForCausalLM, Qwen2ForCausalLM, not GPT2LMHeadModel; ")
    assert "convert_hf_to_gguf.py" in str(refused.value)
    with pytest.raises(UserError, match="not rope_type 'llama3'"):
        architecture_of({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})
    assert architecture_of({"architectures": ["LlamaForCausalLM"], "rope_scaling": None}).permute_qk
    sentencepiece = {"model": {"type": "BPE", "byte_fallback": True}, "decoder": {"type": "Sequence"}}  # Llama 2's
    with pytest.raises(UserError, match=r"writes byte-level BPE tokenizers \(GPT-2's kind\), not BPE with a Sequence decoder; "):
        gguf_writer.check_tokenizer(sentencepiece)
    gguf_writer.check_tokenizer({"model": {"type": "BPE"}, "decoder": {"type": "ByteLevel"}})


def test_the_pre_tokenizer_is_named_as_llama_cpp_names_it():
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == "gpt-2"
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    qwen2 = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZER_SPLITS["qwen2"]}}, {"type": "ByteLevel"}],
    }
    assert pre_tokenizer_name({"pre_tokenizer": qwen2}) == "qwen2"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel"}]}
    assert pre_tokenizer_name({"pre_tokenizer": digits}) is None


def test_a_written_file_holds_llama_cpps_tensors_types_and_metadata(tiny_model_dir, tmp_path):
    import gguf
    from safetensors.numpy import load_file

    out = tmp_path / "model-q8_0.gguf"
    gguf_writer.write_gguf(tiny_model_dir, out, "q8_0")
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    # 2 blocks x (4 attention + 3 MLP + 2 norms) + the embedding and the final norm; the tied output left out
    assert len(tensors) == 2 * 9 + 2 and "output.weight" not in tensors and "token_embd.weight" in tensors
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    field = {
        k: f.contents()
        for k, f in reader.fields.items()
        if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    }
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert field["general.architecture"] == "llama" and field["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert (field["llama.block_count"], field["llama.embedding_length"], field["llama.feed_forward_length"]) == (2, 32, 64)
    assert (field["llama.attention.head_count"], field["llama.attention.head_count_kv"], field["llama.rope.dimension_count"]) == (4, 2, 8)
    assert field["llama.vocab_size"] == config["vocab_size"] and field["llama.context_length"] == 1024
    assert field["tokenizer.ggml.model"] == "gpt2" and field["tokenizer.ggml.pre"] == "gpt-2"
    assert (field["tokenizer.ggml.bos_token_id"], field["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert field["tokenizer.ggml.add_bos_token"] is False
    assert field["tokenizer.chat_template"] == (tiny_model_dir / "chat_template.jinja").read_text()
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert reader.fields["tokenizer.ggml.token_type"].contents()[:1] == [gguf.TokenType.CONTROL]
    # q_proj read back: dequantized and un-permuted, it is the model's own within Q8_0's step (max |w| / 127 a block)
    hf = load_file(str(tiny_model_dir / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    q = gguf.dequantize(tensors["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0).reshape(hf.shape)
    unpermuted = q.reshape(4, 4, 2, 32).swapaxes(1, 2).reshape(hf.shape)
    assert np.abs(unpermuted - hf).max() <= np.abs(hf).max() / 127
    assert np.abs(q - hf).max() > 10 * np.abs(hf).max() / 127  # in the file's own order it is not


def test_a_tensor_whose_rows_do_not_split_into_blocks_stays_float16():
    import gguf

    _, kind = gguf_writer._encoded(np.ones((3, 40), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    assert kind == gguf.GGMLQuantizationType.F16
    data, kind = gguf_writer._encoded(np.ones((3, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    assert kind == gguf.GGMLQuantizationType.Q4_0 and data.dtype == np.uint8 and data.shape == (3, 2 * 18)
    assert gguf_writer._encoded(np.ones(5, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)[1] == gguf.GGMLQuantizationType.F32


def test_a_qwen2_model_is_read_back_by_transformers_with_its_biases(embedded_dir, tmp_path):
    """Qwen2 (q/k/v biases, no q/k reordering in llama.cpp's layout): the file's logits are the model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()  # Qwen2's biases start at zero; a bias lost or misplaced must show
    folder = tmp_path / "qwen2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "file").mkdir()
    gguf_writer.write_gguf(folder, tmp_path / "file" / "model-f16.gguf", "f16")
    read = AutoModelForCausalLM.from_pretrained(tmp_path / "file", gguf_file="model-f16.gguf")
    assert read.config.model_type == "qwen2" and not read.config.tie_word_embeddings
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = read(ids).logits, model(ids).logits
    assert (ours - theirs).abs().max() < 1e-2 and torch.equal(ours.argmax(-1), theirs.argmax(-1))
