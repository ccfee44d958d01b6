"""A request of the one loop and what a step did for it: `Request` owns every piece of a
sequence's state (ids, sampling settings, generator, K and policy, cache slot and cache
lengths, finish reason); nothing of it lives in the engine, a model or a prophet.
`StepEvent` is one row's part in one step. The helpers here read and write a row's caches
by name (the target's, each draft model's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from specdec.defaults import MAX_NEW_TOKENS
from specdec.grammar import Constraint
from specdec.policy import Policy
from specdec.sampling import KeepDrafting, SamplingParams, check_sampling


@dataclass(eq=False)
class Request:
    """One sequence and all of its state. `seed` fixes its generator (drawn at random if None)."""

    prompt: list[int]
    max_new_tokens: int = MAX_NEW_TOKENS
    params: SamplingParams = field(default_factory=SamplingParams)
    k: int = 4  # draft length per step (0 = plain decoding); with a policy, the largest K it may choose
    seed: int | None = None
    policy: Policy | None = None  # this request's own K policy (e.g. AutoPolicy); None: always k
    prophets: frozenset[str] | None = None  # of the engine's prophets, those that may draft for it (None: all)
    sampling: str = "rejection"  # or "coupled": draws keyed by (seed, position) (specdec.sampling)
    # running tokens per round of each prophet whose drafts were verified for it (multi="best")
    recent: dict[str, float] = field(default_factory=dict)
    # its grown draft trees' record, decayed: [tokens expected beyond the round's last, drafted tokens accepted]
    tree_fit: list[float] = field(default_factory=lambda: [0.0, 0.0])
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length", "context", or "error" (see `error`)
    error: str | None = None  # why the engine refused this request (the others in its step go on)
    slot: int | None = None  # the cache slot this request holds while it runs
    target_cached: int = 0  # leading context tokens whose keys/values are in the target's slot
    # the same for each draft model's slot (its prophet state), by the draft model's name
    draft_cached: dict[str, int] = field(default_factory=dict)
    # (D,) the target's feature at context[-2 - forced] (feature prophets), or None
    feature: torch.Tensor | None = None
    # the target's fused features (an eagle3 prophet's true slots) of positions fused_from.., in
    # chunks as target passes computed them, not yet in that prophet's cache
    fused: list[torch.Tensor] = field(default_factory=list, repr=False)
    fused_from: int = 0
    # prompt lookup's index of this request's context, by prophet name (specdec.prophets.ngram.NgramIndex)
    lookups: dict[str, Any] = field(default_factory=dict, repr=False)
    prefix_hit: int = 0  # leading prompt positions the prefix cache gave it (not read again)
    prefix_stored: bool = False  # its prompt's blocks went to the prefix cache (or were there)
    # its output's grammar (specdec.grammar), advanced over the committed output; None: unconstrained
    constraint: Constraint | None = field(default=None, repr=False)
    forced: int = 0  # tokens the grammar forced at the start of this step (committed before drafting)
    seed_used: int = field(init=False, repr=False, default=0)  # the seed, drawn when none was given
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt or not all(isinstance(t, int | np.integer) and not isinstance(t, bool)
                                      for t in self.prompt):
            raise ValueError("a prompt must be a non-empty list of integer token ids")
        self.prompt = [int(t) for t in self.prompt]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k must be an integer >= 0, got {self.k!r}")
        if self.policy is not None and self.k > 0:
            self.policy.reset(self.k, self.params.temperature)  # its state is this request's alone
        self.seed_used = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator().manual_seed(self.seed_used)  # moved to the engine's device on admission
        if check_sampling(self.sampling) == "coupled" and self.params.coupled is None:
            self.params = replace(self.params, coupled=self.seed_used)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        """len(context), without building it."""
        return len(self.prompt) + len(self.generated)

    def context_from(self, start: int) -> list[int]:
        """context[start:], without building the whole context."""
        n = len(self.prompt)
        return self.prompt[start:] + self.generated if start < n else self.generated[start - n :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepEvent:
    """What one step did for one row (terms as in specdec.verify)."""

    request: Request
    drafted: list[int]
    accepted: int
    next_token: int
    next_kind: str  # "recovered" or "bonus" ("error" for a refused request, with next_token -1)
    committed: list[int]  # tokens appended this step, after EOS / length cuts
    finish_reason: str | None
    prophet: str | None = None  # whose draft was verified (None: no draft, a plain step)
    # perf_counter spans of the step's drafting and of its target pass (the row's share of both)
    spans: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    # a token tree (multi="tree"): its nodes, the prophet of each accepted token, tokens proposed per prophet
    tree_size: int = 0
    accepted_by: list[str] | None = None
    proposals: dict[str, int] | None = None
    forced: int = 0  # leading committed tokens the grammar forced (no draft, no pass; specdec.grammar)




def batch_free(req: Request) -> bool:
    """Whether a row's K may follow the batch it shares steps with (costs at that batch size,
    the step's common K): greedy rows and coupled ones (`sampling="coupled"`: their tokens
    never depend on K) and unseeded sampled rows. A seeded sampled row's K comes from costs
    fixed for the request, so its tokens are the same alone, in any batch and under any load;
    that costs speed in a batch (SmolLM2 int4, 8 Spec-Bench rows at T=1: seeded 0.68x batched
    plain, unseeded 1.03x), which coupled sampling does not pay."""
    return req.params.greedy or req.seed is None or req.params.coupled is not None


def keep_drafting_rows(reqs: Sequence[Request]) -> list[KeepDrafting | None]:
    """Each row's early stop (its policy's `keep_drafting`: the confidence policy's), or None."""
    return [r.policy.keep_drafting() if r.policy is not None else None for r in reqs]


def row_slot(req: Request) -> int:
    assert req.slot is not None, "a running request holds a cache slot"
    return req.slot


TARGET = ""  # the target's cache, among a row's caches (the others: draft models, by name)


def row_cached(req: Request, cache: str) -> int:
    """Leading context tokens of a row in one of its caches (TARGET, or a draft model's name)."""
    return req.target_cached if cache == TARGET else req.draft_cached.get(cache, 0)


def set_row_cached(req: Request, cache: str, n: int) -> None:
    if cache == TARGET:
        req.target_cached = n
    else:
        req.draft_cached[cache] = n



def keep_fused(req: Request, start: int, rows: torch.Tensor) -> None:
    """Fused features of positions start.. (a pass's, committed) join the row's pending ones
    (bf16: an eagle3 prophet's input, not exactness-bearing). A gap (the row's pending rows
    do not end at start) drops the old ones: the prophet then waits for a contiguous run."""
    if not req.fused or req.fused_from + sum(len(f) for f in req.fused) != start:
        req.fused, req.fused_from = [], start
    req.fused.append(rows.to(torch.bfloat16))


def row_prefilled(req: Request, cache: str) -> bool:
    return row_cached(req, cache) >= len(req.prompt) - 1




__all__ = ["Request", "StepEvent", "TARGET"]
