"""How many tokens to draft next round.

- auto:       K while speculation measurably pays, plain steps while it does not (default).
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

from specdec.costmodel import Costs, expected_gain
from specdec.sampling import KeepDrafting


@dataclass
class RoundOutcome:
    drafted: int
    accepted: int
    draft_s: float
    target_s: float
    draft_calls: int


def check_k(k: object) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"draft length K must be an integer >= 1, got {k!r}")
    return k


class Policy:
    name = "fixed"
    needs_costs = False  # True: the decoder measures its costs once (calibrate) and sets .costs
    costs: Costs | None = None

    def __init__(self, k: int = 5) -> None:
        self.k0 = check_k(k)
        self.k = k

    def reset(self, k: int | None = None) -> None:
        """A new request: forget what earlier requests taught, start from K = k (or the
        decoder's K). Nothing a request sets leaks into the next."""
        self.k = check_k(k) if k is not None else self.k0

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


class OptimalPolicy(Policy):
    name = "optimal"

    def __init__(self, k: int = 4, k_max: int = 16, verify_slope: float = 0.06, prior_rounds: float = 4.0) -> None:
        super().__init__(k)
        self.k_max = k_max
        self.verify_slope = verify_slope  # extra target cost per extra scored token (measured ~0.05-0.08 on CPU)
        self.prior_rounds = prior_rounds
        self.reset()

    def reset(self, k: int | None = None) -> None:
        """Running estimates restart with each request. They include measured times, so a
        seed does not fix this policy's output at temperature > 0 (greedy output is fixed)."""
        super().reset(k)
        prior_rounds = self.prior_rounds
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


class AutoPolicy(Policy):
    """The default: K drafted tokens while speculation pays, plain target steps while it
    does not. After a few drafted rounds of a request it predicts the speedup from this
    request's tokens per round and the costs measured once for the decoder
    (tokens/round x t_plain / t_round(K)); below `break_even` it takes plain steps for a
    pause that doubles each time (4 rounds up to 64), then drafts again. Its choices
    depend only on acceptance and those fixed costs, so a seed fixes its output on a
    given decoder; another process may measure slightly other costs."""

    name = "auto"
    needs_costs = True

    def __init__(self, k: int = 4, min_rounds: int = 4, max_pause: int = 64, break_even: float = 1.0) -> None:
        super().__init__(k)
        self.min_rounds, self.max_pause, self.break_even = min_rounds, max_pause, break_even
        self.costs: Costs | None = None
        self.reset()

    def reset(self, k: int | None = None) -> None:
        super().reset(k)
        self.pause, self.backoff = 0, 4
        self.rounds, self.tokens = 0, 0
        self.gains: list[float] = []  # the predictions made in this request (for stats and tests)

    def next_k(self) -> int:
        return 0 if self.pause > 0 else self.k

    def predicted_gain(self) -> float | None:
        if self.costs is None or self.rounds < self.min_rounds:
            return None
        return (self.tokens / self.rounds) * self.costs.t_plain / self.costs.round_time(self.k)

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.drafted == 0:
            self.pause = max(0, self.pause - 1)
            return
        self.rounds += 1
        self.tokens += outcome.accepted + 1
        gain = self.predicted_gain()
        if gain is None:
            return
        self.gains.append(gain)
        if gain < self.break_even:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.max_pause)
            self.rounds, self.tokens = 0, 0  # fresh evidence after the pause
        else:
            self.backoff = 4


def make_policy(name: str, k: int) -> Policy:
    if name == "auto":
        return AutoPolicy(k)
    if name == "fixed":
        return Policy(k)
    if name == "adaptive":
        return AdaptivePolicy(k)
    if name == "confidence":
        return ConfidencePolicy(max(k, 8))
    if name == "optimal":
        return OptimalPolicy(k)
    raise ValueError(f"unknown policy '{name}': choose auto, fixed, adaptive, confidence or optimal")


__all__ = ["Policy", "AutoPolicy", "Costs", "AdaptivePolicy", "ConfidencePolicy", "OptimalPolicy", "RoundOutcome",
           "make_policy", "expected_gain"]
