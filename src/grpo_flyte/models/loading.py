"""This module loads a base model for training: in 16 bits or with its linear layers in NF4 (QLoRA),
straight onto its device, with the attention `grpo_flyte.models.attention` chooses; and lets the
models of one process that load the same frozen base hold one copy of its weights
(`share_frozen_weights`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import weakref

from grpo_flyte.models.attention import set_attention
from grpo_flyte.runtime import allocator
from grpo_flyte.runtime.device import best_device, load_device, torch_dtype


def quiet_bitsandbytes() -> None:
    """Before anything imports bitsandbytes (peft and transformers do when it is installed): keep
    its note at import that an optional faster CPU kernel (the `kernels` package, fetched from the
    Hub) is missing off the console; its own CPU kernels work."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def load_base(model_path: str, dtype: str, load_in_4bit: bool = False, embeddings_in_4bit: bool = False):
    """The base model for training, on `best_device`: in `dtype` or, with `load_in_4bit`, with its
    linear layers in NF4 (QLoRA: 4-bit NormalFloat, double quantization of the scales) computing in
    `dtype`, the 16-bit type; the embeddings, norms and output layer stay in `dtype`, unless
    `embeddings_in_4bit` (`nf4_embeddings`). Its attention is `set_attention`'s.

    The weights load straight onto the device (`load_device`), never whole into CPU memory first:
    the processes of a multi-GPU train step each load the base at once, in one pod."""
    quiet_bitsandbytes()
    from transformers import AutoModelForCausalLM

    model = (
        _load_4bit(model_path, dtype, embeddings_in_4bit)
        if load_in_4bit
        else AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype), device_map={"": load_device()})
    )
    set_attention(model, best_device())
    return model


# The frozen base weights this process holds, by (model folder, dtype, device): the parameters of the
# first model `share_frozen_weights` was given, by name, held weakly (they go with their model).
_frozen: dict[tuple[str, str, str], dict[str, weakref.ref]] = {}
_frozen_lock = threading.Lock()


def share_frozen_weights(model, model_path: str, dtype: str) -> int:
    """Make `model`'s parameters hold the same tensors as those of the first live model of the same
    folder, dtype and device given here before (which then keep their own); the number shared (0:
    `model` is the first, and later ones will share its weights).

    For models whose base weights nothing changes in place: the transformers engine's (inference,
    LoRA adapters beside the weights) and the trainer's (LoRA only; the merge loads a base of its
    own). In a local run both load the same base, and this keeps one copy of it instead of two (the
    embedded model in float32: 0.54 GB). Each model keeps its own `Parameter` objects (their
    requires_grad, their module); only the tensors behind them are one. Call it on a freshly loaded
    model, before PEFT wraps it: parameters are matched by name, shape, dtype and device, and a
    parameter with no match keeps its own tensor.
    """
    params = dict(model.named_parameters())
    if not params:
        return 0
    key = (model_path, dtype, str(next(iter(params.values())).device))
    with _frozen_lock:
        found = _frozen.get(key)
        donor = None if found is None else {name: ref() for name, ref in found.items()}
        if donor is None or any(p is None for p in donor.values()):
            _frozen[key] = {name: weakref.ref(p) for name, p in params.items()}
            return 0
    shared = 0
    for name, param in params.items():
        other = donor.get(name)
        if other is None or other is param or other.shape != param.shape or other.dtype != param.dtype or other.device != param.device:
            continue
        param.data = other.data
        shared += 1
    return shared


def _load_4bit(model_path: str, dtype: str, embeddings_in_4bit: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch_dtype(dtype),
    )
    # A 4-bit model cannot be moved after loading: it is placed as it loads (on this process's GPU).
    device = load_device()
    # Quantizing on a CPU leaves the 16-bit layers it read in the heap: handed back when it ends.
    with allocator.handing_back(oversized=device == "cpu"):
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), quantization_config=quantization, device_map={"": device}
        )
        if embeddings_in_4bit:
            nf4_embeddings(model, torch_dtype(dtype))
        if device == "cpu":
            _off_the_checkpoint(model)
            _keep_nf4_differentiable(model)
    return model


def _off_the_checkpoint(model) -> None:
    """Give the 16-bit weights of a 4-bit model loaded on a CPU (the embeddings, norms and output
    layer) memory of their own. As loaded they are views of the checkpoint file's memory map, which
    keeps the pages of the file that quantizing read resident: 0.31 GB of the embedded model's
    0.54 GB file, for its 0.11 GB of such weights."""
    import bitsandbytes as bnb

    for param in model.parameters():
        if not isinstance(param, bnb.nn.Params4bit):
            param.data = param.data.clone()


def nf4_embeddings(model, compute_dtype) -> None:
    """Put a 4-bit model's input embedding matrix and output layer in NF4 too (double quantization),
    in place; a tied output layer shares the embedding's 4-bit weight, as it shared the 16-bit one.

    The lookup dequantizes the matrix and indexes it (`_nf4_embedding`); the output layer is
    bitsandbytes' Linear4bit. Both are frozen: LoRA never targets them here."""
    import bitsandbytes as bnb

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight

    def packed(weight):
        return bnb.nn.Params4bit(weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True).to(weight.device)

    weight = packed(embedding.weight)
    model.set_input_embeddings(_nf4_embedding()(weight, embedding.padding_idx, compute_dtype))
    if head is not None:
        out = bnb.nn.Linear4bit(
            head.in_features, head.out_features, bias=head.bias is not None, compute_dtype=compute_dtype, quant_type="nf4"
        )
        out.weight = weight if tied else packed(head.weight)
        if head.bias is not None:
            out.bias = head.bias
        model.set_output_embeddings(out)


@functools.cache
def _nf4_embedding():
    """The embedding module of `nf4_embeddings` (a class made on first use: torch is imported lazily)."""
    import bitsandbytes as bnb
    import torch

    class NF4Embedding(torch.nn.Module):
        """An embedding matrix held as a bitsandbytes NF4 parameter: each lookup dequantizes it
        whole (a transient 16-bit copy, as bitsandbytes' 4-bit linear layers make per pass) and
        indexes it."""

        def __init__(self, weight, padding_idx: int | None, compute_dtype) -> None:
            super().__init__()
            self.weight, self.padding_idx, self.compute_dtype = weight, padding_idx, compute_dtype

        def forward(self, ids):
            matrix = bnb.functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(self.compute_dtype)
            return torch.nn.functional.embedding(ids, matrix, self.padding_idx)

    return NF4Embedding


def _keep_nf4_differentiable(model) -> None:
    """Turn off bitsandbytes' CPU inference repacking on every 4-bit layer. On a CPU with
    AVX512-BF16, bitsandbytes 0.50 repacks a layer's weights for a faster kernel the first time it
    runs in eval mode without gradients (the trainer's reference pass does), and from then on the
    layer passes no gradient to its input: the LoRA layers before it would silently stop learning
    (a test checks the gradients reach them). The repacking also requires output features in
    multiples of 32."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def require_packages(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} missing: pip install 'grpo-flyte[local]'")
