"""One sub-check of `device_check.py --fork-check`, in a fresh interpreter: a probe, then a child
process started by fork or spawn that touches CUDA, as vLLM starts its engine process.

    python benchmarks/_fork_check.py PROBE METHOD    # prints one JSON object

PROBE is what the process runs first (`PROBES`); METHOD is multiprocessing's start method of the
child. The child makes one CUDA tensor and reports "ok" or its error. After a CUDA runtime call
that leaves CUDA uninitialized (`torch.cuda.is_available()`), torch poisons fork and the forked
child fails ("Cannot re-initialize CUDA in forked subprocess"), which vLLM's choice of fork or
spawn cannot see (it asks `torch.cuda.is_initialized()`). Needs torch and grpo_flyte only (no
flyte, no transformers, no vLLM), so that it runs on any CUDA machine.
"""

from __future__ import annotations

import json
import multiprocessing
import sys


def _is_available():
    import torch

    return torch.cuda.is_available()


def _is_bf16_supported():
    import torch

    return torch.cuda.is_bf16_supported()  # what 'dtype: auto' called before issue 54: it initializes CUDA


def _grpo_flyte_device():
    from grpo_flyte.runtime.device import best_device

    return best_device()


def _grpo_flyte_dtype(name: str):
    """What a generate task resolves before its engine: the dtype, then the backend's device."""
    from grpo_flyte.runtime.device import best_device, resolve_dtype

    return [resolve_dtype(name), best_device()]


PROBES = {
    "is_available": _is_available,
    "is_bf16_supported": _is_bf16_supported,
    "grpo_flyte_device": _grpo_flyte_device,
    "grpo_flyte_dtype_auto": lambda: _grpo_flyte_dtype("auto"),
    "grpo_flyte_dtype_bfloat16": lambda: _grpo_flyte_dtype("bfloat16"),
    "grpo_flyte_dtype_float32": lambda: _grpo_flyte_dtype("float32"),
}


def touch_cuda(answer) -> None:
    """The child: one tensor on the GPU; 'ok' or the error, sent back through `answer`."""
    try:
        import torch

        torch.zeros(1, device="cuda")
        answer.send("ok")
    except Exception as exc:  # noqa: BLE001 -- the child's error is the measurement
        answer.send(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")


def sub_check(probe: str, method: str) -> dict:
    import torch

    out: dict = {"probe": probe, "start_method": method, "torch": torch.__version__}
    out["probe_result"] = PROBES[probe]()
    out["cuda_initialized_after_probe"] = torch.cuda.is_initialized()
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=touch_cuda, args=(send,))
    child.start()
    send.close()
    try:
        out["child"] = receive.recv() if receive.poll(180) else None
    except EOFError:  # the child died before it answered
        out["child"] = None
    child.join(60)
    out["child_exit_code"] = child.exitcode
    return out


if __name__ == "__main__":
    print(json.dumps(sub_check(sys.argv[1], sys.argv[2])))
