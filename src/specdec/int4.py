"""4-bit weights on the lean path (`--dtype int4`): a GGUF file's own blocks, multiplied natively.

A Q4_1 block of a GGUF file holds 32 weights as codes q in 0..15 with a scale d and a
minimum m (fp16): w = d*q + m. That is groupwise asymmetric int4 with groups of 32, which
PyTorch's CPU kernel `aten._weight_int4pack_mm_for_cpu` multiplies without de-quantizing
the matrix: it computes w = (q - 8) * scale + zero per group (checked numerically in
tests/models/test_int4.py), so a Q4_1 block maps to scale = d and zero = m + 8d, and its codes
are packed as they are. The kernel reads scales and zeros in the activations' dtype,
which is bfloat16 for its vectorized path (float32 activations run a scalar loop, ~20x
slower): d and m + 8d are rounded to bfloat16 (a relative 2^-9 each), the activations are
rounded to bfloat16 before each product, the kernel accumulates in float32 and rounds
its output to bfloat16. Everything between the products (residual stream, norms, rotary,
attention, the KV cache) stays float32.

What each tensor of a GGUF file becomes (`from_gguf`):
- Q4_1: one 4-bit plane, from the file's codes (no de-quantization, no re-quantization);
- Q4_0 (w = d (q - 8)): the same, as Q4_1 with m = -8d (`read_q4_0`);
- Q5_0 (w = d (q - 16), q in 0..31): Q8_0 with codes q - 16 (`read_q5_0`);
- Q8_0 (SmolLM2's tied embedding/head, 49152 x 576): two 4-bit planes, exact: a block's
  int8 code q = 16*hi + lo (lo = q & 15, hi = q >> 4) is hi+8 with scale 16d and zero 0,
  plus lo with scale d and zero 8d; the head's product is the sum of the two (10 bits a
  weight read, against 32 in float32). The embedding lookup reads the same blocks
  (`BlockEmbedding`: int8 codes and scales, the float table's very bits in a quarter of its memory).
- every other format (Q4_K, Q5_1, Q5_K, Q6_K, F16, BF16, F32): quantized again from the float32
  weights transformers de-quantized (`requantized`: Q4_K as Q4_1, the others as Q8_0, never fewer
  bits than the file holds), and so is a fused product (q/k/v, gate/up) whose parts the file holds
  in different formats; norms stay float32.
A model that is not a GGUF file is quantized here by the same rules (`from_float`): Q4_1's
min/max rule for the layers' matrices, Q8_0's for the head.

Exactness: every row of the kernel's product is computed alike whatever the row count
(blocks of 4 rows, each output a float32 FMA chain over K in order); `int4_row_policy`
checks this on this machine's kernel once per weight shapes, and runs each row alone
("solo") where it fails, so a verification pass of K+1 rows scores exactly what K+1
one-token steps would.

Cost: the kernel de-quantizes the weights once per block of 4 rows, so a product of M
rows costs about ceil(M/4) one-row products (a float32 product of a few rows costs about
one): 4-bit steps are cheap, verification passes much less so.

The blocks kernels (`specdec.qgemm`, built for this CPU on first use; `kernel_choice`) read the
GGUF blocks as they are (Q8_0 as one 8-bit plane, not two 4-bit ones), each block unpacked once
per tile of rows, chosen by SPECDEC_INT4_KERNEL (by default "amx" on a CPU with amx_bf16, "blocks16"
on one with avx512_bf16, else "blocks"; PyTorch's where the extension does not build: `kernel_choice`
says why). "blocks":
float32 activations (not bfloat16) by weights de-quantized exactly (w = fma(d, q, m)); "blocks16":
activations rounded to bfloat16 multiplied with the 4-bit codes by AVX-512 BF16 dot products (twice
float32's multiply-adds an instruction), each block's d and m applied after in float32 (the weights
exact), on Q4_1 weights regrouped once in panels of 16 rows (`qgemm.panel_q4_1`); "amx": the same
panels, each block's dot products on the AMX tile unit (a block of a panel decoded once into a tile
of codes for every row of the product);
"blocks8": the activations quantized to int8 per block of 32 (llama.cpp's scheme: dx = max|x| / 127)
and integer dot products (vpdpbusd on AVX-512 VNNI), faster with several rows but of llama.cpp's quality.
All three keep rows invariant by construction (one fixed order of operations per output element,
whatever the row count or thread count; the same probe checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec import qgemm  # its kernels build lazily, on first use: importing it costs nothing

GROUP = 32  # weights per block: Q4_1's and Q8_0's, and the kernel's group size
INT4 = torch.quint4x2  # how `--dtype int4` is named among torch dtypes (load(dtype=INT4) or "int4")
ATTR = "specdec_int4"  # the attribute of a loaded model that holds its 4-bit weights
_ROWS_ALIGN = 16  # the kernel takes output rows in blocks of 16..64
_INNER_K_TILES = 2  # the CPU packing's argument (K must be a multiple of 16 * this)


KERNELS = ("auto", "amx", "blocks16", "blocks8", "blocks", "torch")


def kernel_choice() -> str:
    """Which kernel 4-bit products run on: "torch" (PyTorch's int4 kernel: bfloat16 activations),
    "blocks" (`specdec.qgemm`'s float kernel: float32 activations, weights de-quantized exactly),
    "blocks16" (its bfloat16 kernel: activations rounded to bfloat16, the codes' dot products by
    AVX-512 BF16 instructions, d and m per block after; Q4_1 and Q8_0 weights in panels of 16 rows:
    SmolLM2's Q8_0 head there costs about the float kernel's time for one row and 0.4-0.5x for 5-16
    rows, where the float kernel is compute-bound) or "blocks8" (its int8
    kernel: activations quantized to int8 blocks as llama.cpp does, integer dot products).
    "amx" is blocks16 with each block's dot products on the CPU's AMX tile unit (TDPBF16PS: a block of
    16 weight rows decoded once into a tile of bfloat16 codes, shared by every row of the product),
    which adds in its own order: its bits are not blocks16's, so one kernel serves a process.
    SPECDEC_INT4_KERNEL chooses; "auto" (the default) takes "amx" where the extension builds with it
    and the system lends the tile unit (a CPU with amx_bf16), else "blocks16" where it builds with
    that (a CPU with avx512_bf16), else "blocks" where the extension builds (scripts/setup builds
    it), else "torch":
    - on a 2-core Intel Xeon (Sapphire Rapids), SmolLM2 loaded on blocks16 and on amx in one process
      (docs/reports/bench-amx): a one-row product costs 1.00-1.09x blocks16's, a 5-row one 0.45-0.55x;
      a verification pass of 8 tokens 1.7 one-token steps against 2.9; on Spec-Bench (12 questions,
      128 tokens) plain decoding 1.29x blocks16's (prompts read 1.4-1.6x faster, short answers the
      same) and the default decoder greedy 1.59x blocks16's plain decoding (blocks16's own: 1.09x);
    - on a 2-core AMD EPYC Zen 4 (avx512_bf16), SmolLM2 loaded on blocks16 and on blocks in one
      process, steps alternated (two runs): a one-token step takes 0.82-0.97x blocks' time (200 and
      1,000 tokens of context), a 5-token verification pass 0.64-0.84x, a 600-token prompt 0.66-0.71x; on
      Spec-Bench (12 questions, greedy) plain decoding on blocks16 ran 1.97x llama.cpp's on the same
      file (an earlier blocks16, which rounded the weights to bfloat16, ran one-token steps 1.07x
      slower than blocks);
    - without AVX-512 (a 2-core AMD EPYC Zen 3, AVX2 only), PyTorch's kernel has no fast path:
      SmolLM2's products cost 1.3-1.5x the blocks kernel's for one row and 1.5-1.7x for five
      (a verification pass), and its bfloat16 activations round more;
    - int8 activations cost llama.cpp's quality: SmolLM2 then answers "What is the capital of
      France?" as llama.cpp does on the same file ("L'Étoile, la Marseillaise, ..."), where
      float32, bf16 and the other kernels say Paris: blocks8 is never the default.
    A blocks kernel asked for where the extension cannot build (or blocks16 on a CPU without
    avx512_bf16) is an error that says why."""
    from specdec.defaults import choice

    want = choice("SPECDEC_INT4_KERNEL", KERNELS)
    if want == "auto":
        if not qgemm.available():
            return "torch"
        if qgemm.has_amx_kernel():
            return "amx"
        return "blocks16" if qgemm.has_bf16_kernel() else "blocks"
    if want == "torch":
        return "torch"
    if not qgemm.available():
        raise ValueError(f"SPECDEC_INT4_KERNEL={want}, but the kernel does not build here: {qgemm.why_unavailable()}")
    if want == "amx" and not qgemm.has_amx_kernel():
        raise ValueError("SPECDEC_INT4_KERNEL=amx needs a CPU with amx_bf16 (and a system that lets this process use "
                         "its tile unit), which this one lacks; use blocks16, blocks or auto")
    if want == "blocks16" and not qgemm.has_bf16_kernel():
        raise ValueError("SPECDEC_INT4_KERNEL=blocks16 needs a CPU with avx512_bf16, which this one lacks; "
                         "use blocks (float32 activations) or auto")
    return want


_BLOCK_PRODUCTS = {("blocks", "Q4_1"): "q4_1_mm", ("blocks", "Q8_0"): "q8_0_mm",
                   ("blocks8", "Q4_1"): "q4_1_mm8", ("blocks8", "Q8_0"): "q8_0_mm8",
                   ("blocks16", "Q4_1x16"): "q4_1_mm16", ("blocks16", "Q8_0x16"): "q8_0_mm16",
                   ("amx", "Q4_1x16"): "q4_1_mm_amx", ("amx", "Q8_0x16"): "q8_0_mm_amx"}
_PANEL_KERNELS = ("blocks16", "amx")  # the kernels that read panels
# the bfloat16 kernel's panels of each file kind: kind in panels, regrouping, its inverse
_PANELS = {"Q4_1": ("Q4_1x16", qgemm.panel_q4_1, qgemm.unpanel_q4_1),
           "Q8_0": ("Q8_0x16", qgemm.panel_q8_0, qgemm.unpanel_q8_0)}
_FILE_KIND = {panels: kind for kind, (panels, _, _) in _PANELS.items()}


@dataclass
class Blocks:
    """A whole (N, K) weight as GGUF blocks, for `specdec.qgemm`'s kernel: kind "Q4_1"
    (N, K/32, 20) or "Q8_0" (N, K/32, 34) uint8, the file's own bytes (rows in Hugging Face's order),
    or "Q4_1x16": the same bytes regrouped in panels of 16 rows for the bfloat16 kernel
    (N/16, K/32, 320, rows of zeros added up to a multiple of 16; `qgemm.panel_q4_1`)."""

    kind: str
    data: torch.Tensor

    def file_blocks(self) -> Blocks:
        """These weights in the file's layout (kind "Q4_1" or "Q8_0"; panels' rows of zeros kept)."""
        kind = _FILE_KIND.get(self.kind)
        return self if kind is None else Blocks(kind, _PANELS[kind][2](self.data))

    def rows(self, index: torch.Tensor) -> Blocks:
        """Rows `index` in that order, in the file's layout."""
        blocks = self.file_blocks()
        return Blocks(blocks.kind, blocks.data[index])

    def for_kernel(self, kernel: str) -> Blocks:
        """These weights in the layout `kernel` reads (panels for "blocks16" and "amx")."""
        if kernel in _PANEL_KERNELS and self.kind in _PANELS:
            panels, regroup, _ = _PANELS[self.kind]
            return Blocks(panels, regroup(self.data))
        if kernel not in _PANEL_KERNELS and self.kind in _FILE_KIND:
            return self.file_blocks()
        return self


