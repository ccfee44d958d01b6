import os
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import settings

# Reproducible property tests: the same examples on every run, no example database.
settings.register_profile("specdec", derandomize=True, database=None)
settings.load_profile("specdec")

# Tiny models gain nothing from intra-op threads, and threads that spin-wait on a busy
# 2-core machine make every small op ~20x slower.
torch.set_num_threads(1)

# The suite runs two worker processes at once (scripts/test), so every step cost it measures is taken
# under the other's load; keep them anyway (tests assert that costs are stored and reused).
os.environ.setdefault("SPECDEC_STORE_COSTS_UNDER_LOAD", "1")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tokenizer, a small random Llama target and two prophets, saved to disk and
    loadable with from_pretrained: a close prophet (the target plus noise) and a far one."""
    from tests.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_eagle(tiny_pair, tmp_path_factory):
    """A random (imperfect) eagle head for the tiny target, saved like a shipped prophet."""
    from specdec import load
    from specdec.prophets.feature import FeatureHead, save_head

    dim = load(tiny_pair["target"], draft="none").target.head().shape[1]
    torch.manual_seed(5)
    head = FeatureHead("eagle", dim, rank=16, depth=2)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    path = tmp_path_factory.mktemp("eagle") / "tiny-eagle"
    save_head(head, torch.arange(0, 200), path, {})
    return str(path)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """torch.set_num_threads for a test, the count restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _kernels_loaded() -> None:
    """specdec.qgemm (the 4-bit kernels and the C++ layer loop) loaded once, from the cache that
    scripts/setup built it in, before any test points SPECDEC_CACHE elsewhere (where it would be
    compiled again, for minutes)."""
    from specdec import qgemm

    qgemm.available()
