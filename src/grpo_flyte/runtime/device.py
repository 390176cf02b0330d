"""This module decides the device and dtype this process computes with: whether CUDA is usable (and
an error where a GPU was promised but CUDA is not), where a model loads, and what `dtype: auto`
means here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from grpo_flyte.errors import DeviceError


def fast_bfloat16() -> bool:
    """Whether bfloat16 matmuls are fast here: on a CUDA GPU that supports them, or on a CPU whose
    oneDNN kernels do (AVX-512 or AMX). Without those, torch falls back to a reference bfloat16
    GEMM, far slower than float32, so 'auto' picks float32 there (docs/measurements.md#measured)."""
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
# The loaded NVIDIA kernel module's version, as the driver reports it ("... Kernel Module  580.65.06 ...").
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def _driver_version() -> str:
    """This node's NVIDIA driver version (NVIDIA_DRIVER_FILE), or 'none found'."""
    if not NVIDIA_DRIVER_FILE.is_file():
        return "none found"
    # "Kernel Module  535.104.05" or, for the open module, "Open Kernel Module for x86_64  580.65.06"
    found = re.search(r"Kernel Module.*?\s(\d+(?:\.\d+)+)\s", NVIDIA_DRIVER_FILE.read_text())
    return found.group(1) if found else "unreadable"


def _no_cuda_error(found: str) -> DeviceError:
    import torch

    return DeviceError(
        f"this task was given a GPU ({REQUIRE_CUDA_ENV}=1) but CUDA is not usable: torch {torch.__version__} "
        f"{'is built for CUDA ' + torch.version.cuda if torch.version.cuda else 'has no CUDA (a CPU build)'}; the image's "
        f"CUDA 13 needs NVIDIA driver >= {CUDA_DRIVER_NEEDED} (this node's driver: {found}); run the GPU pools on "
        f"nodes with driver >= {CUDA_DRIVER_NEEDED}"
    )


def cuda_available() -> bool:
    """Whether torch can use a GPU here; DeviceError where a GPU is required (REQUIRE_CUDA_ENV) but
    CUDA is unusable (no GPU, or a driver older than the CUDA torch was built for)."""
    import torch

    if torch.cuda.is_available():
        return True
    if os.environ.get(REQUIRE_CUDA_ENV) == "1":
        raise _no_cuda_error(_driver_version())
    return False


def check_driver() -> None:
    """DeviceError where a GPU is required (REQUIRE_CUDA_ENV) but this node has no NVIDIA driver or
    one older than CUDA_DRIVER_NEEDED: `cuda_available`'s check, read from the driver's file without
    touching CUDA. For the vLLM backend: a CUDA call in this process before vLLM starts would make
    vLLM's forked engine process fail ("Cannot re-initialize CUDA in forked subprocess")."""
    if os.environ.get(REQUIRE_CUDA_ENV) != "1":
        return
    found = _driver_version()
    major = found.split(".")[0]
    if not major.isdigit() or int(major) < int(CUDA_DRIVER_NEEDED):
        raise _no_cuda_error(found)


def best_device() -> str:
    return "cuda" if cuda_available() else "cpu"


def load_device():
    """Where this process loads a model: its current GPU (a data-parallel process has set its own),
    or the CPU."""
    import torch

    return torch.cuda.current_device() if best_device() == "cuda" else "cpu"
