"""The round loop's cache slots: which request holds which row of the models' caches, who may
join, how much of a prompt goes in per step, and the prompt prefixes kept for later requests.

A request takes a free slot when it joins (`admit`) and gives it back when it ends or leaves
(`free_slot`, `release`): the target's, every draft model's and every prophet's per-row state
for that slot are freed together, and a finished prompt's prefix is offered to the prefix
cache (`specdec.prefix`) on the way out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from specdec.heap import trim_heap
from specdec.llama import BatchLlama
from specdec.lm import LM
from specdec.prefix import PrefixCache
from specdec.prophets.base import Prophet
from specdec.request import Request, StepEvent


class Slots:
    def __init__(self, target: LM, draft_lms: Sequence[LM], prophet: Prophet | None, prefill_chunk: int,
                 fused_layers: Sequence[int], lock: threading.RLock) -> None:
        self.target, self.draft_lms, self.prophet, self.lock = target, list(draft_lms), prophet, lock
        self.parts: list[Prophet] = list(prophet.parts) if prophet is not None else []
        self.fused_layers = tuple(fused_layers)
        self.free = list(range(target.slots))[::-1]  # slots no request holds
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled per step, at most (one row at least)
        # Prompt prefixes' keys and values kept for later requests (`enable_prefix_cache`), or None
        self.prefix_cache: PrefixCache | None = None

    def invalid(self, req: Request) -> str | None:
        """Why a joining request cannot run here, or None."""
        if max(req.prompt) >= self.target.vocab_size or min(req.prompt) < 0:
            return f"prompt token ids must be in [0, {self.target.vocab_size})"
        if len(req.prompt) >= self.target.max_length:
            return (f"the prompt is {len(req.prompt)} tokens but the target's context is "
                    f"{self.target.max_length} tokens")
        return None

    @staticmethod
    def refuse(req: Request, why: str) -> StepEvent:
        """A request that cannot join ends alone, with its reason; the step goes on without it."""
        req.finish_reason, req.error = "error", why
        return StepEvent(req, [], 0, -1, "error", [], "error")

    def admit(self, active: Sequence[Request]) -> None:
        """New rows take a free cache slot, their per-slot state starting empty."""
        new = [r for r in active if r.slot is None]
        if not new:
            return
        if len(new) > len(self.free):
            raise ValueError(f"{len(active)} requests running but the engine has {self.target.slots} cache slots")
        for r in new:
            r.slot, r.target_cached, r.draft_cached = self.free.pop(), 0, {}
            r.fused, r.fused_from = [], 0
            r.prefix_stored, r.prefix_hit = False, 0
            if r.generator.device != self.target.device and not r.generated:  # random numbers live with the logits
                r.generator = torch.Generator(device=self.target.device).manual_seed(r.seed_used)
        if self.prophet is not None:  # a prophet's own model is small: its prompt goes in at once
            self.prophet.prefill([r for r in new if r.k > 0])

    def free_slot(self, req: Request) -> None:
        """The request's slot back, in every model and prophet (its prompt's prefix kept first)."""
        if req.slot is None:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.store_rows(self.target, [req])
        self.target.free(req.slot)
        for lm in self.draft_lms:
            lm.free(req.slot)
        for part in self.parts:
            part.free(req.slot)
        self.free.append(req.slot)
        req.slot, req.fused = None, []
        lms = [lm for lm in (self.target, *self.draft_lms) if isinstance(lm, BatchLlama)]
        if any([lm.trim_due() for lm in lms]):  # every one asked (each starts its count again)
            trim_heap()

    def release(self, req: Request) -> None:
        """Free the cache slot (and its memory) of a request that leaves before it is done
        (cancelled, or ended by a stop string outside the engine). Safe to call on any request."""
        self.free_slot(req)
        req.target_cached, req.draft_cached = 0, {}
        req.fused, req.fused_from = [], 0

    def set_prefill_chunk(self, tokens: int) -> None:
        """At most `tokens` prompt tokens prefilled per step (at least one row's chunk): the
        longest a running row waits for a joining long prompt. The target's leading queries
        attend in blocks of the same size, so chunked and whole prefills round alike."""
        if tokens < 1:
            raise ValueError("the prefill chunk must be >= 1 token")
        self.prefill_chunk = tokens
        if isinstance(self.target, BatchLlama):
            self.target.attention_chunk = tokens
            if self.prefix_cache is not None and self.prefix_cache.block != tokens:  # blocks of another size
                self.prefix_cache = PrefixCache(tokens, self.prefix_cache.max_bytes)

    def enable_prefix_cache(self, max_bytes: int, shared: PrefixCache | None = None) -> PrefixCache | None:
        """Keep prompt prefixes' keys and values, at most `max_bytes` (0: none), and start later
        requests that share one from there (`specdec.prefix`: the same tokens as reading the
        whole prompt); `shared`: a cache to use (another engine's over the same target) where
        its blocks fit this engine's attention blocks. Only for a target on the lean path, and
        not with an eagle3 prophet (it reads every prompt position's features). Returns the
        cache, or None."""
        with self.lock:
            if max_bytes <= 0 or not isinstance(self.target, BatchLlama) or self.fused_layers:
                self.prefix_cache = None
                return None
            block = self.target.attention_chunk
            if shared is not None and shared.block == block:
                self.prefix_cache = shared
            elif self.prefix_cache is None or self.prefix_cache.block != block:
                self.prefix_cache = PrefixCache(block, max_bytes)
            self.prefix_cache.resize(max_bytes)
            return self.prefix_cache
