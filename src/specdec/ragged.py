"""Verification of a batch of drafts of different lengths ("ragged" acceptance).

The terms are those of `specdec.verify` (p = `target_probs`, q = `draft_probs`; accepted,
recovered, bonus), applied to B rows at once. Row b drafted k_b tokens (0 <= k_b <= K);
the tensors are padded to K and the entries past k_b are never read.

Two implementations with identical results:
- `verify_rows_reference`, the specification: a plain loop calling `verify_chain` per row;
- `verify_rows`, the same arithmetic on the whole batch at once.
- `verify_greedy_rows`, the case of rows whose p is one-hot (a greedy target): from the
  target's choices alone, with no distribution built and nothing drawn.
Each row has its own `torch.Generator`. Both draw from it in the same order, which is what
makes them agree exactly (not only in distribution): k_b uniforms for the acceptance test
(`torch.rand(k_b)`), then one `torch.multinomial` draw of the recovered or bonus token from
the same probabilities, computed elementwise as `specdec.verify.residual` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import sample
from specdec.verify import Verdict, verify_chain


@dataclass(frozen=True)
class RaggedVerdict:
    n_accepted: torch.Tensor  # (B,) int64: accepted drafted tokens of each row (a prefix of its draft)
    next_tokens: torch.Tensor  # (B,) int64: the recovered or bonus token that ends each row's round
    bonus: torch.Tensor  # (B,) bool: True where the next token is a bonus token, False where recovered

    def rows(self) -> list[Verdict]:
        return [Verdict(int(n), int(t), "bonus" if b else "recovered")
                for n, t, b in zip(self.n_accepted.tolist(), self.next_tokens.tolist(), self.bonus.tolist(),
                                   strict=True)]


def _row_q(draft_probs: torch.Tensor | None, one_hot: torch.Tensor | None, b: int, k: int) -> torch.Tensor | None:
    """Row b's q_1..q_k (k, V), or None where the row's prophet is deterministic."""
    if draft_probs is None or (one_hot is not None and bool(one_hot[b])):
        return None
    return draft_probs[b, :k]


def verify_rows_reference(
    draft_tokens: torch.Tensor,  # (B, K) int64, row b valid up to draft_lens[b]
    draft_lens: Sequence[int],  # (B,) k_b
    draft_probs: torch.Tensor | None,  # (B, K, V) q, or None when every row's prophet is deterministic
    one_hot: torch.Tensor | None,  # (B,) bool: rows whose q is one-hot (draft_probs ignored); None = none
    target_probs: torch.Tensor,  # (B, K+1, V) p, row b valid up to draft_lens[b] + 1
    generators: Sequence[torch.Generator],  # (B,) one per row
) -> list[Verdict]:
    """The specification: `verify_chain` on each row, in turn."""
    out = []
    for b, k in enumerate(draft_lens):
        q = _row_q(draft_probs, one_hot, b, k)
        out.append(verify_chain(draft_tokens[b, :k], q, target_probs[b, : k + 1], generators[b]))
    return out


def verify_rows(
    draft_tokens: torch.Tensor,  # (B, K) int64, row b valid up to draft_lens[b]
    draft_lens: Sequence[int],  # (B,) k_b
    draft_probs: torch.Tensor | None,  # (B, K, V) q, or None when every row's prophet is deterministic
    one_hot: torch.Tensor | None,  # (B,) bool: rows whose q is one-hot (draft_probs ignored); None = none
    target_probs: torch.Tensor,  # (B, K+1, V) p, row b valid up to draft_lens[b] + 1
    generators: Sequence[torch.Generator],  # (B,) one per row
) -> RaggedVerdict:
    """Speculative sampling for B rows at once; the same results as `verify_rows_reference`."""
    n_rows, k_max = draft_tokens.shape
    device = target_probs.device
    if n_rows == 1:  # a row alone: the specification itself is cheaper than the batch's bookkeeping
        (v,) = verify_rows_reference(draft_tokens, draft_lens, draft_probs, one_hot, target_probs, generators)
        return RaggedVerdict(torch.tensor([v.n_accepted]), torch.tensor([v.next_token]),
                             torch.tensor([v.next_kind == "bonus"]))
    lens = torch.tensor(list(draft_lens), dtype=torch.long, device=device)  # (B,)
    # 1. Per-row uniforms, drawn from each row's generator exactly as verify_chain draws them.
    u = torch.zeros(n_rows, k_max, device=device)  # (B, K), zero past k_b (never read)
    for b, k in enumerate(draft_lens):
        u[b, :k] = torch.rand(k, generator=generators[b], device=device)
    # 2. The acceptance test u * q(x) < p(x) everywhere; a row accepts its leading run of passes.
    tokens = draft_tokens.clamp_min(0)[:, :, None]  # (B, K, 1): padding may hold any id
    p_of_draft = target_probs[:, :k_max].gather(-1, tokens).squeeze(-1)  # (B, K)
    deterministic = torch.ones(n_rows, dtype=torch.bool, device=device) if draft_probs is None else (
        one_hot if one_hot is not None else torch.zeros(n_rows, dtype=torch.bool, device=device))
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = torch.where(deterministic[:, None], 1.0, draft_probs.gather(-1, tokens).squeeze(-1))
    in_draft = torch.arange(k_max, device=device)[None, :] < lens[:, None]  # (B, K)
    passed = (u * q_of_draft < p_of_draft) & in_draft
    n_accepted = passed.long().cumprod(-1).sum(-1)  # (B,)
    bonus = n_accepted == lens
    # 3. The distribution of the token that ends each row's round: p_{n+1} after a full
    #    acceptance (bonus), else the residual norm(max(0, p_n - q_n)) at the first rejection n.
    rows = torch.arange(n_rows, device=device)
    p_next = target_probs[rows, n_accepted]  # (B, V)
    at = n_accepted.clamp_max(max(k_max - 1, 0))  # (B,) rejection position (clamped for bonus rows)
    if k_max > 0:
        rejected = draft_tokens[rows, at].clamp_min(0)  # (B,)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next)
        else:
            q_next = torch.where(deterministic[:, None], 0.0, draft_probs[rows, at])  # (B, V)
        res = (p_next - q_next).clamp_min(0.0)
        # A one-hot q removes the drafted token: p with x zeroed, as residual() computes it.
        res[rows, rejected] = torch.where(deterministic, 0.0, res[rows, rejected])
        total = res.sum(-1, keepdim=True)  # (B, 1)
        res = torch.where(total > 0, res / total, p_next)  # p itself when p == q up to rounding
        next_probs = torch.where(bonus[:, None], p_next, res)  # (B, V)
    else:
        next_probs = p_next
    # 4. One draw per row from the row's own generator.
    next_tokens = torch.stack([sample(next_probs[b], generators[b]) for b in range(n_rows)]) if n_rows else (
        torch.zeros(0, dtype=torch.long, device=device))
    return RaggedVerdict(n_accepted, next_tokens, bonus)


def greedy_verdicts(drafts: Sequence[Sequence[int]], choices: Sequence[Sequence[int]]) -> list[Verdict]:
    """`verify_greedy_rows` on lists: each row's drafted tokens and the target's choice at each
    scored position (at least one more than drafted). A row accepts its drafts while they are
    the choices; the choice after the last accepted one ends its round."""
    out = []
    for draft, pick in zip(drafts, choices, strict=True):
        n = 0
        while n < len(draft) and draft[n] == pick[n]:
            n += 1
        out.append(Verdict(n, int(pick[n]), "bonus" if n == len(draft) else "recovered"))
    return out


def verify_greedy_rows(
    draft_tokens: torch.Tensor,  # (B, K) int64, row b valid up to draft_lens[b]
    draft_lens: Sequence[int],  # (B,) k_b
    choices: torch.Tensor,  # (B, K+1) int64: the target's argmax at each scored position
) -> RaggedVerdict:
    """Rows whose target distribution is one-hot on `choices` (greedy): `verify_rows` with
    p = one_hot(choices) and any q gives this. A drafted token passes u * q(x) < p(x) exactly
    when it is the choice (p(x) = 1 > u * q(x) for u < 1, q <= 1; else p(x) = 0), and the token
    that ends the round is the choice at the first rejection (the residual max(0, p - q) has
    mass on the choice alone, or none, when p itself is used) or after the last drafted token.
    No uniforms are drawn: a greedy row's generator decides nothing. (B rows of SmolLM2's
    49,152 ids on a 2-core CPU: the one-hot p and `verify_rows` took 8 ms a step at B = 32.)"""
    drafts = [row[:k] for row, k in zip(draft_tokens.tolist(), draft_lens, strict=True)]
    verdicts = greedy_verdicts(drafts, choices.tolist())  # on lists: ~10 tensor calls fewer
    device = choices.device
    return RaggedVerdict(torch.tensor([v.n_accepted for v in verdicts], device=device),
                         torch.tensor([v.next_token for v in verdicts], device=device),
                         torch.tensor([v.next_kind == "bonus" for v in verdicts], device=device))
