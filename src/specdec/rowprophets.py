"""Prophets for rows of the one loop: each drafts up to its own K for every row of a step.

- `ModelBatchProphet`: a small model on its own slots (`BatchLM`), autoregressively, for all rows
  at once; `EarlyExitBatchProphet`: the target's first layers in the rows' own target slots
  (layerskip, kangaroo).
- `LookupBatchProphet`: prompt lookup or retrieval per row (q one-hot); `RowsProphet`: any other
  prophet, a view of it per row.
- `FeatureBatchProphet`: eagle or medusa from each row's last target feature.
- `FirstBatchProphet` (`--multi first`/`best`): per row, the first (or best recent) prophet that
  proposes; `TreeBatchProphet` (`--multi tree`): every prophet, merged into a token tree per row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.branching import TreeBudget, draw_gains, fit_scale
from specdec.lm import tree_depths
from specdec.policy import best_first
from specdec.prophets.base import Prophet
from specdec.prophets.eagle3 import Eagle3Runtime
from specdec.prophets.feature import FeatureProphet, full_vocab_logits
from specdec.prophets.layerskip import AdaptedExitProphet, LayerSkipProphet
from specdec.prophets.ngram import NgramIndex, NgramProphet
from specdec.request import Request, batch_free, keep_drafting_rows, keep_fused, row_cached, row_slot, set_row_cached
from specdec.rows import BatchLM
from specdec.sampling import SamplingParams, check_logits, draw, logits_to_probs
from specdec.verify import DraftTree


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


class ModelBatchProphet:
    """A small model drafting autoregressively for every row at once, each up to its own k_b."""

    reads_features = False

    def __init__(self, lm: BatchLM, name: str | None = None) -> None:
        self.lm, self.name = lm, name or lm.name


    def room(self, req: Request) -> int:
        return self.lm.max_length - req.length + 1  # it scores positions up to len + k - 2

    def prefill(self, reqs: Sequence[Request]) -> None:
        prefill_rows(self.lm, reqs, self.name)

    def _cached(self, req: Request) -> int:
        """Positions of the row's context already in the prophet's cache (drafting starts there)."""
        return row_cached(req, self.name)

    def _fed(self, req: Request, n: int) -> None:
        req.draft_cached[self.name] = self._cached(req) + n  # its own cache keeps what it read

    def _logits(self, slots: list[int], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """One drafting step for these rows: logits (B', V) after each row's feed."""
        return self.lm.forward(slots, starts, feeds, [1] * len(slots))[:, 0]

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs = torch.zeros(len(reqs), max(ks), self.lm.vocab_size, device=self.lm.device)  # (B, K, V)
        at = {b: self._cached(reqs[b]) for b, k in enumerate(ks) if k > 0}
        feeds = {b: reqs[b].context[at[b]:] for b in at}
        keep = keep_drafting_rows(reqs)
        ks = list(ks)
        for j in range(max(ks)):
            live = [b for b in feeds if ks[b] > j]
            if not live:
                break
            logits = self._logits([row_slot(reqs[b]) for b in live], [at[b] for b in live],
                                  [feeds[b] for b in live])  # (B_live, V)
            q = probs_by_params(logits[:, None], [reqs[b] for b in live], f"prophet '{self.name}'")[:, 0]
            probs[live, j] = q
            greedy = q.argmax(-1).tolist()  # (B_live,) the token of a greedy row, whose q is one-hot
            for i, b in enumerate(live):
                req = reqs[b]
                at[b] += len(feeds[b])
                self._fed(req, len(feeds[b]))
                token = greedy[i] if req.params.greedy else draw(q[i], req.params, req.generator,
                                                                    req.length + j)
                feeds[b] = [token]
                tokens[b].append(token)
                stop = keep[b]
                if stop is not None and not stop(torch.softmax(logits[i], -1) if req.params.greedy else q[i]):
                    ks[b] = j + 1  # the confidence policy's early stop: this row drafts no further
        return BatchDraft(tokens, probs)


class EarlyExitBatchProphet(ModelBatchProphet):
    """The target drafting for its own rows with its first L layers (layerskip), or through a
    trained adapter after them (kangaroo, `AdaptedExitProphet`). It reads and writes the
    rows' own target slots: those layers' entries for the drafted positions sit past each
    row's committed tokens, where the verification pass overwrites them; the row's cached
    length never moves while drafting. No model and no cache of its own."""

    def __init__(self, target: BatchLM, prophet: LayerSkipProphet) -> None:
        super().__init__(target)
        self.target, self.prophet, self.name = target, prophet, prophet.name
        self.layers = prophet.layers


    def prefill(self, reqs: Sequence[Request]) -> None:
        pass  # the rows' target slots are its cache

    def _cached(self, req: Request) -> int:
        return req.target_cached

    def _fed(self, req: Request, n: int) -> None:
        pass  # provisional entries: the target's cached length stays at the committed tokens

    @torch.inference_mode()
    def _logits(self, slots: list[int], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        p, ones = self.prophet, [1] * len(slots)
        if not isinstance(p, AdaptedExitProphet):
            return self.target.forward_features(slots, starts, feeds, ones, layers=self.layers)[0][:, 0]
        _, feature = self.target.forward_features(slots, starts, feeds, ones, layers=self.layers, head=False)
        sub = (p.adapter.adapt(feature[:, 0].to(p.dtype)) @ p.sub_head.T).float()  # (B', N)
        return full_vocab_logits(sub, p.vocab_ids, p.vocab_size or 0)  # (B', V)


class LookupBatchProphet:
    """A lookup prophet for every row: one that drafts from the row's context alone, keeps no
    state and no model (prompt lookup, `specdec.prophets.ngram`; retrieval from a datastore,
    `specdec.prophets.retrieval`). Its drafts are deterministic: q is one-hot."""

    reads_features = False

    def __init__(self, prophet: Prophet) -> None:
        self.prophet, self.name = prophet, prophet.name


    def room(self, req: Request) -> int:
        return 1 << 30

    def prefill(self, reqs: Sequence[Request]) -> None:
        pass

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        return BatchDraft([self.prophet.propose(r.context, k, r.params, None).tokens if k else []
                           for r, k in zip(reqs, ks, strict=True)], None)


class RowsProphet(LookupBatchProphet):
    """Any prophet (`specdec.prophets.base.Prophet`) for rows, one row after another: a view
    of it per cache slot (`for_request`: the same weights, state of its own), told what each
    row committed before it drafts, and the target's feature where it reads features. The
    one loop's adapter for a prophet registered without a batched path; its q is its own."""

    def __init__(self, prophet: Prophet, target: Any, slots: int) -> None:
        super().__init__(prophet)
        self.target, self.reads_features = target, prophet.reads_features
        self.views: list[Prophet | None] = [None] * slots
        # seconds per drafted token, as last seen (its cost: it may keep state of its own that
        # a timed call on placeholder rows would disturb)
        self.per_token = 0.0

    def free(self, slot: int) -> None:
        self.views[slot] = None

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        tokens: list[list[int]] = [[] for _ in reqs]
        q_rows: dict[int, torch.Tensor] = {}
        t0, drafted = time.perf_counter(), 0
        for b, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            if not k:
                continue
            view = self.views[row_slot(r)]
            if view is None:
                view = self.views[row_slot(r)] = self.prophet.for_request(self.target)
                view.reset()
            view.committed(r.context)
            if self.reads_features and r.feature is not None:
                view.see_feature(r.length - 2, r.feature)
            keep = r.policy.keep_drafting() if r.policy is not None else None
            d = view.propose(r.context, k, r.params, r.generator, keep)
            tokens[b], drafted = list(d.tokens), drafted + len(d.tokens)
            if d.probs is not None and d.tokens:
                q_rows[b] = d.probs[: len(d.tokens)]
        if drafted:
            self.per_token = (time.perf_counter() - t0) / drafted
        if not q_rows:
            return BatchDraft(tokens, None)
        probs = padded_q(q_rows, len(reqs), max(len(t) for t in tokens))
        return BatchDraft(tokens, probs, one_hot=[b not in q_rows for b in range(len(reqs))])


class NgramBatchProphet(LookupBatchProphet):
    """Prompt lookup per row (see specdec.prophets.ngram), each row from its request's own
    index of its context (`NgramIndex`, kept in `Request.lookups` under the prophet's name):
    the drafts of `NgramProphet.propose`, without scanning the context every step."""

    def __init__(self, n_max: int = 4, n_min: int = 2, prophet: NgramProphet | None = None) -> None:
        self.ngram = prophet if prophet is not None else NgramProphet(n_max, n_min)
        super().__init__(self.ngram)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        return BatchDraft([self._index(r).propose(r.prompt, r.generated, k) if k else []
                           for r, k in zip(reqs, ks, strict=True)], None)

    def _index(self, req: Request) -> NgramIndex:
        index = req.lookups.get(self.name)
        if not isinstance(index, NgramIndex):
            index = req.lookups[self.name] = NgramIndex(self.ngram.n_max, self.ngram.n_min)
        return index


Node = tuple[int, int, torch.Tensor, int, float]  # a tree node to grow: row, node, feature before it, token, chance


class FeatureBatchProphet:
    """A feature prophet (specdec.prophets.feature: eagle or medusa, sharing its heads) for
    every row at once. A row drafts from the target's feature at its last committed
    position, which the previous step's verification pass left in `req.feature`; a row
    without one (it just joined, or its text was cut) drafts nothing this step, and its
    plain step yields one. q is 0 outside the draft vocabulary (exact, see feature.py)."""

    reads_features = True

    def __init__(self, prophet: FeatureProphet, branches: int = 1) -> None:
        self.prophet, self.name = prophet, prophet.name
        self.vocab_size = int(prophet.vocab_size or 0)
        # > 1: an eagle grows a token tree per row, up to this many children a node (propose_trees)
        self.branches = branches if prophet.head.kind == "eagle" else 1

    def room(self, req: Request) -> int:
        return 1 << 30

    def prefill(self, reqs: Sequence[Request]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        """Greedy rows take the argmax over the draft vocabulary (q one-hot: nothing over the
        full vocabulary is built for them); sampled rows sample from q, kept for the verifier.
        With branches: a token tree per row (`propose_trees`)."""
        return self.propose_trees(reqs, ks) if self.branches > 1 else self.propose_chains(reqs, ks)

    @torch.inference_mode()
    def propose_chains(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        """`propose` without branches: a chain per row (what the step costs measure per draft step)."""
        p = self.prophet
        rows = [b for b, (r, k) in enumerate(zip(reqs, ks, strict=True)) if k > 0 and r.feature is not None]
        tokens: list[list[int]] = [[] for _ in reqs]
        if not rows:
            return BatchDraft(tokens, None)
        k_rows = [p.max_k(ks[b]) for b in rows]
        keep = keep_drafting_rows(reqs)
        who = f"prophet '{self.name}'"
        sampled = [i for i, b in enumerate(rows) if not reqs[b].params.greedy]
        probs = torch.zeros(len(reqs), max(k_rows), self.vocab_size, device=p.embed.device) if sampled else None
        h0 = torch.stack([reqs[b].feature for b in rows]).to(p.dtype)  # type: ignore[misc]
        h, last = h0, torch.tensor([reqs[b].context[-1] for b in rows], device=h0.device)
        # a seeded sampled row's draws must not depend on the rows beside it: where the products are not
        # rows-invariant (torch's kernels change with the row count), such a row's guesses are computed alone
        alone = [] if p.rows_invariant else [i for i, b in enumerate(rows) if not batch_free(reqs[b])]
        for j in range(1, max(k_rows) + 1):
            h, sub = _guess(p, h, h0, last, j, alone)  # sub (B', N): logits over the draft vocabulary (q 0 elsewhere)
            check_logits(sub, who)
            picked = p.vocab_ids[sub.argmax(-1)].tolist()  # as FeatureProphet.propose picks greedily
            drawing = [i for i in sampled if k_rows[i] >= j]  # a row draws only while it drafts: its
            if drawing:  # generator's draws never depend on how long the rows beside it draft
                q = probs_by_params(sub[drawing][:, None], [reqs[rows[i]] for i in drawing], who)[:, 0]  # (B_s, N)
                for n, i in enumerate(drawing):
                    req = reqs[rows[i]]
                    picked[i] = draw(q[n], req.params, req.generator, req.length + j - 1, p.vocab_ids,
                                     self.vocab_size)
                    # q placed in the full vocabulary where the verifier reads it (0 elsewhere: the tensor's zeros)
                    probs[rows[i], j - 1].index_copy_(-1, p.vocab_ids, q[n].float())  # type: ignore[index]
            for i, b in enumerate(rows):
                if k_rows[i] >= j:
                    tokens[b].append(picked[i])
                    stop = keep[b]
                    if stop is not None and k_rows[i] > j:
                        sure = probs[b, j - 1] if probs is not None and not reqs[b].params.greedy else \
                            torch.softmax(sub[i].float(), -1)
                        if not stop(sure):
                            k_rows[i] = j  # the confidence policy's early stop: this row drafts no further
            last = torch.tensor(picked, device=h0.device)
        return BatchDraft(tokens, probs, one_hot=[r.params.greedy for r in reqs])

    @torch.inference_mode()
    def propose_trees(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        """A token tree per row, grown depth by depth up to the row's K (EAGLE-2's dynamic
        trees; `specdec.branching` says how far): where the target's choice is deterministic
        (greedy or coupled rows) each kept node offers its q's top `branches` tokens (one-hot
        proposals, exact whatever is chosen); where the row samples, up to `branches`
        independent draws from q, each kept with its q (recursive rejection sampling: exact as
        long as no drawn child is dropped). The first node is always drafted (the row's policy
        chose to draft); every other joins while it pays by the row's costs."""
        p = self.prophet
        who = f"prophet '{self.name}'"
        trees = [DraftTree() for _ in reqs]
        chains: list[dict[str, list[int]]] = [{} for _ in reqs]
        rows = [b for b, (r, k) in enumerate(zip(reqs, ks, strict=True)) if k > 0 and r.feature is not None]
        budgets = {b: TreeBudget(_row_costs(reqs[b]), self.name) for b in rows}
        scale = {b: fit_scale(reqs[b].tree_fit) for b in rows}
        # the nodes to expand (row, node, the feature guessed before it, its token, its chance)
        frontier = [(b, -1, reqs[b].feature.to(p.dtype), reqs[b].context[-1], 1.0) for b in rows]  # type: ignore[union-attr]
        depth = 0
        while frontier:
            depth += 1
            h = torch.stack([f[2] for f in frontier])
            last = torch.tensor([f[3] for f in frontier], device=h.device)
            # a seeded sampled row's nodes each computed alone where products are not rows-invariant
            alone = [] if p.rows_invariant else [i for i, f in enumerate(frontier) if not batch_free(reqs[f[0]])]
            g, sub = _guess(p, h, h, last, depth, alone)
            check_logits(sub, who)
            grown: list[Node] = []
            for b in dict.fromkeys(f[0] for f in frontier):
                grown += self._grow_row(reqs[b], trees[b], budgets[b], scale[b], b, depth, frontier, g, sub)
            # the next depth expands each row's likeliest new nodes (at most `branches`), within its K,
            # unless even a sure child of its likeliest could not pay for the drafting step (then none is drafted)
            frontier = []
            for b in dict.fromkeys(f[0] for f in grown):
                best = sorted((f for f in grown if f[0] == b), key=lambda f: -f[4])[: self.branches]
                if depth < ks[b] and budgets[b].pays(best[0][4], new_step=True):
                    frontier += best
        for b in rows:
            tree = trees[b]
            tree.expected = budgets[b].expected
            if tree.tokens:  # its longest path: what the row's policy counts as drafted
                depths = tree_depths(tree.parents)
                deepest = max(range(len(tree.tokens)), key=lambda n: (depths[n], -n))
                path: list[int] = []
                while deepest >= 0:
                    path.insert(0, tree.tokens[deepest])
                    deepest = tree.parents[deepest]
                chains[b][self.name] = path
        names: list[str | None] = [self.name if trees[b].tokens else None for b in range(len(reqs))]
        return BatchDraft([[] for _ in reqs], None, names, trees=trees, chains=chains)

    def _grow_row(self, req: Request, tree: DraftTree, budget: TreeBudget, scale: float, b: int, depth: int,
                  frontier: Sequence[Node], g: torch.Tensor,
                  sub: torch.Tensor) -> list[Node]:
        """One depth of one row's tree: the children its frontier nodes offer, in order of chance,
        while they pay. Returns the new nodes (as frontier entries)."""
        p, width = self.prophet, self.branches
        mine = sorted((i for i, f in enumerate(frontier) if f[0] == b), key=lambda i: -frontier[i][4])
        deterministic = req.params.greedy or req.params.coupled is not None
        q_all = torch.softmax(sub[mine].float(), -1) if req.params.greedy else \
            probs_by_params(sub[mine][:, None], [req] * len(mine), f"prophet '{self.name}'")[:, 0]
        new: list[Node] = []
        first_here = True
        if deterministic:  # every node's top tokens, likeliest first across the depth
            offers = []
            for n, i in enumerate(mine):
                conf, idx = q_all[n].topk(min(width, q_all.shape[-1]))
                for c, j in zip(conf.tolist(), idx.tolist(), strict=True):
                    offers.append((frontier[i][4] * min(1.0, scale * c), i, int(p.vocab_ids[j])))
            for s, i, token in sorted(offers, key=lambda o: -o[0]):
                if tree.tokens and not budget.pays(s, new_step=first_here):
                    break
                node = tree.child(frontier[i][1], token)
                tree.proposals.append((frontier[i][1], node, None, self.name))
                budget.add(s, new_step=first_here)
                first_here = False
                new.append((b, node, g[i], token, s))
            return new
        for n, i in enumerate(mine):  # a sampled row: draws from each node's q while they pay
            q = q_all[n]
            q_full = torch.zeros(self.vocab_size, device=q.device)
            q_full.index_copy_(-1, p.vocab_ids, q.float())
            for gain, fresh in draw_gains(q, width):
                s = frontier[i][4] * min(1.0, scale * gain)
                if tree.tokens and not budget.pays(s, new_step=first_here, nodes=fresh):
                    break
                token = draw(q, req.params, req.generator, req.length + depth - 1, p.vocab_ids, self.vocab_size)
                known = len(tree.tokens)
                node = tree.child(frontier[i][1], token)
                tree.proposals.append((frontier[i][1], node, q_full, self.name))
                budget.add(s, new_step=first_here, node=node == known)  # a repeated draw: no new node
                first_here = False
                if node == known:  # a token not drawn here before: a node to score and grow
                    new.append((b, node, g[i], token, frontier[i][4] * min(1.0, scale * _q_of(q, p.vocab_ids, token))))
        return new


def _q_of(q: torch.Tensor, ids: torch.Tensor, token: int) -> float:
    """q's probability (over the draft vocabulary `ids`) of a full-vocabulary token."""
    where = (ids == token).nonzero()
    return float(q[where[0, 0]]) if len(where) else 0.0


def _row_costs(req: Request) -> Any:
    """The costs a row's policy weighs (set by the engine each step), or None."""
    return getattr(req.policy, "costs", None) if req.policy is not None else None


def _guess(p: FeatureProphet, h: torch.Tensor, h0: torch.Tensor, last: torch.Tensor, j: int,
           alone: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step j's guessed features and draft-vocabulary logits for every row, the rows `alone`
    each computed by itself (as it would be in a batch of one), the others together."""
    if not alone:
        g = p.guess(h, h0, last, j)
        return g, p.draft_logits(g)
    single = set(alone)
    together = [i for i in range(h.shape[0]) if i not in single]
    parts = ([together] if together else []) + [[i] for i in alone]
    gs = [p.guess(h[part], h0[part], last[part], j) for part in parts]
    rows = [i for part in parts for i in part]
    return in_row_order(rows, gs), in_row_order(rows, [p.draft_logits(x) for x in gs])


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


class Eagle3BatchProphet:
    """The EAGLE-3-style prophet (specdec.prophets.eagle3) for every row: a row's true slots
    come from the target's fused features, which every target pass (prefill chunks and
    verification) leaves in `Request.fused` for the positions it committed; a row drafts
    once its slots reach its last committed position but one (right after its prompt is
    in), and each draft step is one more slot fed the layer's own output. Its cache length
    is `Request.draft_cached[name]`, true slots only (drafted slots lie past it). q is 0
    outside the draft vocabulary (exact, see feature.py)."""

    reads_features = False

    def __init__(self, runtime: Eagle3Runtime) -> None:
        self.runtime, self.name = runtime, runtime.name
        self.fused_layers = runtime.layers
        self.vocab_size = self.full_vocab = int(runtime.embed.shape[0])  # the target's vocabulary

    def room(self, req: Request) -> int:
        return 1 << 30

    def prefill(self, reqs: Sequence[Request]) -> None:
        pass

    def free(self, slot: int) -> None:
        self.runtime.free(slot)

    def _catch_up(self, reqs: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Feed each row's pending true slots. Returns the rows that can draft now (their
        slots reach len(context) - 2) and their last outputs (B', D), whose head gives d_1."""
        ready: list[int] = []
        slots, starts, feats, toks = [], [], [], []
        for b, r in enumerate(reqs):
            have = row_cached(r, self.name)
            if not r.fused or r.fused_from != have:
                continue  # no fresh slot to start from (it just joined, or was cut): no draft this step
            pending = torch.cat(r.fused)
            if have + len(pending) != r.length - 1:
                continue
            ready.append(b)
            slots.append(row_slot(r))
            starts.append(have)
            feats.append(pending)
            toks.append(r.context[have + 1 : have + 1 + len(pending)])
        if not ready:
            return ready, None
        g = self.runtime.run(slots, starts, feats, toks, [True] * len(ready))
        for b in ready:
            r = reqs[b]
            set_row_cached(r, self.name, r.length - 1)
            r.fused, r.fused_from = [], r.length - 1
        return ready, g

    @torch.inference_mode()
    def settle(self, reqs: Sequence[Request], leave: int = 0) -> None:
        """Feed each row's pending true slots into its cache but the last `leave` (so that a
        timed round catches up on as many slots as a real one does)."""
        for r in reqs:
            pending = torch.cat(r.fused) if r.fused else None
            have = row_cached(r, self.name)
            if pending is None or r.fused_from != have or len(pending) <= leave:
                continue
            m = len(pending) - leave
            self.runtime.run([row_slot(r)], [have], [pending[:m]], [r.context[have + 1 : have + 1 + m]], [True])
            set_row_cached(r, self.name, have + m)
            r.fused, r.fused_from = [pending[m:]], have + m

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        rt = self.runtime
        tokens: list[list[int]] = [[] for _ in reqs]
        want = [b for b, k in enumerate(ks) if k > 0]
        if not want:
            return BatchDraft(tokens, None)
        got, g = self._catch_up([reqs[b] for b in want])
        rows = [want[i] for i in got]
        if g is None:
            return BatchDraft(tokens, None)
        k_rows = [ks[b] for b in rows]
        keep = keep_drafting_rows(reqs)
        who = f"prophet '{self.name}'"
        sampled = [i for i, b in enumerate(rows) if not reqs[b].params.greedy]
        probs = torch.zeros(len(reqs), max(k_rows), self.full_vocab, device=g.device) if sampled else None
        for j in range(1, max(k_rows) + 1):
            live = [i for i in range(len(rows)) if k_rows[i] >= j]
            if j > 1:  # slot N-2+j-1 of each row still drafting: (its last output, its last draft)
                g_live = rt.run([row_slot(reqs[rows[i]]) for i in live],
                                [reqs[rows[i]].length - 2 + j - 1 for i in live],
                                [g[i][None] for i in live], [[tokens[rows[i]][-1]] for i in live],
                                [False] * len(live))
                g = g.clone()
                g[live] = g_live
            sub = rt.logits(g[live])  # (B', N)
            check_logits(sub, who)
            picked = rt.vocab_ids[sub.argmax(-1)].tolist()
            drawing = [n for n, i in enumerate(live) if i in sampled]
            if drawing:
                q = probs_by_params(sub[drawing][:, None], [reqs[rows[live[n]]] for n in drawing], who)[:, 0]
                for m, n in enumerate(drawing):
                    req = reqs[rows[live[n]]]
                    picked[n] = draw(q[m], req.params, req.generator, req.length + j - 1, rt.vocab_ids,
                                     self.full_vocab)
                    probs[rows[live[n]], j - 1].index_copy_(-1, rt.vocab_ids, q[m].float())  # type: ignore[index]
            for n, i in enumerate(live):
                b = rows[i]
                tokens[b].append(picked[n])
                stop = keep[b]
                if stop is not None and k_rows[i] > j:
                    sure = probs[b, j - 1] if probs is not None and not reqs[b].params.greedy else \
                        torch.zeros(self.full_vocab, device=g.device).index_copy_(
                            -1, rt.vocab_ids, torch.softmax(sub[n].float(), -1))
                    if not stop(sure):
                        k_rows[i] = j
        return BatchDraft(tokens, probs, one_hot=[r.params.greedy for r in reqs])


class FirstBatchProphet:
    """Several prophets, the first in order that proposes something for a row drafts for it
    (`multi="first"`, e.g. prompt lookup where the context repeats, eagle elsewhere), or,
    with `best`, only the one with the best recent tokens per round in that row's request
    (`multi="best"`, `Request.recent`). The choice depends on each row's committed context
    and its own past rounds only, so it stays exact; the verifier sees one-hot q for a
    deterministic prophet's rows."""

    def __init__(self, parts: Sequence[LookupBatchProphet | FeatureBatchProphet | ModelBatchProphet],
                 best: bool = False) -> None:
        if len({p.name for p in parts}) < len(parts):
            raise ValueError("each prophet among several needs a name of its own (a row keeps a cache per draft model)")
        self.parts = list(parts)
        self.best = best
        self.name = "+".join(p.name for p in parts)
        self.reads_features = any(p.reads_features for p in parts)

    def _order(self, req: Request) -> list[str]:
        """The order in which this row asks the prophets: theirs, or with `best` by the
        row's own running tokens per round (`policy.best_first`)."""
        names = [p.name for p in self.parts]
        return best_first(names, req.recent) if self.best else names

    def room(self, req: Request) -> int:
        return min(p.room(req) for p in self.parts)

    def prefill(self, reqs: Sequence[Request]) -> None:
        for p in self.parts:
            p.prefill(reqs)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                budget: Callable[[Request, str], int]) -> BatchDraft:
        """ks: each row's largest K; budget(req, prophet name): that prophet's K for the row
        (its policy's K, 0 where the row may not use that prophet)."""
        tokens: list[list[int]] = [[] for _ in reqs]
        names: list[str | None] = [None] * len(reqs)
        one_hot = [True] * len(reqs)  # lookup rows, greedy rows: q is one-hot on the drafted tokens
        q_from: dict[int, torch.Tensor] = {}  # rows drafted from a sampled q: the prophet's whole q (B, K, V)
        grown: dict[int, tuple[DraftTree, dict[str, list[int]]]] = {}  # rows a branching prophet drafted a tree for
        orders = [self._order(r) for r in reqs]
        # Rank by rank: a row asks its rank-th prophet only while nothing earlier proposed.
        for rank, part in ((rank, part) for rank in range(len(self.parts)) for part in self.parts):
            part_ks = [0 if tokens[b] or b in grown or not k or orders[b][rank] != part.name else
                       min(k, budget(r, part.name)) for b, (r, k) in enumerate(zip(reqs, ks, strict=True))]
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



class TreeBatchProphet:
    """Several prophets, every one drafting for each row (`multi="tree"`): a row's chains (and a
    branching eagle's grown tree) are merged into one token tree (`specdec.verify.DraftTree`),
    scored in one pass with a tree mask and verified by recursive rejection sampling
    (`verify_tree`), exact at every temperature: each was drawn independently of the others,
    from its own q."""

    def __init__(self, parts: Sequence[LookupBatchProphet | FeatureBatchProphet | ModelBatchProphet]) -> None:
        if len({p.name for p in parts}) < len(parts):
            raise ValueError("each prophet in a tree needs a name of its own (a row keeps a cache per draft model)")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in parts)
        self.reads_features = any(p.reads_features for p in parts)  # an eagle's chain in the tree

    def room(self, req: Request) -> int:
        return min(p.room(req) for p in self.parts)

    def prefill(self, reqs: Sequence[Request]) -> None:
        for p in self.parts:
            p.prefill(reqs)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                budget: Callable[[Request, str], int] | None = None) -> BatchDraft:
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





BatchProphet = ModelBatchProphet | LookupBatchProphet | FeatureBatchProphet | Eagle3BatchProphet | FirstBatchProphet | \
    TreeBatchProphet
TREE = "*"  # what a row's policy keeps evidence for in a tree step: every prophet at once


def prefill_rows(lm: BatchLM, reqs: Sequence[Request], cache: str, budget: int | None = None,
             capture: tuple[int, ...] = ()) -> None:
    """Feed rows' prompts but their last token (later steps then feed few tokens per row):
    with a budget, one chunk per row, from where the row is (its length in `cache`) to
    the next multiple of `budget` positions, for rows in order while the chunks fit `budget`
    tokens in all (at least one row); without, every row's whole prompt. capture: target
    layers whose outputs each row keeps for an eagle3 prophet (`Request.fused`)."""
    feeds: list[tuple[Request, int, int]] = []
    used = 0
    for r in reqs:
        done, end = row_cached(r, cache), len(r.prompt) - 1
        if done >= end:
            continue
        stop = end if budget is None else min(end, (done // budget + 1) * budget)
        if feeds and budget is not None and used + stop - done > budget:
            break
        feeds.append((r, done, stop))
        used += stop - done
    args = ([row_slot(r) for r, _, _ in feeds], [a for _, a, _ in feeds], [r.prompt[a:b] for r, a, b in feeds],
            [0] * len(feeds))
    if feeds and capture:
        fused = lm.forward_fused(*args, capture=capture)[2]  # type: ignore[attr-defined]
        for i, (r, a, b) in enumerate(feeds):
            keep_fused(r, a, fused[i, : b - a])
    elif feeds:
        lm.forward(*args)
    for r, _, b in feeds:
        set_row_cached(r, cache, b)




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




__all__ = ["TREE", "BatchDraft", "BatchProphet", "EarlyExitBatchProphet", "Eagle3BatchProphet", "FeatureBatchProphet",
           "FirstBatchProphet", "LookupBatchProphet", "ModelBatchProphet", "NgramBatchProphet", "RowsProphet",
           "TreeBatchProphet", "padded_q"]
