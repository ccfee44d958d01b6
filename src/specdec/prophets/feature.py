"""Prophets over the target's own features (its last hidden state, after the final norm).

The verification pass already computes the target's hidden state h_t at every scored
position, and the target's head turns h_t into p(x_{t+1}). A feature prophet reuses it:
- `eagle` (autoregressive over features, after EAGLE): a small network maps
  (h_t, embedding of x_{t+1}) to a guess of h_{t+1}; the target's head turns the guess into
  q(x_{t+2}); the drafted token is fed back with the guessed feature, K times.
- `medusa` (non-autoregressive, after Medusa): head k maps h_t alone to a guess of
  h_{t+k}; all K tokens are drafted at once.
- `kangaroo` (autoregressive over tokens, after Kangaroo's early exit with an adapter): the
  target's own first L layers read each drafted token (through the target's KV cache, as
  in layerskip), and a small adapter maps their output, through the final norm, to a
  guess of the last layer's feature at the same position (specdec.prophets.layerskip).
The networks are residual MLPs; the embedding and the head are the target's own, handed
in at construction (nothing is copied into the prophet's file).

Reduced draft vocabulary: the head is cut to the N token ids most frequent in the
target's answers, and q is 0 everywhere else. That stays exact: the verifier accepts a
drafted token x with probability min(1, p(x)/q(x)) and on rejection samples from
norm(max(0, p - q)), which is p itself outside the N ids; a token q cannot propose is
simply recovered from p. Only the acceptance rate depends on N.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec import qgemm
from specdec.branching import TreeBudget, draw_gains, fit_scale
from specdec.grammar import mask_draft
from specdec.lm import LM, tree_depths
from specdec.prophets.base import BatchDraft, Budget, Prophet, in_row_order, probs_by_params
from specdec.request import Request, batch_free, keep_drafting_rows
from specdec.sampling import check_logits, draw
from specdec.verify import DraftTree


class ResidualMLP(nn.Module):
    """x + W2 silu(W1 [x; extra])."""

    def __init__(self, dim: int, extra: int, rank: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim + extra, rank, bias=False)
        self.down = nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.down.weight)  # starts as the identity: a guess of "the same feature"

    # At run time beside a 4-bit target: the two products as Q8_0 blocks on the target's block kernel
    # (`FeatureProphet`), float32 activations; None: the float (or bf16) Linear layers (training)
    products: tuple[Any, Any] | None = None

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        inp = x if extra is None else torch.cat([x, extra], dim=-1)
        if self.products is not None:
            up, down = self.products
            return x + down.mm(torch.nn.functional.silu(up.mm(inp)))
        return x + self.down(torch.nn.functional.silu(self.up(inp)))


KINDS = ("eagle", "medusa", "kangaroo")


class FeatureHead(nn.Module):
    """The trainable part of a feature prophet. kind "eagle": blocks[0] reads (h, e), the
    rest read h; kind "medusa": heads[k] maps h to the feature k+1 steps ahead; kind
    "kangaroo": the blocks map the target's early-exit feature after `layers` layers to
    the last layer's feature."""

    def __init__(self, kind: str, dim: int, rank: int, depth: int = 2, n_heads: int = 4, layers: int = 0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"feature prophet kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "kangaroo" and layers < 1:
            raise ValueError("a kangaroo adapter needs the number of target layers it reads (layers >= 1)")
        self.kind, self.dim, self.rank, self.depth, self.n_heads = kind, dim, rank, depth, n_heads
        self.layers = layers
        if kind == "eagle":
            self.blocks = nn.ModuleList([ResidualMLP(dim, dim if i == 0 else 0, rank) for i in range(depth)])
        elif kind == "medusa":
            self.blocks = nn.ModuleList([ResidualMLP(dim, 0, rank) for _ in range(n_heads)])
        else:
            self.blocks = nn.ModuleList([ResidualMLP(dim, 0, rank) for _ in range(depth)])

    def config(self) -> dict[str, Any]:
        out = {"kind": self.kind, "dim": self.dim, "rank": self.rank, "depth": self.depth, "n_heads": self.n_heads}
        return {**out, "layers": self.layers} if self.kind == "kangaroo" else out

    def step(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """eagle: the next feature from the feature h (..., D) and the next token's embedding e."""
        x = self.blocks[0](h, e)
        for block in self.blocks[1:]:
            x = block(x)
        return x

    def ahead(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """medusa: the feature k >= 1 steps after h."""
        return self.blocks[k - 1](h)

    def adapt(self, early: torch.Tensor) -> torch.Tensor:
        """kangaroo: the last layer's feature guessed from the early-exit one (..., D). With
        zero-initialised blocks this is the identity, i.e. plain early exit (layerskip)."""
        x = early
        for block in self.blocks:
            x = block(x)
        return x


def save_head(head: FeatureHead, vocab_ids: torch.Tensor, out: Path, info: dict[str, Any]) -> None:
    """Weights as int8 with one scale per output row (a quarter of fp32's bytes), the draft
    vocabulary, and the config; loadable with `load_head`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"vocab_ids": vocab_ids.to(torch.int32).contiguous()}
    for name, w in head.state_dict().items():
        w = w.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        tensors[name + ".int8"] = (w / scale).round().clamp(-127, 127).to(torch.int8).contiguous()
        tensors[name + ".scale"] = scale.to(torch.float32).contiguous()
    save_file(tensors, str(out / "prophet.safetensors"))
    (out / "prophet.json").write_text(json.dumps({**head.config(), **info}, indent=2) + "\n")


def load_head(path: Path) -> tuple[FeatureHead, torch.Tensor, dict[str, Any]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "prophet.json").read_text())
    tensors = load_file(str(path / "prophet.safetensors"))
    head = FeatureHead(cfg["kind"], cfg["dim"], cfg["rank"], cfg.get("depth", 2), cfg.get("n_heads", 4),
                       cfg.get("layers", 0))
    state = {name[: -len(".int8")]: tensors[name].float() * tensors[name[: -len(".int8")] + ".scale"]
             for name in tensors if name.endswith(".int8")}
    head.load_state_dict(state)
    return head.eval(), tensors["vocab_ids"].long(), cfg


def full_vocab_logits(sub: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary (..., N) placed in the full vocabulary (..., V), -inf
    (q = 0) at every other id."""
    logits = torch.full((*sub.shape[:-1], vocab_size), float("-inf"), device=sub.device)
    logits[..., vocab_ids] = sub
    return logits


def _fused_step(head: FeatureHead) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """An eagle's `FeatureHead.step` as one call of the extension's layer loop (`residual_mlps`: the same
    ATen calls and block products in the same order, so the same bits), where every block multiplies on
    the block kernels and the C++ loop runs here; else None (the Python blocks)."""
    products = [getattr(b, "products", None) for b in head.blocks]
    if head.kind != "eagle" or any(p is None for p in products):
        return None  # checked before asking for the extension: a float prophet never builds it
    from specdec import layerloop

    module = layerloop.kernels()
    if module is None or layerloop.loop_choice() == "python":
        return None
    ups = [layerloop.cpp_product(module, up, "") for up, _ in products]  # type: ignore[misc]
    downs = [layerloop.cpp_product(module, down, "") for _, down in products]  # type: ignore[misc]
    if any(p is None for p in ups + downs):
        return None
    return functools.partial(module.residual_mlps, ups, downs)


def is_feature_prophet(path: str) -> bool:
    return (Path(path) / "prophet.json").is_file()


Node = tuple[int, int, torch.Tensor, int, float]  # a tree node to grow: row, node, feature before it, token, chance


class FeatureProphet(Prophet):
    """Eagle or medusa for every row at once. A row drafts from the target's feature at its
    last committed position, which the previous step's verification pass left in
    `req.feature`; a row without one (it just joined, or its text was cut) drafts nothing
    this step, and its plain step yields one. q is 0 outside the draft vocabulary (exact,
    see above)."""

    reads_features = True

    def __init__(self, head: FeatureHead, embed: torch.Tensor, lm_head: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, name: str = "feature", dtype: torch.dtype = torch.float32,
                 block_head: Any = None) -> None:
        """block_head: the target's head rows of the draft vocabulary on a 4-bit block kernel
        (`Int4Weight.block_rows`), multiplied instead of the float rows where given (whatever
        `dtype` the prophet's own layers run in: the block kernel takes float32 activations):
        a draft step reads 5 MB of SmolLM2's Q8_0 head rows instead of 19 MB of float32 (9 MB
        of bfloat16), and the float rows are not kept."""
        mlps = [b for b in head.blocks if isinstance(b, ResidualMLP)]
        if block_head is not None and embed.device.type == "cpu" and all(
                b.up.weight.shape[1] % 32 == 0 and b.down.weight.shape[1] % 32 == 0 for b in mlps):
            # its own products as Q8_0 blocks too (the block kernel's activations): SmolLM2's eagle step (two residual
            # MLPs, 0.92M weights) took 205 us in bfloat16 and 149 in float32 through torch, 72 on the blocks
            # (2-core AMD EPYC, avx512_bf16): its weights are read from memory after every target pass
            from specdec.int4 import Int4Weight, quantize_q8_0

            head = copy.deepcopy(head).float()
            for b in head.blocks:  # every block is a ResidualMLP (FeatureHead)
                assert isinstance(b, ResidualMLP)
                b.products = (Int4Weight(quantize_q8_0(b.up.weight.detach())),
                              Int4Weight(quantize_q8_0(b.down.weight.detach())))
            dtype = torch.float32
        self.head = head.to(device=embed.device, dtype=dtype).eval()  # on the target's device
        self._fused = _fused_step(self.head)
        self.name = name
        self.vocab_size: int | None = vocab_size
        self.full_vocab = int(vocab_size)  # the width of the q the verifier reads
        self.embed = embed  # (V, D) the target's, shared
        self.vocab_ids = vocab_ids.to(embed.device)  # (N,) the draft vocabulary
        self.block_head = block_head
        # (N, D) the head's rows of the draft vocabulary, in float, unless the block rows are multiplied
        self.sub_head = None if self.block_head is not None else lm_head[vocab_ids].to(dtype).contiguous()
        self.dtype = dtype
        # > 1: an eagle grows a token tree per row, up to this many children a node (propose_trees)
        self.branches = 1

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's q never depends on the rows drafted beside it: every product on a block
        kernel (rows invariant by construction). torch's float32 and bfloat16 products are not: their
        kernels change with the row count, so a row's q differs in the last bits."""
        return self.block_head is not None and all(getattr(b, "products", None) is not None
                                                   for b in self.head.blocks)

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> FeatureProphet:
        other = copy.copy(self)
        other.branches = branches if self.head.kind == "eagle" else 1
        return other

    def max_k(self, k: int) -> int:
        """Medusa drafts at most one token per head."""
        return min(k, self.head.n_heads) if self.head.kind == "medusa" else k

    def guess(self, h: torch.Tensor, h0: torch.Tensor, tokens: torch.Tensor | int, step: int) -> torch.Tensor:
        """The feature whose head gives q at draft step `step` (1-based), for features (..., D):
        eagle from the previous guess h and the embedding of the token drafted before it,
        medusa from the starting feature h0 alone."""
        if self.head.kind == "eagle":
            e = self.embed[tokens].to(self.dtype)
            return self._fused(h, e) if self._fused is not None else self.head.step(h, e)
        return self.head.ahead(h0, step)

    def draft_logits(self, guess: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (..., N) from guessed features (..., D)."""
        if self.block_head is not None:
            return self.block_head.mm(guess.float())  # type: ignore[no-any-return]
        assert self.sub_head is not None
        return qgemm.f32_product(guess.to(self.dtype), self.sub_head).float()  # x @ sub_head.T

    @property
    def head_weight(self) -> Any:
        """What a draft step's head multiplies: the block rows (an Int4Weight) or the float rows."""
        return self.block_head if self.block_head is not None else self.sub_head

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        """Greedy rows take the argmax over the draft vocabulary (q one-hot: nothing over the
        full vocabulary is built for them); sampled rows sample from q, kept for the verifier.
        With branches: a token tree per row (`propose_trees`)."""
        return self.propose_trees(reqs, ks) if self.branches > 1 else self.propose_chains(reqs, ks)

    @torch.inference_mode()
    def propose_chains(self, reqs: Sequence[Request], ks: Sequence[int]) -> BatchDraft:
        """`propose` without branches: a chain per row (what the step costs measure per draft step)."""
        p = self
        # a row whose grammar forced tokens this step: an eagle catches up on them (`_catch_up`), a medusa waits
        rows = [b for b, (r, k) in enumerate(zip(reqs, ks, strict=True))
                if k > 0 and r.feature is not None and (not r.forced or p.head.kind == "eagle")]
        tokens: list[list[int]] = [[] for _ in reqs]
        if not rows:
            return BatchDraft(tokens, None)
        k_rows = [p.max_k(ks[b]) for b in rows]
        keep = keep_drafting_rows(reqs)
        who = f"prophet '{self.name}'"
        sampled = [i for i, b in enumerate(rows) if not reqs[b].params.greedy]
        probs = torch.zeros(len(reqs), max(k_rows), self.full_vocab, device=p.embed.device) if sampled else None
        h0 = torch.stack([reqs[b].feature for b in rows]).to(p.dtype)  # type: ignore[misc]
        h, last = _catch_up(p, h0, [reqs[b] for b in rows]), torch.tensor([reqs[b].context[-1] for b in rows],
                                                                        device=h0.device)
        # a seeded sampled row's draws must not depend on the rows beside it: where the products are not
        # rows-invariant (torch's kernels change with the row count), such a row's guesses are computed alone
        alone = [] if p.rows_invariant else [i for i, b in enumerate(rows) if not batch_free(reqs[b])]
        for j in range(1, max(k_rows) + 1):
            h, sub = _guess(p, h, h0, last, j, alone)  # sub (B', N): logits over the draft vocabulary (q 0 elsewhere)
            if any(reqs[b].constraint is not None for b in rows):  # q under each row's grammar, along its draft
                sub = mask_draft(sub, [reqs[b] for b in rows], [tokens[b] for b in rows], p.vocab_ids)
            check_logits(sub, who)
            picked = p.vocab_ids[sub.argmax(-1)].tolist()  # a greedy row's token
            drawing = [i for i in sampled if k_rows[i] >= j]  # a row draws only while it drafts: its
            if drawing:  # generator's draws never depend on how long the rows beside it draft
                q = probs_by_params(sub[drawing][:, None], [reqs[rows[i]] for i in drawing], who)[:, 0]  # (B_s, N)
                for n, i in enumerate(drawing):
                    req = reqs[rows[i]]
                    picked[i] = draw(q[n], req.params, req.generator, req.length + j - 1, p.vocab_ids,
                                     self.full_vocab)
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
        p = self
        who = f"prophet '{self.name}'"
        trees = [DraftTree() for _ in reqs]
        chains: list[dict[str, list[int]]] = [{} for _ in reqs]
        rows = [b for b, (r, k) in enumerate(zip(reqs, ks, strict=True))
                if k > 0 and r.feature is not None and not r.forced]  # forced tokens: its feature is behind
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
        p, width = self, self.branches
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
            q_full = torch.zeros(self.full_vocab, device=q.device)
            q_full.index_copy_(-1, p.vocab_ids, q.float())
            for gain, fresh in draw_gains(q, width):
                s = frontier[i][4] * min(1.0, scale * gain)
                if tree.tokens and not budget.pays(s, new_step=first_here, nodes=fresh):
                    break
                token = draw(q, req.params, req.generator, req.length + depth - 1, p.vocab_ids, self.full_vocab)
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


def _catch_up(p: FeatureProphet, h0: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """The rows' starting features (B', D), each moved over the tokens its grammar forced this
    step (`Request.forced`: its feature is the target's that many tokens back) by the eagle's
    own steps, as if it had drafted them: the feature it then drafts from."""
    if not any(r.forced for r in reqs):
        return h0
    h = h0.clone()
    for i, r in enumerate(reqs):
        ctx, m = r.context, r.forced
        hi = h0[i: i + 1]
        for t in range(m):  # the tokens at context[-1 - m] .. context[-2]
            hi = p.guess(hi, h0[i: i + 1], torch.tensor([ctx[-1 - m + t]], device=h0.device), t + 1)
        h[i] = hi[0]
    return h


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
