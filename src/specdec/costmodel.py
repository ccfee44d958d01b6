"""The cost model of speculative decoding, in one place (Leviathan et al., 2023).

With per-position acceptance a (i.i.d.), a round of K drafts yields on average
(1 - a^(K+1)) / (1 - a) tokens; it costs K drafting steps of c target steps each and one
verification pass of v(K) target steps (v = 1 would be free verification). The expected
walltime gain over plain decoding is tokens / (K c + v).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


def clamp_acceptance(a: float) -> float:
    """An acceptance estimate the formulas can use: within [0, 0.999]."""
    return min(max(a, 0.0), 0.999)


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(CPU seconds every process on this machine has run, this process's own, wall clock), or None
    where /proc/stat cannot be read (not Linux). Busy = user + nice + system + irq + softirq + steal
    (a VM's steal is time the host gave to someone else: contention as well)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


class OtherLoad:
    """How busy the rest of the machine was while something ran: started, then `cores()` gives the
    CPU time other processes took over the wall time since (1.0 = one core's worth, on average).
    Step costs measured while others took a share of the CPU describe that moment, not the machine:
    a plain step timed at 22.6 ms instead of 14 and an eagle draft step at 8.3 ms instead of 0.8,
    stored once, made the auto policy draft too little for every later load."""

    def __init__(self) -> None:
        self.start = _cpu_seconds()

    def cores(self) -> float:
        end = _cpu_seconds()
        if self.start is None or end is None or end[2] <= self.start[2]:
            return 0.0
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(0.0, others / (end[2] - self.start[2]))


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


def interleaved_times(fns: Mapping[Any, Callable[..., object]], repeats: int,
                      after: Callable[[], object] = lambda: None, budget_s: float | None = None
                      ) -> dict[Any, list[float]]:
    """Every timed call of each function, `repeats` rounds of them taken in turn (after one
    warm-up round), `after` run outside the timing after every call. Taking the functions in
    turn spreads a burst of noise over all of them instead of one; on a shared machine noise only
    ever adds time, so a call's cost is the minimum of its timings. budget_s: no further round
    starts once the timed rounds took that long (two are always timed), so a slow or busy
    machine is not held up by the measurement."""
    times: dict[Any, list[float]] = {key: [] for key in fns}
    start = time.perf_counter()
    for rep in range(repeats + 1):
        if rep > 2 and budget_s is not None and time.perf_counter() - start > budget_s:
            break
        if rep == 1:
            start = time.perf_counter()
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            after()
            if rep > 0:  # the first round is the warm-up
                times[key].append(dt)
    return times


def relative_spread(times: Sequence[float]) -> float:
    """How far the median of repeated timings lies above their minimum, relative to it (0:
    every call took the same time): how noisy the machine was while they were taken."""
    return statistics.median(times) / min(times) - 1.0 if times and min(times) > 0 else 0.0


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
    """Measured once per decoder and machine (SpeculativeDecoder.calibrate, through the one
    loop's own passes: `coststore.measure`), in seconds: a plain step (the target's pass
    over one token, its probabilities and the verification), the same scoring n tokens (a
    few n from 1 up; v(K) = t_verify(K+1) / t_plain), one drafting step of a round (all its
    prophets together), what a drafting call costs once per round on top of its steps
    (`t_call_by`: an eagle's K=1 round is not one tenth of its K=8 round), and how many
    drafts a round scores side by side (width: a tree of several prophets' chains).
    `sampled`: the same measured at temperature 1, where the target's probabilities, the
    prophet's q and the rejection test all cost more than a greedy step's argmax (on
    SmolLM2 int4 here a sampled eagle round of K=1 cost 1.4 plain steps; greedy 1.1).

    On a CPU the verification cost is far from linear in n: for SmolLM2 in float32 here,
    scoring 2-3 tokens costs 1.04-1.10 plain steps and 5 tokens 1.6, so the best K depends
    on the measured curve, not on a slope."""

    t_plain: float
    t_verify: dict[int, float]
    t_draft: float
    width: int = 1
    t_draft_by: dict[str, float] = field(default_factory=dict)  # one prophet's drafting step, by name
    t_call_by: dict[str, float] = field(default_factory=dict)  # its fixed cost per round, by name
    sampled: Costs | None = None  # the same, measured at temperature 1
    context: int = 0  # the context length these were measured at (0: unknown)
    long: Costs | None = None  # the same, measured at a long context (attention then weighs more)
    spread: float = 0.0  # the plain step's timings' relative spread (`relative_spread`) when measured

    def __post_init__(self) -> None:
        if not self.t_verify or min(self.t_verify) < 1:
            raise ValueError("t_verify needs measurements for n >= 1 scored tokens")

    def to_dict(self) -> dict[str, object]:
        return {"t_plain": self.t_plain, "t_verify": {str(n): t for n, t in self.t_verify.items()},
                "t_draft": self.t_draft, "width": self.width, "t_draft_by": dict(self.t_draft_by),
                "t_call_by": dict(self.t_call_by),
                "sampled": self.sampled.to_dict() if self.sampled is not None else None,
                "context": self.context, "long": self.long.to_dict() if self.long is not None else None,
                "spread": self.spread}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        return cls(float(d["t_plain"]), {int(n): float(t) for n, t in d["t_verify"].items()}, float(d["t_draft"]),
                   int(d["width"]), {str(k): float(v) for k, v in d["t_draft_by"].items()},
                   {str(k): float(v) for k, v in d.get("t_call_by", {}).items()},
                   cls.from_dict(d["sampled"]) if d.get("sampled") else None, int(d.get("context", 0)),
                   cls.from_dict(d["long"]) if d.get("long") else None, float(d.get("spread", 0.0)))

    def for_params(self, greedy: bool) -> Costs:
        """The costs of greedy steps, or of sampled ones (`sampled`, where measured: it
        holds its own `long`)."""
        return self if greedy or self.sampled is None else self.sampled

    def at(self, n_context: int) -> Costs:
        """The costs at a context of n tokens: between the short and the long measurement
        linearly (in buckets of 64 tokens, so a request's choices depend on its length only),
        the nearer one outside them. On SmolLM2 int4 here scoring 4 tokens cost 1.35 plain
        steps at a context of 64 and 1.64 at 1,024."""
        long = self.long
        if long is None or n_context <= self.context or long.context <= self.context:
            return self
        if n_context >= long.context:
            return long
        bucket = min(long.context, self.context + -(-(n_context - self.context) // 64) * 64)
        cache = self.__dict__.setdefault("_at", {})
        if bucket not in cache:
            w = (bucket - self.context) / (long.context - self.context)

            def mix(a: dict[Any, float], b: dict[Any, float]) -> dict[Any, float]:
                return {key: (1 - w) * a[key] + w * b.get(key, a[key]) for key in a}

            verify = monotone(mix(self.t_verify, long.t_verify))
            cache[bucket] = Costs((1 - w) * self.t_plain + w * long.t_plain, verify,
                                  (1 - w) * self.t_draft + w * long.t_draft, self.width,
                                  mix(self.t_draft_by, long.t_draft_by), mix(self.t_call_by, long.t_call_by),
                                  None, bucket)
        return cache[bucket]

    def alone(self) -> Costs:
        """These costs for one prophet's chain (width 1): in a token tree each prophet's K is
        weighed by its own chain, the others' riding in the same pass by their own choices."""
        if self.width == 1:
            return self
        cache = self.__dict__.get("_alone")
        if cache is None:
            cache = self.__dict__["_alone"] = replace(self, width=1)
        return cache  # type: ignore[no-any-return]

    def verify_time(self, n: int) -> float:
        """Seconds to score n tokens: linear between the measured sizes, and past the
        largest along the last measured slope."""
        points = self.__dict__.get("_points")  # a Costs is never changed once made: sorted once
        if points is None:
            points = self.__dict__["_points"] = sorted(self.t_verify.items())
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
        """A round of k drafts: k drafting steps and the call's fixed cost (of `prophet` when
        its own costs are known, else of every prophet in a tree, the costliest otherwise),
        then one pass over the 1 + width * k tokens. (Kept by (k, prophet): the policies ask
        for every K of every row each step.)"""
        cache = self.__dict__.setdefault("_rounds", {})
        if (k, prophet) not in cache:
            cache[k, prophet] = self._round_time(k, prophet)
        return float(cache[k, prophet])

    def _round_time(self, k: int, prophet: str | None) -> float:
        return self.time_of(k, self.width * k, prophet)

    def time_of(self, steps: int, drafted: int, prophet: str | None = None) -> float:
        """A round of `steps` drafting steps (and the call's fixed cost) whose pass scores 1 +
        `drafted` tokens: a chain's (drafted = width x steps) or a token tree's (its nodes)."""
        t_draft = self.t_draft_by.get(prophet, self.t_draft) if prophet else self.t_draft
        calls = self.t_call_by.values()
        t_call = self.t_call_by[prophet] if prophet in self.t_call_by else \
            sum(calls) if self.width > 1 else max(calls, default=0.0)
        return (steps * t_draft + t_call if steps else 0.0) + self.verify_time(1 + drafted)

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