@dataclass
class Codes:
    """One 4-bit plane of a (N, K) weight before packing: w = (q - 8) * scale + zero per group
    of 32 along K. q (N, K) uint8 in 0..15; scale, zero (N, K/32) float32. The first plane of
    a weight may carry `blocks`: the whole weight (all its planes) as GGUF blocks."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    blocks: Blocks | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weights this plane holds, scales and zeros as the kernel reads them (bf16)."""
        s = self.scale.bfloat16().float().repeat_interleave(GROUP, dim=1)
        z = self.zero.bfloat16().float().repeat_interleave(GROUP, dim=1)
        return (self.q.float() - 8) * s + z

    def rows(self, index: torch.Tensor) -> Codes:
        blocks = self.blocks.rows(index) if self.blocks is not None else None
        return Codes(self.q[index], self.scale[index], self.zero[index], blocks)


def cat_codes(parts: Sequence[Sequence[Codes]]) -> list[Codes]:
    """Planes of weights stacked along N (a fused product), plane by plane (and their blocks,
    where every part has blocks of one kind)."""
    planes = [Codes(torch.cat([p[i].q for p in parts]), torch.cat([p[i].scale for p in parts]),
                    torch.cat([p[i].zero for p in parts])) for i in range(len(parts[0]))]
    blocks = [p[0].blocks for p in parts]
    if all(b is not None for b in blocks) and len({b.kind for b in blocks if b is not None}) == 1:
        planes[0].blocks = Blocks(blocks[0].kind, torch.cat([b.data for b in blocks if b is not None]))  # type: ignore[union-attr]
    return planes


