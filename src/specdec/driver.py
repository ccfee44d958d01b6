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

    def step(self, requests: Sequence[Request]) -> list[StepEvent]: ...

    def finish_step(self, e: StepEvent, finish: Finish) -> list[int]: ...

    def round_event(self, e: StepEvent, index: int, t0: float, committed: Sequence[int] | None = None,
                    text: str = "", finish_reason: str | None = None) -> RoundEvent: ...

    def release(self, req: Request) -> None: ...


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
        out.append((row, engine.round_event(e, row.rounds, row.t0, added, text, req.finish_reason)))
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
