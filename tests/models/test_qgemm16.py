"""specdec.qgemm's bfloat16 kernel (AVX-512 BF16): Q4_1 weights regrouped in panels of 16 rows, activations rounded
to bfloat16, the codes' dot products by vdpbf16ps accumulating in float32, each block's d and m applied after.

- the panels hold the file's bytes (a round trip), rows of zeros up to a multiple of 16;
- the activations' rounding: torch's round-to-nearest-even bfloat16, bit for bit;
- products against a pure-torch reference of exactly the kernel's arithmetic (per output, for each block, with the
  codes as c = 128 + q: even pairs E = (E + x[2i+1] c[2i+1]) + x[2i] c[2i] from 0, odd pairs O likewise,
  T = T + d (E + O); then M = M + (m - 128 d) s over the blocks, s the block's bfloat16 activations summed in
  position order; y = T + M): equal, bit for bit;
- against the float64 product of the unrounded activations within bfloat16's rounding of them (weights exact);
- rows invariant (M = 1 against any row of M = 2..9, 15-17, 23-24, 47-49, 64; 1 and 2 threads); bad inputs raise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec import qgemm
from tests.models.test_qgemm import ROW_COUNTS, assert_rows_invariant, q4_1_blocks

pytestmark = pytest.mark.skipif(not qgemm.available() or not qgemm.has_bf16_kernel(),
                                reason="no bfloat16 kernel here (needs the extension and a CPU with avx512_bf16)")


def reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: x (M, K) float32, blocks (N, K/32, 20) Q4_1."""
    xb = x.bfloat16().float()
    n, kb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, kb).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, kb).float()
    q = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=-1).float()  # (N, KB, 32) positions
    c = 128 + q  # the codes as the kernel multiplies them (bfloat16 words 0x4300 | q)
    rows = xb.shape[0]
    prod = xb.reshape(rows, 1, kb, 16, 2) * c.reshape(1, n, kb, 16, 2)  # exact: 8-bit by 8-bit significands
    t = torch.zeros(rows, n)
    for b in range(kb):
        e, o = torch.zeros(rows, n), torch.zeros(rows, n)
        for i in range(0, 16, 2):
            e = (e + prod[:, :, b, i, 1]) + prod[:, :, b, i, 0]  # float32 adds, each rounded
            o = (o + prod[:, :, b, i + 1, 1]) + prod[:, :, b, i + 1, 0]
        t = t + d[:, b] * (e + o)
    s = torch.zeros(rows, kb)
    for pos in range(32):
        s = s + xb.reshape(rows, kb, 32)[:, :, pos]
    mins = torch.zeros(rows, n)
    for b in range(kb):
        mins = mins + (m[:, b] - d[:, b] * 128) * s[:, b : b + 1]
    return t + mins


def test_panels_hold_the_files_bytes() -> None:
    for n in (16, 37, 64):
        blocks = q4_1_blocks(n, 96, seed=n)
        panels = qgemm.panel_q4_1(blocks)
        rows = -(-n // 16) * 16
        assert panels.shape == (rows // 16, 3, 320) and panels.dtype == torch.uint8
        back = qgemm.unpanel_q4_1(panels)
        assert torch.equal(back[:n], blocks) and not back[n:].any()  # rows of zeros up to a multiple of 16
    with pytest.raises(ValueError, match="blocks must be uint8"):
        qgemm.panel_q4_1(torch.zeros(16, 3, 34, dtype=torch.uint8))
    with pytest.raises(ValueError, match="panels must be uint8"):
        qgemm.unpanel_q4_1(torch.zeros(1, 3, 20, dtype=torch.uint8))


def test_activations_round_to_nearest_even() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 3, 96)
    assert torch.equal(qgemm.round_bf16(x), x.bfloat16())


@pytest.mark.parametrize("n,k,m", [(37, 64, 1), (50, 576, 2), (48, 576, 5), (19, 1536, 9), (33, 576, 8),
                                   (33, 576, 23), (70, 96, 48), (64, 576, 64)])
def test_matches_the_reference_bit_for_bit(n: int, k: int, m: int) -> None:
    blocks = q4_1_blocks(n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = qgemm.q4_1_mm16(x, qgemm.panel_q4_1(blocks))
    rows = -(-n // 16) * 16
    assert out.dtype == torch.float32 and out.shape == (m, rows)
    assert torch.equal(out[:, :n], reference(x, blocks)) and not out[:, n:].any()
    # and within bfloat16's rounding of the activations of the exact product (the weights are not rounded)
    exact = x.double() @ qgemm.dequantize_q4_1(blocks).double().T
    scale = x.double().abs() @ qgemm.dequantize_q4_1(blocks).double().abs().T
    assert bool(((out[:, :n].double() - exact).abs() <= 2.0**-8 * scale + 1e-30).all())


@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 64)])
def test_rows_are_invariant(n: int, k: int, threads: Callable[[int], None]) -> None:
    """Row r of a product has the bits of that row alone, whatever the other rows, the row count (one tile of up
    to 8 rows, tiles of near-equal heights beyond) and the thread count."""
    sizes = (*ROW_COUNTS, 23, 24, 47, 48, 49, 64)
    assert_rows_invariant(lambda x, p, impl="auto": qgemm.q4_1_mm16(x, p), qgemm.panel_q4_1(q4_1_blocks(n, k, seed=11)),
                          k, threads, ["auto"], sizes)


