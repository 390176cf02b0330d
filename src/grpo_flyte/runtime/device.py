"""This module decides the device and dtype this process computes with: whether CUDA is usable (and
an error where a GPU was promised but CUDA is not), where a model loads, and what `dtype: auto`
means here.

The probes leave CUDA alone in this process. A CUDA runtime call (`torch.cuda.is_available()` is
one) makes torch mark a later fork as poisoned: a forked child that touches CUDA fails with "Cannot
re-initialize CUDA in forked subprocess", and vLLM forks its engine process unless CUDA is already
initialized here (a poisoned but uninitialized process is the case its check cannot see: vLLM
#15681). So the probes ask the NVIDIA driver's management library (NVML: the GPUs, their compute
capability, the newest CUDA the driver runs), which is safe across a fork, and use CUDA itself only
where CUDA is already initialized or NVML cannot answer. The vLLM engine starts its processes by
spawn besides (`engine.vllm_generator.VLLM_START_METHOD`), so whatever else touched CUDA first
cannot break it either.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_flyte.errors import DeviceError

# The compute capability from which a GPU computes bfloat16 natively (Ampere, 8.0). Older GPUs
# emulate it, far slower than float32, and vLLM refuses bfloat16 there.
BF16_COMPUTE_CAPABILITY = (8, 0)
NVML_LIBRARY = "libnvidia-ml.so.1"


@dataclass(frozen=True)
class DriverView:
    """What NVML says about this machine: the newest CUDA version its driver runs, and each GPU's
    compute capability in NVML's order (all GPUs, whatever CUDA_VISIBLE_DEVICES hides)."""

    cuda_version: tuple[int, int]
    capabilities: tuple[tuple[int, int], ...]


def nvml_view() -> DriverView | None:
    """This machine's `DriverView`, read through NVML without initializing CUDA in this process;
    None where NVML cannot answer (no NVIDIA driver, no library, a call that fails)."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        version, count = ctypes.c_int(), ctypes.c_uint()
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) or nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)):
            return None
        capabilities = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) or nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            ):
                return None
            capabilities.append((major.value, minor.value))
    finally:
        nvml.nvmlShutdown()  # NVML counts its inits: this ends only ours
    # 13000 -> (13, 0)
    return DriverView((version.value // 1000, version.value % 1000 // 10), tuple(capabilities))


def _cuda_usable() -> bool:
    """Whether torch can use a GPU here, asked without a CUDA call where NVML answers: a GPU
    visible to this process and a driver that runs torch's CUDA major version (what the CUDA
    runtime's own check, `cudaGetDeviceCount`, tests). Within a major version a driver runs a
    newer minor one (CUDA's minor version compatibility)."""
    import torch

    if torch.cuda.is_initialized():
        return True
    if torch.version.cuda is None:  # a CPU build, or ROCm's
        return bool(torch.version.hip) and torch.cuda.is_available()
    view = nvml_view()
    if view is None:
        # The CUDA runtime's answer: it poisons fork, which vLLM's spawned engine process does not mind.
        return torch.cuda.is_available()
    # device_count() counts through NVML too (CUDA_VISIBLE_DEVICES applied); only where NVML cannot
    # map those devices (MIG names) does it fall back to the runtime.
    return view.cuda_version[0] >= int(torch.version.cuda.split(".")[0]) and torch.cuda.device_count() > 0


def _compute_capability() -> tuple[int, int]:
    """The compute capability of this process's first GPU (CUDA_VISIBLE_DEVICES applied), from NVML
    where CUDA is not initialized here; call only where `_cuda_usable()`."""
    import torch

    view = None if torch.cuda.is_initialized() else nvml_view()
    if view is None or not view.capabilities:
        return torch.cuda.get_device_capability()
    try:
        # torch's own map of CUDA_VISIBLE_DEVICES (indices or UUIDs) to NVML's numbering
        return view.capabilities[torch.cuda._get_nvml_device_index(0)]
    except (AttributeError, RuntimeError, IndexError, ValueError):  # a private API; MIG names it cannot map
        return min(view.capabilities)


def fast_bfloat16() -> bool:
    """Whether bfloat16 matmuls are fast here: on a CUDA GPU of compute capability 8.0 or newer
    (BF16_COMPUTE_CAPABILITY), or on a CPU whose oneDNN kernels do (AVX-512 or AMX). Without those,
    torch falls back to an emulated or reference bfloat16 GEMM, far slower than float32, so 'auto'
    picks float32 there (docs/measurements.md#measured). Leaves CUDA uninitialized here."""
    import torch

    if _cuda_usable():
        return bool(torch.version.hip) or _compute_capability() >= BF16_COMPUTE_CAPABILITY
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
    if _cuda_usable():
        return True
    if os.environ.get(REQUIRE_CUDA_ENV) == "1":
        raise _no_cuda_error(_driver_version())
    return False


def check_driver() -> None:
    """DeviceError where a GPU is required (REQUIRE_CUDA_ENV) but this node has no NVIDIA driver or
    one older than CUDA_DRIVER_NEEDED: `cuda_available`'s check, read from the driver's file without
    touching CUDA or NVML (the module's docstring says why CUDA is left alone)."""
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
