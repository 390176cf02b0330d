"""This module makes the torch thread keep the memory its steps reuse (glibc's malloc on Linux).

A GRPO step on a CPU allocates and frees gigabytes of activations. glibc keeps freed blocks in the
torch thread's malloc arena, so the next step reuses pages that are already mapped. Two things
handed them back to the kernel between steps, and the next step faulted every page in again, at a
large share of its CPU time (docs/measurements.md#iteration-overhead-issue-41-2026-11-26):

- protobuf's Python runtime (upb, which Flyte's input and output conversions use) calls
  `malloc_trim(0)` after every 10,000th memory block it frees (python/protobuf.c,
  `upb_trim_allocfunc`). That call releases the free pages of every arena of the process, the
  torch thread's included. Flyte local mode frees enough of them to trim several times an
  iteration, so every train step began with its memory gone; a plain loop, which makes no
  protobuf messages, never trims. `stop_protobuf_trims` points upb's own reference to
  `malloc_trim` (its slot in the library's global offset table, written by the dynamic linker) at
  a function that does nothing. Nothing else in the process changes: any other caller of
  `malloc_trim` still reaches glibc.
- glibc unmaps a thread arena's last 64 MiB heap the moment its last block is freed
  (`heap_trim`). `keep_freed_memory` sets a top pad of one heap, which keeps every heap mapped,
  and fixes the mmap and trim thresholds where glibc's dynamic rule ends up (setting any of them
  turns that rule off).

What is kept is bounded by what is worth keeping: work on a sequence longer than a train
micro-batch (a long observation's step, checkpointed; its generation) runs inside `handing_back`,
which maps that work's large blocks on their own while it runs and hands every freed page back to
the kernel when it ends, so a long step's memory is not carried into the next generation, nor a long
generation's into the step (docs/measurements.md#where-a-local-runs-memory-goes-issue-55-2026-11-27). The default steps,
whose pages the next step reuses, never trim.

Both run once, when the torch thread starts (`grpo_flyte.runtime.torch_thread`); they do nothing on other
C libraries or platforms, and `keep_freed_memory` leaves alone a process whose allocator the user
tuned through the environment. `GRPO_FLYTE_LEAVE_MALLOC=1` turns both off (the C library's allocator
exactly as the process found it: for a process that cannot have a library's table of addresses
written, or to compare). The price is resident memory: a process keeps the largest working
set its torch thread has had (a step's activations), as it did already whenever a live block
happened to sit at the top of the arena.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# mallopt parameters (<malloc.h>)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# glibc's largest heap of a thread arena on a 64-bit system (HEAP_MAX_SIZE), and where its dynamic
# mmap threshold stops growing (DEFAULT_MMAP_THRESHOLD_MAX, half a heap) and the trim threshold
# with it (twice the mmap threshold).
HEAP_BYTES = 64 * 2**20
MMAP_THRESHOLD_BYTES = HEAP_BYTES // 2
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
# While oversized work runs (`handing_back`), blocks of this size or more are mapped on their own: a
# checkpointed 6,000-token step then peaked 0.43 GB above the model instead of 2.3 GB
# (docs/measurements.md#long-observations-issue-40-2026-11-26).
OVERSIZED_MMAP_THRESHOLD_BYTES = 64 * 2**10
# The user's own malloc settings, which win.
MALLOC_ENVIRONMENT = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")

# Set to 1 (or true, yes): neither change is made.
LEAVE_MALLOC = "GRPO_FLYTE_LEAVE_MALLOC"

UPB_MODULE = "google._upb._message"
TRIM_SYMBOL = "malloc_trim"

_lock = threading.Lock()
_done = False
_tuned: ctypes.CDLL | None = None  # glibc, once keep_freed_memory made its settings in this process


def _libc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc on Linux, else None."""
    try:
        glibc = sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):  # no such name on this system
        glibc = False
    if not glibc:
        return None
    return ctypes.CDLL(None, use_errno=True)


