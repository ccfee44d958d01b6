"""The C heap of a long-running process: freed memory handed back to the system (glibc's
allocator controls; nothing elsewhere)."""

from __future__ import annotations

from typing import Any

from specdec.defaults import HEAPS, choice

TRIM_BYTES = 8 << 20  # a freed slot this large is handed back to the system (see trim_heap)


def _libc() -> Any:
    """glibc, for its allocator's controls (False elsewhere: then those do nothing)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing
    elsewhere). After a long request the allocator would otherwise keep its pages."""
    if _libc():
        _LIBC.malloc_trim(0)


M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_heap() -> bool:
    """Every thread created from now on allocates from the main heap (glibc's M_ARENA_MAX 1; where
    the allocator is not glibc's, nothing): for a server, before it loads anything. With an arena
    per thread (the scheduler's, OpenMP's workers), a long prompt's passes left 50-60 MiB of some
    arena's pages pinned by small live blocks that no trim could return; one heap returns them, at
    the same decoding speed on 2 cores. SPECDEC_HEAPS=per-thread keeps glibc's default. Whether it was set."""
    if choice("SPECDEC_HEAPS", HEAPS) == "per-thread":
        return False
    return bool(_libc()) and _LIBC.mallopt(M_ARENA_MAX, 1) == 1


_LIBC: Any = None


def release_load_memory() -> None:
    """What loading (or measuring) left behind handed back to the system: its cycles collected and
    the C heap's free pages returned (reading SmolLM2's GGUF file leaves ~100 MiB of freed copies in
    the heap, which a process would otherwise keep until a long request's end trims it)."""
    import gc

    gc.collect()
    trim_heap()
