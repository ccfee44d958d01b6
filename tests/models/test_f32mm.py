"""specdec's float32 product of a few rows (kernels/f32mm.cpp, `qgemm.f32_product`): the values of
x @ W.T, every row the same bits whatever else shares the product, the thread count or the
instruction set it was built for; and the lean float32 path multiplies through it."""

from __future__ import annotations

import pytest
import torch

from specdec import qgemm

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=f"qgemm unavailable: {qgemm.why_unavailable()}")

SHAPES = [(3072, 576), (576, 1536), (37, 45), (5, 16), (9, 1), (1, 33), (130, 17)]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic, written out: 16 partial sums, each a chain of fused multiply-adds over
    positions l, l + 16, .. (zeros past K), then the fixed tree (l + 8, l + 4, l + 2, l + 1)."""
    m, k = x.shape
    pad = -k % 16
    xs = torch.nn.functional.pad(x, (0, pad)).double().view(m, -1, 16)
    ws = torch.nn.functional.pad(w, (0, pad)).double().view(w.shape[0], -1, 16)
    s = torch.zeros(m, w.shape[0], 16, dtype=torch.float32)
    for c in range(xs.shape[1]):  # fma: the exact product plus s, rounded once (exact in float64 here)
        s = (xs[:, None, c, :] * ws[None, :, c, :] + s.double()).float()
    s = s[..., :8] + s[..., 8:]
    s = s[..., :4] + s[..., 4:]
    s = s[..., :2] + s[..., 2:]
    return s[..., 0] + s[..., 1]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_rows_have_one_value_whatever_shares_the_product(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    rows = qgemm.f32_rows()
    x = torch.randn(rows, k, generator=gen) * 3
    ext = qgemm.module()
    alone = torch.cat([ext.f32_mm(x[i : i + 1], w) for i in range(rows)])
    for m in range(1, rows + 1):  # every row count the kernel serves, rows from anywhere in x
        start = (m * 5) % (rows + 1 - m)
        assert torch.equal(ext.f32_mm(x[start : start + m], w), alone[start : start + m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ext.f32_mm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)
    expected = (x.double() @ w.double().T).float()
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5 * max(1.0, k ** 0.5))


@pytest.mark.parametrize(("n", "k"), [(37, 45), (5, 16), (9, 1), (130, 17), (64, 576)])
def test_each_output_is_the_documented_sequence(n: int, k: int) -> None:
    """The same bits as the arithmetic the source states, so that every build (scalar, AVX2,
    AVX-512) computes the same values."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(5, k, generator=gen)
    assert torch.equal(qgemm.module().f32_mm(x, w), _reference(x, w))


def test_product_routes_few_rows_to_the_kernel_and_more_to_aten() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    rows = qgemm.f32_rows()
    assert rows == 64
    assert qgemm.f32_tile() in ("6x4", "2x2", "1x1")  # AVX-512, AVX2, scalar (a step's costs key names it)
    few = torch.randn(2, 3, 64, generator=gen)  # 6 rows in a (2, 3, K) tensor
    assert torch.equal(qgemm.f32_product(few, w), qgemm.module().f32_mm(few.reshape(6, 64), w).view(2, 3, 48))
    many = torch.randn(rows + 1, 64, generator=gen)
    assert torch.equal(qgemm.f32_product(many, w), many @ w.T)
    half = few.to(torch.bfloat16)
    assert torch.equal(qgemm.f32_product(half, w.to(torch.bfloat16)), half @ w.to(torch.bfloat16).T)
    assert qgemm.f32_product(torch.zeros(0, 64), w).shape == (0, 48)
    strided = torch.randn(64, 4, generator=gen).T  # not contiguous
    assert torch.equal(qgemm.f32_product(strided, w), qgemm.module().f32_mm(strided.contiguous(), w))


def test_bad_shapes_say_what_is_wrong() -> None:
    ext = qgemm.module()
    with pytest.raises(RuntimeError, match="columns"):
        ext.f32_mm(torch.zeros(2, 8), torch.zeros(3, 9))
    with pytest.raises(RuntimeError, match="float32"):
        ext.f32_mm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8))


def test_lean_float32_path_multiplies_through_it(monkeypatch: pytest.MonkeyPatch, tiny_pair) -> None:
    """The lean Llama path's float32 products go through `f32_product` in both layer loops, and a
    step's head rows equal the same rows multiplied alone (what a verification pass scores)."""
    from specdec import load

    lm = load(tiny_pair["target"], draft="none", dtype="float32").target
    calls: list[tuple[int, ...]] = []
    real = qgemm.f32_product

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, w)

    monkeypatch.setattr(qgemm, "f32_product", counted)
    monkeypatch.setenv("SPECDEC_LAYER_LOOP", "python")
    view = lm.view(2)
    logits = view.forward([0], [0], [[5, 6, 7, 8]], [3])
    assert len(calls) == 4 * lm.n_layers + 1  # qkv, o, gate_up, down a layer, then the head
    hidden = torch.randn(3, lm.lm_head.shape[1])
    rows = qgemm.f32_product(hidden, lm.lm_head)
    assert all(torch.equal(rows[i], qgemm.f32_product(hidden[i : i + 1], lm.lm_head)[0]) for i in range(3))
    assert logits.shape[:2] == (1, 3)
