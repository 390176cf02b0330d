"""This module writes a merged transformers model folder as one GGUF file (what llama.cpp, Ollama
and LM Studio load), with the `gguf` package, and finds the GGUF a folder holds.

What goes into the file:

- the tensors under llama.cpp's names, from the `gguf` package's own table
  (`gguf.get_tensor_name_map`), never a table of ours; a tied output (SmolLM2's lm_head is its
  embedding) is left out, as llama.cpp expects. LLaMA's q_proj and k_proj rows are reordered for
  llama.cpp's rotary layout: each head's rows, split into halves [h0 | h1] (HF's rotate_half
  pairs), are interleaved as pairs, W.reshape(heads, 2, d / 2, in).swapaxes(1, 2) with d the
  head dimension (transformers' GGUF loader undoes exactly this, `_reverse_permute_weights`);
- one-dimensional tensors (norms, biases) in float32, every other tensor in the chosen type
  (`QUANT_TYPES`), quantized by `gguf.quants.quantize` in numpy; a tensor whose rows do not split
  into the type's blocks stays float16;
- the hyper-parameters llama.cpp reads (`{arch}.context_length`, `embedding_length`,
  `block_count`, `feed_forward_length`, `attention.head_count`, `head_count_kv`,
  `layer_norm_rms_epsilon`, `rope.dimension_count`, `rope.freq_base`, `vocab_size`) and
  `general.file_type`;
- the tokenizer: a byte-level BPE (`tokenizer.ggml.model` "gpt2"): every token in id order with its
  type (control for special added tokens, user-defined for other added ones, unused for ids the
  vocabulary leaves empty), the merges, the special ids, add_bos and the chat template
  (`gguf.vocab.SpecialVocab`), and the pre-tokenizer's name (`tokenizer.ggml.pre`) where this
  tokenizer's splitting has one (`pre_tokenizer_name`).

Models: the LLaMA and Qwen2 architectures with a byte-level BPE tokenizer (SmolLM2, Llama 3
without rope scaling, Qwen2 and 2.5); any other (a SentencePiece tokenizer as Llama 2's, another
architecture, rope scaling) is refused in one line that points at llama.cpp's convert_hf_to_gguf.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from grpo_flyte.config.constants import GGUFQuant
from grpo_flyte.errors import UserError

logger = logging.getLogger(__name__)

# The types `--quant` takes: those the gguf package writes from numpy (f32 and f16 by dtype, the
# rest by gguf.quants.quantize). The k-quants (Q4_K_M, ...) and i-quants need llama.cpp's
# llama-quantize (the package can only read them).
QUANT_TYPES: tuple[str, ...] = get_args(GGUFQuant)
# f16 by default: the weights of a 16-bit base as they are (a bf16 value within f16's range is
# exact in f16), read by every llama.cpp build and by transformers; the quantized types trade
# answers for size and are checked like any other export.
DEFAULT_QUANT = "f16"
CONVERTER = "llama.cpp's convert_hf_to_gguf.py (https://github.com/ggml-org/llama.cpp)"


@dataclass(frozen=True)
class Architecture:
    gguf_name: str  # gguf.MODEL_ARCH's member
    permute_qk: bool  # llama.cpp's rotary layout for q_proj / k_proj


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("LLAMA", permute_qk=True),
    "Qwen2ForCausalLM": Architecture("QWEN2", permute_qk=False),
}


def gguf_name(quant: str) -> str:
    """The GGUF form's file name for `quant` (in its folder gguf-<quant>/)."""
    return f"model-{quant}.gguf"


def check_quant(quant: str) -> str:
    """`quant` if `--quant` takes it, else a UserError naming it and the choices."""
    if quant not in QUANT_TYPES:
        raise UserError(f"--quant {quant!r} is not a type the GGUF export writes; choose one of {', '.join(QUANT_TYPES)}")
    return quant


def quant_type(quant: str):
    """The gguf package's (GGMLQuantizationType, LlamaFileType) for a `--quant` value."""
    import gguf

    name = check_quant(quant).upper()
    file_type = gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType[f"MOSTLY_{name}"]
    return gguf.GGMLQuantizationType[name], file_type


def architecture_of(config: dict) -> Architecture:
    """The architecture a model folder's config.json names, or a UserError naming it."""
    names = config.get("architectures") or [config.get("model_type", "unknown")]
    found = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if found is None:
        raise UserError(
            f"the GGUF export writes {', '.join(sorted(ARCHITECTURES))}, not {', '.join(names)}; "
            f"convert the merged folder (export --to merged) with {CONVERTER}"
        )
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(
            f"the GGUF export writes models without rope scaling, not rope_type {rope_type!r}; "
            f"convert the merged folder (export --to merged) with {CONVERTER}"
        )
    return found


