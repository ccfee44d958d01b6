"""The bfloat16 kernel's products with each block's dot products on the AMX tile unit (kernel "amx"): the same
panels and arithmetic outside the block sums, which the tile unit adds in its own order.

- products within float32 rounding of the vdpbf16ps kernel's (`q4_1_mm16`, `q8_0_mm16`: the same bfloat16
  activations, exact weights, d and m per block) and within bfloat16's rounding of the float64 product;
- rows invariant (a row's bits alone = in any product of 2..64 rows, 1 and 2 threads), the property that lets a
  verification pass score what one-token steps do;
- the layer loop's product (step.cpp) is the kernel's; `kernel_choice` takes it by default where the tile unit is.
Skipped where the CPU has no AMX (amx_bf16) or the system refuses the tile state.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec import qgemm
from tests.models.test_qgemm import ROW_COUNTS, assert_rows_invariant, q4_1_blocks, q8_0_blocks

pytestmark = pytest.mark.skipif(not qgemm.available() or not qgemm.has_amx_kernel(),
                                reason="no AMX tile unit here (needs the extension and a CPU with amx_bf16)")

SHAPES = [(37, 64, 1), (50, 576, 2), (48, 576, 5), (19, 1536, 9), (33, 576, 16), (33, 576, 23), (64, 576, 64)]


def within(out: torch.Tensor, other: torch.Tensor, x: torch.Tensor, w: torch.Tensor, k: int) -> None:
    """out within float32 rounding of the block sums (2^-24 per add, 32 adds a block) of `other`, and within bfloat16's
    rounding of the activations of the float64 product."""
    scale = x.bfloat16().double().abs() @ w.double().abs().T
    assert bool(((out.double() - other.double()).abs() <= 64 * 2.0**-24 * scale + 1e-30).all())
    exact = x.double() @ w.double().T
    assert bool(((out.double() - exact).abs() <= 2.0**-8 * x.double().abs() @ w.double().abs().T + 1e-30).all())


FORMATS = {"Q4_1": (q4_1_blocks, qgemm.panel_q4_1, qgemm.dequantize_q4_1, qgemm.q4_1_mm16, qgemm.q4_1_mm_amx),
           "Q8_0": (q8_0_blocks, qgemm.panel_q8_0, qgemm.dequantize_q8_0, qgemm.q8_0_mm16, qgemm.q8_0_mm_amx)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_agrees_with_the_dot_kernel(fmt: str, n: int, k: int, m: int) -> None:
    make, panel, dequantize, mm16, mm_amx = FORMATS[fmt]
    blocks = make(n, k, seed=n + m)
    panels = panel(blocks)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = mm_amx(x, panels)
    assert out.dtype == torch.float32 and out.shape == (m, -(-n // 16) * 16) and not out[:, n:].any()
    within(out[:, :n], mm16(x, panels)[:, :n], x, dequantize(blocks), k)


def test_the_tile_unit_adds_in_its_own_order() -> None:
    """Why a process uses one unit for every product: on random rows some block sums differ from vdpbf16ps's (if this
    ever fails, the two kernels agree here and one-token steps could take the cheaper one)."""
    panels = qgemm.panel_q4_1(q4_1_blocks(256, 576, seed=3))
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(qgemm.q4_1_mm_amx(x, panels), qgemm.q4_1_mm16(x, panels))


@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 64)])
def test_rows_are_invariant(n: int, k: int, threads: Callable[[int], None]) -> None:
    sizes = (*ROW_COUNTS, 16, 17, 23, 24, 31, 32, 33, 47, 48, 49, 64)
    panels = qgemm.panel_q4_1(q4_1_blocks(n, k, seed=11))
    assert_rows_invariant(lambda x, p, impl="auto": qgemm.q4_1_mm_amx(x, p), panels, k, threads, ["auto"], sizes)


def test_q8_0_rows_are_invariant(threads: Callable[[int], None]) -> None:
    sizes = (*ROW_COUNTS, 16, 17, 33, 64)
    panels = qgemm.panel_q8_0(q8_0_blocks(1024, 576, seed=5))
    assert_rows_invariant(lambda x, p, impl="auto": qgemm.q8_0_mm_amx(x, p), panels, 576, threads, ["auto"], sizes)


def test_the_layer_loops_product_is_the_kernels() -> None:
    from specdec import layerloop

    module = qgemm.module()
    for fmt, blocks, panel, mm in ((0, q4_1_blocks(37, 96, seed=4), qgemm.panel_q4_1, qgemm.q4_1_mm_amx),
                                   (1, q8_0_blocks(37, 96, seed=6), qgemm.panel_q8_0, qgemm.q8_0_mm_amx)):
        panels = panel(blocks)
        product = module.Product(layerloop._KINDS["amx"], panels, fmt + 2, [], [], 37, 96, False)
        x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(1))
        assert torch.equal(product.mm(x).reshape(6, 37), mm(x.reshape(6, 96), panels)[:, :37])


def test_bad_inputs() -> None:
    panels = qgemm.panel_q4_1(q4_1_blocks(16, 64))
    assert qgemm.q4_1_mm_amx(torch.randn(0, 64), panels).shape == (0, 16)
    with pytest.raises(RuntimeError, match="panels hold K = 64"):
        qgemm.q4_1_mm_amx(torch.randn(2, 96), panels)
    with pytest.raises(RuntimeError, match="format"):
        qgemm.module().qmm16(torch.randn(2, 64), panels, 4)
