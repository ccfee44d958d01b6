"""Exact verification of drafted tokens. Pure functions on probability tensors, no model.

Names follow Leviathan et al. / Chen et al. once, here, and nowhere else:
    p = `target_probs`  the distribution the target samples from (after temperature/top-k/top-p)
    q = `draft_probs`   the distribution the prophet sampled its token from (same settings)

Each round ends with exactly one token that was not drafted-and-accepted:
    accepted   drafted tokens that passed the test  u < p(x) / q(x)
    recovered  the token sampled from norm(max(0, p - q)) at the first rejection
    bonus      the token sampled from p_{K+1} when all K drafted tokens were accepted
so output tokens per round = accepted + 1 (recovered or bonus).

A deterministic prophet (prompt lookup, retrieval, greedy) has `draft_probs=None`: q is
one-hot on its token, so acceptance happens with probability p(x) and the residual is p
with x removed. Greedy decoding is the case where p is one-hot too: accept while the
drafted token is the target's argmax, then emit the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from specdec.sampling import sample

NextKind = Literal["recovered", "bonus"]


@dataclass(frozen=True)
class Verdict:
    n_accepted: int  # how many drafted tokens (a prefix of the draft) were accepted
    next_token: int  # the recovered or bonus token that ends the round
    next_kind: NextKind


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)). target_probs (V,), draft_probs (V,) or None (= one-hot at token)."""
    if draft_probs is None:
        res = target_probs.clone()
        res[token] = 0.0
    else:
        res = (target_probs - draft_probs).clamp_min(0.0)
    total = res.sum()
    if total <= 0:
        # Only reachable through rounding when p == q up to float error; then p itself is the residual.
        return target_probs
    return res / total


def verify_chain(
    draft_tokens: torch.Tensor,  # (K,) int64
    draft_probs: torch.Tensor | None,  # (K, V) q_1..q_K, or None for a deterministic prophet
    target_probs: torch.Tensor,  # (K+1, V) p_1..p_{K+1}
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling for one sequence: accept a prefix of the draft, then one more token."""
    k = draft_tokens.shape[0]
    if k == 0:  # nothing drafted (a plain step): the bonus token alone; no uniform is drawn either way
        return Verdict(0, int(sample(target_probs[0], generator)), "bonus")
    # 1. Acceptance test for every position at once; only the first rejection matters.
    p_of_draft = target_probs[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)  # (K,)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)  # (K,)
    u = torch.rand(k, generator=generator, device=target_probs.device)
    accepted = u * q_of_draft < p_of_draft  # u < p/q without dividing by a zero q
    rejected_at = (~accepted).nonzero()
    n_accepted = int(rejected_at[0]) if len(rejected_at) else k
    # 2. All accepted: the target's distribution after the last draft gives a bonus token.
    if n_accepted == k:
        return Verdict(k, int(sample(target_probs[k], generator)), "bonus")
    # 3. First rejection at position n: recover from the residual of p_n and q_n.
    token = int(draft_tokens[n_accepted])
    q_n = None if draft_probs is None else draft_probs[n_accepted]
    res = residual(target_probs[n_accepted], q_n, token)
    return Verdict(n_accepted, int(sample(res, generator)), "recovered")


@dataclass
class DraftTree:
    """Candidate continuations from several prophets, merged into a token tree.

    Nodes are numbered 0..N-1 in an order where a parent comes before its children; parent
    -1 is the root (the position right after the committed context). A *proposal* is one
    prophet's claim that `node` follows `parent`, with the q it sampled from (None = one-hot).
    Two prophets proposing the same token at the same place share the node but keep two
    proposals: each is tested in turn, which keeps the scheme exact.
    """

    tokens: list[int] = field(default_factory=list)  # (N,) token of each node
    parents: list[int] = field(default_factory=list)  # (N,) parent node, -1 = root
    proposals: list[tuple[int, int, torch.Tensor | None, str]] = field(default_factory=list)
    # (parent, node, draft_probs (V,) or None, prophet name), in the order they are tried
    expected: float = 0.0  # tokens its prophet expected the tree to yield (a grown tree's; 0: not estimated)

    def child(self, parent: int, token: int) -> int:
        """The node for `token` under `parent`, created if new."""
        for i, (t, par) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if par == parent and t == token:
                return i
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def graft(self, other: DraftTree) -> None:
        """Add another tree's proposals (in its order), its nodes merged with these where the
        same token follows the same path."""
        where = {-1: -1}  # other's node -> this tree's
        for parent, node, q, name in other.proposals:
            where[node] = self.child(where[parent], other.tokens[node])
            self.proposals.append((where[parent], where[node], q, name))

    def add_chain(self, tokens: list[int], probs: torch.Tensor | None, name: str) -> None:
        """Add one prophet's chain. probs (len(tokens), V) or None."""
        parent = -1
        for i, t in enumerate(tokens):
            node = self.child(parent, t)
            self.proposals.append((parent, node, None if probs is None else probs[i], name))
            parent = node


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted nodes, root to leaf
    next_token: int
    next_kind: NextKind
    accepted_by: list[str]  # prophet whose proposal was accepted at each step of the path


def verify_tree(
    tree: DraftTree,
    target_probs: torch.Tensor,  # (N+1, V): row 0 = p at the root, row i+1 = p after node i
    generator: torch.Generator | None,
) -> TreeVerdict:
    """Multi-draft speculative sampling (recursive rejection sampling over a token tree).

    At each node, try its proposals in order: accept with min(1, p(x)/q(x)); on rejection
    replace p by norm(max(0, p - q)) and try the next. If all are rejected, the residual
    left is sampled (recovered); at a leaf whose path was all accepted, p there is sampled
    (bonus). Exact because each proposal was drawn independently of the earlier ones.
    """
    path: list[int] = []
    accepted_by: list[str] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        moved = tried = False
        for parent, child, q, name in tree.proposals:
            if parent != node:
                continue
            tried = True
            x = tree.tokens[child]
            q_x = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
                path.append(child)
                accepted_by.append(name)
                node, moved = child, True
                break
            p = residual(p, q, x)
        if moved:
            continue
        # Nothing left to try here: recovered if proposals were rejected, bonus at a leaf
        # (or at the root of an empty tree, which is a plain decoding step).
        kind: NextKind = "recovered" if tried else "bonus"
        return TreeVerdict(path, int(sample(p, generator)), kind, accepted_by)


def verify_greedy_tree(tree: DraftTree, choices: list[int]) -> TreeVerdict:
    """`verify_tree` where p is one-hot (greedy, or a coupled draw): choices[i] is the target's
    token at row i (0: the root, i + 1: after node i). From the root, move to the child whose
    token is the choice while there is one; the round ends on the choice there (recovered where
    the node had proposals, bonus at a leaf). No probabilities, no random numbers: the same
    verdict as `verify_tree` on one-hot rows, whose every test is then certain."""
    path: list[int] = []
    accepted_by: list[str] = []
    node = -1
    while True:
        want = choices[node + 1]
        tried = False
        for parent, child, _, name in tree.proposals:
            if parent != node:
                continue
            tried = True
            if tree.tokens[child] == want:
                path.append(child)
                accepted_by.append(name)
                node = child
                break
        else:
            return TreeVerdict(path, want, "recovered" if tried else "bonus", accepted_by)