class Int4Weight:
    """A (rows, K) weight held as 4-bit planes for the CPU int4 kernel: x @ W.T is the sum
    of the planes' products (one plane for Q4_1, two for Q8_0), in x's dtype.

    Where the planes carry the weight's GGUF blocks and `specdec.qgemm` builds on this machine
    (`kernel_choice`), the product runs on the blocks instead ("blocks": float32 activations,
    weights de-quantized exactly; "blocks8": int8 activations, integer dot products; each
    block unpacked once for all rows of a product) and the planes are not packed for PyTorch's
    kernel ("torch")."""

    def __init__(self, planes: Sequence[Codes]) -> None:
        n, k = planes[0].q.shape
        if k % GROUP or k % (16 * _INNER_K_TILES):
            raise ValueError(f"int4 weights need K a multiple of {GROUP}, got {k}")
        self.shape = torch.Size((n, k))
        self.out_rows = n  # rows returned: the first `out_rows` (see first_rows)
        self.planes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.family = kernel_choice()  # the kernel asked for (every block kind runs on it)
        self.blocks: Blocks | None = None
        self.kernel, self.block_product = "torch", ""
        if self.family != "torch" and planes[0].blocks is not None:
            self._set_blocks(planes[0].blocks)
            return
        pad = -n % _ROWS_ALIGN
        with torch.no_grad():
            for p in planes:
                q, scale, zero = p.q.to(torch.int32), p.scale.float(), p.zero.float()
                if pad:  # rows of zeros (scale 0, zero 0), sliced off each product
                    q = torch.cat([q, torch.full((pad, k), 8, dtype=torch.int32)])
                    scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
                    zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INNER_K_TILES)
                scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
                self.planes.append((packed, scales_zeros))  # scales_zeros (K/32, N, 2)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: packed codes, scales and zeros (or the blocks)."""
        if self.blocks is not None:
            return self.blocks.data.numel()
        return sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in self.planes)

    def _set_blocks(self, blocks: Blocks) -> None:
        """Multiply from `blocks`: the kernel for their kind, in the layout it reads, and its qgemm
        function (chosen once; looked up by name, as profilers wrap it)."""
        self.kernel = self.family  # every block kind runs on the kernel asked for
        self.blocks = blocks.for_kernel(self.kernel)
        self.block_product = _BLOCK_PRODUCTS[(self.kernel, self.blocks.kind)]

    def first_rows(self, n: int) -> Int4Weight:
        """The same weights, products returning their first n rows only (a head sliced to the vocabulary)."""
        if n == self.out_rows:
            return self
        # the rows past n are never multiplied (but panels' rows of zeros up to a multiple of 16)
        if self.blocks is None:
            return self._with_rows(n, None)
        blocks = self.blocks.file_blocks()
        return self._with_rows(n, Blocks(blocks.kind, blocks.data[:n]))

    def block_rows(self, index: torch.Tensor) -> Int4Weight | None:
        """The weight's rows `index` (in that order) as a weight of their own on the same block
        kernel (a feature prophet's head cut to its draft vocabulary: the target's own bytes,
        a quarter of float32's for Q8_0), or None where the product does not run on blocks."""
        if self.blocks is None:
            return None
        return self._with_rows(len(index), self.blocks.rows(index.to(self.blocks.data.device)))

    def _with_rows(self, n: int, blocks: Blocks | None) -> Int4Weight:
        """This weight returning n rows, multiplied from `blocks` (everything else shared)."""
        other = object.__new__(Int4Weight)
        other.__dict__.update(self.__dict__)
        other.out_rows, other.shape = n, torch.Size((n, self.shape[1]))
        if blocks is not None:
            other._set_blocks(blocks)
        return other

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (M, K) -> (M, out_rows) float32 (flat bfloat16 for PyTorch's kernel, float32 for the blocks')."""
        if self.blocks is not None:
            full: torch.Tensor = getattr(qgemm, self.block_product)(flat, self.blocks.data)
            return full if full.shape[1] == self.out_rows else full[:, : self.out_rows]  # panels' rows of zeros
        out: torch.Tensor | None = None
        for packed, scales_zeros in self.planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_zeros).float()
            out = part if out is None else out + part
        assert out is not None
        return out if out.shape[1] == self.out_rows else out[:, : self.out_rows]

    def mm(self, x: torch.Tensor, rows: str = "none") -> torch.Tensor:
        """x (..., K) @ W.T in x's dtype. rows: "none" (all rows in one product) or "solo"
        (each row alone, where the kernel's rows depend on the row count; see int4_row_policy)."""
        k = self.shape[1]
        act = torch.float32 if self.blocks is not None else torch.bfloat16
        flat = x.reshape(-1, k).to(act).contiguous()
        if flat.shape[0] == 0:
            out = flat.new_zeros(0, self.out_rows, dtype=torch.float32)
        elif rows == "solo":
            out = torch.cat([self._product(flat[i : i + 1]) for i in range(flat.shape[0])])
        else:
            out = self._product(flat)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_rows)


