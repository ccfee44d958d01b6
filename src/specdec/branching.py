"""How far a prophet's draft tree grows in a round (EAGLE-2's dynamic trees, sized by the cost model).

A feature prophet drafting with branches (`branches` > 1) grows a token tree depth by depth:
each node kept at a depth offers children (its q's top tokens where the target's choice is
deterministic, independent draws from q where the row samples). Each child has an estimated
chance of being reached and accepted, `s` = its parent's times its own confidence (the
prophet's q of the token, scaled by how well the request's past trees kept their promises:
`Request.tree_fit`). A child joins the tree only while it pays by the measured step costs: a
round yielding E expected tokens in T seconds (drafting steps so far, then the target's pass
over 1 + n tokens) takes a node of chance s that makes the pass score one token more (dT) when
s / dT > E / T, the round's own rate; a new depth costs one more drafting step. So on a machine
where each scored token costs a tenth of a step the tree grows wide and deep, and where it costs
a quarter (a 2-core CPU) it keeps the chain's first node and adds only children nearly as sure.

Nothing here reads the target: the rule sees the prophet's confidences and the costs only, so
the tree it shapes stays exact to verify (`specdec.verify.verify_tree`: one-hot proposals where
the target's choice is deterministic; independent draws, never dropped once drawn, where it
samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.costmodel import Costs

FIT_PRIOR = 2.0  # expected tokens of past trees counted as kept before any is seen (tree_fit)
FIT_RANGE = (0.25, 1.5)  # how far a request's record scales its prophet's confidences
FIT_DECAY = 0.9  # each round, a request's record of past trees keeps this much of its weight


def record_fit(fit: list[float], expected: float, accepted: int) -> None:
    """A grown tree's round, into a request's record (`Request.tree_fit`, decayed by FIT_DECAY):
    the tokens its prophet expected beyond the round's last (expected - 1), those accepted."""
    fit[:] = [FIT_DECAY * fit[0] + expected - 1.0, FIT_DECAY * fit[1] + accepted]


def fit_scale(fit: tuple[float, float] | list[float]) -> float:
    """The factor on a prophet's confidences from a request's past trees: (observed accepted
    tokens + prior) / (expected + prior), within FIT_RANGE. fit = [expected, observed]."""
    expected, observed = float(fit[0]), float(fit[1])
    lo, hi = FIT_RANGE
    return min(hi, max(lo, (observed + FIT_PRIOR) / (expected + FIT_PRIOR)))


@dataclass
class TreeBudget:
    """One row's running round while its tree grows: the expected tokens so far (1 for the
    token every round ends with, plus each node's chance), the nodes, the drafting steps."""

    costs: Costs | None
    prophet: str
    nodes: int = 0
    expected: float = 1.0
    steps: int = 0

    def pays(self, s: float, new_step: bool = False, nodes: float = 1.0) -> bool:
        """Whether adding nodes (default one) that bring s expected tokens raises the round's
        rate (a new depth: one drafting step more). Without costs, any node of chance >= 0.1."""
        if self.costs is None:
            return s >= 0.1
        steps = self.steps + (1 if new_step else 0)
        now = self.costs.time_of(max(self.steps, 1), self.nodes, self.prophet)
        later = self.costs.time_of(steps, self.nodes + max(1, round(nodes)), self.prophet)
        return (self.expected + s) / later > self.expected / now

    def add(self, s: float, new_step: bool = False, node: bool = True) -> None:
        """A proposal of chance s joins (a new node unless `node` is False: a repeated draw)."""
        self.nodes += 1 if node else 0
        self.expected += s
        if new_step:
            self.steps += 1


def draw_gains(q: torch.Tensor, draws: int) -> list[tuple[float, float]]:
    """For up to `draws` independent draws from q (N,): for the m-th draw, the chance it adds
    (the probability that the target's sample is among the distinct tokens drawn, assuming q
    stands for the target's distribution, rises by that much) and the chance it is a token not
    drawn before (a new node to score)."""
    qd = q.double()
    out, before = [], torch.zeros_like(qd)
    for m in range(1, draws + 1):
        hit = 1.0 - (1.0 - qd) ** m  # P(x among m draws)
        gain = float((qd * (hit - before)).sum())
        new = float((qd * (1.0 - qd) ** (m - 1)).sum())
        out.append((gain, new))
        before = hit
    return out
