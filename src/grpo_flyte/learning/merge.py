"""This module merges the adapter into its base: one plain transformers model folder, for serving
without PEFT."""

from __future__ import annotations

import shutil
from pathlib import Path

# The merged model's largest file: saving copies one file's tensors to the CPU at a time.
MERGE_SHARD_SIZE = "2GB"
# What a server reads beside the weights: the tokenizer, its chat template and the generation settings.
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def copy_serving_files(model_path: str | Path, out: Path) -> None:
    """The base's tokenizer files, chat template and generation config, where it has them and
    `out` has not (what the merge saved itself is what the check must see)."""
    model_path = Path(model_path)
    for name in SERVING_FILES:
        if (model_path / name).is_file() and not (out / name).exists():
            shutil.copy2(model_path / name, out / name)


def merge_into_base(model_path: str, adapter_path: str, out: Path) -> None:
    """Save base + LoRA as one plain transformers model folder (weights in the base's own dtype).

    The base loads in its own dtype straight onto this process's device (the train pool's GPU), so
    the merge needs one copy of the 16-bit base in GPU memory and none in the pod's memory (a
    float32 copy on the CPU, 12 GB for a 3B base, did not fit the train pod). PEFT adds each
    layer's update B @ A (computed from its float32 LoRA weights) to the weight in that dtype; the
    folder is written in shards of at most `MERGE_SHARD_SIZE`, each copied to the CPU on its own.
    The tokenizer is saved alongside, and the base's serving files the save left out (a
    generation config: `copy_serving_files`).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_flyte.runtime.device import load_device

    saved = AutoConfig.from_pretrained(model_path)
    dtype = getattr(saved, "dtype", None) or getattr(saved, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map={"": load_device()})
    merged = PeftModel.from_pretrained(base, adapter_path).merge_and_unload()
    merged.save_pretrained(str(out), max_shard_size=MERGE_SHARD_SIZE)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(str(out))
    copy_serving_files(model_path, out)