# ----------------------------------------------------------------- rows
INT4_ROW_POLICIES = ("none", "solo")
_INT4_POLICY: dict[tuple[Any, ...], str] = {}  # probed once per weight shapes


@torch.inference_mode()
def rows_invariant(weight: Int4Weight, sizes: Sequence[int], rows: int, seed: int = 0) -> bool:
    """Whether every row of a product of m rows (each m in sizes) has the bits of the same
    row multiplied alone, on random rows (on this machine's kernel)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], generator=gen) * 2
    alone = weight.mm(x, "solo")
    for m in sizes:
        for s in range(0, rows - rows % m, m):
            if not torch.equal(weight.mm(x[s : s + m]), alone[s : s + m]):
                return False
    return True


PROBE_SIZES = (*range(1, 18), 24, 33)  # row counts probed: verification passes (K+1), trees, batches
HEAD_PROBE_SIZES = (1, 2, 3, 4, 5, 8, 9, 17)  # a head (V rows) is ~50x a layer's product: fewer


def int4_row_policy(weights: Sequence[Int4Weight], head: Int4Weight | None = None) -> str:
    """"none" where every row count gives each row the bits of a one-row product (so a
    verification pass scores what one-token steps do), else "solo". Probed once per shapes
    (~0.5 s on SmolLM2, most of it the head's products)."""
    key = tuple((tuple(w.shape), len(w.planes)) for w in (*weights, *([head] if head else [])))
    if key not in _INT4_POLICY:
        same = all(rows_invariant(w, PROBE_SIZES, 34) for w in weights)
        same = same and (head is None or rows_invariant(head, HEAD_PROBE_SIZES, 17))
        _INT4_POLICY[key] = "none" if same else "solo"
    return _INT4_POLICY[key]


# ----------------------------------------------------------------- codes from blocks
def q4_1_codes(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, raw: torch.Tensor | None = None) -> list[Codes]:
    """Q4_1 (w = d*q + m; d, m (N, K/32) fp16, q (N, K) in 0..15) as one plane, carrying its
    blocks (raw: the file's bytes (N, K/32, 20), else packed here)."""
    q = q.to(torch.uint8)
    blocks = Blocks("Q4_1", raw if raw is not None else qgemm.pack_q4_1(d.half(), m.half(), q))
    d, m = d.float(), m.float()
    return [Codes(q, d, m + 8 * d, blocks)]


def q8_0_codes(d: torch.Tensor, q: torch.Tensor, raw: torch.Tensor | None = None) -> list[Codes]:
    """Q8_0 (w = d*q; d (N, K/32) fp16, q (N, K) int8) as two planes: hi+8 (scale 16d, zero 0)
    and lo (scale d, zero 8d), where q = 16*hi + lo, lo = q & 15 in 0..15, hi = q >> 4 in -8..7;
    the first carries the blocks (raw: the file's bytes (N, K/32, 34), else packed here)."""
    blocks = Blocks("Q8_0", raw if raw is not None else qgemm.pack_q8_0(d.half(), q.to(torch.int8)))
    d, q = d.float(), q.to(torch.int16)
    lo, hi = q & 15, q >> 4
    return [Codes((hi + 8).to(torch.uint8), 16 * d, torch.zeros_like(d), blocks), Codes(lo.to(torch.uint8), d, 8 * d)]


def quantize_q4_1(w: torch.Tensor) -> list[Codes]:
    """Float weights (N, K) to Q4_1 as llama.cpp's reference quantizer does: per block of 32,
    d = (max - min) / 15, m = min (both stored as fp16), q = round((w - m) / d) in 0..15."""
    blocks = w.float().reshape(w.shape[0], -1, GROUP)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((blocks - lo[..., None]) * inv[..., None] + 0.5).floor().clamp(0, 15).reshape(w.shape)
    return q4_1_codes(d.half(), lo.half(), q)


def quantize_q8_0(w: torch.Tensor) -> list[Codes]:
    """Float weights (N, K) to Q8_0 as llama.cpp does: per block, d = max|w| / 127 (fp16), q = round(w / d)."""
    blocks = w.float().reshape(w.shape[0], -1, GROUP)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).reshape(w.shape)
    return q8_0_codes(d.half(), q)


