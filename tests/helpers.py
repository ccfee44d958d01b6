"""Shared helpers for the tests."""

from collections import Counter

from specdec.certify import goodness_of_fit
from specdec.decoder import SpeculativeDecoder
from specdec.llama import BatchLlama
from specdec.sampling import SamplingParams
from specdec.sequence import OneSequence
from specdec.toy import MarkovLM, sequence_distribution

ALPHA = 0.001


def sample_continuations(decoder: SpeculativeDecoder, prompt, length: int, n: int, seed0: int = 0, **settings):
    counts: Counter = Counter()
    for i in range(n):
        g = decoder.generate(prompt, max_new_tokens=length, seed=seed0 + i, **settings)
        counts[tuple(g.token_ids)] += 1
    return counts


def fit_against_exact(decoder: SpeculativeDecoder, target: MarkovLM, prompt, length: int, n: int, **settings):
    params = SamplingParams(settings.get("temperature", 1.0), settings.get("top_k"), settings.get("top_p", 1.0))
    exact = sequence_distribution(target, prompt, length, params)
    counts = sample_continuations(decoder, prompt, length, n, **settings)
    return goodness_of_fit(counts, exact, alpha=ALPHA)


def lean(model, name: str = "lean", **kwargs) -> OneSequence:
    """One sequence of `model` on the lean path (slot 0 of a one-slot `BatchLlama`)."""
    return OneSequence(BatchLlama(model, name, 1, **kwargs))
