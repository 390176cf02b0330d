"""grpo_flyte.runtime.allocator: the torch thread keeps the memory its steps reuse.

What it changes is seen here by its mechanism (where upb's malloc_trim calls land, which settings are
made); its effect, minor page faults per train step, is a measurement (docs/measurements.md,
benchmarks/iteration_overhead.py), not a test.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from grpo_flyte.runtime import allocator
from grpo_flyte.runtime.torch_thread import on_torch_thread

libc = allocator._libc()
needs_glibc = pytest.mark.skipif(libc is None, reason="glibc's malloc only")


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class Recording:
    """A C library that records the allocator calls made to it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


@needs_glibc
def test_once_the_torch_thread_runs_protobufs_malloc_trim_calls_do_nothing():
    """upb calls malloc_trim(0) on every 10,000th block it frees: in Flyte local mode that released
    the torch thread's free memory before every train step. After the thread has started, upb's
    reference to malloc_trim points at libc's abs (abs(0) == 0: 'nothing released')."""
    on_torch_thread(lambda: None)
    slots = allocator.trim_slots(libc)
    assert slots, "this protobuf build calls malloc_trim: the test needs it to mean anything"
    assert set(slots) == {_address(libc.abs)}
    assert _address(libc.abs) != _address(libc.malloc_trim)


@needs_glibc
def test_protobuf_still_works_past_many_trims_and_redirecting_again_is_harmless():
    from google.protobuf import struct_pb2

    on_torch_thread(lambda: None)
    assert allocator.stop_protobuf_trims(libc) == len(allocator.trim_slots(libc)) > 0
    for i in range(25_000):  # past two of upb's trims
        message = struct_pb2.Struct()
        message.update({"i": i, "ids": [1, 2, 3]})
        assert message["i"] == i
        del message


@needs_glibc
@pytest.mark.parametrize("environment", [{}, {"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_malloc_settings_are_made_unless_the_user_tuned_malloc_in_the_environment(monkeypatch, environment):
    for name in (*allocator.MALLOC_ENVIRONMENT, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    recording = Recording()
    assert allocator.keep_freed_memory(recording) == (not environment)
    if environment:
        assert recording.calls == []
    else:  # the thresholds before the top pad: setting any of them freezes the others
        assert recording.calls == [
            ("mallopt", allocator.M_MMAP_THRESHOLD, 32 * 2**20),
            ("mallopt", allocator.M_TRIM_THRESHOLD, 64 * 2**20),
            ("mallopt", allocator.M_TOP_PAD, 64 * 2**20),
        ]


@needs_glibc
@pytest.mark.parametrize("leave", ["", "1"])
def test_a_fresh_process_with_the_torch_thread_never_calls_glibcs_malloc_trim(tmp_path, leave):
    """The whole chain in a new process: protobuf imported first (as Flyte does), then the torch
    thread started; upb's slot is bound to glibc's malloc_trim before and redirected after. With
    GRPO_FLYTE_LEAVE_MALLOC=1 it stays glibc's, and no malloc setting is made."""
    script = tmp_path / "check.py"
    script.write_text(
        textwrap.dedent(
            """
            import ctypes
            from google.protobuf import struct_pb2
            from grpo_flyte.runtime import allocator
            from grpo_flyte.runtime.torch_thread import on_torch_thread

            libc = ctypes.CDLL(None)
            for _ in range(12_000):  # one trim: the lazily bound slot now holds glibc's malloc_trim
                struct_pb2.Struct().update({"a": 1})
            before = set(allocator.trim_slots(libc))
            on_torch_thread(lambda: None)
            after = set(allocator.trim_slots(libc))
            trim, no_op = (ctypes.cast(f, ctypes.c_void_p).value for f in (libc.malloc_trim, libc.abs))
            print(before == {trim}, after == {no_op}, after == {trim})
            """
        )
    )
    env = {**_python_env(), allocator.LEAVE_MALLOC: leave}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == (["True", "False", "True"] if leave else ["True", "True", "False"])


def test_oversized_work_maps_its_large_blocks_and_trims_after_even_when_it_fails(monkeypatch):
    recording = Recording()
    monkeypatch.setattr(allocator, "_tuned", recording)
    low = ("mallopt", allocator.M_MMAP_THRESHOLD, allocator.OVERSIZED_MMAP_THRESHOLD_BYTES)
    restored = ("mallopt", allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD_BYTES)
    with allocator.handing_back(True):
        assert recording.calls == [low]
    assert recording.calls == [low, restored, ("malloc_trim", 0)]
    recording.calls.clear()
    with pytest.raises(RuntimeError), allocator.handing_back(True):
        raise RuntimeError("a failed step")
    assert recording.calls == [low, restored, ("malloc_trim", 0)]
    recording.calls.clear()
    with allocator.handing_back(True, mmap_large_blocks=False):  # a decode: its cache grows by a copy a token
        assert recording.calls == []
    assert recording.calls == [("malloc_trim", 0)]
    recording.calls.clear()
    with allocator.handing_back(False):
        pass
    assert recording.calls == []  # the default steps keep their pages for the next one


def test_a_process_whose_malloc_was_not_tuned_here_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", None)  # the user's own settings, GRPO_FLYTE_LEAVE_MALLOC, not glibc
    with allocator.handing_back(True):
        pass  # nothing to call: a C library call here would fail on None


@needs_glibc
@pytest.mark.parametrize("mode", ["kept", "mapped", "trimmed"])
def test_freed_memory_of_oversized_work_goes_back_to_the_kernel(tmp_path, mode):
    """In a fresh process with the torch thread's settings: 300 MB of 1 MB blocks, written, then
    freed with a live block after them (as a step's activations end). Kept: the pages stay resident
    (the next step reuses them). Inside `handing_back(True)`: each block was mapped on its own and
    unmapped when freed; with mmap_large_blocks=False the trim at the end hands the pages back."""
    script = tmp_path / "check.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import ctypes
            from grpo_flyte.runtime import allocator
            from grpo_flyte.runtime.torch_thread import on_torch_thread

            def rss():
                for line in open("/proc/self/status"):
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024

            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = [ctypes.c_void_p]

            def work():
                blocks = [libc.malloc(2**20) for _ in range(300)]
                for b in blocks:
                    ctypes.memset(b, 1, 2**20)
                live = libc.malloc(1024)  # the heap's top stays in use
                for b in blocks:
                    libc.free(b)
                return live

            def run(mode):
                start = rss()
                if mode == "kept":
                    work()
                else:
                    with allocator.handing_back(True, mmap_large_blocks=mode == "mapped"):
                        work()
                return (rss() - start) / 2**20

            print(on_torch_thread(run, {mode!r}))
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=_python_env())
    grown = float(out.stdout.split()[-1])
    assert grown > 250 if mode == "kept" else grown < 50, (mode, grown)


def test_a_file_that_is_not_an_elf_library_is_refused(tmp_path):
    path = tmp_path / "not_elf.so"
    path.write_bytes(b"#!/bin/sh\n" * 10)
    with pytest.raises(ValueError, match="ELF"):
        allocator.ElfImage(str(path))


@needs_glibc
def test_the_elf_reader_finds_upbs_malloc_trim_and_nothing_it_does_not_import():
    image = allocator.ElfImage(allocator._upb_file())
    low, high = image.span()
    (offset,) = image.relocations("malloc_trim")
    assert low <= offset < high
    assert image.relocations("no_such_symbol") == []


def _python_env() -> dict[str, str]:
    import os
    from pathlib import Path

    import grpo_flyte

    src = str(Path(grpo_flyte.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
