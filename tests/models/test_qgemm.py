"""specdec.qgemm: float32 x GGUF Q4_1 / Q8_0 block weights, against a float64 reference, and its rows
bit-for-bit the same whatever the row count, the other rows, the thread count and the instruction set."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from specdec import qgemm

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=f"qgemm unavailable: {qgemm.why_unavailable()}")

Mm = Callable[..., torch.Tensor]


def q4_1_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_1 blocks with scales and minimums like a model's (d ~ 1e-3..2e-2, m ~ -0.15..0)."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, kb, generator=g) * 0.15).half()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    return qgemm.pack_q4_1(d, m, q)


def q8_0_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.01 + 1e-4).half()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return qgemm.pack_q8_0(d, q)


FORMATS: dict[str, tuple[Callable[..., torch.Tensor], Mm, Callable[[torch.Tensor], torch.Tensor]]] = {
    "q4_1": (q4_1_blocks, qgemm.q4_1_mm, qgemm.dequantize_q4_1),
    "q8_0": (q8_0_blocks, qgemm.q8_0_mm, qgemm.dequantize_q8_0),
}


def check_close(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out against x @ w.T in float64, within float32 accumulation's bound: each output is a chain of
    K/32 fused multiply-adds a lane and 5 additions, so |error| <= n u sum |x||w| with n = K/32 + 5."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    n = x.shape[-1] // 32 + 5
    bound = 1.01 * n * 2.0**-24 * scale + 1e-30
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3g}"


# ------------------------------------------------------------------------------------------- layouts

def test_q4_1_layout_is_gguf() -> None:
    """One block written byte by byte as llama.cpp lays it out: w[j] = d*(qs[j]&15)+m, w[j+16] = d*(qs[j]>>4)+m."""
    qs = bytes((j | ((15 - j) << 4)) for j in range(16))
    raw = struct.pack("<ee", 0.5, -1.25) + qs
    blocks = torch.tensor(list(raw), dtype=torch.uint8).reshape(1, 1, 20)
    w = qgemm.dequantize_q4_1(blocks)[0]
    expect = [0.5 * j - 1.25 for j in range(16)] + [0.5 * (15 - j) - 1.25 for j in range(16)]
    assert w.tolist() == expect
    x = torch.eye(32)
    assert qgemm.q4_1_mm(x, blocks)[:, 0].tolist() == expect
    q = torch.tensor([list(range(16)) + [15 - j for j in range(16)]], dtype=torch.uint8)
    packed = qgemm.pack_q4_1(torch.tensor([[0.5]]).half(), torch.tensor([[-1.25]]).half(), q)
    assert torch.equal(packed, blocks)


def test_q8_0_layout_is_gguf() -> None:
    q = [(-1) ** j * (4 * j) for j in range(32)]
    raw = struct.pack("<e", 0.25) + struct.pack("<32b", *q)
    blocks = torch.tensor(list(raw), dtype=torch.uint8).reshape(1, 1, 34)
    expect = [0.25 * v for v in q]
    assert qgemm.dequantize_q8_0(blocks)[0].tolist() == expect
    assert qgemm.q8_0_mm(torch.eye(32), blocks)[:, 0].tolist() == expect
    packed = qgemm.pack_q8_0(torch.tensor([[0.25]]).half(), torch.tensor([q], dtype=torch.int8))
    assert torch.equal(packed, blocks)


def test_dequantize_is_the_rounded_exact_value() -> None:
    """The reference weights are d*q+m computed exactly and rounded once (what the kernel's fma gives)."""
    blocks = q4_1_blocks(8, 64, seed=3)
    d = blocks[..., 0:2].contiguous().view(torch.float16).double().numpy()
    m = blocks[..., 2:4].contiguous().view(torch.float16).double().numpy()
    qs = blocks[..., 4:].numpy()
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)
    expect = (d * q + m).astype(np.float32).reshape(8, 64)
    assert np.array_equal(qgemm.dequantize_q4_1(blocks).numpy(), expect)


# ---------------------------------------------------------------------------------------- correctness

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 64), (1, 32), (61, 96)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 100]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference(fmt: str, n: int, k: int) -> None:
    make, mm, dequantize = FORMATS[fmt]
    blocks = make(n, k, seed=n + k)
    w = dequantize(blocks)
    g = torch.Generator().manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        check_close(x, w, mm(x, blocks))


def test_head_q8_0() -> None:
    """SmolLM2's tied head, 49152 x 576 in Q8_0."""
    blocks = q8_0_blocks(49152, 576, seed=7)
    w = qgemm.dequantize_q8_0(blocks)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    out = qgemm.q8_0_mm(x, blocks)
    check_close(x, w, out)
    assert torch.equal(out[1], qgemm.q8_0_mm(x[1:2], blocks)[0])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_shapes_and_casts(fmt: str) -> None:
    make, mm, dequantize = FORMATS[fmt]
    blocks = make(45, 128, seed=5)
    w = dequantize(blocks)
    x = torch.randn(2, 3, 128)
    out = mm(x, blocks)
    assert out.shape == (2, 3, 45)
    assert torch.equal(out, mm(x.reshape(6, 128), blocks).reshape(2, 3, 45))
    assert mm(x[0, 0], blocks).shape == (45,)
    xt = torch.randn(128, 4).T  # not contiguous
    assert torch.equal(mm(xt, blocks), mm(xt.contiguous(), blocks))
    xd = torch.randn(4, 128, dtype=torch.float64)  # cast to float32 first
    assert torch.equal(mm(xd, blocks), mm(xd.float(), blocks))
    check_close(xd.float(), w, mm(xd, blocks))
    assert mm(torch.randn(0, 128), blocks).shape == (0, 45)
    assert mm(torch.randn(3, 128), blocks[:0]).shape == (3, 0)


