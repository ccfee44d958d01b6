"""Prompt lookup: no model. Match the last n tokens (n from n_max down to n_min) against the
prompt and the text generated so far, and propose what followed the latest match.
Deterministic: q is one-hot, which the verifier handles exactly. Each row drafts from its
request's own index of its context (`NgramIndex`, kept in `Request.lookups` under the
prophet's name), never scanning the context every step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.prophets.base import BatchDraft, Budget, Prophet
from specdec.request import Request


def lookup(context: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix. context (L,).
    Only the positions holding the last token can end a match: they are found in one pass,
    and longer suffixes are checked there alone (a step's lookup in a context of 1,000
    tokens fell from 0.3 ms to a few tens of microseconds)."""
    n_top = min(n_max, len(context) - 1)
    if n_top < n_min:
        return []
    # ends of matches over context[:-1], so that a match always has at least one token after it
    ends = np.flatnonzero(context[:-1] == context[-1])
    for n in range(n_top, n_min - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            hits = hits[context[hits - j] == context[-1 - j]]
        if len(hits):
            start = int(hits[-1]) + 1
            return context[start : start + k].tolist()
    return []


def lookup_reference(context: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """The specification of `lookup`: every window of each size compared with the suffix."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        windows = sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return context[start : start + k].tolist()
    return []


class NgramIndex:
    """One context's n-grams (n_min..n_max), each mapped to the position where its latest
    occurrence ends, kept up to date as the context grows: a step's lookup reads a few dict
    entries instead of scanning the context (on SmolLM2's Spec-Bench contexts of ~700 tokens
    a step's lookup took ~0.1 ms, about 1% of a plain step, in every step the prophet was
    asked). It proposes exactly what `lookup` proposes (tested). A context is the same
    sequence growing: one that is not (shorter, or another sequence) is indexed afresh."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence

    def _extend(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Index the n-grams that end before the context's last position. `tokens` is the
        index's own copy of the context (each step then adds only the new tokens)."""
        n_prompt, have = len(prompt), len(self.tokens)
        length = n_prompt + len(generated)
        if have > length or have and self.tokens[-1] != (
                prompt[have - 1] if have <= n_prompt else generated[have - 1 - n_prompt]):
            self.tokens, self.latest, have = [], {}, 0  # not the indexed sequence grown: index afresh
        self.tokens += [*prompt[have:], *generated] if have < n_prompt else generated[have - n_prompt :]
        tokens, latest = self.tokens, self.latest
        # ends indexed so far: up to have - 2; now up to length - 2 (a match needs a token after it)
        for end in range(max(0, have - 1), length - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                latest[tuple(tokens[end - n + 1 : end + 1])] = end

    def propose(self, prompt: Sequence[int], generated: Sequence[int], k: int) -> list[int]:
        """`lookup(prompt + generated, k, n_max, n_min)`, from the index."""
        self._extend(prompt, generated)
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = self.latest.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class NgramProphet(Prophet):
    is_lookup = True

    # A one-token match predicts little in real text (measured on SmolLM2's answers: acceptance
    # 0.02) and each failed draft costs a longer verification pass, so matches start at 2.
    def __init__(self, n_max: int = 4, n_min: int = 2, name: str = "ngram") -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min, self.name = n_max, n_min, name

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        """Each row's `lookup(context, k, n_max, n_min)`, from its index."""
        return BatchDraft([self._index(r).propose(r.prompt, r.generated, k) if k else []
                           for r, k in zip(reqs, ks, strict=True)], None)

    def _index(self, req: Request) -> NgramIndex:
        index = req.lookups.get(self.name)
        if not isinstance(index, NgramIndex):
            index = req.lookups[self.name] = NgramIndex(self.n_max, self.n_min)
        return index
