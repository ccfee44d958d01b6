"""Free the calling thread's OpenMP worker threads (GNU libgomp, which PyTorch's CPU builds and
specdec's kernels run on).

libgomp keeps, for every thread that has run a parallel region, a pool of worker threads. While
it manages more threads than the machine has CPUs, a worker spins only ~100 times after a region
before it sleeps, so each of a step's ~150 parallel regions (4 products and the attention a
layer) wakes it again through the kernel. A server loads its model on one thread, measures its
step costs on another and steps on a third: three pools on 2 CPUs. Measured on a 2-core AMD EPYC
(SmolLM2 int4, one-token steps at a 200-token context in a second thread): 12-14 ms a step while
the loading thread's pool lived, 5-6.7 ms once it was freed; the server's worker thread made
~20,000 voluntary context switches a second. `omp_pause_resource_all` frees the calling thread's
pool (its workers exit); the next parallel region of that thread makes a new one."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp PyTorch runs on (its own copy, else the system's), or None. Other packages may
    bring copies of their own (sentencepiece's wheel does): pausing one of those would free
    nothing of PyTorch's, so PyTorch's copy comes first, whatever order they were loaded in."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            maps = f.read()
    except OSError:  # not Linux
        return None
    paths = []
    for line in maps.splitlines():
        fields = line.split()
        path = fields[-1] if len(fields) >= 6 else ""
        if os.path.basename(path).startswith("libgomp") and ".so" in path and path not in paths:
            paths.append(path)
    import torch

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in torch_first(paths, torch_lib):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            return None
        return lib if hasattr(lib, "omp_pause_resource_all") else None
    return None


def torch_first(paths: list[str], torch_lib: str) -> list[str]:
    """libgomp copies in the order to try them: PyTorch's own (under its lib folder) first."""
    return sorted(paths, key=lambda p: not p.startswith(torch_lib))


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True when they were freed (GNU libgomp
    loaded), False where there is nothing to do here (another OpenMP runtime, not Linux, or the
    call came from inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    return int(lib.omp_pause_resource_all(1)) == 0  # 1: omp_pause_soft
