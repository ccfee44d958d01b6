"""specdec.qgemm's int8 kernel: int8-quantized activations x GGUF Q4_1 / Q8_0 blocks.

- quantize_rows against a pure-torch quantizer: equal, bit for bit;
- products against a pure-torch reference of exactly the kernel's arithmetic (same quantization, exact integer block
  dots, the same float32 operations in the same order, fma emulated exactly through float64 and round-to-odd): equal,
  bit for bit (torch.equal, no tolerance);
- products against the float64 product of the unquantized x within the int8 quantization's error bound;
- rows invariant (M = 1 vs any row of M = 2..9, 17, 40; 1 and 2 threads); the ISA paths identical; bad inputs raise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec import qgemm
from tests.models.test_qgemm import assert_rows_invariant, q4_1_blocks, q8_0_blocks

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=f"qgemm unavailable: {qgemm.why_unavailable()}")


FORMATS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "q4_1": (q4_1_blocks, qgemm.q4_1_mm8, qgemm.dequantize_q4_1),
    "q8_0": (q8_0_blocks, qgemm.q8_0_mm8, qgemm.dequantize_q8_0),
}


# ------------------------------------------------------------------------------------------- reference

def ref_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = amax / 127, q = round-half-even(x / dx) clamped to +-127 (0 where dx is 0), sx = dx * sum(q); float32."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    dx = xb.abs().amax(-1) / 127
    live = (dx > 0).unsqueeze(-1)
    q = torch.where(live, torch.round(xb / torch.where(live, dx.unsqueeze(-1), 1)), 0).clamp(-127, 127)
    q8 = q.to(torch.int8)
    sx = dx * q8.sum(-1, dtype=torch.int32).float()
    return q8.reshape(m, k), dx, sx


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma of float32 tensors, rounded once: a*b exact in float64, a*b + c rounded to odd in float64 (TwoSum), then
    to nearest float32 (53 >= 24 + 2 bits, so this is the correctly rounded a*b + c)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def weight_codes(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int (N, KB, 32), d float32 (N, KB), m float32 (N, KB)) of the blocks."""
    if fmt == "q4_1":
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        qs = blocks[..., 4:]
        return torch.cat([qs & 15, qs >> 4], dim=-1).long(), d, m
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    return blocks[..., 2:].contiguous().view(torch.int8).long(), d, torch.zeros_like(d)