def test_shapes_casts_and_bad_inputs() -> None:
    panels = qgemm.panel_q4_1(q4_1_blocks(16, 64))
    x = torch.randn(2, 3, 64)
    out = qgemm.q4_1_mm16(x, panels)
    assert out.shape == (2, 3, 16) and torch.equal(out, qgemm.q4_1_mm16(x.reshape(6, 64), panels).reshape(2, 3, 16))
    assert torch.equal(qgemm.q4_1_mm16(x.double(), panels), out)
    assert qgemm.q4_1_mm16(torch.randn(0, 64), panels).shape == (0, 16)
    with pytest.raises(RuntimeError, match="panels hold K = 64"):
        qgemm.q4_1_mm16(torch.randn(2, 96), panels)
    with pytest.raises(RuntimeError, match="panels must be contiguous uint8"):
        qgemm.q4_1_mm16(torch.randn(2, 64), q4_1_blocks(16, 64))


def test_the_layer_loops_product_returns_the_weights_rows_only() -> None:
    """A weight whose rows are not a multiple of 16 (panels padded with rows of zeros): the layer loop's product
    (step.cpp) returns its own rows, with the kernel's bits."""
    from specdec import layerloop

    module = qgemm.module()
    blocks = q4_1_blocks(37, 96, seed=4)
    panels = qgemm.panel_q4_1(blocks)
    product = module.Product(layerloop._KINDS["blocks16"], panels, 0, [], [], 37, 96, False)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(1))
    out = product.mm(x)
    assert out.shape == (2, 3, 37)
    assert torch.equal(out.reshape(6, 37), qgemm.q4_1_mm16(x.reshape(6, 96), panels)[:, :37])


# ------------------------------------------------------------------------------------------- Q8_0 panels
def reference8(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The Q8_0 kernel's arithmetic in torch: x (M, K) float32, blocks (N, K/32, 34) Q8_0; per output, for each
    block, even pairs E = (E + x[2i+1] q[2i+1]) + x[2i] q[2i] from 0, odd pairs O likewise, y = y + d (E + O)."""
    xb = x.bfloat16().float()
    n, kb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, kb).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # (N, KB, 32): every int8 exact in bfloat16
    rows = xb.shape[0]
    prod = xb.reshape(rows, 1, kb, 16, 2) * q.reshape(1, n, kb, 16, 2)  # exact
    t = torch.zeros(rows, n)
    for b in range(kb):
        e, o = torch.zeros(rows, n), torch.zeros(rows, n)
        for i in range(0, 16, 2):
            e = (e + prod[:, :, b, i, 1]) + prod[:, :, b, i, 0]
            o = (o + prod[:, :, b, i + 1, 1]) + prod[:, :, b, i + 1, 0]
        t = t + d[:, b] * (e + o)
    return t


def test_q8_0_panels_hold_the_files_bytes() -> None:
    from tests.models.test_qgemm import q8_0_blocks

    for n in (16, 37, 64):
        blocks = q8_0_blocks(n, 96, seed=n)
        panels = qgemm.panel_q8_0(blocks)
        assert panels.shape == (-(-n // 16), 3, 544) and panels.dtype == torch.uint8
        back = qgemm.unpanel_q8_0(panels)
        assert torch.equal(back[:n], blocks) and not back[n:].any()
    with pytest.raises(ValueError, match="blocks must be uint8"):
        qgemm.panel_q8_0(torch.zeros(16, 3, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="panels must be uint8"):
        qgemm.unpanel_q8_0(torch.zeros(1, 3, 320, dtype=torch.uint8))


@pytest.mark.parametrize("n,k,m", [(37, 64, 1), (50, 576, 2), (48, 576, 5), (19, 1536, 9), (33, 576, 8),
                                   (33, 576, 23), (64, 576, 64)])
def test_q8_0_matches_the_reference_bit_for_bit(n: int, k: int, m: int) -> None:
    from tests.models.test_qgemm import q8_0_blocks

    blocks = q8_0_blocks(n, k, seed=n + m)  # codes -128..127
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = qgemm.q8_0_mm16(x, qgemm.panel_q8_0(blocks))
    assert out.dtype == torch.float32 and out.shape == (m, -(-n // 16) * 16)
    assert torch.equal(out[:, :n], reference8(x, blocks)) and not out[:, n:].any()
    exact = x.double() @ qgemm.dequantize_q8_0(blocks).double().T
    scale = x.double().abs() @ qgemm.dequantize_q8_0(blocks).double().abs().T
    assert bool(((out[:, :n].double() - exact).abs() <= 2.0**-8 * scale + 1e-30).all())


@pytest.mark.parametrize("n,k", [(1024, 576), (37, 64)])
def test_q8_0_rows_are_invariant(n: int, k: int, threads: Callable[[int], None]) -> None:
    from tests.models.test_qgemm import q8_0_blocks

    sizes = (*ROW_COUNTS, 23, 24, 47, 48, 49, 64)
    assert_rows_invariant(lambda x, p, impl="auto": qgemm.q8_0_mm16(x, p), qgemm.panel_q8_0(q8_0_blocks(n, k, seed=5)),
                          k, threads, ["auto"], sizes)


def test_the_layer_loops_q8_0_product_is_the_kernels() -> None:
    """A Q8_0 weight in panels in the layer loop (step.cpp): its product has the kernel's bits (the format picks the
    kernel; the raw layers' product into a buffer: tests/prophets/test_eagle3.py, a layer of Q8_0 products)."""
    from specdec import layerloop
    from tests.models.test_qgemm import q8_0_blocks

    module = qgemm.module()
    blocks = q8_0_blocks(37, 96, seed=6)
    panels = qgemm.panel_q8_0(blocks)
    product = module.Product(layerloop._KINDS["blocks16"], panels, 1, [], [], 37, 96, False)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(2))
    assert torch.equal(product.mm(x).reshape(6, 37), qgemm.q8_0_mm16(x.reshape(6, 96), panels)[:, :37])
    assert torch.equal(qgemm.q8_0_mm16(x.reshape(6, 96), panels)[:, :37], reference8(x.reshape(6, 96), blocks))
