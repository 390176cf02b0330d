"""The peak memory of a span of work: this process's tree polled (a child's memory included), the
span's own stretch of time, the polling thread's end, and torch's GPU counters shared by
overlapping spans."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import psutil
import pytest

from grpo_flyte.runtime import memory

HELD = 200_000_000  # bytes the child holds
# The child script: hold HELD written bytes, say so, wait for a line on stdin (or its end).
HOLDER = f"import sys; held = b'x' * {HELD}; print('holding', flush=True); sys.stdin.readline()"


def _holding_child() -> subprocess.Popen:
    """A child (in a session of its own, as the reward workers are) holding HELD bytes, once it says so."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert child.stdout.readline().strip() == "holding"
    return child


def _end(child: subprocess.Popen) -> None:
    child.stdin.close()
    child.wait(timeout=30)


def test_the_peak_is_at_least_the_resident_memory_inside_the_span():
    with memory.span() as measured:
        inside = psutil.Process().memory_info().rss
    assert measured.peak is not None and measured.peak.rss_gb * memory.GB >= inside
    assert measured.peak.gpu_gb is None and measured.peak.gpu_allocated_gb is None  # no GPU span


def test_a_child_holding_200_mb_raises_the_peak_by_about_that_and_the_poller_caught_it():
    sampler = memory.Sampler(interval_s=0.1)
    opened = sampler.open()
    before = opened.rss
    child = _holding_child()
    time.sleep(0.5)  # several polls while the child holds its memory
    _end(child)
    peak = sampler.close(opened)  # the child has ended: only the poller's readings saw it
    grown = peak.rss_gb * memory.GB - before
    # the child's bytes, plus a bare interpreter's own resident memory (about 10 MB), give or take
    # what this process did meanwhile
    assert 0.9 * HELD <= grown <= HELD + 60e6, grown / memory.GB


def test_take_gives_the_peak_so_far_and_restarts_the_span():
    sampler = memory.Sampler(interval_s=0.1)
    opened = sampler.open()
    child = _holding_child()
    time.sleep(0.4)
    _end(child)
    first = sampler.take(opened)
    second = sampler.take(opened)  # the child had ended before this stretch began
    sampler.close(opened)
    assert first.rss_gb - second.rss_gb >= 0.9 * HELD / memory.GB


def test_an_outer_span_sees_every_reading_of_the_spans_inside_it():
    sampler = memory.Sampler(interval_s=10.0)  # no poll in between: only the readings as spans open and end
    outer = sampler.open()
    before = outer.rss
    inner = sampler.open()
    child = _holding_child()
    try:
        inner_peak = sampler.close(inner)  # read while the child holds its memory
    finally:
        _end(child)
    outer_peak = sampler.close(outer)
    assert outer_peak.rss_gb >= inner_peak.rss_gb >= (before + 0.9 * HELD) / memory.GB


def test_the_poller_runs_only_while_a_span_is_open():
    sampler = memory.Sampler(interval_s=0.05)
    assert not sampler.polling()
    first, second = sampler.open(), sampler.open()
    assert sampler.polling()
    sampler.close(first)
    time.sleep(0.2)
    assert sampler.polling()
    sampler.close(second)
    deadline = time.monotonic() + 5
    while sampler.polling() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sampler.polling()  # woken by the last close: it ends at once, not after a wait
    again = sampler.open()  # and a later span starts it again
    assert sampler.polling()
    sampler.close(again)


def test_a_span_ends_when_its_block_raises():
    with pytest.raises(ValueError), memory.span() as measured:
        raise ValueError("boom")
    assert measured.peak is not None and measured.peak.rss_gb > 0


class _FakeCuda:
    """torch.cuda's peak counters on one device: a test sets `allocated` and `reserved`."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self.resets = 0

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets += 1
        self.allocated = self.reserved = 0

    def max_memory_allocated(self, device: int) -> int:
        return self.allocated

    def max_memory_reserved(self, device: int) -> int:
        return self.reserved


def test_gpu_spans_reset_the_counters_only_when_none_is_open(monkeypatch):
    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    sampler = memory.Sampler(interval_s=10.0)
    cuda.allocated, cuda.reserved = 7 * 10**9, 8 * 10**9  # before any span: a reset forgets it
    first = sampler.open(gpu=True)
    assert cuda.resets == 1 and cuda.allocated == 0
    cuda.allocated, cuda.reserved = 2 * 10**9, 3 * 10**9
    second = sampler.open(gpu=True)  # overlaps the first: no reset, it shares the counters
    plain = sampler.open()  # a span without gpu never touches them
    assert cuda.resets == 1
    assert sampler.close(plain).gpu_gb is None
    peak = sampler.close(first)
    assert (peak.gpu_gb, peak.gpu_allocated_gb) == (3.0, 2.0)
    assert sampler.close(second).gpu_gb == 3.0  # since the first opened: never less than its own
    sampler.open(gpu=True)  # none open now: a fresh stretch
    assert cuda.resets == 2


def test_without_cuda_a_gpu_span_has_no_gpu_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False)))
    with memory.span(gpu=True) as measured:
        pass
    assert measured.peak.gpu_gb is None and measured.peak.gpu_allocated_gb is None
