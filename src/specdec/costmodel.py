"""The cost model of speculative decoding, in one place (Leviathan et al., 2023).

With per-position acceptance a (i.i.d.), a round of K drafts yields on average
(1 - a^(K+1)) / (1 - a) tokens; it costs K drafting steps of c target steps each and one
verification pass of v(K) target steps (v = 1 would be free verification). The expected
walltime gain over plain decoding is tokens / (K c + v).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def clamp_acceptance(a: float) -> float:
    """An acceptance estimate the formulas can use: within [0, 0.999]."""
    return min(max(a, 0.0), 0.999)


def median_seconds(fn: Callable[[], object], repeats: int, after: Callable[[], object] = lambda: None) -> float:
    """Median wall time of fn over `repeats` calls, after one warm-up call (the first pass
    of a new shape is slower); `after` runs after every call, outside the timing (e.g. to
    roll a cache back)."""
    fn()
    after()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        after()
    return statistics.median(times)


def interleaved_minimums(fns: Mapping[int, Callable[..., object]], repeats: int,
                         after: Callable[[], object] = lambda: None) -> dict[int, float]:
    """The fastest of `repeats` timed calls of each function, the functions taken in turn
    (after one warm-up call each), `after` run outside the timing after every call. On a
    shared machine noise only ever adds time, so the minimum is the estimate of what a call
    costs, and taking the functions in turn spreads a burst of noise over all of them
    instead of one (a median of 3 once stored v(2) = 1.8 plain steps against v(5) = 1.3)."""
    best = {key: float("inf") for key in fns}
    for rep in range(repeats + 1):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            after()
            if rep > 0:  # the first pass is the warm-up
                best[key] = min(best[key], dt)
    return best


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """A verification curve that never falls: scoring more tokens in one pass cannot cost
    less than scoring fewer (a smaller measurement past a larger one is noise)."""
    out, top = {}, 0.0
    for n in sorted(curve):
        top = max(top, curve[n])
        out[n] = top
    return out


def expected_tokens_per_round(a: float, k: float) -> float:
    """(1 - a^(K+1)) / (1 - a): expected output tokens of a round with i.i.d. acceptance a."""
    if a >= 1.0:
        return k + 1
    return (1 - a ** (k + 1)) / (1 - a)


def expected_gain(a: float, k: float, c: float, v: float = 1.0) -> float:
    """Expected speedup of rounds of K drafts over plain decoding, with drafting costing c
    and verification v target steps (a is clamped to [0, 0.999])."""
    return expected_tokens_per_round(clamp_acceptance(a), k) / (k * c + v)


@dataclass
class Costs:
    """Measured once per decoder (SpeculativeDecoder.calibrate), in seconds: a plain target
    step, scoring n tokens in one target pass (a few n from 1 up; v(K) = t_verify(K+1) /
    t_plain), one drafting step of a round (all its prophets together), and how many drafts
    a round scores side by side (width: a tree of several prophets' chains).

    On a CPU the verification cost is far from linear in n: for SmolLM2 in float32 here,
    scoring 2-3 tokens costs 1.04-1.10 plain steps and 5 tokens 1.6, so the best K depends
    on the measured curve, not on a slope."""

    t_plain: float
    t_verify: dict[int, float]
    t_draft: float
    width: int = 1
    t_draft_by: dict[str, float] = field(default_factory=dict)  # one prophet's drafting step, by name

    def __post_init__(self) -> None:
        if not self.t_verify or min(self.t_verify) < 1:
            raise ValueError("t_verify needs measurements for n >= 1 scored tokens")

    def to_dict(self) -> dict[str, object]:
        return {"t_plain": self.t_plain, "t_verify": {str(n): t for n, t in self.t_verify.items()},
                "t_draft": self.t_draft, "width": self.width, "t_draft_by": dict(self.t_draft_by)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        return cls(float(d["t_plain"]), {int(n): float(t) for n, t in d["t_verify"].items()}, float(d["t_draft"]),
                   int(d["width"]), {str(k): float(v) for k, v in d["t_draft_by"].items()})

    def verify_time(self, n: int) -> float:
        """Seconds to score n tokens: linear between the measured sizes, and past the
        largest along the last measured slope."""
        points = sorted(self.t_verify.items())
        if n <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        if len(points) == 1:
            return points[0][1]
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) / (n1 - n0) * (n - n1)

    def round_time(self, k: int, prophet: str | None = None) -> float:
        """A round of k drafts: k drafting steps (of `prophet` when its own cost is known),
        then one pass over the 1 + width * k tokens."""
        t_draft = self.t_draft_by.get(prophet, self.t_draft) if prophet else self.t_draft
        return k * t_draft + self.verify_time(1 + self.width * k)

    def speedup(self, tokens: float, k: int, prophet: str | None = None) -> float:
        """Speedup over plain decoding of rounds of k drafts that yield `tokens` on average."""
        return tokens * self.t_plain / self.round_time(k, prophet)

    def gain(self, a: float, k: int, prophet: str | None = None) -> float:
        """Expected speedup over plain decoding of rounds of k drafts at per-position acceptance a."""
        return self.speedup(expected_tokens_per_round(clamp_acceptance(a), k), k, prophet)

    def best_k(self, a: float, k_max: int, prophet: str | None = None) -> tuple[int, float]:
        """The K in 1..k_max with the largest expected gain at acceptance a, and that gain."""
        gains = {k: self.gain(a, k, prophet) for k in range(1, max(1, k_max) + 1)}
        k = max(gains, key=lambda key: (gains[key], -key))
        return k, gains[k]