def ref_mm8(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernel's arithmetic in torch: S[l] (l = b mod 16) = fma(m_w, sx, S[l]) (Q4_1), then
    S[l] = fma(d_w * dx, float(idot), S[l]), over b in order; T = S[:8] + S[8:], U = T[:4] + T[4:],
    y = (U0 + U2) + (U1 + U3)."""
    q, dx, sx = ref_quantize(x)
    mrows, k = x.shape
    kb = k // 32
    qw, dw, mw = weight_codes(blocks, fmt)
    idot = torch.einsum("mbj,nbj->mnb", q.reshape(mrows, kb, 32).double(), qw.double()).float()  # exact integers
    S = torch.zeros(mrows, blocks.shape[0], 16)
    for b in range(kb):
        lane = b % 16
        if fmt == "q4_1":
            S[:, :, lane] = fma32(mw[None, :, b].expand_as(S[:, :, lane]), sx[:, None, b].expand_as(S[:, :, lane]),
                                  S[:, :, lane])
        s = dw[None, :, b] * dx[:, None, b]
        S[:, :, lane] = fma32(s, idot[:, :, b], S[:, :, lane])
    T = S[..., :8] + S[..., 8:]
    U = T[..., :4] + T[..., 4:]
    return (U[..., 0] + U[..., 2]) + (U[..., 1] + U[..., 3])


# ------------------------------------------------------------------------------------------ quantization

def test_quantize_rows_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=g) * torch.rand(7, 1, generator=g) * 5
    x[0, :32] = 0  # an all-zero block
    x[1, 32:64] = 1e-44  # amax / 127 underflows to 0: treated as zero
    # ties: amax 127 -> dx = 1, x / dx = 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -0.5 -> 0
    x[2, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5] + [0.0] * 24)
    q, dx, sx = qgemm.quantize_rows(x)
    rq, rdx, rsx = ref_quantize(x)
    assert q.dtype == torch.int8 and dx.dtype == torch.float32 and sx.dtype == torch.float32
    assert torch.equal(q, rq) and torch.equal(dx, rdx) and torch.equal(sx, rsx)
    assert q[2, :8].tolist() == [127, 2, 4, -2, 0, 0, 2, -2]
    assert float(dx[0, 0]) == 0 and float(dx[1, 1]) == 0 and not q[1, 32:64].any()
    assert int(q.abs().max()) == 127


# ------------------------------------------------------------------------------------------ correctness

SHAPES = [(37, 64), (50, 576), (19, 1536), (8, 96), (33, 800), (21, 512), (5, 32), (3, 1056)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference_bit_for_bit(fmt: str, n: int, k: int) -> None:
    make, mm, _ = FORMATS[fmt]
    blocks = make(n, k, seed=n + k)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 5, 9, 12):
        x = torch.randn(m, k, generator=g) * 3
        expect = ref_mm8(x, blocks, fmt)
        for impl in qgemm.impls8():
            assert torch.equal(mm(x, blocks, impl=impl), expect), (impl, m)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (61, 96)])
def test_close_to_float_product(fmt: str, n: int, k: int) -> None:
    """|y - x @ W.T| <= sum_b dx_b / 2 * sum_{j in b} |w_j| (each activation off by at most dx/2), plus float32's
    rounding (K/32 + 5 operations a chain on |x^| |w|), 1% slack."""
    make, mm, dequantize = FORMATS[fmt]
    blocks = make(n, k, seed=3)
    w = dequantize(blocks).double()
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    out = mm(x, blocks).double()
    _, dx, _ = qgemm.quantize_rows(x)
    wabs = w.abs().reshape(n, k // 32, 32).sum(-1)  # (N, KB)
    qerr = 0.5 * dx.double() @ wabs.T
    float_err = (2 * k // 32 + 8) * 2.0**-24 * (x.double().abs() * 1.01) @ w.abs().T
    bound = 1.01 * (qerr + float_err) + 1e-30
    err = (out - x.double() @ w.T).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float((err / bound).max()) > 0.01  # the bound is not vacuous


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_shapes_and_edges(fmt: str) -> None:
    make, mm, _ = FORMATS[fmt]
    blocks = make(45, 128, seed=5)
    x = torch.randn(2, 3, 128)
    out = mm(x, blocks)
    assert out.shape == (2, 3, 45)
    assert torch.equal(out, mm(x.reshape(6, 128), blocks).reshape(2, 3, 45))
    assert mm(x[0, 0], blocks).shape == (45,)
    xt = torch.randn(128, 4).T
    assert torch.equal(mm(xt, blocks), mm(xt.contiguous(), blocks))
    assert mm(torch.randn(0, 128), blocks).shape == (0, 45)
    assert mm(torch.randn(3, 128), blocks[:0]).shape == (3, 0)
    assert not mm(torch.zeros(2, 128), blocks).any()  # zero activations: exactly zero


def test_head_q8_0() -> None:
    blocks = q8_0_blocks(49152, 576, seed=7)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    out = qgemm.q8_0_mm8(x, blocks)
    assert torch.equal(out[:, :4096], ref_mm8(x, blocks[:4096], "q8_0"))
    assert torch.equal(out[1], qgemm.q8_0_mm8(x[1:2], blocks)[0])


# ------------------------------------------------------------------------------------------ exactness

@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 64), (40, 800)])
def test_rows_are_invariant(fmt: str, n: int, k: int, threads: Callable[[int], None]) -> None:
    make, mm, _ = FORMATS[fmt]
    assert_rows_invariant(mm, make(n, k, seed=11), k, threads, qgemm.impls8())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_implementations_agree(fmt: str) -> None:
    make, mm, _ = FORMATS[fmt]
    impls = qgemm.impls8()
    assert impls[0] == "scalar"
    for n, k, m in [(37, 64, 1), (50, 576, 5), (19, 1536, 9), (8, 96, 17), (16, 1024, 3), (7, 288, 40)]:
        blocks = make(n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 4
        outs = [mm(x, blocks, impl=impl) for impl in impls]
        for impl, out in zip(impls[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), impl
        assert torch.equal(mm(x, blocks), outs[0])


def test_extreme_weights_are_exact() -> None:
    """Q8_0 codes -128 and 127 and Q4_1 codes 15 against activations +-127 (the int16 / bias paths' limits)."""
    n, k = 8, 256
    q8 = torch.where(torch.arange(k) % 2 == 0, -128, 127).to(torch.int8).repeat(n, 1)
    b8 = qgemm.pack_q8_0(torch.full((n, k // 32), 0.5).half(), q8)
    q4 = torch.full((n, k), 15, dtype=torch.uint8)
    b4 = qgemm.pack_q4_1(torch.full((n, k // 32), 0.25).half(), torch.full((n, k // 32), -1.0).half(), q4)
    x = torch.where(torch.arange(k) % 2 == 0, -1.0, 1.0).repeat(3, 1)
    x[1] = -x[1]
    for fmt, b in (("q8_0", b8), ("q4_1", b4)):
        mm = FORMATS[fmt][1]
        expect = ref_mm8(x, b, fmt)
        for impl in qgemm.impls8():
            assert torch.equal(mm(x, b, impl=impl), expect), (fmt, impl)


# ------------------------------------------------------------------------------------------ bad inputs

def test_bad_inputs_raise() -> None:
    blocks = q4_1_blocks(16, 64)
    x = torch.randn(2, 64)
    module = qgemm._require()
    with pytest.raises(RuntimeError, match="uint8"):
        qgemm.q4_1_mm8(x, blocks.view(torch.int8))
    with pytest.raises(RuntimeError, match="shape"):
        qgemm.q8_0_mm8(x, blocks)
    with pytest.raises(RuntimeError, match="shape"):
        qgemm.q4_1_mm8(x, blocks.reshape(16, 40))
    with pytest.raises(RuntimeError, match="K = 64"):
        qgemm.q4_1_mm8(torch.randn(2, 96), blocks)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qgemm.q4_1_mm8(torch.randn(2, 33), blocks[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="contiguous"):
        qgemm.q4_1_mm8(x, q4_1_blocks(16, 128)[:, ::2])
    with pytest.raises(RuntimeError, match="float32"):
        module.qmm8(x.double(), blocks, 0, 0)
    with pytest.raises(RuntimeError, match="2-D"):
        module.qmm8(x[0], blocks, 0, 0)
    with pytest.raises(RuntimeError, match="unknown format"):
        module.qmm8(x, blocks, 5, 0)
    with pytest.raises(RuntimeError, match="not compiled"):
        module.qmm8(x, blocks, 0, 9)
    with pytest.raises(ValueError, match="impl"):
        qgemm.q4_1_mm8(x, blocks, impl="sse9")
    with pytest.raises(ValueError, match="dimension"):
        qgemm.q4_1_mm8(torch.tensor(1.0), blocks)
    with pytest.raises(RuntimeError, match="float32"):
        qgemm.quantize_rows(x.double())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qgemm.quantize_rows(torch.randn(2, 40))
    with pytest.raises(RuntimeError, match="2-D"):
        qgemm.quantize_rows(x[0])
