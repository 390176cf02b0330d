"""grpo_flyte.runtime.device: the device and dtype probes read the GPU through NVML and leave CUDA
alone in this process (a CUDA runtime call would poison vLLM's forked engine process)."""

from __future__ import annotations

import ctypes

import pytest

from grpo_flyte.errors import DeviceError
from grpo_flyte.runtime import device
from grpo_flyte.runtime.device import DriverView


@pytest.fixture
def cuda_machine(monkeypatch):
    """This CPU build of torch made to look like a CUDA 13 build on a machine with one GPU, whose
    CUDA runtime calls fail the test: the runtime's device count (`torch.cuda.is_available()`
    calls it, and it poisons fork) and CUDA's initialization (`is_bf16_supported`,
    `get_device_capability`). Torch's own NVML count answers 1 GPU; `view` is what NVML says."""
    import torch

    def cuda_call(*args):
        raise AssertionError("a CUDA runtime call in the process that starts vLLM")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_call, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", cuda_call)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # importing vLLM sets it (vllm/env_override.py), and a test before may have: torch's own
    # is_available() would then count through NVML too
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delenv(device.REQUIRE_CUDA_ENV, raising=False)
    view = {"now": DriverView((13, 0), ((9, 0),))}  # an H100 under a CUDA 13 driver
    monkeypatch.setattr(device, "nvml_view", lambda: view["now"])
    return view


def test_the_probes_find_the_gpu_and_its_dtype_without_a_cuda_call(cuda_machine):
    """What a generate task asks before vLLM builds its engine: the backend's GPU, the dtype of
    'auto', 'bfloat16' and 'float32'. None of it may call CUDA (the fixture fails such a call), and
    CUDA stays uninitialized. Before, `torch.cuda.is_available()` did, and vLLM's forked engine
    process failed with --dtype bfloat16 or float32."""
    import torch

    assert device.cuda_available() and device.best_device() == "cuda"
    assert [device.resolve_dtype(name) for name in ("auto", "bfloat16", "float32")] == ["bfloat16", "bfloat16", "float32"]
    assert device.torch_dtype("auto") is torch.bfloat16
    assert not torch.cuda.is_initialized()


def test_auto_is_float32_below_compute_capability_8(cuda_machine):
    """A T4 (7.5) emulates bfloat16, slower than float32, and vLLM refuses bfloat16 there."""
    cuda_machine["now"] = DriverView((13, 0), ((7, 5),))
    assert device.cuda_available() and device.resolve_dtype("auto") == "float32"
    cuda_machine["now"] = DriverView((13, 0), ((8, 0),))  # an A100
    assert device.resolve_dtype("auto") == "bfloat16"


def test_the_first_visible_gpu_decides_auto(cuda_machine, monkeypatch):
    """NVML numbers every GPU; CUDA_VISIBLE_DEVICES picks which this process uses."""
    cuda_machine["now"] = DriverView((13, 0), ((7, 5), (9, 0)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert device.resolve_dtype("auto") == "bfloat16"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert device.resolve_dtype("auto") == "float32"


def test_a_driver_older_than_torchs_cuda_is_no_cuda_and_an_error_where_a_gpu_was_given(cuda_machine, monkeypatch):
    """A CUDA 12.4 driver cannot run torch's CUDA 13 (cudaGetDeviceCount finds no device there);
    read from NVML, the same answer, and on a GPU pool the one-line error."""
    cuda_machine["now"] = DriverView((12, 4), ((9, 0),))
    assert not device.cuda_available() and device.best_device() == "cpu"
    monkeypatch.setenv(device.REQUIRE_CUDA_ENV, "1")
    with pytest.raises(DeviceError, match=r"CUDA 13 needs NVIDIA driver >= 580"):
        device.cuda_available()
    cuda_machine["now"] = DriverView((13, 1), ((9, 0),))  # a newer minor version runs it
    assert device.cuda_available()


def test_without_nvml_the_cuda_runtime_answers(cuda_machine, monkeypatch):
    """Where NVML cannot answer (no driver library) the probe falls back to torch's own check,
    which may poison fork: vLLM's engine process is spawned, so that does not break it."""
    import torch

    cuda_machine["now"] = None
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0, raising=False)
    assert not device.cuda_available()


class _FakeNvml:
    """libnvidia-ml as ctypes sees it: each call writes through its pointer arguments, returns 0."""

    def __init__(self, driver: int, capabilities: list[tuple[int, int]]):
        self.driver, self.capabilities, self.open = driver, capabilities, 0

    def nvmlInit_v2(self):
        self.open += 1
        return 0

    def nvmlShutdown(self):
        self.open -= 1
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, version):
        version._obj.value = self.driver
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.capabilities)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 1000 + index
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.capabilities[handle.value - 1000]
        return 0


def test_nvml_view_reads_the_driver_and_each_gpu(monkeypatch):
    nvml = _FakeNvml(13000, [(9, 0), (8, 6)])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: nvml)
    assert device.nvml_view() == DriverView((13, 0), ((9, 0), (8, 6)))
    assert nvml.open == 0  # every init it made is shut down
    nvml.driver = 12040
    assert device.nvml_view().cuda_version == (12, 4)

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)  # this machine: no NVIDIA driver
    assert device.nvml_view() is None
