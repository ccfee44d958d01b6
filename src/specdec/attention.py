"""Attention as every fast-path pass computes it: a sequence's new queries over its cache,
leading (prompt) queries in causal blocks, scored queries each alone as a one-token step attends
(`exact_attention`, `one_query`), and a family's own scale, soft-cap or sliding window
(`Scores`, `scored_attention`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec import layerloop
from specdec.defaults import PREFILL_CHUNK, attention_block_end


def causal_mask(n: int, start: int, device: torch.device) -> torch.Tensor | None:
    """New token j sees the cache and the new tokens up to itself. (n, start+n) or None for n == 1."""
    return None if n == 1 else torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start)


class Scores(NamedTuple):
    """How a family's attention differs from softmax(q k^T / sqrt(head dim)) over every earlier
    key (`specdec.families.Arch`): its scale, soft-capping of the scores, sliding window (the
    keys a query sees, itself included). Attention with one runs in PyTorch (`scored_attention`)."""

    scale: float  # 0: 1/sqrt(head dim), as Llama's (and the kernels' default, computed alike)
    softcap: float | None
    window: int | None


def scored_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, end: int,
                     scores: Scores, gqa: bool, positions: torch.Tensor | None = None,
                     key_positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Queries q (1, Hq, m, hd) at positions start.. (or `positions`) over keys/values [0, end) of
    (1, Hkv, >= end, hd) at positions 0.. (or `key_positions`), causally (or as `mask` (m, end)
    allows), within the window, with the family's scale and soft-cap. Returns (1, Hq, m, hd).
    Without soft-capping as Llama's attention runs (one query: `attend_one` over the window's keys,
    with the family's scale; several: PyTorch's, under the window's mask); with it in PyTorch
    (scores in q's dtype, softmax in float32, as transformers' eager attention computes them)."""
    m = q.shape[2]
    lo = 0
    if scores.window is not None and key_positions is None and positions is None:
        lo = max(0, start - scores.window + 1)  # keys no query of these sees
    plain = scores.softcap is None and mask is None
    if plain and m == 1 and q.dtype == torch.float32 and q.device.type == "cpu":
        ext = layerloop.kernels()
        if ext is not None:
            return ext.attend_one(q, keys[:, :, lo:], values[:, :, lo:], end - lo,  # type: ignore[no-any-return]
                                  scores.scale)
    qpos = positions if positions is not None else torch.arange(start, start + m, device=q.device)
    kpos = key_positions if key_positions is not None else torch.arange(lo, end, device=q.device)
    allowed = mask[:, lo:end] if mask is not None else kpos[None, :] <= qpos[:, None]
    if scores.window is not None:
        allowed = allowed & (kpos[None, :] > qpos[:, None] - scores.window)
    k, v = keys[:, :, lo:end].to(q.dtype), values[:, :, lo:end].to(q.dtype)
    if plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scores.scale or None, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * (scores.scale or q.shape[-1] ** -0.5)  # (1, Hq, m, end - lo)
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, solo: int,
                    gqa: bool, chunk: int = PREFILL_CHUNK, scores: Scores | None = None) -> torch.Tensor:
    """Attention of one sequence's n new queries q (1, Hq, n, hd) at positions start.. over its
    cache keys/values (1, Hkv, >= start+n, hd): the leading n - solo queries under a causal
    mask, in blocks that end where `defaults.attention_block_end` says (multiples of `chunk`
    positions, and of FINE_BLOCK within the first chunk: a long prompt never builds an n x n
    score matrix, and a prompt fed whole or from any block's end attends alike), then each of
    the last `solo` queries alone, exactly as a one-token step attends (in bfloat16 attention
    over several queries at once rounds differently). Every row of the lean path
    (`BatchLlama`) attends through here, so a row's scores never depend on how many tokens or
    rows share its pass. scores: a family's own scale, soft-cap or window (`Scores`), else
    Llama's. Returns (1, Hq, n, hd)."""
    n = q.shape[2]
    lead = n - solo
    parts = []
    a = 0
    while a < lead:  # block [a, b) of the leading queries, b at the next block's end
        b = min(lead, attention_block_end(start + a, chunk) - start)
        if b - a == 1:
            parts.append(one_query(q[:, :, a:b], keys, values, start + b, gqa, scores))
        elif scores is not None:
            parts.append(scored_attention(q[:, :, a:b], keys, values, start + a, start + b, scores, gqa))
        else:
            parts.append(F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, :start + b].to(q.dtype),
                                                        values[:, :, :start + b].to(q.dtype),
                                                        attn_mask=causal_mask(b - a, start + a, q.device),
                                                        enable_gqa=gqa))
        a = b
    parts += [one_query(q[:, :, j:j + 1], keys, values, start + j + 1, gqa, scores) for j in range(lead, n)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # one part (a one-token step): no copy


def one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int, gqa: bool,
              scores: Scores | None = None) -> torch.Tensor:
    """One query q (1, Hq, 1, hd) over the first `end` keys/values (1, Hkv, >= end, hd): the
    extension's `attend_one` (float32 on the CPU, where it builds; measured on a 2-core AMD EPYC
    with AVX2, 9 query heads over 3 key heads of 64: 13-17 us against PyTorch's 26-37 at 64 keys,
    149 against 188 at 1,024, 590 against 685 at 4,096), else PyTorch's attention. Every query that
    attends alone (a one-token step, a scored query of a verification pass, a token tree's node)
    attends here or, in the C++ loop, through the same `attend_one`: steps and passes attend alike.
    scores: a family's own (`Scores`): then `scored_attention`, alike for steps and passes."""
    if scores is not None:
        return scored_attention(q, keys, values, end - 1, end, scores, gqa)
    if q.dtype == torch.float32 and q.device.type == "cpu":
        ext = layerloop.kernels()
        if ext is not None:
            return ext.attend_one(q, keys, values, end)  # type: ignore[no-any-return]
    return F.scaled_dot_product_attention(q, keys[:, :, :end].to(q.dtype), values[:, :, :end].to(q.dtype),
                                          enable_gqa=gqa)
