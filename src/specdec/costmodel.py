"""The cost model of speculative decoding, in one place (Leviathan et al., 2023).

With per-position acceptance a (i.i.d.), a round of K drafts yields on average
(1 - a^(K+1)) / (1 - a) tokens; it costs K drafting steps of c target steps each and one
verification pass of v(K) target steps (v = 1 would be free verification). The expected
walltime gain over plain decoding is tokens / (K c + v).
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_round(a: float, k: float) -> float:
    """(1 - a^(K+1)) / (1 - a): expected output tokens of a round with i.i.d. acceptance a."""
    if a >= 1.0:
        return k + 1
    return (1 - a ** (k + 1)) / (1 - a)


def expected_gain(a: float, k: float, c: float, v: float = 1.0) -> float:
    """Expected speedup of rounds of K drafts over plain decoding, with drafting costing c
    and verification v target steps (a is clamped to [0, 0.999])."""
    return expected_tokens_per_round(min(max(a, 0.0), 0.999), k) / (k * c + v)


@dataclass
class Costs:
    """Measured once per decoder (SpeculativeDecoder.calibrate): seconds per plain target
    step, per round of K drafted tokens (drafting + verifying K+1 tokens), and that K."""

    t_plain: float
    t_round: float
    k: int

    def round_time(self, k: int) -> float:
        """A round of k drafts, scaled linearly from the measured one (drafting and the
        extra verified tokens both grow with k)."""
        return self.t_plain + (self.t_round - self.t_plain) * k / self.k
