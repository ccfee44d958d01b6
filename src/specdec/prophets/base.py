"""The prophet protocol: draft for rows of the one loop (`specdec.batch.BatchEngine`).

A prophet is handed a step's rows (`specdec.request.Request`) and each row's K; it returns
each row's drafted tokens and their q (`BatchDraft`, q None or one-hot for a deterministic
prophet). What it keeps for a row lives in the row's request (its cache length under the
prophet's name in `draft_cached`, a lookup index in `lookups`), or in a cache slot of its
own model (`draft_lm`, freed by the engine) or its own (`free`). A single request is a batch
of one. The engine asks a prophet's attributes, never its class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.lm import LM
from specdec.request import Request
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify import DraftTree

# budget(req, prophet name): that prophet's K for the row (its policy's K; 0 where the row may not use it)
Budget = Callable[[Request, str], int]
TREE = "*"  # what a row's policy keeps evidence for in a tree step: every prophet at once


@dataclass
class BatchDraft:
    tokens: list[list[int]]  # (B, k_b) drafted tokens per row
    probs: torch.Tensor | None  # (B, K, V) q per row, or None for a deterministic prophet (one-hot q)
    names: list[str | None] | None = None  # the prophet of each row's draft (None: the prophet's name)
    one_hot: list[bool] | None = None  # rows whose q is one-hot (probs ignored there): greedy or lookup
    # multi="tree": each row's prophets' chains merged into one token tree (tokens then unused),
    # and each row's chains by prophet (a draft model's cache keeps what agrees with the path)
    trees: list[DraftTree] | None = None
    chains: list[dict[str, list[int]]] | None = None

    def cut(self, ks: Sequence[int]) -> BatchDraft:
        return BatchDraft([t[:k] for t, k in zip(self.tokens, ks, strict=True)], self.probs, self.names, self.one_hot)


class Prophet(Protocol):
    """Drafts up to each row's K for a step's rows. The defaults here suit a prophet that keeps
    nothing per cache slot and reads nothing of the target (a lookup); a class may inherit them."""

    name: str
    vocab_size: int | None = None  # the ids it scores (None: not a model); the target's
    reads_features: bool = False  # drafts from the target's feature at each row's last position (`Request.feature`)
    fused_layers: tuple[int, ...] = ()  # target layers whose outputs it drafts from (`Request.fused`)
    draft_lm: LM | None = None  # its own draft model, whose cache slots the engine frees with the rows'
    is_lookup: bool = False  # drafts with no weights (cost ~0): timed alone, its drafts cut after drafting
    model_steps: bool = False  # one model pass per drafted token: the step's K is chosen before it drafts
    combine: str | None = None  # "first" or "tree": a combiner of `parts`, each a prophet

    @property
    def parts(self) -> Sequence[Prophet]:
        """The prophets one by one (several in a combiner)."""
        return [self]

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> Prophet:
        """This prophet for an engine of `slots` cache slots over `target` (the engine's view of
        the target): the same weights, slots of its own. branches > 1: a prophet that can grow a
        token tree per row grows up to this many children a node."""
        return self

    def room(self, req: Request) -> int:
        """The most tokens it can draft for the row (its own context's limit)."""
        return 1 << 30

    def prefill(self, reqs: Sequence[Request]) -> None:
        """Read the rows' prompts into what it keeps (a draft model's cache)."""
        return None

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        """Up to ks[b] tokens for row b (fewer, even none, is allowed); budget: a combiner's K per
        prophet and row (a single prophet drafts ks)."""
        ...

    def free(self, slot: int) -> None:
        """Forget what it keeps in a cache slot (its request has left)."""
        return None

    def settle(self, reqs: Sequence[Request], leave: int = 0) -> None:
        """Bring what it keeps for the rows up to date but the last `leave` positions (before a
        timed round, so that it catches up on as much as a real round does)."""
        return None


def probs_by_params(logits: torch.Tensor, reqs: Sequence[Request], who: str) -> torch.Tensor:
    """logits (B, n, V) -> each row's sampling distribution (B, n, V), one call per distinct setting."""
    groups: dict[SamplingParams, list[int]] = {}
    for b, r in enumerate(reqs):
        groups.setdefault(r.params, []).append(b)
    if len(groups) == 1:  # one setting (a request alone, or rows alike): no gather and scatter
        return logits_to_probs(logits, reqs[0].params, who=who)
    out = torch.empty_like(logits)
    for params, rows in groups.items():
        out[rows] = logits_to_probs(logits[rows], params, who=who)
    return out


def padded_q(q_rows: Mapping[int, torch.Tensor], n_rows: int, k_max: int) -> torch.Tensor:
    """Some rows' q (row b: (k_b, V), k_b <= k_max) in one zeroed (n_rows, k_max, V) tensor, as the
    verifier reads a batch's draft distributions (the other rows are one-hot: theirs is never read)."""
    first = next(iter(q_rows.values()))
    probs = torch.zeros(n_rows, k_max, first.shape[-1], device=first.device)
    for b, q in q_rows.items():
        probs[b, : len(q)] = q
    return probs


def in_row_order(rows: Sequence[int], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Results computed by groups of rows (`parts`, concatenated in the order of `rows`, the row
    index of each of their entries) back in row order 0..B-1."""
    return torch.cat(list(parts))[torch.argsort(torch.tensor(list(rows), device=parts[0].device))]


def is_chain(tree: DraftTree) -> bool:
    """Whether a tree is one chain: one proposal a node, each node the last one's child (or empty)."""
    return tree.parents == list(range(-1, len(tree.tokens) - 1)) and len(tree.proposals) == len(tree.tokens)


def chain_draft(trees: Sequence[DraftTree]) -> tuple[list[list[int]], torch.Tensor | None, list[bool]]:
    """One prophet's grown trees that are chains (`is_chain`) as the chain draft they are: each
    row's tokens, q (B, K, V) for the rows that sampled them (else None) and which rows' q is
    one-hot. The same verdicts either way: a chain verified by rejection sampling is a
    one-proposal tree's recursive test."""
    qs = [[q for _, _, q, _ in tree.proposals] for tree in trees]
    one_hot = [all(q is None for q in row) for row in qs]  # a grown row's proposals are all one kind
    rows = {b: torch.stack(row) for b, row in enumerate(qs) if not one_hot[b]}  # type: ignore[arg-type]
    probs = padded_q(rows, len(trees), max(len(t.tokens) for t in trees)) if rows else None
    return [list(t.tokens) for t in trees], probs, one_hot
