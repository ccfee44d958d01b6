"""`specdec check`: a statistical certificate that a configured pair decodes losslessly.

Samples the next few tokens many times from the same prompt with speculation and with
plain decoding (same target, same settings, independent seeds), then runs a chi-square
test of homogeneity on the two samples of continuations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdec.certify import TestResult, two_sample
from specdec.decoder import SpeculativeDecoder


@dataclass
class CheckReport:
    result: TestResult
    tokens: int
    distinct_spec: int
    distinct_plain: int
    acceptance_rate: float
    settings: dict[str, Any]
    drafted: int = 0  # tokens the prophets proposed in all the speculative samples (0: nothing was tested)

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {"statistic": r.statistic, "dof": r.dof, "p_value": r.p_value, "alpha": r.alpha,
                "passed": r.passed, "verdict": r.verdict, "samples": r.n_a, "tokens": self.tokens,
                "distinct_speculative": self.distinct_spec, "distinct_plain": self.distinct_plain,
                "acceptance_rate": self.acceptance_rate, "drafted": self.drafted, "settings": self.settings}


def certify(spec: SpeculativeDecoder, plain: SpeculativeDecoder, prompt: str | list[int], tokens: int = 3,
            samples: int = 600, alpha: float = 0.001, seed: int = 0,
            progress: Callable[[int], None] | None = None, chunk: int = 64, **settings: Any) -> CheckReport:
    """Sample in batches (generate_many: one batch of rows from the same prompt where the
    prophet has a batched path), alternating speculative and plain chunks so that drift
    affects both alike. Sample i uses seed + 2i (speculative) and seed + 2i + 1 (plain)."""
    a: Counter[tuple[int, ...]] = Counter()
    b: Counter[tuple[int, ...]] = Counter()
    drafted = accepted = 0
    for start in range(0, samples, chunk):
        idx = range(start, min(samples, start + chunk))
        outs = spec.generate_many([{"prompt": prompt, "seed": seed + 2 * i} for i in idx], max_batch=chunk,
                                  max_new_tokens=tokens, **settings)
        for out in outs:
            a[tuple(out.token_ids)] += 1
            drafted += out.stats.drafted
            accepted += out.stats.accepted
        for out in plain.generate_many([{"prompt": prompt, "seed": seed + 2 * i + 1} for i in idx], max_batch=chunk,
                                       max_new_tokens=tokens, **settings):
            b[tuple(out.token_ids)] += 1
        if progress:
            progress(idx[-1] + 1)
    result = two_sample(a, b, alpha)
    return CheckReport(result, tokens, len(a), len(b), accepted / drafted if drafted else 0.0,
                       dict(settings, prompt=prompt if isinstance(prompt, str) else list(prompt)), drafted)