def read_q4_1(raw: np.ndarray, n: int, k: int) -> list[Codes]:
    """A Q4_1 tensor's bytes (N, K/32 * 20): per block d, m (fp16), then 16 bytes whose low
    nibbles are weights 0..15 and high nibbles weights 16..31."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, 20)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    return q4_1_codes(d, m, torch.from_numpy(q), torch.from_numpy(blocks.copy()))


def read_q4_0(raw: np.ndarray, n: int, k: int) -> list[Codes] | None:
    """A Q4_0 tensor's bytes (N, K/32 * 18): per block d (fp16), then 16 bytes of codes laid out as
    Q4_1's; w = d (q - 8). The same block as Q4_1 with m = -8 d, which fp16 holds exactly (a power
    of two times d) unless it overflows: the file's codes and scales as they are, in Q4_1's form.
    None where some m would overflow (the weights are then quantized again)."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, 18)
    d16 = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m16 = (d16.astype(np.float32) * -8).astype(np.float16)
    if not np.array_equal(m16.astype(np.float32), d16.astype(np.float32) * -8):
        return None
    qs = blocks[..., 2:18]
    q1 = np.concatenate([blocks[..., 0:2], m16[..., None].view(np.uint8), qs], axis=-1)  # (N, K/32, 20)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    return q4_1_codes(torch.from_numpy(d16.copy()), torch.from_numpy(m16.copy()), torch.from_numpy(q),
                      torch.from_numpy(np.ascontiguousarray(q1)))


