"""Products whose rows keep their bits at any row count: how a reduced-precision product's
rows are padded (`ROW_POLICIES`), probed once per weight shapes on this machine's kernels.
Speculative verification scores K+1 rows at once where plain decoding scores one, and a
batch scores many requests' rows together: each row must round as it would alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def row_bucket(m: int) -> int:
    """The row count a product of m rows is padded to: m itself up to 16, then 8 buckets per
    doubling (18, 20, .., 32, 36, .., 64, 72, ..), so padding stays under 1/8 of the rows."""
    if m <= 16:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


# How the rows of a reduced-precision product are padded so that each row's result never
# depends on how many rows share the product (speculative verification scores K+1 rows at
# once where plain decoding scores one; a batch scores many requests' rows together):
#   "min2":  at least 2 rows (then row_bucket). CPUs that compute bf16 natively (avx512_bf16,
#            AMX) run a 1-row product on another kernel, whose reduction order differs: on an
#            AMD EPYC with avx512_bf16, SmolLM2's down projection rounds ~6% of single rows
#            differently, and greedy speculative bf16 output left plain bf16 decoding on 7 of
#            10 chat prompts. From 2 rows up every row count gives the same bits there.
#   "tile16": a multiple of 16 rows. Kernels that emulate bf16 (AVX-512 without bf16) change
#            a row's bits with the row count unless every product is whole 16-row tiles.
#   "none":  any row count gives the same bits (e.g. AVX2 kernels).
#   "chunk16": whole 16-row tiles, each its own product. AMX kernels (Intel Xeon with amx_bf16)
#            round rows of a 48-row product unlike those of a 16-row one, on every SmolLM2 shape.
ROW_POLICIES = ("none", "min2", "tile16", "chunk16")
_ROW_POLICY: dict[tuple[Any, ...], str] = {}  # probed once per (dtype, weight shapes, device)


def row_policy_for(key: tuple[Any, ...], weights: Sequence[torch.Tensor]) -> str:
    """The row policy of products of these weights (probed once per key: dtype, device, shapes)."""
    if key not in _ROW_POLICY:
        _ROW_POLICY[key] = probe_row_policy(weights)
    return _ROW_POLICY[key]


def padded_rows(m: int, policy: str) -> int:
    """The row count a product of m rows runs at under a row policy (see ROW_POLICIES)."""
    if policy in ("tile16", "chunk16"):
        return -(-row_bucket(m) // 16) * 16
    if policy == "min2":
        return max(2, row_bucket(m))
    return row_bucket(m)


def probe_row_policy(weights: Sequence[torch.Tensor], sizes: Sequence[int] = (1, 2, 3, 5, 9, 16, 17, 24, 33, 40),
                     rows: int = 96) -> str:
    """The cheapest row policy under which every row of a product of these weights has the
    same bits whatever the row count (checked on random rows against whole 16-row tiles, on
    this machine's kernels); "chunk16" (which is the reference) if no cheaper one holds."""
    gen = torch.Generator().manual_seed(0)
    for policy in ROW_POLICIES[:-1]:
        if all(_rows_invariant(w, policy, sizes, rows, gen) for w in weights):
            return policy
    return "chunk16"


def row_product(flat: torch.Tensor, weight: torch.Tensor, policy: str) -> torch.Tensor:
    """flat (m, D) @ weight.T with its rows run as the row policy says (see ROW_POLICIES)."""
    m = flat.shape[0]
    padded = padded_rows(m, policy)
    if padded != m:
        flat = F.pad(flat, (0, 0, 0, padded - m))
    if policy == "chunk16" and padded > 16:
        return torch.cat([flat[s : s + 16] @ weight.T for s in range(0, padded, 16)])[:m]
    return (flat @ weight.T)[:m]


@torch.inference_mode()
def _rows_invariant(weight: torch.Tensor, policy: str, sizes: Sequence[int], rows: int,
                    gen: torch.Generator) -> bool:
    x = (torch.randn(rows, weight.shape[1], generator=gen) * 2).to(weight.dtype).to(weight.device)
    reference = torch.cat([F.pad(x[s : s + 16], (0, 0, 0, 16 - len(x[s : s + 16]))) @ weight.T
                           for s in range(0, rows, 16)])[:rows]
    for m in sizes:
        n = rows - rows % m
        for s in range(0, n, m):
            block = x[s : s + m]
            got = row_product(block, weight, policy)
            if not torch.equal(got, reference[s : s + m]):
                return False
    return True
