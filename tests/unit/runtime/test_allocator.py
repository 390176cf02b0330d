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
    made = []

    class Recording:
        def mallopt(self, param: int, value: int) -> int:
            made.append((param, value))
            return 1

    assert allocator.keep_freed_memory(Recording()) == (not environment)
    if environment:
        assert made == []
    else:  # the thresholds before the top pad: setting any of them freezes the others
        assert made == [
            (allocator.M_MMAP_THRESHOLD, 32 * 2**20),
            (allocator.M_TRIM_THRESHOLD, 64 * 2**20),
            (allocator.M_TOP_PAD, 64 * 2**20),
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
