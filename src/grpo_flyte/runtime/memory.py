"""This module measures the peak memory of a span of work in this process: the resident memory of
the process and of every process below it (the reward workers, the train processes, a vLLM engine's
own process), polled, and the GPU memory torch's allocator held.

Resident memory is polled: one background thread per process reads the process tree every
POLL_S seconds while a span is open (and once more as each span opens, ends or is read), and stops
when the last span ends. A reading is the sum of each process's RSS, so pages that processes share
(a forked worker's copy-on-write pages, shared libraries) count once per process: an upper bound of
what the tree holds, and a peak shorter than POLL_S between two readings can be missed. One
reading costs about 2 ms with 90 processes on the machine (psutil lists every process to find the
children); at POLL_S that is well under 1% of a core.

The GPU's peak is torch's own (`torch.cuda.max_memory_reserved`, `max_memory_allocated`, the
largest over the devices): exact, not polled, and only in a process that has initialized CUDA (the
counters are the process's, not the tree's: a vLLM engine in its own process, or another rank of a
data-parallel step, is not in them). A span that asks for it (`span(gpu=True)`) resets the
counters when it opens, unless another such span is open in the process: then the spans that
overlap share the counters, and each reads the peak since the first of them opened, never less
than its own.

Each process measures itself: on a cluster the driver's figure is its own pod's tree, and a task
that reports its peak (generate, score_group, train_step) reports its own process's tree while it
ran; in a local run every task runs in the driver's process, so its tree is the whole run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from grpo_flyte.types import MemoryPeak

# Seconds between readings of the process tree while a span is open.
POLL_S = 0.5
# The unit of every figure: 10^9 bytes.
GB = 1e9


def tree_rss(pid: int | None = None) -> int:
    """The resident bytes of process `pid` (None: this one) and every process below it: the sum of
    their RSS (a process that ends while it is read counts 0)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def _gpu_peak() -> tuple[float | None, float | None]:
    """The GPU's peak (reserved, allocated) in GB since the counters' last reset, the largest over
    the devices; (None, None) when this process has not initialized CUDA (torch never imported
    here for it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None, None
    devices = range(torch.cuda.device_count())
    reserved = max(torch.cuda.max_memory_reserved(d) for d in devices)
    allocated = max(torch.cuda.max_memory_allocated(d) for d in devices)
    return reserved / GB, allocated / GB


def _reset_gpu_peak() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)


class Span:
    """A span of work whose peak the sampler follows: `rss` is the highest reading of the process
    tree since it opened (or was last read with `Sampler.take`); `peak` is set when it ends."""

    def __init__(self, rss: int, gpu: bool) -> None:
        self.opened = time.monotonic()
        self.rss = rss
        self.gpu = gpu
        self.peak: MemoryPeak | None = None


class Sampler:
    """The process's memory sampler: open spans, the thread that polls the tree while any is open."""

    def __init__(self, interval_s: float = POLL_S) -> None:
        self.interval_s = interval_s
        self._changed = threading.Condition(threading.Lock())
        self._spans: set[Span] = set()
        self._gpu_spans = 0
        self._thread: threading.Thread | None = None

    def _observe(self, rss: int, at: float) -> None:
        """A reading taken at `at` counts for every span open by then (under the lock)."""
        for span in self._spans:
            if span.opened <= at:
                span.rss = max(span.rss, rss)

    def _read(self) -> None:
        at = time.monotonic()
        rss = tree_rss()
        with self._changed:
            self._observe(rss, at)

    def open(self, gpu: bool = False) -> Span:
        """A new span, from a reading taken now; `gpu`: it follows the GPU's peak too."""
        span = Span(tree_rss(), gpu)
        with self._changed:
            self._observe(span.rss, span.opened)
            if gpu:
                if self._gpu_spans == 0:
                    _reset_gpu_peak()
                self._gpu_spans += 1
            self._spans.add(span)
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="grpo-flyte-memory", daemon=True)
                self._thread.start()
        return span

    def take(self, span: Span) -> MemoryPeak:
        """The span's peak so far (resident memory only), and the span restarted from a reading
        taken now: consecutive takes cover consecutive stretches of time."""
        at = time.monotonic()
        rss = tree_rss()
        with self._changed:
            self._observe(rss, at)
            peak, span.rss, span.opened = span.rss, rss, at
        return MemoryPeak(rss_gb=peak / GB)

    def close(self, span: Span) -> MemoryPeak:
        """End the span: its peak, resident (a last reading taken now) and, for a GPU span, the GPU's."""
        at = time.monotonic()
        rss = tree_rss()
        with self._changed:
            self._observe(rss, at)
            self._spans.discard(span)
            reserved = allocated = None
            if span.gpu:
                reserved, allocated = _gpu_peak()
                self._gpu_spans -= 1
            self._changed.notify_all()  # the last span gone: the thread ends now, not after its wait
        span.peak = MemoryPeak(rss_gb=span.rss / GB, gpu_gb=reserved, gpu_allocated_gb=allocated)
        return span.peak

    def _poll(self) -> None:
        while True:
            with self._changed:
                if not self._spans:
                    self._thread = None
                    return
                self._changed.wait(self.interval_s)
                if not self._spans:
                    self._thread = None
                    return
            self._read()

    def polling(self) -> bool:
        """Whether the polling thread is alive (while a span is open)."""
        with self._changed:
            return self._thread is not None


_sampler = Sampler()


def _forked() -> None:
    """A forked child starts with no span and no thread (its parent's lock may be held)."""
    global _sampler
    _sampler = Sampler(_sampler.interval_s)


os.register_at_fork(after_in_child=_forked)


def sampler() -> Sampler:
    return _sampler


@contextlib.contextmanager
def span(gpu: bool = False) -> Iterator[Span]:
    """Follow the peak memory of the block (`Span.peak` once it ends); `gpu`: the GPU's peak too.
    The span ends however the block does."""
    current = _sampler
    opened = current.open(gpu)
    try:
        yield opened
    finally:
        current.close(opened)