def keep_memory() -> None:
    """`keep_freed_memory` and `stop_protobuf_trims`, once per process."""
    global _done, _tuned
    with _lock:
        if _done:
            return
        _done = True
        if os.environ.get(LEAVE_MALLOC, "").strip().lower() in ("1", "true", "yes"):
            logger.debug("malloc left as it is (%s)", LEAVE_MALLOC)
            return
        try:
            libc = _libc()
            if libc is not None:
                if keep_freed_memory(libc):
                    _tuned = libc
                stop_protobuf_trims(libc)
        except Exception as exc:  # noqa: BLE001 -- a speed-up only: the torch thread must start regardless
            logger.warning("malloc left as it is (%s: %s)", type(exc).__name__, exc)


def keep_freed_memory(libc: ctypes.CDLL) -> bool:
    """glibc keeps every heap of a thread arena mapped once it has it; whether the settings were made."""
    tuned = [name for name in MALLOC_ENVIRONMENT if name in os.environ]
    if tuned or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        logger.debug("malloc settings left as the environment sets them (%s)", tuned or "GLIBC_TUNABLES")
        return False
    # The thresholds first: setting any of these three freezes the other two where they stand.
    for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, HEAP_BYTES)):
        if libc.mallopt(param, value) != 1:
            logger.debug("mallopt(%d, %d) was refused", param, value)
            return False
    return True


