"""The scheduler: one thread owns the engine; everything else talks to it through queues.

    stream = scheduler.submit(job)      # in the event loop; QueueFull when the queue is full
    async for item in stream: ...       # Round per engine round, then one End
    stream.cancel("disconnect")         # queued: dropped now; running: stopped before its next round

Requests join and leave between rounds (continuous batching) on the one round loop
(`specdec.wiring.engine_for`, the engine `generate` steps a request alone on): up to
`max_batch` requests are rows of ONE `engine.step(rows)` per iteration, one drafting pass
and one target forward for all of them (a lean Llama target; any other model scores its
rows in turn, `specdec.rows`), each row accepting its own number of tokens, with any
prophet or several (first, best, a token tree per row). Each row owns its generator and
cache slot, so its tokens are those it would get alone (greedy: exactly). Text release and
stop strings are `specdec.finish`'s, as for `generate`. Each row has its own policy
(`specdec.policy`, else the decoder's kind; auto by default: K per row from its acceptance
and the step costs measured at startup for that batch size, up to `specdec.draft_tokens`,
else the policy's K0) and may keep to some of the prophets (`specdec.draft`).

The thread never blocks on a client: it posts each item with `loop.call_soon_threadsafe`
into the request's asyncio queue, and a client that stops reading costs it nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specdec.batch import BatchEngine, BatchLlama
from specdec.decoder import SpeculativeDecoder
from specdec.driver import Row, step_rows
from specdec.errors import SpecdecError
from specdec.events import RoundEvent
from specdec.finish import Finish
from specdec.request import Request
from specdec.server.metrics import ServerMetrics
from specdec.wiring import engine_for

log = logging.getLogger("specdec.server")


class QueueFull(Exception):
    pass


class ShuttingDown(QueueFull):
    """The server is stopping and takes no more requests."""


@dataclass
class Job:
    """A validated, tokenised request, ready to run."""

    ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    draft_tokens: int | None = None
    sampling: str = "rejection"  # or "coupled": draws keyed by (seed, position) (specdec.sampling)
    plain: bool = False  # plain decoding (no prophet), e.g. the web view's side-by-side run
    prophets: list[str] | None = None  # which of the loaded prophets may draft (None: all)
    policy: str | None = None  # its K policy's kind (None: the decoder's)
    details: bool = True  # token texts of each round, for the web view
    timeout_s: float | None = None
    endpoint: str = "completions"
    constraint: dict[str, Any] = field(default_factory=dict)  # response_format, regex or grammar (specdec.grammar)
    tools: str | None = None  # the tool choice where the answer may be a tool call (specdec.tools)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    request: Request | None = None  # made from the fields above by the front door (`Scheduler.admit`)
    finish: Finish | None = None


@dataclass
class Round:
    event: RoundEvent
    drafted_text: list[str]
    next_text: str


@dataclass
class End:
    reason: str  # "done", "cancelled", "deadline", "shutdown" or "error"
    message: str = ""
    status: int = 200  # the HTTP status an error maps to


class JobStream:
    """The client side of a job: an async iterator of Round items ending with one End."""

    def __init__(self, scheduler: Scheduler, job: Job) -> None:
        self.scheduler, self.job = scheduler, job
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Round | End] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.deadline = self.arrived + job.timeout_s if job.timeout_s else None
        self.cancelled: str | None = None  # why, once cancelled
        self.ended = False  # an End was received by the client side
        self.started: float | None = None
        self.first_token: float | None = None
        self.cached_tokens = 0  # prompt positions its request took from the prefix cache

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> Round | End:
        if self.ended:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, End):
            self.ended = True
        return item

    def cancel(self, why: str = "cancelled") -> None:
        if not self.ended:
            self.scheduler.cancel(self, why)

    def post(self, item: Round | End) -> None:
        """From any thread; dropped silently if the event loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


@dataclass(eq=False)
class ServedRow:
    """A request running on the batched engine (its driver row: request, finishing, rounds),
    with its stream and what it has been sent."""

    stream: JobStream
    row: Row
    tokens: int = 0
    kv_bytes: int = 0  # the cache memory reserved for it (see Scheduler.kv_need)

    @property
    def request(self) -> Request:
        return self.row.request


class NeverFits(ValueError):
    """A request whose KV cache could never fit the server's memory budget (a 400)."""


