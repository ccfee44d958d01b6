"""How many tokens to draft next round.

- auto:       K while speculation measurably pays, plain steps while it does not (default).
- fixed:      always K.
- adaptive:   grow K after a fully accepted round, shrink it after a rejection (the
              heuristic of transformers' assisted generation, bounded to [k_min, k_max]).
- confidence: draft up to k_max but stop as soon as the prophet's top probability falls
              below a threshold (the seeds' "early stop").
- optimal:    the K that maximises the expected walltime gain
              (1 - a^(K+1)) / ((1 - a) (K c + v(K))) from a running estimate of the
              acceptance rate a and the decoder's stored costs: c = t_draft / t_target and
              the cost v(K) of verifying K+1 tokens relative to one target step.

All are exact: they only choose how much to draft, never what is accepted. None reads the
clock during a request (auto and optimal decide from costs measured once and stored), so a
seed fixes the output of every policy, across loads and processes on one machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    prophet: str | None = None  # the prophet whose draft was verified ("a+b" for a tree), None: a plain step
    # another prophet's part of a round already observed (a tree's chains, each its prophet's evidence)
    same_round: bool = False


def check_k(k: object) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"draft length K must be an integer >= 1, got {k!r}")
    return k


class Policy:
    name = "fixed"
    needs_costs = False  # True: the decoder measures its costs once (calibrate) and sets .costs
    per_prophet = False  # True: K and evidence per prophet (a tree's chains are observed one by one)
    costs: Costs | None = None

    def __init__(self, k: int = 5) -> None:
        self.k0 = check_k(k)
        self.k = k

    def reset(self, k: int | None = None, temperature: float = 0.0) -> None:
        """A new request (sampled at `temperature`, 0 greedy): forget what earlier requests
        taught, start from K = k (or the decoder's K). Nothing a request sets leaks into the next."""
        self.k = check_k(k) if k is not None else self.k0

    def next_k(self, prophet: str | None = None) -> int:
        """K for the next round (of `prophet`, for policies that keep evidence per prophet)."""
        return self.k

    def keep_drafting(self) -> KeepDrafting | None:
        return None

    def observe(self, outcome: RoundOutcome) -> None:
        pass

    def acceptance(self, prophet: str | None = None) -> float | None:
        """This request's estimate of a drafted token's acceptance (of `prophet`), or None
        where the policy keeps none (a batched step then assumes its drafts are accepted)."""
        return None


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
    """The K that maximises the expected gain (1 - a^(K+1)) / ((1 - a) (K c + v(K))) from a
    running estimate of the acceptance a in this request and the decoder's fixed costs:
    c = t_draft / t_plain and v(K) = t_verify(K+1) / t_plain, measured once and stored
    (SpeculativeDecoder.stored_costs). Its choices depend on acceptance and those stored
    numbers only, never on the clock during a request, so a seed fixes its output. Without
    costs (a policy used outside a decoder) it assumes c = 0.1 and v(K) = 1 + verify_slope K."""

    name = "optimal"
    needs_costs = True

    def __init__(self, k: int = 4, k_max: int = 16, verify_slope: float = 0.06, prior_rounds: float = 4.0) -> None:
        super().__init__(k)
        self.k_max = k_max
        self.verify_slope = verify_slope  # extra target cost per extra scored token (measured ~0.05-0.08 on CPU)
        self.prior_rounds = prior_rounds
        self.costs: Costs | None = None
        self.reset()

    def reset(self, k: int | None = None, temperature: float = 0.0) -> None:
        """The running acceptance estimate restarts with each request."""
        super().reset(k, temperature)
        # Running sums, started from a mild prior (a = 0.7) so the first rounds are sane.
        self.proposed, self.accepted = self.prior_rounds, 0.7 * self.prior_rounds

    def acceptance(self, prophet: str | None = None) -> float:
        return self.accepted / self.proposed

    def _gain(self, a: float, k: int) -> float:
        if self.costs is None:
            return expected_gain(a, k, 0.1, 1 + self.verify_slope * k)
        return self.costs.gain(a, k)

    def observe(self, outcome: RoundOutcome) -> None:
        # Acceptance of a position given the ones before it were accepted: accepted / tested.
        if outcome.drafted == 0:
            return
        self.proposed += min(outcome.drafted, outcome.accepted + 1)
        self.accepted += outcome.accepted
        a = self.acceptance()
        self.k = max(range(1, self.k_max + 1), key=lambda k: self._gain(a, k))


@dataclass
class _Evidence:
    """What the auto policy knows about one prophet within a request."""

    tested: float
    accepted: float
    k: int
    rounds: int = 0  # drafted rounds since the request started or the last pause ended
    pause: int = 0
    backoff: int = 4
    paused_before: bool = False


class AutoPolicy(Policy):
    """The default: the K in 1..K_max that the cost model predicts to pay most, and plain
    target steps while none pays. After each drafted round it updates this request's
    per-position acceptance a of the prophet that drafted (accepted / tested, a decaying
    average started from a prior) and takes K = argmax tokens(a, K) x t_plain /
    (K t_draft + t_verify(K+1)) from the costs measured once for the decoder (t_draft is
    that prophet's own). When the best predicted gain falls below `break_even` that prophet
    pauses (plain steps, or another prophet's drafts) for a pause that doubles each time
    (4 rounds up to 64). A pause keeps what the prophet showed (its evidence only weighs
    `resume_weight` as much after it), so the round that tries it again drafts the K that
    acceptance predicts (1 for a prophet that was never right: the cheapest probe), and one
    probe that does not pay pauses it again, twice as long. The pause shortens back to 4
    only after `min_rounds` rounds that pay. The prior a request starts from is `prior_a`
    when greedy and falls linearly to `prior_a_sampled` at temperature 1 and above: drafts
    are accepted less often when the target samples (measured on Spec-Bench with SmolLM2 at
    T=1: 0.35-0.37 a position for eagle and prompt lookup), and a prior of 0.6 there made
    the first rounds of every request draft K = 2-3 at a loss (0.85x and 0.58x of a plain
    step's worth of tokens). Likewise what a pause keeps: `resume_weight` when greedy, up to
    `resume_weight_sampled` (all of it) at temperature 1, where a lucky probe otherwise
    restarted runs of rounds that did not pay (Spec-Bench dev questions at T=1, 36 requests,
    one process, variants rotated: 0.980x of plain keeping it all against 0.971x keeping
    half; greedy, keeping it all measured 0.7% slower, so greedy keeps half). Its choices
    depend only on the request's temperature, its acceptance and those fixed costs (measured
    once per machine and settings, and stored: SpeculativeDecoder.stored_costs), so a seed
    fixes its output across loads."""

    name = "auto"
    needs_costs = True
    per_prophet = True

    # break_even above 1: the stored costs are minimums measured on a short placeholder
    # context, and real rounds come out dearer than predicted: ~4% on a 2-core AMD EPYC Zen 4
    # (SmolLM2 int4 on blocks16, eagle rounds of K = 1-3 at temperature 1 on Spec-Bench: 1.29-1.65
    # plain steps against 1.25-1.57), 3-12% on a 2-core Xeon Sapphire Rapids (the amx kernel,
    # Spec-Bench translation and QA, medians of each kind of round: eagle K = 1 1.03-1.07x greedy
    # and 1.06-1.09x at T=1, K = 2 1.07-1.12x and 1.06-1.09x, prompt lookup K = 1 1.09x at T=1),
    # so a round predicted to gain less than 8% gains nothing
    def __init__(self, k: int = 4, min_rounds: int = 2, max_pause: int = 64, break_even: float = 1.08,
                 prior_a: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9,
                 resume_weight: float = 0.5, prior_a_sampled: float = 0.4,
                 resume_weight_sampled: float = 1.0) -> None:
        super().__init__(k)
        self.min_rounds, self.max_pause, self.break_even = min_rounds, max_pause, break_even
        self.resume_weight = resume_weight
        self.prior_a, self.prior_weight, self.decay = prior_a, prior_weight, decay
        self.prior_a_sampled, self.resume_weight_sampled = prior_a_sampled, resume_weight_sampled
        self.costs: Costs | None = None
        self.reset()

    def reset(self, k: int | None = None, temperature: float = 0.0) -> None:
        """A new request; k (or the decoder's K) is the largest K this request may draft."""
        super().reset(k, temperature)
        self.k_max = self.k
        # this request's prior and what a pause keeps: the greedy value at T=0, the sampled one from T=1
        t = min(max(float(temperature), 0.0), 1.0)
        self.prior = self.prior_a + (self.prior_a_sampled - self.prior_a) * t
        self.resume = self.resume_weight + (self.resume_weight_sampled - self.resume_weight) * t
        self.evidence: dict[str, _Evidence] = {}
        self.gains: list[float] = []  # the predictions made in this request (for stats and tests)
        self.ks: list[int] = []  # the K chosen after each drafted round

    def _of(self, prophet: str | None) -> _Evidence:
        key = prophet or "*"
        if key not in self.evidence:
            w = self.prior_weight
            self.evidence[key] = _Evidence(w, self.prior * w, self.k_max)
        return self.evidence[key]

    def acceptance(self, prophet: str | None = None) -> float:
        """This request's running estimate of a prophet's per-position acceptance rate."""
        ev = self._of(prophet)
        return ev.accepted / ev.tested

    def next_k(self, prophet: str | None = None) -> int:
        ev = self._of(prophet)
        if ev.pause > 0:
            return 0
        if self.costs is not None and ev.rounds == 0:
            ev.k = self.costs.best_k(ev.accepted / ev.tested, self.k_max, prophet or "*")[0]
        self.k = ev.k
        return ev.k

    def observe(self, outcome: RoundOutcome) -> None:
        key = (outcome.prophet or "*") if outcome.drafted else None
        for name, other in self.evidence.items() if not outcome.same_round else ():
            # a round passes (once) for every pausing prophet but the one that drafted
            if name != key and other.pause > 0:
                other.pause -= 1
                if other.pause == 0:  # the pause ends: what it showed weighs less against the next rounds
                    other.tested *= self.resume
                    other.accepted *= self.resume
                    other.rounds = 0
        if key is None:
            return
        ev = self._of(key)
        ev.rounds += 1
        # Position i is tested only if positions 1..i-1 were accepted.
        ev.tested = self.decay * ev.tested + min(outcome.drafted, outcome.accepted + 1)
        ev.accepted = self.decay * ev.accepted + outcome.accepted
        if self.costs is None:
            return
        ev.k, gain = self.costs.best_k(ev.accepted / ev.tested, self.k_max, key)
        self.k = ev.k
        self.gains.append(gain)
        self.ks.append(ev.k)
        if gain < self.break_even and (ev.rounds >= self.min_rounds or ev.paused_before):
            # a first try gets min_rounds rounds; after a pause one probe decides
            ev.pause, ev.backoff, ev.paused_before = ev.backoff, min(2 * ev.backoff, self.max_pause), True
        elif gain >= self.break_even and ev.rounds >= self.min_rounds:
            ev.backoff = 4  # it pays again: the next pause is short


POLICIES = ("auto", "fixed", "adaptive", "confidence", "optimal")


# ----------------------------------------------------------------- multi="best"
def best_first(names: Sequence[str], recent: Mapping[str, float]) -> list[str]:
    """multi="best": the order in which a request asks its prophets for a draft (the first
    that proposes something drafts): those never verified for it yet first, in their own
    order (each gets tried), then by running tokens per round, best first (ties: their own
    order). It depends on the request's own past rounds only, so every loop stays exact."""
    return sorted(names, key=lambda n: (n in recent, -recent.get(n, 0.0)))


def observe_recent(recent: dict[str, float], prophet: str, accepted: int) -> None:
    """A prophet's running tokens per round in one request, after a round it drafted."""
    tokens = accepted + 1.0
    recent[prophet] = tokens if prophet not in recent else 0.8 * recent[prophet] + 0.2 * tokens


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
    raise ValueError(f"unknown policy '{name}': choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "Policy", "AutoPolicy", "Costs", "AdaptivePolicy", "ConfidencePolicy", "OptimalPolicy",
           "RoundOutcome", "make_policy", "expected_gain"]