def read_q5_0(raw: np.ndarray, n: int, k: int) -> list[Codes]:
    """A Q5_0 tensor's bytes (N, K/32 * 22): per block d (fp16), the codes' fifth bits (4 bytes, bit j
    for weight j), then 16 bytes of their low four bits laid out as Q4_1's; w = d (q - 16), q in 0..31.
    That is a Q8_0 block with codes q - 16 and the same d: the file's scales and codes exactly, on
    the 8-bit kernel (8.5 bits a weight read, against the file's 5.5)."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, 22)
    d = blocks[..., 0:2].copy().view(np.float16)
    high = blocks[..., 2:6].copy().view("<u4")  # (N, K/32, 1)
    qs = blocks[..., 6:22]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16)  # (N, K/32, 32)
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    q = (low | (fifth << 4)) - 16
    q8 = np.concatenate([d.view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=-1)  # (N, K/32, 34)
    return q8_0_codes(torch.from_numpy(d[..., 0].copy()), torch.from_numpy(q.reshape(n, k).astype(np.int8)),
                      torch.from_numpy(np.ascontiguousarray(q8)))


def q8_0_parts(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes (N, K/32 * 34: per block d (fp16), then 32 int8 weights) as its blocks
    (N, K/32, 34) (a view of raw), d (N, K/32) float16 and q (N, K) int8."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    q = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8).reshape(n, k))
    return blocks, d, q


def read_q8_0(raw: np.ndarray, n: int, k: int) -> list[Codes]:
    """A Q8_0 tensor's bytes (N, K/32 * 34): per block d (fp16), then 32 int8 weights."""
    blocks, d, q = q8_0_parts(raw, n, k)
    return q8_0_codes(d, q, torch.from_numpy(blocks.copy()))


READERS: dict[str, Callable[[np.ndarray, int, int], list[Codes] | None]] = {
    "Q4_0": read_q4_0, "Q4_1": read_q4_1, "Q5_0": read_q5_0, "Q8_0": read_q8_0}
