"""K choice: how many tokens each row drafts in a step of the one loop.

A row's own policy proposes its K (`specdec.policy`, from its acceptance and the costs of a
step). With several rows, the step pays for its longest feed, so one K for the step is chosen
from the rows' acceptance and the measured costs of a step at this batch size (`step_k`), and a
prophet no K would pay for is not asked (`not_paying`). Costs are measured once per batch-size
bucket (1, 2, 4, ...) on the loop's own passes (`specdec.coststore.measure_rows`) and kept in the
cost store; a seeded sampled row decides from costs fixed for the request (`row_costs`), so its
tokens never depend on what shares its steps. Acceptance is pooled over every row per prophet
(`pooled`), decayed, so a batch of fresh requests stops paying for drafts that do not pay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from specdec.costmodel import Costs, clamp_acceptance, expected_tokens_per_round
from specdec.coststore import measure, measure_rows
from specdec.prophets.base import TREE
from specdec.request import Request, batch_free

POOL_DECAY, POOL_MIN = 0.98, 12.0  # `KChoice.pooled`: weight of each older round; positions needed
POOL_PROBE = 16  # a step that would skip a prophet that does not pay drafts with it anyway, every 16th


class KChoice:
    """The K choices of one engine (`specdec.batch.BatchEngine`): its measured costs by
    batch-size bucket, its prophets' pooled acceptance and the costs seeded rows decide from."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.by_bucket: dict[int, Costs] = {}  # measured step costs by batch-size bucket (auto K per row)
        # Per prophet, the per-position acceptance of recent rounds of every row, decayed
        # (tested, accepted): what a step's common K and its choice to draft at all read for
        # rows whose K may follow the batch (`batch_free`).
        self.pooled: dict[str, list[float]] = {}
        self.costed_steps = 0  # steps that drafted by costs without a tree (POOL_PROBE counts them)
        # The costs a sampled row's policy decides from, the same for every request whatever
        # shares its steps (wiring.engine_for sets the decoder's stored costs; else one row's, measured)
        self.row_costs: Costs | None = None
        # Where a bucket's measured costs are kept across processes (wiring.engine_for: the
        # decoder's stored_batch_costs), or None: measured in each process
        self.cost_store: Callable[[int, int, Callable[[], Costs]], Costs] | None = None

    def observe(self, prophet: str, k: int, accepted: int) -> None:
        """A round of `prophet` for some row: k drafted, `accepted` of them kept."""
        pooled = self.pooled.setdefault(prophet, [0.0, 0.0])
        pooled[0] = pooled[0] * POOL_DECAY + min(k, accepted + 1)
        pooled[1] = pooled[1] * POOL_DECAY + accepted

    def budget(self, req: Request, prophet: str | None = None) -> int:
        """K for this step: of `prophet` as the request's policy chooses it (None: the largest
        the request allows), cut so a step never overshoots max_new_tokens (a step yields up
        to K+1 tokens) or the target's or prophet's context."""
        if self.engine.prophet is None or req.k == 0 or (prophet not in (None, TREE) and req.prophets is not None
                                                   and prophet not in req.prophets):
            return 0
        k = req.policy.next_k(prophet) if req.policy is not None and prophet is not None else req.k
        remaining = req.max_new_tokens - len(req.generated)
        room = self.engine.target.max_length - req.length
        return max(0, min(k, req.k, remaining - 1, room, self.engine.prophet.room(req)))

    def set_costs(self, costs: Costs) -> None:
        """Use these costs at every batch size instead of measuring them (tests, known hardware)."""
        self.by_bucket = {b: costs for b in range(1, self.engine.target.slots + 1)}

    def step_k(self, active: Sequence[Request], lens: Sequence[int], costs: Costs,
                names: Sequence[str | None] | None = None) -> list[int]:
        """Each row's draft length cut to the one K that maximises the step's expected
        tokens per second: a row with acceptance a_b and a draft of n_b tokens yields
        tokens(a_b, min(K, n_b)) (1 without a draft), and every row pays for the longest
        feed. No K paying more than plain steps: no drafts this step. The cut depends on
        draft lengths and acceptance only, never on drafted tokens, so it stays exact. A row
        alone keeps the K its policy chose (the policy weighed the same costs, and may probe)."""
        if not any(lens) or len(active) == 1:  # a row alone: its own policy's K (probes included)
            return list(lens)
        default = self.engine.prophet.name if self.engine.prophet is not None else None
        row_names = [n or default for n in names] if names else [default] * len(active)
        rates = [a if (a := self.rate(r, n)) is not None else 0.999 for r, n in zip(active, row_names, strict=True)]
        # The step drafts as long as its costliest prophet in use (a lookup costs nothing).
        used = {n for n, k in zip(row_names, lens, strict=True) if k and n}
        prophet = max(used, key=lambda n: costs.t_draft_by.get(n, costs.t_draft), default=default)

        def gain(k: int) -> float:
            tokens = sum(expected_tokens_per_round(clamp_acceptance(a), min(k, n)) if n else 1.0
                         for a, n in zip(rates, lens, strict=True))
            return costs.speedup(tokens / len(active), k, prophet)

        best = max(range(max(lens) + 1), key=lambda k: (gain(k) if k else 1.0, -k))
        return [min(n, best) for n in lens]

    def rate(self, req: Request, prophet: str | None) -> float | None:
        """The per-position acceptance a step weighs for a row's drafts by `prophet`: its recent
        acceptance pooled over every row once there is enough of it, else what the row's own
        policy expects of it (None where the policy keeps no estimate)."""
        pooled = self.pooled_rate(prophet)
        if pooled is not None:
            return pooled
        return req.policy.acceptance(prophet) if req.policy is not None else None

    def pooled_rate(self, prophet: str | None) -> float | None:
        """The recent per-position acceptance of a prophet over every row, once there is
        enough of it (POOL_MIN tested positions), else None."""
        pooled = self.pooled.get(prophet or "")
        return pooled[1] / pooled[0] if pooled is not None and pooled[0] >= POOL_MIN else None

    def not_paying(self, active: Sequence[Request], costs: Costs, step_index: int) -> set[str]:
        """Prophets that no K would pay for at this batch size, at their recent acceptance over
        every row (until enough of it is pooled, the mean of what the batch-free rows' policies
        expect of it: the rates the step's cut would weigh): batch-free rows do not ask them this
        step (their draft would be cut to nothing after it was paid for, and a draft always cut
        pools no acceptance). A lookup drafts for free but is asked row by row: with many rows,
        where each scored token costs nearly a row's step, 64 rows' lookups and budgets took
        ~0.8 ms of a ~25 ms step. Every POOL_PROBE-th step asks them anyway (`step_index`): the
        estimate stays fresh."""
        if len(active) == 1 or step_index % POOL_PROBE == 0:
            return set()
        k_max = max(r.k for r in active)
        free = [r for r in active if batch_free(r)]
        out = set()
        for part in self.engine.parts:
            a = self.pooled_rate(part.name)
            if a is None:  # nothing pooled yet (its drafts so far all cut): the mean of the rows' own expectations
                expected = [x for r in free if (x := self.rate(r, part.name)) is not None]
                a = sum(expected) / len(expected) if expected else None
            if a is None or k_max < 1:
                continue
            if costs.best_k(a, k_max, part.name)[1] <= 1.0:
                out.add(part.name)
        return out

    def calibrate(self, k_max: int, prompt_len: int = 16) -> dict[int, Costs]:
        """Measure now, on placeholder rows, the step costs of every batch-size bucket (1, 2,
        4, ... up to the slots) that the auto policy would otherwise measure on the first
        requests of that size (a server does this at startup, so that no request waits for
        it). Buckets already measured are kept. Returns the costs by bucket."""
        if self.engine.prophet is None or k_max < 1:
            return dict(self.by_bucket)
        for size in sorted({self.bucket(n) for n in range(1, self.engine.target.slots + 1)}):
            if size not in self.by_bucket and len(self.engine.slots.free) >= size:
                now = functools.partial(measure, self.engine, size, k_max, [0] * prompt_len)
                self.by_bucket[size] = self.cost_store(size, k_max, now) if self.cost_store else now()
        return dict(self.by_bucket)

    def bucket(self, n_rows: int) -> int:
        """The batch-size bucket whose measured costs a step of n_rows uses: 1, 2, 4, ... (up
        to the slots)."""
        return min(1 << (n_rows - 1).bit_length(), self.engine.target.slots)

    def policy_costs(self, active: Sequence[Request]) -> Costs | None:
        """Hand rows whose policy needs costs the costs of a step at this batch size,
        measured once per size bucket (1, 2, 4, 8, ...) on the rows themselves: a target
        pass over n = 1..K+1 tokens per row, and a drafting pass. Nothing it writes
        survives: caches are written by position, past each row's cached length."""
        rows = [r for r in active if r.policy is not None and r.policy.needs_costs and r.k > 0]
        if not rows or self.engine.prophet is None:
            return None
        bucket = self.bucket(len(active))
        if bucket not in self.by_bucket:
            self.by_bucket[bucket] = self.bucket_costs(bucket, active, max(r.k for r in rows))
        for r in rows:  # each at its own context length (`Costs.at`) and temperature
            if batch_free(r):
                base = self.by_bucket[bucket]
            else:  # a seeded sampled row's K must not depend on the batch: costs fixed for the request
                if self.row_costs is None:
                    self.row_costs = self.by_bucket.get(1) or measure_rows(self.engine, active[:1],
                                                                           max(r.k for r in rows))
                base = self.row_costs
            own = base.for_params(r.params.greedy).at(r.length)
            # a tree's prophets each choose their own K (per-prophet policies): each weighs its own chain
            tree_k = self.engine.prophet.combine == "tree" and r.policy.per_prophet  # type: ignore[union-attr]
            r.policy.costs = own.alone() if tree_k else own  # type: ignore[union-attr]
        # the step's own choices (its common K, which prophets to ask) weigh sampled costs if any row samples
        return self.by_bucket[bucket].for_params(all(r.params.greedy for r in active)).at(
            max(r.length for r in active))

    def bucket_costs(self, bucket: int, active: Sequence[Request], k_max: int) -> Costs:
        """A bucket's step costs: from `cost_store` (the decoder's stored costs, measured once
        per machine and settings) where the engine has one, else measured now on these rows."""
        if self.cost_store is not None:
            return self.cost_store(bucket, k_max, lambda: measure_rows(self.engine, active, k_max))
        return measure_rows(self.engine, active, k_max)

    @staticmethod
    def batch_cut(active: Sequence[Request], ks: Sequence[int], cut: Sequence[int]) -> list[int]:
        """The step's common K applies to greedy rows and unseeded sampled rows: a greedy row's
        tokens do not depend on its K, and an unseeded row promises no particular tokens; a
        seeded sampled row's draws depend on its K, so it keeps the K its own policy chose from
        costs fixed for the request (`row_costs`), whatever shares the step."""
        return [c if batch_free(r) else k for r, k, c in zip(active, ks, cut, strict=True)]
