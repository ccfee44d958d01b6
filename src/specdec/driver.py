"""The one driver: rows stepped on the one round loop, each step's part of a row finished
(stop strings and text, `specdec.finish`) and recorded as its RoundEvent.

    request -> Row -> engine.step (one round for every row) -> finish -> RoundEvent

Every caller runs its requests through it: `generate` and `stream` (one row alone),
`generate_many` (many rows, joining as others finish), `BatchEngine.generate` and the
server's scheduler (rows that join and leave between steps, `step_rows`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.events import RoundEvent
from specdec.finish import Finish
from specdec.request import Request, StepEvent


class Loop(Protocol):
    """What the driver needs of the one round loop (`specdec.batch.BatchEngine`)."""

    target: Any  # its rows' model: `slots` of them
    model_names: set[str]  # the prophets whose draft steps are forward passes of a model

    def step(self, requests: Sequence[Request]) -> list[StepEvent]: ...

    def finish_step(self, e: StepEvent, finish: Finish) -> list[int]: ...

    def release(self, req: Request) -> None: ...


def round_event(e: StepEvent, index: int, t0: float, model_names: set[str], committed: Sequence[int] | None = None,
                text: str = "", finish_reason: str | None = None) -> RoundEvent:
    """The RoundEvent of one row's part in a step, times relative to t0 (its request's start):
    the step's drafting and target spans are the row's; draft calls count the passes of the
    prophets in `model_names` (one per drafted token). committed and finish_reason: as the
    caller cut them (stop strings), else the step's."""
    (d0, d1), (g0, g1) = e.spans
    name = e.prophet
    proposals = e.proposals if e.proposals is not None else {name: len(e.drafted)} if name else {}
    return RoundEvent(
        index=index, prophet=name, k=max(e.proposals.values(), default=0) if e.proposals else len(e.drafted),
        drafted=list(e.drafted), accepted=e.accepted,
        next_token=e.next_token, next_kind=e.next_kind,
        committed=list(e.committed if committed is None else committed),
        draft_calls=sum(n for who, n in proposals.items() if who in model_names),
        target_calls=int(e.next_kind != "forced"), forced=e.forced,
        start=d0 - t0, end=time.perf_counter() - t0, draft_spans=[(d0 - t0, d1 - t0)] if e.drafted else [],
        target_span=(g0 - t0, g1 - t0), tree_size=e.tree_size,
        accepted_by=e.accepted_by if e.accepted_by is not None else [name] * e.accepted if name else [],
        proposals=proposals, text=text, finish_reason=e.finish_reason if finish_reason is None else finish_reason)


@dataclass(eq=False)
class Row:
    """A request on its way through the loop, with its finishing and what it has been sent."""

    request: Request
    finish: Finish
    release_text: bool = True  # each event carries the text its round releases (streams)
    t0: float = field(default_factory=time.perf_counter)  # event times are relative to it
    rounds: int = 0


def step_rows(engine: Loop, rows: Sequence[Row]) -> list[tuple[Row, RoundEvent | None]]:
    """One step of the engine for these rows (one drafting pass and one target pass for all):
    each row's part, finished and recorded, in the step's order. A row the engine refused
    gets None (its request's `error` says why; the others went on)."""
    events = engine.step([r.request for r in rows])
    by_request = {id(r.request): r for r in rows}
    out: list[tuple[Row, RoundEvent | None]] = []
    for e in events:
        row = by_request[id(e.request)]
        req = row.request
        if req.error is not None:
            out.append((row, None))
            continue
        added = engine.finish_step(e, row.finish)
        text = row.finish.release(req.generated, req.done) if row.release_text else ""
        out.append((row, round_event(e, row.rounds, row.t0, engine.model_names, added, text, req.finish_reason)))
        row.rounds += 1
    return out


def run_rows(engine: Loop, rows: Sequence[Row], width: int | None = None
             ) -> Iterator[tuple[Row, RoundEvent | None]]:
    """Step rows to their end, at most `width` at a time (default and at most: the engine's
    slots): rows leave as they finish and waiting ones join. Yields what `step_rows` gives.
    Every row's cache slot is freed when it ends, or when the caller stops early."""
    width = min(width or engine.target.slots, engine.target.slots)
    waiting, running = deque(rows), list[Row]()
    try:
        while waiting or running:
            while waiting and len(running) < width:
                running.append(waiting.popleft())
            yield from step_rows(engine, running)
            running = [r for r in running if not r.request.done]
    finally:
        for r in rows:
            engine.release(r.request)