def default_kv_memory() -> int:
    """Half of the memory this machine has available now (MemAvailable), or 4 GiB where it
    cannot be read: the batched cache's budget when the operator sets none."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // 2
    except (OSError, StopIteration, ValueError):
        return 4 << 30


class Scheduler:
    def __init__(self, decoder: SpeculativeDecoder, metrics: ServerMetrics, max_batch: int = 8,
                 max_queue: int = 256, prefill_chunk: int | None = None, kv_memory: int | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.decoder, self.metrics = decoder, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        self.default_k = decoder.policy.k0
        # The one loop's engine: every request is a row of its steps
        self.engine: BatchEngine = engine_for(decoder, max_batch)
        if prefill_chunk is not None:
            self.engine.slots.set_prefill_chunk(prefill_chunk)
        # The batched cache's memory budget: rows join while their reserved caches fit it
        self.kv_memory = kv_memory if kv_memory is not None else default_kv_memory()
        self._kv_reserved = 0
        self.mode = "batched"  # /v1/models says so: continuous batching, one round loop
        self._pending: deque[JobStream] = deque()
        self._rows: list[ServedRow] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def warm_up(self) -> float:
        """Before serving: measure the batched step's costs at every batch-size bucket when
        the policy chooses K from measured costs, so that the first requests of each size
        do not wait for it. Returns the seconds it took (0 when there is nothing to do)."""
        if self.engine.prophet is None or not getattr(self.decoder.policy, "needs_costs", False) \
                or self.default_k < 1:
            return 0.0
        t0 = time.perf_counter()
        with self._cond:  # nothing runs yet, but the engine is the scheduler thread's
            self.engine.kchoice.calibrate(self.default_k)
        took = time.perf_counter() - t0
        log.info("measured the batched step's costs at batch sizes up to %d in %.1fs", self.max_batch, took)
        return took

    def kv_need(self, job: Job) -> int:
        """Bytes of KV cache a job may come to hold on the batched engine: every position it
        can reach (prompt, answer and a round's draft), as the slot's buffer grows by doubling,
        in the target and a draft model (models scored row by row, `specdec.rows`, count 0)."""
        k = 0 if job.plain else job.draft_tokens or self.default_k
        positions = len(job.ids) + job.max_tokens + k + 1
        models = [self.engine.target, *self.engine.draft_lms]
        return sum(lm.position_bytes() * lm.capacity_for(positions) for lm in models if isinstance(lm, BatchLlama))

    def check_fits(self, job: Job) -> None:
        """Raise NeverFits when a job's cache could never fit the memory budget."""
        need = self.kv_need(job)
        if need > self.kv_memory:
            raise NeverFits(f"this request may need {need / 2**20:,.0f} MiB of KV cache (prompt {len(job.ids)} "
                            f"tokens + max_tokens {job.max_tokens}) but the server's budget is "
                            f"{self.kv_memory / 2**20:,.0f} MiB (--kv-memory): ask for fewer tokens")

    # ----------------------------------------------------------------- client side
    def submit(self, job: Job) -> JobStream:
        """Queue a job (call from the event loop); raises QueueFull when the queue is full."""
        stream = JobStream(self, job)
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting, {self._n_running()} "
                                "running): retry later")
            self._pending.append(stream)
            self.metrics.queue_depth.set(len(self._pending))
            self._ensure_thread()
            self._cond.notify()
        return stream

    def cancel(self, stream: JobStream, why: str = "cancelled") -> None:
        """Queued: removed at once. Running: stopped before its next round."""
        with self._cond:
            if stream.cancelled:
                return
            stream.cancelled = why
            queued = stream in self._pending
            if queued:
                self._pending.remove(stream)
                self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
        if why == "disconnect":
            self.metrics.disconnects.labels("queued" if queued else "running").inc()
            log.info("client disconnected from request %s while %s", stream.job.id, "queued" if queued else "running")
        if queued:
            self._end(stream, End("cancelled", f"cancelled ({why}) while queued"))

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._pending), self._n_running()

    def _n_running(self) -> int:
        return len(self._rows)

    def shut_down(self) -> None:
        """Stop taking requests, and end every one there is: running ones after the step now
        under way (their streams get an error, then [DONE]), queued ones at once (503).
        Returns at once; the thread ends them and exits."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            idle = self._thread is None or not self._thread.is_alive()
        if idle:  # no thread to do it (none was ever needed)
            self._shutdown()

    def stop(self, timeout: float = 5.0) -> None:
        self.shut_down()
        with self._cond:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ----------------------------------------------------------------- the thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._pending or self._rows):
                        self._cond.wait(timeout=1.0)
                    if self._stopping:
                        break
                    self._admit_rows()
                self._step(self.engine)
        except BaseException:  # a bug here must not leave clients waiting forever
            log.exception("the scheduler failed")
            raise
        finally:
            self._shutdown()

    def _expire_queued(self) -> None:
        now = time.monotonic()
        for stream in list(self._pending):
            if stream.deadline is not None and now > stream.deadline:
                self._pending.remove(stream)
                self._end(stream, End("deadline", "the request timed out in the queue", 503))

    # ----------------------------------------------------------------- the rows
    def _admit_rows(self) -> None:
        """Queued jobs become rows while there is room (with the lock held); they take an
        engine cache slot at their first step."""
        self._expire_queued()
        while self._pending and len(self._rows) < self.max_batch:
            need = self.kv_need(self._pending[0].job)
            if self._rows and self._kv_reserved + need > self.kv_memory:
                break  # it waits (first come, first served) until running rows free enough memory
            stream = self._pending.popleft()
            try:
                req, finish = self.admit(stream.job)
            except (SpecdecError, ValueError) as e:
                self._end(stream, End("error", str(e), 400))
                continue
            stream.started = time.monotonic()
            self.metrics.queue_wait.observe(stream.started - stream.arrived)
            self._rows.append(ServedRow(stream, Row(req, finish), kv_bytes=need))
            self._kv_reserved += need
        self.metrics.queue_depth.set(len(self._pending))
        self.metrics.batch_size.set(len(self._rows))

    def admit(self, job: Job) -> tuple[Request, Finish]:
        """The job's request, made by the decoder's front door (`SpeculativeDecoder.request`:
        the checks and the K policy every path gets). A server asks this as it takes a job, so
        bad settings are a 400 before the job is queued."""
        if job.request is None:
            job.request, job.finish = self.decoder.request(
                job.ids, job.max_tokens, job.temperature, job.top_k, job.top_p, job.seed, job.draft_tokens, job.stop,
                None, job.prophets, job.policy, job.sampling, plain=job.plain or self.engine.prophet is None,
                **job.constraint)
        assert job.finish is not None
        return job.request, job.finish

    def _step(self, engine: BatchEngine) -> None:
        """Drop cancelled and expired rows, then one engine step for all the others."""
        now = time.monotonic()
        for row in list(self._rows):
            if row.stream.cancelled:
                self._finish_row(engine, row, End("cancelled", row.stream.cancelled))
            elif row.stream.deadline is not None and now > row.stream.deadline:
                # 503 as in the queue when it has no token yet (e.g. still waiting for its prompt's
                # prefill); with tokens sent, its answer ends there instead (deadline_exceeded)
                self._finish_row(engine, row, End("deadline", "the request timed out before its first token", 503))
        rows = list(self._rows)
        if not rows:
            return
        try:
            done = step_rows(engine, [r.row for r in rows])
        except Exception as e:  # the whole step failed: every row in it ends, slots freed
            bad_input = isinstance(e, SpecdecError | ValueError)
            if not bad_input:
                log.exception("a batched step of %d requests failed", len(rows))
            for row in rows:
                self._finish_row(engine, row, End("error", str(e), 400) if bad_input else
                                 End("error", f"generation failed: {type(e).__name__}: {e}", 500))
            return
        self.metrics.step_rows.observe(len(rows))
        self.metrics.prefix(engine.slots.prefix_cache)
        served = {id(r.row): r for r in rows}
        for stepped, event in done:
            self._post_step(engine, served[id(stepped)], event)

    def _post_step(self, engine: BatchEngine, row: ServedRow, event: RoundEvent | None) -> None:
        req, stream = row.request, row.stream
        stream.cached_tokens = req.prefix_hit
        if event is None:  # the engine refused this row alone; the others went on
            self._finish_row(engine, row, End("error", req.error or "refused", 400))
            return
        finish = req.finish_reason
        row.tokens += len(event.committed)
        self.metrics.round(event)
        if stream.first_token is None and event.committed:
            stream.first_token = time.monotonic()
            self.metrics.ttft.observe(stream.first_token - stream.arrived)
        stream.post(self._round_item(stream.job, event))
        if finish is not None:
            self._finish_row(engine, row, End("done"))

    def _finish_row(self, engine: BatchEngine, row: ServedRow, end: End) -> None:
        engine.release(row.request)
        with self._cond:
            self._rows.remove(row)
            self._kv_reserved -= row.kv_bytes
            self.metrics.batch_size.set(len(self._rows))
        self._end(row.stream, end)

    def _round_item(self, job: Job, event: RoundEvent) -> Round:
        tok = self.decoder.tokenizer
        if not job.details or tok is None:
            return Round(event, [], "")
        return Round(event, [tok.decode([t]) for t in event.drafted], tok.decode([event.next_token]))

    def _end(self, stream: JobStream, end: End) -> None:
        outcome = "disconnected" if stream.cancelled == "disconnect" else end.reason
        self.metrics.requests.labels(stream.job.endpoint, outcome).inc()
        if end.reason == "done":
            self.metrics.latency.observe(time.monotonic() - stream.arrived)
        stream.post(end)

    def _shutdown(self) -> None:
        with self._cond:
            left = [r.stream for r in self._rows] + list(self._pending)
            self._rows.clear()
            self._pending.clear()
        for stream in left:
            self._end(stream, End("shutdown", "the server is shutting down", 503))
