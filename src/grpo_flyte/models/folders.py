"""This module finds where a base model comes from: a local folder or a Hub id, checked before a run
starts (its files, its weights, the LoRA target modules it has), and the name an adapter's card
gives it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from grpo_flyte.config.constants import EMBEDDED_MODEL
from grpo_flyte.errors import ModelError
from grpo_flyte.models.embedded import EMBEDDED_HUB_ID, embedded_model_dir

logger = logging.getLogger(__name__)


# The files of a model repo a run needs: config, weights as safetensors, tokenizer, chat template.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
# The files the checks before a cluster run read (config, tokenizer, chat template): no weights.
CHECK_FILES = [pattern for pattern in MODEL_FILES if pattern != "*.safetensors"]


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


def check_model_folder(model_dir: Path, field: str = "model", weights: bool = True):
    """A model folder's tokenizer, once the folder is checked usable: its weights are there (with
    `weights`; a Hub repo's `CHECK_FILES` have none, the cluster fetches them) and its tokenizer
    loads; else a one-line ModelError naming the option (a folder with only config.json fails in
    the tokenizer library with 40 lines, or when the weights load, mid-run)."""
    from transformers import AutoTokenizer

    if weights and not any(next(model_dir.glob(pattern), None) for pattern in WEIGHT_FILES):
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


def hub_check_files(repo_id: str, field: str = "model") -> Path:
    """A Hub repo's `CHECK_FILES` (config, tokenizer; no weights) in the Hugging Face cache, for
    the checks before a cluster run (whose pods fetch the whole repo). The Hub's own error when it
    cannot be read; a ModelError when the repo has no config.json."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id, allow_patterns=CHECK_FILES))
    if not (folder / "config.json").is_file():
        raise ModelError(f"{repo_id!r}: the repo has no config.json (expected a transformers model repo)", field=field)
    return folder


ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer


def lora_target_problem(model_dir: Path, targets: tuple[str, ...], shown: str | None = None) -> str | None:
    """Why LoRA cannot go on `targets` in this model (None: it can), found without loading its
    weights (the model is built on the meta device from its config), naming the model `shown`
    (default: its folder's name). A target matches a linear layer named like it or ending in
    '.<target>', as PEFT matches them; 'all-linear' matches every linear layer but the output layer."""
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
            return f"{target!r} names no linear layer of {shown or model_dir.name}; expected some of {', '.join(known)}, or '{ALL_LINEAR}'"
    return None


def shareable_base(model: str) -> str:
    """The base model a saved adapter names, for others to load: the Hub id when there is one
    (for 'embedded', the repo it was quantized from), else the local directory."""
    if model == EMBEDDED_MODEL:
        return EMBEDDED_HUB_ID
    return model if is_repo_id(model) else str(Path(model).expanduser().resolve())


# A model's position limit, by the config.json keys vLLM 0.32 reads (the smallest of those present;
# model_max_length, where the config sets it, wins), as vllm.config.model._get_and_verify_max_len.
_WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")  # fmt: skip
# RoPE types whose max_position_embeddings is already the stretched window: vLLM does not apply
# their `factor` to it again. Any other type with a factor (linear, dynamic) multiplies it.
_PRESCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}


def _rope_parameters(config: dict) -> list[dict]:
    """The config's RoPE settings (`rope_parameters`, or the older `rope_scaling`), one per layer
    type where they are nested."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        return []
    nested = [p for p in rope.values() if isinstance(p, dict) and p]
    return nested if nested and all(isinstance(v, dict) for v in rope.values()) else [rope]


def context_window(model_dir: Path) -> tuple[int, str] | None:
    """The longest sequence the model in `model_dir` takes, read from its config.json and
    tokenizer_config.json as vLLM 0.32 derives it (and refuses a longer max_model_len), and where it
    comes from; None when the config names no limit.

    window = min(the config's position keys (`_WINDOW_KEYS`), the tokenizer's model_max_length)
    x factor, where the config sets a RoPE scaling whose type stretches it (linear, dynamic)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config") or config
    found = {key: config[key] for key in _WINDOW_KEYS if isinstance(config.get(key), int) and config[key] > 0}
    if not found:
        return None
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.__getitem__)
    window, source = found[key], f"{key} in its config.json"
    tokenizer_config = model_dir / "tokenizer_config.json"
    limit = json.loads(tokenizer_config.read_text()).get("model_max_length") if tokenizer_config.is_file() else None
    if isinstance(limit, int) and limit < window:
        window, source = limit, "model_max_length in its tokenizer_config.json"
    factor = 1.0
    if "gemma3" not in str(config.get("model_type", "")):
        for rope in _rope_parameters(config):
            if rope.get("rope_type", rope.get("type")) not in _PRESCALED_ROPE:
                factor = rope.get("factor") or factor
    if factor != 1.0:
        window, source = int(window * factor), f"{source}, x{factor:g} by its RoPE scaling"
    return window, source


def context_problem(model_dir: Path, tokens: int) -> str | None:
    """Why a context of `tokens` tokens does not fit the model in `model_dir` (`context_window`),
    or None. A config.json that sets model_max_length at least `tokens` passes, as vLLM lets it."""
    import json

    window = context_window(model_dir)
    if window is None or tokens <= window[0]:
        return None
    config = json.loads((model_dir / "config.json").read_text())
    stated = (config.get("text_config") or config).get("model_max_length")
    if isinstance(stated, int) and tokens <= stated:
        return None
    return (
        f"{tokens} tokens; expected at most the model's window, {window[0]} tokens ({window[1]}): a shorter context, or, for a "
        "model whose window can be stretched, its RoPE scaling set in its config.json (docs/configuration.md#context-longer-than-the-model)"
    )
