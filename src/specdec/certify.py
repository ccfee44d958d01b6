"""Statistical certificates of losslessness: chi-square tests on sampled continuations.

- `goodness_of_fit`: observed continuations against an exactly known distribution (the
  toy models of specdec.toy);
- `two_sample`: continuations sampled with speculation against continuations sampled by
  plain decoding from the same prompt (any model pair; what `specdec check` runs).
Cells with small expected counts are pooled so the chi-square approximation holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TestResult:
    statistic: float
    dof: int
    p_value: float
    alpha: float
    n_a: int
    n_b: int = 0

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    @property
    def verdict(self) -> str:
        if self.passed:
            return f"PASS: no evidence of a different distribution (p = {self.p_value:.4g} >= alpha = {self.alpha})"
        return f"FAIL: the distributions differ (p = {self.p_value:.4g} < alpha = {self.alpha})"


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def goodness_of_fit(observed: Mapping[Hashable, int], expected_probs: Mapping[Hashable, float],
                    alpha: float = 0.001, min_expected: float = 5.0) -> TestResult:
    """Pearson's chi-square test of observed counts against exact probabilities."""
    n = sum(observed.values())
    unknown = set(observed) - {k for k, p in expected_probs.items() if p > 0}
    if unknown:  # an outcome of probability zero was observed: certainly not the distribution
        return TestResult(float("inf"), 1, 0.0, alpha, n)
    stat, dof = 0.0, -1
    pooled_obs, pooled_exp = 0.0, 0.0
    for key, p in sorted(expected_probs.items(), key=lambda kv: -kv[1]):
        exp = n * p
        if exp < min_expected:
            pooled_obs += observed.get(key, 0)
            pooled_exp += exp
            continue
        stat += (observed.get(key, 0) - exp) ** 2 / exp
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return TestResult(stat, dof, chi2_sf(stat, dof), alpha, n)


def two_sample(a: Mapping[Any, int], b: Mapping[Any, int], alpha: float = 0.001,
               min_count: int = 5) -> TestResult:
    """Chi-square test of homogeneity between two samples of outcomes; outcomes seen fewer
    than min_count times in both samples together are pooled into one cell."""
    na, nb = sum(a.values()), sum(b.values())
    cells: list[tuple[int, int]] = []
    rare_a = rare_b = 0
    for key in set(a) | set(b):
        ca, cb = a.get(key, 0), b.get(key, 0)
        if ca + cb < min_count:
            rare_a, rare_b = rare_a + ca, rare_b + cb
        else:
            cells.append((ca, cb))
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    dof = len(cells) - 1
    return TestResult(stat, dof, chi2_sf(stat, dof), alpha, na, nb)