@contextlib.contextmanager
def handing_back(oversized: bool, mmap_large_blocks: bool = True) -> Iterator[None]:
    """Run oversized work without keeping its memory: while it runs, blocks of
    OVERSIZED_MMAP_THRESHOLD_BYTES or more are mapped on their own (`mmap_large_blocks`; off for a
    decode, whose key/value cache grows by a copy every token), and when it ends every free page of
    the process's heaps goes back to the kernel (glibc's `malloc_trim`, not protobuf's redirected
    one). Nothing happens for other work, or where `keep_freed_memory` made no settings (another C
    library, malloc tuned by the user, GRPO_FLYTE_LEAVE_MALLOC): those processes keep what glibc keeps.
    """
    libc = _tuned
    if not oversized or libc is None:
        yield
        return
    if mmap_large_blocks:
        libc.mallopt(M_MMAP_THRESHOLD, OVERSIZED_MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        if mmap_large_blocks:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.malloc_trim(0)


def stop_protobuf_trims(libc: ctypes.CDLL) -> int:
    """Point upb's calls to `malloc_trim` at a function that does nothing; the number of its
    references redirected (0: protobuf is not the upb runtime, or it no longer calls malloc_trim)."""
    upb = _upb_file()
    if upb is None:
        return 0
    try:
        image = ElfImage(upb)
        slots = image.relocations(TRIM_SYMBOL)
    except (OSError, ValueError, struct.error) as exc:
        logger.debug("protobuf's trims left alone: %s cannot be read (%s)", upb, exc)
        return 0
    if not slots:
        return 0
    base = _load_address(libc, upb)
    if base is None:
        return 0
    # upb calls malloc_trim(0): abs(0) is 0, malloc_trim's "nothing was released", and abs touches
    # nothing. A function of the C library lives as long as the process, unlike a Python callback,
    # which the interpreter's shutdown frees while protobuf may still be freeing messages.
    no_op = ctypes.cast(libc.abs, ctypes.c_void_p).value
    trim = ctypes.cast(libc.malloc_trim, ctypes.c_void_p).value
    low, high = image.span()
    for offset in slots:
        slot = ctypes.c_void_p.from_address(base + offset)
        # Before the first call a lazily bound slot points into the library itself (its PLT);
        # after it, at glibc's malloc_trim. Anything else: someone else changed it; leave it.
        if slot.value not in (trim, no_op) and not (base + low <= (slot.value or 0) < base + high):
            logger.debug("protobuf's trims left alone: an unexpected address in its malloc_trim slot")
            return 0
    for offset in slots:
        _write_pointer(libc, base + offset, no_op, read_only=image.in_relro(offset))
    logger.debug("protobuf's malloc_trim calls (%d) now do nothing", len(slots))
    return len(slots)


def trim_slots(libc: ctypes.CDLL) -> list[int]:
    """The addresses upb's calls to malloc_trim jump to now (for checks; [] without upb)."""
    upb = _upb_file()
    base = _load_address(libc, upb) if upb else None
    if upb is None or base is None:
        return []
    return [ctypes.c_void_p.from_address(base + offset).value or 0 for offset in ElfImage(upb).relocations(TRIM_SYMBOL)]


def _upb_file() -> str | None:
    """The upb runtime's shared library when it is protobuf's implementation, loaded."""
    try:
        from google.protobuf.internal import api_implementation
    except ImportError:
        return None
    if api_implementation.Type() != "upb":
        return None
    import importlib

    return importlib.import_module(UPB_MODULE).__file__


def _load_address(libc: ctypes.CDLL, path: str) -> int | None:
    """Where the dynamic linker loaded `path` (`l_addr` of its link map: dlinfo(3))."""
    rtld_di_linkmap = 2
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    link_map = ctypes.c_void_p()
    libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    if libc.dlinfo(handle._handle, rtld_di_linkmap, ctypes.byref(link_map)) != 0 or not link_map.value:
        return None
    return ctypes.c_size_t.from_address(link_map.value).value


def _write_pointer(libc: ctypes.CDLL, address: int, value: int, read_only: bool) -> None:
    """Store `value` at `address`, lifting the page's write protection for the store when the
    dynamic linker made it read-only (RELRO)."""
    if read_only:
        page = os.sysconf("SC_PAGE_SIZE")
        start = address & ~(page - 1)
        length = address + ctypes.sizeof(ctypes.c_void_p) - start
        prot_read, prot_write = 1, 2
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(start, length, prot_read | prot_write) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.c_void_p.from_address(address).value = value
        libc.mprotect(start, length, prot_read)
    else:
        ctypes.c_void_p.from_address(address).value = value


class ElfImage:
    """What `stop_protobuf_trims` reads of a 64-bit little-endian ELF shared library: its
    relocations against one symbol, its loaded span and its RELRO range. Written here rather than
    with pyelftools: three tables of fixed-size records, and no dependency for them."""

    SHT_RELA, PT_LOAD, PT_GNU_RELRO = 4, 1, 0x6474E552

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.data = f.read()
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        phoff, shoff = struct.unpack_from("<QQ", self.data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", self.data, 0x36)
        # (p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align)
        self.segments = [struct.unpack_from("<IIQQQQQQ", self.data, phoff + i * phentsize) for i in range(phnum)]
        # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize)
        self.sections = [struct.unpack_from("<IIQQQQIIQQ", self.data, shoff + i * shentsize) for i in range(shnum)]

    def relocations(self, symbol: str) -> list[int]:
        """The offsets (from the load address) that the dynamic linker fills with `symbol`'s address."""
        wanted = symbol.encode()
        found = []
        for section in self.sections:
            if section[1] != self.SHT_RELA:
                continue
            symbols = self.sections[section[6]]
            names = self.sections[symbols[6]]
            for entry in range(section[4], section[4] + section[5], 24):  # Elf64_Rela
                offset, info = struct.unpack_from("<QQ", self.data, entry)
                index = info >> 32
                if index == 0:
                    continue
                (name,) = struct.unpack_from("<I", self.data, symbols[4] + index * 24)  # Elf64_Sym's st_name
                start = names[4] + name
                if self.data[start : self.data.index(b"\0", start)] == wanted:
                    found.append(offset)
        return found

    def span(self) -> tuple[int, int]:
        """The offsets the loaded segments cover."""
        loads = [s for s in self.segments if s[0] == self.PT_LOAD]
        return min(s[3] for s in loads), max(s[3] + s[6] for s in loads)

    def in_relro(self, offset: int) -> bool:
        return any(s[0] == self.PT_GNU_RELRO and s[3] <= offset < s[3] + s[6] for s in self.segments)
