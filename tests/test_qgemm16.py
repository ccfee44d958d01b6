"""specdec.qgemm's bfloat16 kernel (AVX-512 BF16): activations and de-quantized weights rounded to bfloat16,
vdpbf16ps dot products accumulating in float32.

- the activations' and weights' rounding: torch's round-to-nearest-even bfloat16, bit for bit;
- products against a pure-torch reference of exactly the kernel's arithmetic (per lane of a block's pairs, from 0
  over the blocks in order: S + x[2i+1] w[2i+1], rounded, + x[2i] w[2i], rounded; the products of two bfloat16
  values are exact in float32; then the fixed tree T, U, V, y): equal, bit for bit;
- against the float64 product of the unrounded operands within bfloat16's rounding;
- rows invariant (M = 1 against any row of M = 2..9, 15-17, 47-49 (the register-blocked kernel from 48), 64;
  1 and 2 threads); bad inputs raise; a CPU without avx512_bf16 gets no such kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec import qgemm
from tests.test_qgemm import ROW_COUNTS, assert_rows_invariant, q4_1_blocks, q8_0_blocks

pytestmark = pytest.mark.skipif(not qgemm.available() or not qgemm.has_bf16_kernel(),
                                reason="no bfloat16 kernel here (needs the extension and a CPU with avx512_bf16)")

FORMATS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "q4_1": (q4_1_blocks, qgemm.q4_1_mm16, qgemm.dequantize_q4_1),
    "q8_0": (q8_0_blocks, qgemm.q8_0_mm16, qgemm.dequantize_q8_0),
}


def reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: x (M, K) float32, dense (N, K) the de-quantized float32 weights."""
    xb, wb = x.bfloat16().float(), dense.bfloat16().float()
    m, k = xb.shape
    n = wb.shape[0]
    xs = xb.reshape(m, 1, k // 32, 16, 2)
    ws = wb.reshape(1, n, k // 32, 16, 2)
    prod = xs * ws  # exact in float32: 8-bit by 8-bit significands
    s = torch.zeros(m, n, 16)
    for b in range(k // 32):
        s = (s + prod[:, :, b, :, 1]) + prod[:, :, b, :, 0]  # float32 adds, each rounded
    t = s[..., :8] + s[..., 8:]
    u = t[..., :4] + t[..., 4:]
    v = u[..., :2] + u[..., 2:]
    return v[..., 0] + v[..., 1]


def test_activations_round_to_nearest_even() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 3, 96)
    assert torch.equal(qgemm.round_bf16(x), x.bfloat16())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k,m", [(37, 64, 1), (50, 576, 5), (19, 1536, 9), (33, 576, 23), (33, 576, 47),
                                   (70, 96, 48), (64, 576, 64)])
def test_matches_the_reference_bit_for_bit(fmt: str, n: int, k: int, m: int) -> None:
    make, mm, dequantize = FORMATS[fmt]
    blocks = make(n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    dense = dequantize(blocks)
    out = mm(x, blocks)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.equal(out, reference(x, dense))
    # and within bfloat16's rounding of both operands of the unrounded product
    exact = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    assert bool(((out.double() - exact).abs() <= 2 * 2.0**-8 * scale + 1e-30).all())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 64)])
def test_rows_are_invariant(fmt: str, n: int, k: int, threads: Callable[[int], None]) -> None:
    """Row r of a product has the bits of that row alone, whatever the other rows, the row count (one tile,
    several, the register-blocked kernel) and the thread count."""
    make, mm, _ = FORMATS[fmt]
    sizes = (*ROW_COUNTS, 23, 24, 47, 48, 49, 64)  # and across the register-blocked kernel's threshold (48)
    assert_rows_invariant(lambda x, b, impl="auto": mm(x, b), make(n, k, seed=11), k, threads, ["auto"], sizes)


def test_shapes_casts_and_bad_inputs() -> None:
    blocks = q4_1_blocks(10, 64)
    x = torch.randn(2, 3, 64)
    out = qgemm.q4_1_mm16(x, blocks)
    assert out.shape == (2, 3, 10) and torch.equal(out, qgemm.q4_1_mm16(x.reshape(6, 64), blocks).reshape(2, 3, 10))
    assert torch.equal(qgemm.q4_1_mm16(x.double(), blocks), out)
    assert qgemm.q4_1_mm16(torch.randn(0, 64), blocks).shape == (0, 10)
    with pytest.raises(RuntimeError, match="blocks hold K = 64"):
        qgemm.q4_1_mm16(torch.randn(2, 96), blocks)
    with pytest.raises(RuntimeError, match="blocks must have shape"):
        qgemm.q8_0_mm16(torch.randn(2, 64), blocks)
