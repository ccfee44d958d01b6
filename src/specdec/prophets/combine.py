"""Several prophets as one (`--multi`): `FirstProphet` (first, best) drafts for each row with
one of them, `TreeProphet` (tree) merges every one's drafts into a token tree per row. Each
implements the prophet protocol over its parts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.lm import LM
from specdec.policy import best_first
from specdec.prophets.base import BatchDraft, Budget, Prophet, padded_q
from specdec.request import Request
from specdec.verify import DraftTree


class Combined(Prophet):
    """What every combiner does with its parts: names, room, prefill, slots and settling."""

    def __init__(self, parts: Sequence[Prophet]) -> None:
        if len({p.name for p in parts}) < len(parts):
            raise ValueError("each prophet among several needs a name of its own (a row keeps a cache per draft model)")
        self._parts = list(parts)
        self.name = "+".join(p.name for p in parts)
        self.reads_features = any(p.reads_features for p in parts)  # an eagle's chain among them

    @property
    def parts(self) -> list[Prophet]:
        return self._parts

    def room(self, req: Request) -> int:
        return min(p.room(req) for p in self.parts)

    def prefill(self, reqs: Sequence[Request]) -> None:
        for p in self.parts:
            p.prefill(reqs)

    def free(self, slot: int) -> None:
        for p in self.parts:
            p.free(slot)

    def settle(self, reqs: Sequence[Request], leave: int = 0) -> None:
        for p in self.parts:
            p.settle(reqs, leave)


class FirstProphet(Combined):
    """Several prophets, the first in order that proposes something for a row drafts for it
    (`multi="first"`, e.g. prompt lookup where the context repeats, eagle elsewhere), or,
    with `best`, only the one with the best recent tokens per round in that row's request
    (`multi="best"`, `Request.recent`). The choice depends on each row's committed context
    and its own past rounds only, so it stays exact; the verifier sees one-hot q for a
    deterministic prophet's rows."""

    combine = "first"

    def __init__(self, parts: Sequence[Prophet], best: bool = False) -> None:
        super().__init__(parts)
        self.best = best

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> FirstProphet:
        return FirstProphet([p.for_engine(target, slots, branches) for p in self.parts], self.best)

    def _order(self, req: Request) -> list[str]:
        """The order in which this row asks the prophets: theirs, or with `best` by the
        row's own running tokens per round (`policy.best_first`)."""
        names = [p.name for p in self.parts]
        return best_first(names, req.recent) if self.best else names

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        """ks: each row's largest K; budget(req, prophet name): that prophet's K for the row
        (its policy's K, 0 where the row may not use that prophet); without a budget, up to ks."""
        tokens: list[list[int]] = [[] for _ in reqs]
        names: list[str | None] = [None] * len(reqs)
        one_hot = [True] * len(reqs)  # lookup rows, greedy rows: q is one-hot on the drafted tokens
        q_from: dict[int, torch.Tensor] = {}  # rows drafted from a sampled q: the prophet's whole q (B, K, V)
        grown: dict[int, tuple[DraftTree, dict[str, list[int]]]] = {}  # rows a branching prophet drafted a tree for
        orders = [self._order(r) for r in reqs]
        # Rank by rank: a row asks its rank-th prophet only while nothing earlier proposed.
        for rank, part in ((rank, part) for rank in range(len(self.parts)) for part in self.parts):
            part_ks = [0 if tokens[b] or b in grown or not k or orders[b][rank] != part.name else
                       k if budget is None else min(k, budget(r, part.name))
                       for b, (r, k) in enumerate(zip(reqs, ks, strict=True))]
            if not any(part_ks):
                continue
            got = part.propose(reqs, part_ks)
            if got.trees is not None and got.chains is not None:
                for b, tree in enumerate(got.trees):
                    if tree.tokens and part_ks[b]:
                        grown[b], names[b] = (tree, got.chains[b]), part.name
                continue
            for b, t in enumerate(got.tokens):
                if t and not tokens[b]:
                    tokens[b], names[b] = t, part.name
                    if got.probs is not None and not (got.one_hot and got.one_hot[b]):
                        one_hot[b] = False
                        q_from[b] = got.probs
        if grown:  # every row's draft as a tree: the grown ones, the others' chains
            trees = [DraftTree() for _ in reqs]
            chains: list[dict[str, list[int]]] = [{} for _ in reqs]
            for b, t in enumerate(tokens):
                if b in grown:
                    trees[b], chains[b] = grown[b]
                elif t:
                    name = str(names[b])  # set with t
                    trees[b].add_chain(t, q_from[b][b, : len(t)] if b in q_from else None, name)
                    chains[b] = {name: t}
            return BatchDraft([[] for _ in reqs], None, names, trees=trees, chains=chains)
        if not q_from:
            return BatchDraft(tokens, None, names)
        k_max = max(len(t) for t in tokens)
        whole = next(iter(q_from.values()))
        if whole.shape[1] >= k_max and all(q is whole for q in q_from.values()):
            # one prophet sampled every such row: its q as it is, not copied (the verifier reads no
            # other row's q: those rows are one-hot)
            return BatchDraft(tokens, whole[:, :k_max], names, one_hot)
        probs = padded_q({b: q[b, : len(tokens[b])] for b, q in q_from.items()}, len(reqs), k_max)
        return BatchDraft(tokens, probs, names, one_hot)


class TreeProphet(Combined):
    """Several prophets, every one drafting for each row (`multi="tree"`): a row's chains (and a
    branching eagle's grown tree) are merged into one token tree (`specdec.verify.DraftTree`),
    scored in one pass with a tree mask and verified by recursive rejection sampling
    (`verify_tree`), exact at every temperature: each was drawn independently of the others,
    from its own q."""

    combine = "tree"

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> TreeProphet:
        return TreeProphet([p.for_engine(target, slots, branches) for p in self.parts])

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        """ks: each row's largest K; budget(req, prophet name): that prophet's K for the row (its
        policy's, where it keeps one per prophet; 0 where the row may not use it); without a
        budget every prophet the row may use drafts up to ks."""
        trees = [DraftTree() for _ in reqs]
        chains: list[dict[str, list[int]]] = [{} for _ in reqs]
        for part in self.parts:
            part_ks = [0 if r.prophets is not None and part.name not in r.prophets else
                       k if budget is None else min(k, budget(r, part.name))
                       for r, k in zip(reqs, ks, strict=True)]
            if not any(part_ks):
                continue
            got = part.propose(reqs, part_ks)
            if got.trees is not None and got.chains is not None:  # a branching eagle's grown trees
                for b, grown in enumerate(got.trees):
                    if grown.tokens:
                        trees[b].graft(grown)
                        chains[b][part.name] = got.chains[b].get(part.name, [])
                continue
            for b, t in enumerate(got.tokens):
                if t:
                    one_hot = bool(got.one_hot and got.one_hot[b])  # its q is one-hot on its tokens
                    q = None if got.probs is None or one_hot else got.probs[b, : len(t)]
                    trees[b].add_chain(t, q, part.name)
                    chains[b][part.name] = t
        return BatchDraft([[] for _ in reqs], None, trees=trees, chains=chains)


def combined(parts: Sequence[Prophet], multi: str) -> Prophet | None:
    """One prophet for an engine: none, the only one, or several combined as `multi` says
    ("tree", "first" or "best")."""
    if len(parts) < 2:
        return parts[0] if parts else None
    return TreeProphet(parts) if multi == "tree" else FirstProphet(parts, best=multi == "best")


__all__ = ["FirstProphet", "TreeProphet", "combined"]
