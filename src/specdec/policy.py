"""How many tokens to draft next round.

- fixed:      always K.
- adaptive:   grow K after a fully accepted round, shrink it after a rejection (the
              heuristic of transformers' assisted generation, bounded to [k_min, k_max]).
- confidence: draft up to k_max but stop as soon as the drafter's top probability falls
              below a threshold (the seeds' "early stop").
- optimal:    the K that maximises the expected walltime gain
              (1 - a^(K+1)) / ((1 - a) (K c + v(K))) from running estimates of the
              acceptance rate a, the cost ratio c = t_draft / t_target and the cost v(K)
              of verifying K+1 tokens relative to one target step.

All are exact: they only choose how much to draft, never what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.drafters.base import KeepDrafting


@dataclass
class RoundOutcome:
    drafted: int
    accepted: int
    draft_s: float
    target_s: float
    draft_calls: int


class Policy:
    name = "fixed"

    def __init__(self, k: int = 5) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"draft length K must be an integer >= 1, got {k!r}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def keep_drafting(self) -> KeepDrafting | None:
        return None

    def observe(self, outcome: RoundOutcome) -> None:
        pass


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, k: int = 5, k_min: int = 1, k_max: int = 16) -> None:
        super().__init__(k)
        self.k_min, self.k_max = k_min, k_max

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.drafted == 0:
            return
        if outcome.accepted == outcome.drafted:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(self.k_min, self.k - 1)


class ConfidencePolicy(Policy):
    name = "confidence"

    def __init__(self, k: int = 10, threshold: float = 0.4) -> None:
        super().__init__(k)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def keep_drafting(self) -> KeepDrafting | None:
        threshold = self.threshold
        return lambda q: bool(q.max() >= threshold)


def expected_gain(a: float, k: int, c: float, v: float) -> float:
    """Expected speedup of one round of K drafts over plain decoding (Leviathan et al.),
    with verification costing v target steps instead of 1."""
    a = min(max(a, 0.0), 0.999)
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + v)


class OptimalPolicy(Policy):
    name = "optimal"

    def __init__(self, k: int = 4, k_max: int = 16, verify_slope: float = 0.06, prior_rounds: float = 4.0) -> None:
        super().__init__(k)
        self.k_max = k_max
        self.verify_slope = verify_slope  # extra target cost per extra scored token (measured ~0.05-0.08 on CPU)
        # Running sums, started from a mild prior (a = 0.7, c = 0.1) so the first rounds are sane.
        self.proposed, self.accepted = prior_rounds, 0.7 * prior_rounds
        self.draft_s_per_call, self.target_s = 0.1 * prior_rounds, prior_rounds
        self.draft_calls, self.target_rounds = prior_rounds, prior_rounds

    def observe(self, outcome: RoundOutcome) -> None:
        # Acceptance of a position given the ones before it were accepted: accepted / tested.
        tested = min(outcome.drafted, outcome.accepted + 1)
        self.proposed += tested
        self.accepted += outcome.accepted
        self.draft_s_per_call += outcome.draft_s
        self.draft_calls += outcome.draft_calls
        self.target_s += outcome.target_s
        self.target_rounds += 1
        a = self.accepted / self.proposed
        c = (self.draft_s_per_call / max(self.draft_calls, 1)) / (self.target_s / self.target_rounds)
        self.k = max(range(1, self.k_max + 1),
                     key=lambda k: expected_gain(a, k, c, 1 + self.verify_slope * k))


def make_policy(name: str, k: int) -> Policy:
    if name == "fixed":
        return Policy(k)
    if name == "adaptive":
        return AdaptivePolicy(k)
    if name == "confidence":
        return ConfidencePolicy(max(k, 8))
    if name == "optimal":
        return OptimalPolicy(k)
    raise ValueError(f"unknown policy '{name}': choose fixed, adaptive, confidence or optimal")


__all__ = ["Policy", "AdaptivePolicy", "ConfidencePolicy", "OptimalPolicy", "RoundOutcome", "make_policy",
           "expected_gain"]