# GGUF formats of 4 bits a weight that no reader here takes as they are (Q4_K): their products are
# quantized again to Q4_1 from the weights transformers de-quantized (up to the rounding of Q4_K's
# scales); every other format (Q5_1, Q5_K, Q6_K, F16, BF16, ...) to Q8_0, never to fewer bits than
# the file holds. Every product stays on the 4-/8-bit kernels.
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def requantized(kinds: Sequence[str], weight: torch.Tensor) -> tuple[str, list[Codes]]:
    """A product whose parts the file holds as `kinds`, quantized here from its float weight."""
    if all(k in FOUR_BIT for k in kinds):
        return "Q4_1", quantize_q4_1(weight)
    return "Q8_0", quantize_q8_0(weight)


def unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """The row order that turns a GGUF llama q/k matrix back into Hugging Face's: llama.cpp
    interleaves each head's two rotary halves (rows i and i + hd/2 become 2i and 2i+1);
    Hugging Face row r of a head is GGUF row index[r]."""
    half = n_rows // heads // 2
    return torch.arange(n_rows).reshape(heads, half, 2).transpose(1, 2).reshape(n_rows)


# ----------------------------------------------------------------- a model's 4-bit weights
LAYER_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
               "down": ("ffn_down",)}
# a product's parts as GGUF files name them, whichever way a family's file fuses them (Phi-3: attn_qkv, ffn_up)
GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v", "attn_qkv"), "o": ("attn_output",),
              "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
HF_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}


class BlockEmbedding:
    """An embedding table (N, K) held as a GGUF file's Q8_0 blocks: int8 codes (N, K) and a
    float32 scale per block of 32 (N, K/32), rows de-quantized as they are looked up (`table[ids]`:
    (..., K) float32, as indexing the float table gives).

    d * q is exact in float32 (an fp16 scale's 11 significant bits times an integer of 7), so a row
    has the very bits of the float32 table transformers de-quantized from the same blocks
    (`from_gguf` checks rows of it), in a quarter of its memory: SmolLM2's 49152 x 576 table is
    32 MiB here against 113 MiB, and that float table is mapped from the converted file and read
    lazily, so each new token a server met would add a page of it to the process's memory for good."""

    dtype = torch.float32  # what a lookup returns

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % GROUP or d.shape != (q.shape[0], q.shape[1] // GROUP):
            raise ValueError("BlockEmbedding needs int8 codes (N, K), K a multiple of 32, and scales (N, K/32)")
        self.q, self.d = q.contiguous(), d.float().contiguous()
        self.shape = torch.Size(q.shape)
        self.device = q.device

    def __getitem__(self, ids: Any) -> torch.Tensor:
        ext = qgemm.loaded()
        if ext is not None and self.device.type == "cpu" and isinstance(ids, (int, torch.Tensor)) and \
                not isinstance(ids, bool) and (not isinstance(ids, torch.Tensor) or ids.dtype == torch.int64):
            # one call of the extension, the same product (a one-token lookup 15 us against 32)
            flat = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).contiguous()
            lead = torch.Size(ids.shape) if isinstance(ids, torch.Tensor) else torch.Size()
            return ext.embed_q8_0(self.q, self.d, flat).view(*lead, self.shape[1])  # type: ignore[no-any-return]
        q, d = self.q[ids], self.d[ids]
        lead = q.shape[:-1]
        return (q.view(*lead, -1, GROUP).float() * d[..., None]).view(*lead, self.shape[1])

    def __len__(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        """Bytes a weight takes here (its code; the scales add 1/8 of it)."""
        return 1

    def float(self) -> torch.Tensor:
        """The whole table in float32."""
        return self[torch.arange(self.shape[0], device=self.device)]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * 4


def block_embedding(t: Any, table: torch.Tensor) -> BlockEmbedding | None:
    """The GGUF tensor `t` (token_embd) as a `BlockEmbedding` where it is Q8_0 of the float
    `table`'s shape and its rows give `table`'s bits (rows spread over the table: a mismatch
    falls back on the float table), else None."""
    if t is None or t.kind != "Q8_0" or t.shape != tuple(table.shape) or table.shape[1] % GROUP:
        return None
    n, k = table.shape
    _, d, q = q8_0_parts(t.data, n, k)
    embedding = BlockEmbedding(q, d)
    rows = torch.arange(0, n, max(1, n // 64))
    with torch.no_grad():
        if not torch.equal(embedding[rows], table[rows].float()):
            return None
    return embedding
