"""The prophet protocol: propose up to k tokens (with q, or none for a deterministic
prophet), then hear what was committed so that caches and indexes stay in step."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec.sampling import KeepDrafting, SamplingParams, draw, logits_to_probs

# KeepDrafting (sampling.py): called after each drafted token with that step's q (V,);
# returning False stops drafting early (the confidence policy).


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # (len(tokens), V) q_1..q_k; None = deterministic (one-hot q)
    prophet: str
    step_spans: list[tuple[float, float]] = field(default_factory=list)  # perf_counter spans, for the timeline
    forward_calls: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


class Prophet(Protocol):
    name: str
    vocab_size: int | None  # None for prophets that are not models
    reads_features: bool  # True: the engine calls see_feature(position, hidden) after each round

    def see_feature(self, position: int, feature: torch.Tensor) -> None:
        """The target's last hidden state (D,) at context[position]."""
        ...

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        """Up to k tokens that might follow context; fewer (even none) is allowed."""
        ...

    def committed(self, context: Sequence[int]) -> None:
        """The round is over and context is the new committed sequence."""
        ...

    def reset(self) -> None:
        """Forget per-request state (caches, the prompt index)."""
        ...

    def for_request(self, target: Any) -> Prophet:
        """This prophet for another request running on `target` (the request's own view of
        the target): the same weights, state of its own."""
        ...


class FeatureBlind:
    """For prophets that do not read the target's features."""

    reads_features = False

    def see_feature(self, position: int, feature: torch.Tensor) -> None:
        pass

    def for_request(self, target: Any) -> Any:
        """This prophet for another request running on `target` (a view of the same target
        with a cache of its own): the same weights, state of its own. Stateless prophets
        (lookups) are simply copied."""
        other = copy.copy(self)
        other.reset()  # type: ignore[attr-defined]
        return other


def span() -> float:
    return time.perf_counter()


def draft_autoregressively(step: Callable[[list[int]], torch.Tensor], feed: list[int], k: int, name: str,
                           params: SamplingParams, generator: torch.Generator | None,
                           keep_drafting: KeepDrafting | None, position: int = 0) -> Draft:
    """The drafting loop shared by model-based prophets: step(ids) -> logits (V,) of the
    last id; each drafted token is fed back; q is recorded for the verifier. position: the
    absolute position of the first drafted token (where coupled draws are keyed)."""
    draft = Draft([], None, name)
    rows: list[torch.Tensor] = []
    for j in range(k):
        t0 = span()
        logits = step(feed)  # (V,)
        q = logits_to_probs(logits, params, who=f"prophet '{name}'")
        token = draw(q, params, generator, position + j)
        draft.step_spans.append((t0, span()))
        draft.tokens.append(token)
        rows.append(q)
        feed = [token]
        # In greedy mode q is one-hot, so confidence is read from the plain softmax.
        if keep_drafting is not None and not keep_drafting(torch.softmax(logits, -1) if params.greedy else q):
            break
    draft.probs = torch.stack(rows) if rows else None
    return draft
