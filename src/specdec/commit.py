"""The last stage of a round: a row's verdict committed. Its tokens are appended one by one
(stopping at EOS, max_new_tokens or the context), its grammar advances over them, its policy
and the K choice observe the round, its caches are cut back to what was accepted, and a row
that ended gives its slot back. Tokens a grammar forces are committed here too, before any
draft (`force`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from specdec.events import finish_reason
from specdec.kchoice import KChoice
from specdec.policy import RoundOutcome, observe_recent
from specdec.prophets.base import TREE
from specdec.request import Request, StepEvent, keep_fused
from specdec.slots import Slots
from specdec.verify import Verdict

Spans = tuple[tuple[float, float], tuple[float, float]]


class Committer:
    def __init__(self, max_length: int, eos_token_ids: Iterable[int], kchoice: KChoice, drafting: bool,
                 slots: Slots) -> None:
        self.max_length, self.eos_token_ids = max_length, set(eos_token_ids)
        self.kchoice, self.drafting, self.slots = kchoice, drafting, slots

    def commit(self, req: Request, drafted: list[int], n_accepted: int, next_token: int, kind: str,
               prophet: str | None = None, share: tuple[float, float] = (0.0, 0.0),
               n_drafted: int | None = None, each: dict[str, tuple[int, int]] | None = None) -> StepEvent:
        """Append the row's tokens one by one, stopping at EOS, max_new_tokens or the context;
        the row's policy observes the round (n_drafted: the K it drafted, default
        len(drafted); a tree's accepted path is shorter) with the row's share of the step's
        draft and target time; each: a tree's chains by prophet, (drafted, accepted) each,
        observed as that prophet's rounds instead."""
        before = req.length
        for token in [*drafted[:n_accepted], next_token]:
            req.generated.append(token)
            req.finish_reason = finish_reason(token, len(req.generated), req.length, self.eos_token_ids,
                                              req.max_new_tokens, self.max_length)
            if req.finish_reason:
                break
        if req.constraint is not None:
            req.constraint.commit(req.generated[before - len(req.prompt):])
        n_drafted = len(drafted) if n_drafted is None else n_drafted
        if drafted and prophet not in (None, TREE):  # the multi="best" choice's evidence
            observe_recent(req.recent, prophet, n_accepted)
        rounds = list(each.items()) if each else [(prophet, (n_drafted, n_accepted))]
        for i, (name, (k, accepted)) in enumerate(rounds):
            if k and name is not None:
                self.kchoice.observe(name, k, accepted)
            if req.policy is not None and self.drafting:
                req.policy.observe(RoundOutcome(k, accepted, share[0], share[1], 1 if k else 0,
                                                name if k else None, same_round=i > 0))
        # The caches hold the drafted tokens too: valid only up to the last accepted one.
        req.target_cached = min(req.target_cached, before + n_accepted)
        req.draft_cached = {name: min(n, before + n_accepted) for name, n in req.draft_cached.items()}
        if req.done:
            self.slots.free_slot(req)
        return StepEvent(req, drafted, n_accepted, next_token, kind,
                         req.generated[before - req.forced - len(req.prompt):], req.finish_reason,
                         prophet if drafted else None, forced=req.forced)

    def chain(self, r: Request, b: int, drafted: list[int], v: Verdict, name: str | None, share: tuple[float, float],
              spans: Spans, hidden: torch.Tensor | None, fused: torch.Tensor | None, start: int) -> StepEvent:
        """Row b's chain committed after its verdict, with the step's spans, the feature its
        next draft starts from and its fused features."""
        e = self.commit(r, drafted, v.n_accepted, v.next_token, v.next_kind, name, share)
        e.spans = spans
        self.keep_feature(e, hidden, b, v.n_accepted)
        self.keep_fused(r, fused, b, start)
        return e

    def force(self, active: Sequence[Request]) -> list[StepEvent]:
        """Commit the tokens each row's grammar forces (`Constraint.forced`: masked p is
        one-hot there at any temperature, so they are the target's tokens with certainty),
        within its length and the context; the rows they end (EOS, length) leave with their
        event (next_kind "forced": no pass). The others draft from after them (a feature
        prophet's feature is then `forced` tokens behind: an eagle catches up on them)."""
        ended = []
        for r in active:
            r.forced = 0
            if r.constraint is None:
                continue
            for token in r.constraint.forced(min(r.max_new_tokens - len(r.generated), self.max_length - r.length)):
                r.generated.append(token)
                r.forced += 1
                r.finish_reason = finish_reason(token, len(r.generated), r.length, self.eos_token_ids,
                                                r.max_new_tokens, self.max_length)
                if r.finish_reason:
                    break
            if r.done:
                self.slots.free_slot(r)
                e = StepEvent(r, [], 0, r.generated[-1], "forced", r.generated[-r.forced:], r.finish_reason,
                              forced=r.forced)
                now = time.perf_counter()
                e.spans = ((now, now), (now, now))
                ended.append(e)
        return ended

    @staticmethod
    def keep_feature(e: StepEvent, hidden: torch.Tensor | None, b: int, at: int) -> None:
        """The next token came from the head at row b's position `at` of the pass (the last
        accepted token or node): its feature is where a feature prophet starts next step
        (none if the commit was cut short or the row ended)."""
        r = e.request
        whole = len(e.committed) == e.forced + e.accepted + 1
        r.feature = hidden[b, at] if hidden is not None and whole and not r.done else None

    @staticmethod
    def keep_fused(req: Request, fused: torch.Tensor | None, b: int, start: int,
                   order: Sequence[int] | None = None) -> None:
        """After a commit: the fused features of the pass's new positions that now hold
        committed tokens (start .. req.target_cached - 1; order: which of the pass's new
        tokens lie there, for a tree's accepted path) join the row's pending ones."""
        count = req.target_cached - start
        if fused is None or req.done or count <= 0:
            return
        rows = fused[b, :count] if order is None else fused[b, torch.tensor(list(order)[:count], device=fused.device)]
        keep_fused(req, start, rows)
