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
    """The libgomp this process has loaded (PyTorch's own copy or the system's), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            maps = f.read()
    except OSError:  # not Linux
        return None
    for line in maps.splitlines():
        fields = line.split()
        path = fields[-1] if len(fields) >= 6 else ""
        if os.path.basename(path).startswith("libgomp") and ".so" in path:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                return None
            return lib if hasattr(lib, "omp_pause_resource_all") else None
    return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True when they were freed (GNU libgomp
    loaded), False where there is nothing to do here (another OpenMP runtime, not Linux, or the
    call came from inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    return int(lib.omp_pause_resource_all(1)) == 0  # 1: omp_pause_soft
