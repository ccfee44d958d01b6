"""specdec.openmp: the calling thread's OpenMP workers are freed (they exit), and the next
parallel region of that thread runs as before (a new pool)."""

import os
import threading

import pytest
import torch

from specdec.openmp import _libgomp, release_pool

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="GNU libgomp is not this process's OpenMP runtime")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_threads_workers_exit_when_released_and_come_back_on_use(threads):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: no OpenMP workers")
    threads(2)
    x = torch.randn(512, 512)
    seen: dict[str, object] = {}

    def work() -> None:
        torch.set_num_threads(2)  # this thread's own OpenMP setting
        y = x @ x  # a parallel region: this thread's pool of workers
        torch.nn.functional.silu(torch.randn(1 << 20))
        seen["before"] = _threads()
        seen["released"] = release_pool()
        seen["after"] = _threads()
        seen["again"] = torch.equal(x @ x, y)  # a new pool, the same result

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["released"] is True
    assert seen["after"] < seen["before"]
    assert seen["again"] is True


def test_pytorchs_libgomp_is_the_one_paused_when_another_package_brings_its_own():
    """sentencepiece's wheel brings a libgomp of its own, loaded before PyTorch's when imported
    first; pausing that copy freed none of PyTorch's workers."""
    from specdec.openmp import torch_first

    paths = ["/venv/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0", "/venv/torch/lib/libgomp.so.1",
             "/usr/lib/libgomp.so.1"]
    assert torch_first(paths, "/venv/torch/lib")[0] == "/venv/torch/lib/libgomp.so.1"
    assert torch_first(paths[::2], "/venv/torch/lib") == paths[::2]