def check_model(folder: Path) -> Architecture:
    """The architecture of the model folder `folder`, if this module writes it and its tokenizer
    (else a UserError)."""
    folder = Path(folder)
    architecture = architecture_of(json.loads((folder / "config.json").read_text()))
    check_tokenizer(json.loads((folder / "tokenizer.json").read_text()) if (folder / "tokenizer.json").is_file() else {})
    return architecture


def check_tokenizer(tokenizer_json: dict) -> None:
    """A UserError unless `tokenizer_json` (a tokenizer.json) is a byte-level BPE (GPT-2's kind)."""
    model, decoder = tokenizer_json.get("model") or {}, tokenizer_json.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        kind = f"{model.get('type', 'no tokenizer.json')} with a {decoder.get('type', 'no')} decoder"
        raise UserError(f"the GGUF export writes byte-level BPE tokenizers (GPT-2's kind), not {kind}; convert with {CONVERTER}")


def permute_qk(weight, heads: int):
    """llama.cpp's rotary layout of a q_proj or k_proj weight (out, in) with `heads` heads:
    out = heads * d rows; per head, rows [0, d/2) and [d/2, d) are interleaved, row 2i from the
    first half and row 2i + 1 from the second (the inverse of transformers' `_reverse_permute_weights`)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for this tokenizer's splitting (`tokenizer.ggml.pre`): "gpt-2" for GPT-2's
    own (a ByteLevel pre-tokenizer with its regex), else the name transformers' GGUF loader gives a
    Split regex followed by a plain ByteLevel (its table, read backwards); None where neither fits."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        return None
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    regex = (steps[0].get("pattern") or {}).get("Regex")
    return next((name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), None)


def _add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tokenizer's metadata: tokens and types, merges, special ids, add_bos, chat template."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    check_tokenizer(tokenizer_json)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # the embedding's rows; ids the tokenizer lacks are unused padding
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    pre = pre_tokenizer_name(tokenizer_json)
    if pre is None:
        logger.warning("no llama.cpp pre-tokenizer name for this tokenizer's splitting: llama.cpp will split text its default way")
    else:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:
        ids = tokenizer("x")["input_ids"]
        writer.add_add_bos_token(bool(ids) and ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id is not None)
    if special.chat_template is None and tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _add_hparams(writer, config: dict, file_type) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _weights(folder: Path):
    """(name, float32 numpy array) for every tensor of the folder's safetensors files."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{str(folder)!r} holds no .safetensors weights to write as GGUF")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()


def write_gguf(folder: Path, out: Path, quant: str = DEFAULT_QUANT, *, permute: bool = True) -> None:
    """Write the transformers model `folder` (a merged model: config.json, safetensors, the
    tokenizer) as the GGUF file `out` with its 2-D tensors in `quant`. `permute` False leaves q/k
    in HF's layout (a damaged file: what the export's check must catch)."""
    import gguf

    tensor_type, file_type = quant_type(quant)
    config = json.loads((folder / "config.json").read_text())
    arch = check_model(folder)
    model_arch = gguf.MODEL_ARCH[arch.gguf_name]
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_name(config.get("_name_or_path") or folder.name)
    _add_hparams(writer, config, file_type)
    _add_tokenizer(writer, folder, config["vocab_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, weight in _weights(folder):
        if name == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(f"tensor {name!r} of {folder} has no GGUF name for {arch.gguf_name.lower()}; convert with {CONVERTER}")
        if arch.permute_qk and permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = permute_qk(weight, heads if "q_proj" in name else kv_heads)
        data, raw_dtype = _encoded(weight, tensor_type)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _encoded(weight, tensor_type):
    """(data, raw_dtype) for `add_tensor`: 1-D tensors in float32, others in `tensor_type` where
    their rows split into its blocks, else float16."""
    import gguf
    import numpy as np

    if weight.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
        return weight.astype(np.float32), gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    if weight.shape[-1] % block:
        tensor_type = gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(weight, tensor_type), tensor_type


def gguf_in(folder: str | Path) -> str | None:
    """The name of the one .gguf file a folder without config.json holds (an exported GGUF form, as
    the engine loads it: `from_pretrained(folder, gguf_file=name)`); None otherwise."""
    folder = Path(folder)
    if (folder / "config.json").exists() or not folder.is_dir():
        return None
    files = sorted(folder.glob("*.gguf"))
    return files[0].name if len(files) == 1 else None