# ------------------------------------------------------------------------------------------ exactness

@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 64)])
def test_rows_are_invariant(fmt: str, n: int, k: int, threads: Callable[[int], None]) -> None:
    """Row r of a product is bit-for-bit the product of that row alone, whatever the other rows, the
    row count (one tile, several tiles) and the thread count."""
    make, mm, _ = FORMATS[fmt]
    assert_rows_invariant(mm, make(n, k, seed=11), k, threads, ["auto"])


ROW_COUNTS = (2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 40)


def assert_rows_invariant(mm: Callable[..., torch.Tensor], blocks: torch.Tensor, k: int,
                          threads: Callable[[int], None], impls: list[str],
                          sizes: tuple[int, ...] = ROW_COUNTS) -> None:
    """A random row multiplied alone (1 thread) has the bits of that row in products of `sizes`
    random rows (by default 2..9, 15-17 and 40), with 1 and 2 threads, on each implementation in impls."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, k, generator=g)
    threads(1)
    alone = mm(row, blocks)[0]
    for t in (1, 2):
        threads(t)
        assert torch.equal(mm(row, blocks)[0], alone)
        for m in sizes:
            x = torch.randn(m, k, generator=g) * float(torch.rand(1, generator=g) * 10)
            at = int(torch.randint(0, m, (1,), generator=g))
            x[at] = row[0]
            for impl in impls:
                assert torch.equal(mm(x, blocks, impl=impl)[at], alone), (t, m, at, impl)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_implementations_agree(fmt: str) -> None:
    """Scalar, AVX2 and AVX-512 (those compiled here) give the same bits: one order of operations."""
    make, mm, _ = FORMATS[fmt]
    impls = qgemm.impls()
    assert impls[0] == "scalar"
    # the last five: products of >= 16 rows run the register-blocked kernel (panels of 16 weight rows,
    # tiles of 6 rows): its edges (15/16/17 rows, weight rows not a multiple of 16, one panel short)
    for n, k, m in [(37, 64, 1), (50, 576, 5), (19, 1536, 9), (8, 96, 17), (33, 576, 15), (33, 576, 16),
                    (17, 1536, 23), (5, 64, 64), (70, 96, 130)]:
        blocks = make(n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        outs = [mm(x, blocks, impl=impl) for impl in impls]
        for impl, out in zip(impls[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), impl
        assert torch.equal(mm(x, blocks), outs[0])


# ------------------------------------------------------------------------------------------ bad inputs

def test_bad_inputs_raise() -> None:
    blocks = q4_1_blocks(16, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        qgemm.q4_1_mm(x, blocks.view(torch.int8))
    with pytest.raises(RuntimeError, match="shape"):
        qgemm.q8_0_mm(x, blocks)  # 20-byte blocks given as Q8_0
    with pytest.raises(RuntimeError, match="shape"):
        qgemm.q4_1_mm(x, blocks.reshape(16, 40))
    with pytest.raises(RuntimeError, match="K = 64"):
        qgemm.q4_1_mm(torch.randn(2, 96), blocks)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qgemm.q4_1_mm(torch.randn(2, 33), blocks[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="contiguous"):
        qgemm.q4_1_mm(x, q4_1_blocks(16, 128)[:, ::2])
    module = qgemm._load()
    assert module is not None
    with pytest.raises(RuntimeError, match="float32"):
        module.qmm(x.double(), blocks, 0, 0)
    with pytest.raises(RuntimeError, match="2-D"):
        module.qmm(x[0], blocks, 0, 0)
    with pytest.raises(RuntimeError, match="unknown format"):
        module.qmm(x, blocks, 5, 0)
    with pytest.raises(ValueError, match="impl"):
        qgemm.q4_1_mm(x, blocks, impl="sse9")
    with pytest.raises(ValueError, match="dimension"):
        qgemm.q4_1_mm(torch.tensor(1.0), blocks)


def test_bad_packing_raises() -> None:
    d = torch.ones(4, 2).half()
    with pytest.raises(ValueError, match="0..15"):
        qgemm.pack_q4_1(d, d, torch.full((4, 64), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float16"):
        qgemm.pack_q4_1(d.float(), d, torch.zeros(4, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm.pack_q8_0(d, torch.zeros(4, 60, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        qgemm.pack_q8_0(d, torch.zeros(4, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks"):
        qgemm.dequantize_q8_0(torch.zeros(4, 2, 20, dtype=torch.uint8))


def test_build_is_cached_under_specdec_cache() -> None:
    assert qgemm.why_unavailable() is None
    assert qgemm.build_dir().name == qgemm.build_name()
    assert qgemm.build_dir().is_dir()


def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next_process() -> None:
    """Torch's builder waits with no end while a `lock` file is in the build folder; one left by a
    killed build (Ctrl-C during the first compile) is removed by the next process, which loads."""
    import subprocess
    import sys

    assert qgemm.available()
    stale = qgemm.build_dir() / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-c", "from specdec import qgemm; print(qgemm.available())"],
                              capture_output=True, text=True, timeout=240)
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_stored_step_costs_are_keyed_by_the_kernels_build(tiny_pair):
    """A changed kernel source gives another build name, so costs stored for the old kernel are
    not read for the new one."""
    from specdec import load
    from specdec.coststore import costs_key

    assert costs_key(load(tiny_pair["target"], draft="none"))["kernel_build"] == qgemm.build_name()
