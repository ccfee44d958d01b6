"""FastAPI app: OpenAI-compatible /v1/completions and /v1/chat/completions (server-sent
events with `stream: true`), /v1/models, /health, /metrics (Prometheus) and a live web
view at /.

A request is validated and tokenised before it is queued, so bad input is a 4xx before any
response header is sent and never reaches the engine. The scheduler (scheduler.py) runs the
engine in one thread; here each request only awaits its own queue, and a task watches the
connection so that a client that goes away, queued or running, is cancelled at once.

On SIGTERM or SIGINT (before uvicorn's graceful shutdown starts waiting for open requests)
the scheduler ends every request at once: a running stream gets an error event, then
[DONE]; a queued or newly arriving request gets a 503. So the connections close promptly
and nothing is cut off by uvicorn's --shutdown-timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from specdec.decoder import SpeculativeDecoder
from specdec.defaults import MAX_NEW_TOKENS, PREFILL_CHUNK, SERVE_PREFIX_CACHE_MB, TEMPERATURE, TOP_P, display_name
from specdec.errors import ContextLengthError, SpecdecError
from specdec.grammar import GrammarError, check_grammar, grammar_of
from specdec.heap import release_load_memory
from specdec.openmp import release_pool
from specdec.policy import POLICIES
from specdec.server.errors import ApiError, install_handlers
from specdec.server.metrics import ServerMetrics
from specdec.server.middleware import ApiKeyAuth, BodyLimit
from specdec.server.scheduler import End, Job, JobStream, NeverFits, QueueFull, Round, Scheduler, ShuttingDown
from specdec.server.schemas import ChatRequest, CompletionRequest, SamplingFields, SpecdecOptions
from specdec.stats import summarize
from specdec.tools import call_text, check_tools, may_be_call, read_calls, tool_grammar, with_tools

log = logging.getLogger("specdec.server")


@dataclass
class ServerConfig:
    """What the operator allows. Per-request settings must stay within these."""

    api_key: str | None = None
    max_batch: int = 8  # requests generated at once: rows of one batched step
    max_queue: int = 256  # requests waiting; beyond it, 429
    timeout_s: float | None = 600.0  # per-request deadline, from arrival
    max_body_bytes: int = 2_000_000
    max_tokens: int = 4096  # largest max_tokens a request may ask for
    max_draft_tokens: int = 16  # largest specdec.draft_tokens a request may ask for
    warm_up: bool = True  # measure the batched step's costs before serving (the auto policy's K)
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens prefilled per batched step: the longest stall of a stream
    kv_memory: int | None = None  # bytes of batched KV cache requests may reserve (None: half of MemAvailable)
    prefix_cache_mb: float = SERVE_PREFIX_CACHE_MB  # MiB of prompt prefixes' keys and values kept (specdec.prefix)


def create_app(decoder: SpeculativeDecoder, model_name: str = "specdec", config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics()
    decoder.prefix_cache_mb = config.prefix_cache_mb  # before the scheduler builds its engine
    scheduler = Scheduler(decoder, metrics, config.max_batch, config.max_queue, config.prefill_chunk,
                          config.kv_memory)
    tokenizer_lock = threading.Lock()  # a HF tokenizer may not be used from two threads at once

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.warm_up:
            await asyncio.to_thread(_then_release_pool, scheduler.warm_up)
            release_load_memory()  # what measuring left in the heap: idle is what serving holds
        # Only the scheduler's thread runs the model from here: the OpenMP workers of the threads
        # that loaded it and measured its costs would keep its own from spinning (specdec.openmp)
        release_pool()
        restore = _shut_down_on_exit_signals(asyncio.get_running_loop(), scheduler.shut_down)
        try:
            yield
        finally:
            restore()
            scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan,
                  description="Lossless speculative decoding behind OpenAI-compatible endpoints")
    app.state.scheduler, app.state.metrics, app.state.config = scheduler, metrics, config
    install_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, key=config.api_key, open_paths={"/health"})

    prophet = "+".join(d.name for d in decoder.prophets) or "none"
    policy = getattr(decoder.policy, "name", "fixed")  # the default; a request may ask for another

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "specdec",
                "specdec": {"target": display_name(decoder.target.name), "draft": prophet, "policy": policy,
                            "prophets": [d.name for d in decoder.prophets],
                            "draft_tokens": scheduler.default_k, "context": decoder.target.max_length,
                            "max_draft_tokens": config.max_draft_tokens, "max_tokens": config.max_tokens,
                            "batching": scheduler.mode, "max_batch": config.max_batch,
                            "chat": bool(getattr(decoder.tokenizer, "chat_template", None))}}

    # ----------------------------------------------------------------- validation
    def settings(body: SamplingFields, max_tokens: int | None, prompt_len: int, endpoint: str) -> Job:
        opts = body.specdec or SpecdecOptions()
        if opts.draft_tokens is not None and opts.draft_tokens > config.max_draft_tokens:
            raise ApiError(400, f"specdec.draft_tokens may be at most {config.max_draft_tokens} on this server",
                           "specdec.draft_tokens")
        names = [d.name for d in decoder.prophets]
        chosen: list[str] | None = None  # all the loaded prophets
        if opts.draft not in (None, "default", "none"):
            chosen = opts.draft.split("+")
            if not names or any(c not in names for c in chosen) or len(set(chosen)) != len(chosen):
                raise ApiError(400, f"specdec.draft: this server has prophet '{prophet}' loaded; choose 'default', "
                                    "'none' (plain decoding)" + (f" or some of {', '.join(names)} joined by '+'"
                                                                   if len(names) > 1 else ""), "specdec.draft")
        if opts.policy not in (None, *POLICIES):
            raise ApiError(400, f"specdec.policy: choose one of {', '.join(POLICIES)} (this server's default: "
                                f"{policy})", "specdec.policy")
        room = decoder.target.max_length - prompt_len
        if max_tokens is None:  # the one rule for defaults (specdec.defaults), within the context
            max_tokens = max(1, min(MAX_NEW_TOKENS, config.max_tokens, room))
        if max_tokens > config.max_tokens:
            raise ApiError(400, f"max_tokens may be at most {config.max_tokens} on this server", "max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        temperature = TEMPERATURE if body.temperature is None else body.temperature
        top_p = TOP_P if body.top_p is None else body.top_p
        return Job(ids=[], max_tokens=max_tokens, temperature=temperature, top_k=body.top_k or None, top_p=top_p,
                   seed=body.seed, stop=stop, draft_tokens=opts.draft_tokens, sampling=body.sampling or "rejection",
                   plain=opts.draft == "none" and prophet != "none", prophets=chosen, policy=opts.policy,
                   details=opts.rounds,
                   timeout_s=config.timeout_s,
                   endpoint=endpoint)

    def constraint(body: SamplingFields, tools: tuple[list[dict[str, Any]], str | None] | None) -> dict[str, Any]:
        """The answer's grammar as the front door's keywords: response_format, or the tools'
        (specdec.tools); checked here (400 naming the parameter)."""
        try:
            spec = grammar_of(body.response_format)
            if tools is not None and tools[1] != "none":
                if spec is not None:
                    raise GrammarError("pass response_format or tools with tool_choice other than \"none\", not both")
                spec = tool_grammar(*tools)
            if spec is not None:
                check_grammar(spec)
        except GrammarError as e:
            param = "tools" if tools is not None and body.response_format is None else "response_format"
            raise ApiError(400, f"{param}: {e}", param) from None
        if spec is None:
            return {}
        return {"grammar": spec.source} if spec.kind == "lark" else {"response_format": body.response_format}

    def check_common(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise ApiError(400, f"the model '{body.model[:100]}' is not served here; this server serves "
                                f"'{model_name}' (see /v1/models)", "model", "model_not_found")
        if (bad := body.unsupported()) is not None:
            raise ApiError(400, bad[1], bad[0], "unsupported_parameter")
        if body.stop and decoder.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer", "stop")

    def admit(job: Job, param: str) -> None:
        """The job's request made by the decoder's front door (the checks every path gets)."""
        try:
            scheduler.admit(job)
        except ContextLengthError as e:
            raise ApiError(400, str(e), param, "context_length_exceeded") from None
        except (SpecdecError, ValueError) as e:
            raise ApiError(400, str(e), param) from None

    def check_memory(job: Job) -> None:
        try:
            scheduler.check_fits(job)
        except NeverFits as e:
            raise ApiError(400, str(e), "max_tokens", "kv_memory_exceeded") from None

    def encode_prompt(prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            ids = [int(p) for p in prompt]
            if min(ids) < 0 or max(ids) >= decoder.target.vocab_size:
                raise ApiError(400, f"prompt token ids must be in [0, {decoder.target.vocab_size})", "prompt")
            return ids
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ApiError(400, "a list of prompts is not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        if decoder.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send token ids", "prompt")
        with tokenizer_lock:
            return list(decoder.tokenizer(prompt)["input_ids"])

    def encode_chat(body: ChatRequest, functions: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's ids in the chat template; earlier tool calls as the text that
        wrote them, the tools in the template where it takes them, else in a system message."""
        tok = decoder.tokenizer
        template = getattr(tok, "chat_template", None)
        if tok is None or not template:
            raise ApiError(400, f"the model '{model_name}' has no chat template: use /v1/completions", "messages")
        messages = []
        for i, m in enumerate(body.messages):
            try:
                content = m.text()
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            try:
                content += call_text((m.model_extra or {}).get("tool_calls") or [])
            except ValueError as e:
                raise ApiError(400, str(e), f"messages.{i}.tool_calls") from None
            messages.append({"role": m.role, "content": content})
        extra: dict[str, Any] = {}
        if functions and "tools" in str(template):
            extra["tools"] = [{"type": "function", "function": f} for f in functions]
        elif functions:
            messages = with_tools(messages, functions)
        with tokenizer_lock:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    # ----------------------------------------------------------------- running a job
    def submit(job: Job) -> JobStream:
        try:
            return scheduler.submit(job)
        except ShuttingDown as e:
            metrics.rejected.labels("shutdown").inc()
            raise ApiError(503, str(e), None, "shutdown") from None
        except QueueFull as e:
            metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, str(e), None, "queue_full", {"Retry-After": "1"}) from None

    async def watch(request: Request, stream: JobStream) -> None:
        """Cancel the job when the client goes away (the body has been read by now)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not stream.ended:
                    stream.cancel("disconnect")
                return

    async def run(request: Request, job: Job, chat: bool, include_usage: bool, stream_it: bool) -> Response:
        """Queue the job; its answer as one response or streamed (a tool call, where the job
        may make one, read back as tool_calls)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + job.id
        stream = submit(job)
        watcher = asyncio.create_task(watch(request, stream))
        try:
            first = await anext(stream)
        except BaseException:
            watcher.cancel()
            stream.cancel()
            raise
        if isinstance(first, End) and first.reason != "done":
            watcher.cancel()
            raise _end_to_error(first)
        shape = _Shape(rid, model_name, chat, len(job.ids), include_usage, job.tools)
        if stream_it:
            return EventStream(shape.sse(first, stream, watcher))
        try:
            return JSONResponse(await shape.collect(first, stream))
        finally:
            watcher.cancel()

    # ----------------------------------------------------------------- endpoints
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_common(body)
        ids = await run_in_threadpool(encode_prompt, body.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        job = settings(body, body.max_tokens, len(ids), "completions")
        job.ids, job.constraint = ids, constraint(body, None)
        admit(job, "prompt" if body.max_tokens is None else "max_tokens")
        check_memory(job)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run(request, job, False, usage, body.stream)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_common(body)
        tools = None
        if body.tools:
            try:
                tools = check_tools(body.tools, body.tool_choice)
            except GrammarError as e:
                param = "tool_choice" if "tool_choice" in str(e) else "tools"
                raise ApiError(400, str(e) if param in str(e) else f"{param}: {e}", param) from None
        elif body.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice names a function but there are no tools", "tool_choice")
        ids = await run_in_threadpool(encode_chat, body, tools[0] if tools else None)
        if not ids:
            raise ApiError(400, "the prompt is empty", "messages")
        job = settings(body, body.max_completion_tokens or body.max_tokens, len(ids), "chat")
        job.ids, job.constraint = ids, constraint(body, tools)
        job.tools = tools[1] if tools is not None and tools[1] != "none" else None
        admit(job, "messages" if (body.max_completion_tokens or body.max_tokens) is None else "max_tokens")
        check_memory(job)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run(request, job, True, usage, body.stream)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        queued, running = scheduler.depth()
        return {"status": "ok", "queued": queued, "running": running}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise ApiError(404, f"the model '{model_id[:100]}' does not exist; this server serves '{model_name}'",
                           "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def web_view() -> HTMLResponse:
        return HTMLResponse(files("specdec.server").joinpath("static/index.html").read_text(encoding="utf-8"))

    return app


class EventStream(Response):
    """Server-sent events from an async iterator of strings. The disconnect watcher, not
    this response, notices a client that leaves; sending to it then is a no-op."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[str, None]) -> None:
        self.status_code, self.background, self.chunks = 200, None, chunks
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no content-length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass
        finally:
            await self.chunks.aclose()


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "stop" if reason in ("eos", "stop") else "length"


class _Shape:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int, include_usage: bool,
                 tools: str | None = None) -> None:
        self.rid, self.model, self.chat, self.include_usage = rid, model, chat, include_usage
        self.tools = tools  # the tool choice where the answer may be a tool call (specdec.tools)
        self.prompt_tokens, self.created = prompt_tokens, int(time.time())
        self.completion_tokens = 0

    def usage(self, stream: JobStream) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens read from the prefix cache (--prefix-cache)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stream.cached_tokens}}

    async def collect(self, first: Round | End, stream: JobStream) -> dict[str, Any]:
        events, item = [], first
        while isinstance(item, Round):
            events.append(item.event)
            item = await anext(stream)
        if item.reason not in ("done", "deadline"):
            raise _end_to_error(item)
        text = "".join(e.text for e in events)
        self.completion_tokens = sum(len(e.committed) for e in events)
        reason = _finish(events[-1].finish_reason if events else "length") or "length"
        calls = read_calls(text) if self.tools else None
        if calls is not None:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": None,
                                                              "tool_calls": calls},
                                      "finish_reason": "tool_calls", "logprobs": None}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        stats = summarize(events).to_dict()
        if item.reason == "deadline":
            stats["deadline_exceeded"] = True
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(stream),
                "specdec": stats}

    def chunk(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None,
              usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        if extra is not None:
            body["specdec"] = extra
        return f"data: {json.dumps(body)}\n\n"

    def choice(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    async def sse(self, first: Round | End, stream: JobStream,
                  watcher: asyncio.Task[None]) -> AsyncGenerator[str, None]:
        try:
            # a tool call is held back until the answer ends, then sent as one tool_calls delta;
            # text is sent as it comes once it cannot be a call (`may_be_call`)
            item, n, held, deciding = first, 0, "", bool(self.tools)
            while isinstance(item, Round):
                e = item.event
                self.completion_tokens += len(e.committed)
                text, finish, calls = e.text, _finish(e.finish_reason), None
                if deciding:
                    held, text = held + text, ""
                    if not may_be_call(held):
                        text, held, deciding = held, "", False
                    elif finish is not None:
                        calls = read_calls(held)
                        text, finish = ("", "tool_calls") if calls is not None else (held, finish)
                extra = {"round": e.index, "prophet": e.prophet, "drafted": item.drafted_text, "drafted_ids": e.drafted,
                         "accepted": e.accepted, "next_kind": e.next_kind, "next_token": item.next_text,
                         "committed": len(e.committed), "draft_ms": round(e.draft_s * 1e3, 3),
                         "target_ms": round(e.target_s * 1e3, 3), "start_ms": round(e.start * 1e3, 3),
                         "end_ms": round(e.end * 1e3, 3)} if stream.job.details else None
                choice = self.choice(text, finish, n == 0)
                if calls is not None:
                    choice["delta"] = {**({"role": "assistant"} if n == 0 else {}), "content": None,
                                       "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                yield self.chunk([choice], extra)
                n += 1
                item = await anext(stream)
            if item.reason == "deadline":
                yield self.chunk([self.choice("", "length", n == 0)], {"deadline_exceeded": True})
            elif item.reason != "done":  # an error event, then [DONE]: the stream still ends as streams end
                err = _end_to_error(item)
                yield f"data: {json.dumps(err.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if self.include_usage:
                yield self.chunk([], None, self.usage(stream))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            stream.cancel()


def _then_release_pool(fn: Callable[[], Any]) -> Any:
    """fn(), then the calling thread's OpenMP workers freed (a worker thread that ran the model
    once: its pool would keep the scheduler's from spinning, specdec.openmp)."""
    try:
        return fn()
    finally:
        release_pool()


def _shut_down_on_exit_signals(loop: asyncio.AbstractEventLoop, shut_down: Callable[[], None]) -> Callable[[], None]:
    """Run `shut_down` in the event loop on SIGTERM and SIGINT, then the handler that was
    there (uvicorn's, which starts its graceful shutdown). Returns what puts the old handlers
    back. Only in the main thread (signals are delivered there), and only over a handler
    that is a function: the default action or an ignored signal is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    installed: dict[int, tuple[Any, Any]] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum: int, frame: Any, previous: Callable[[int, Any], Any] = previous) -> None:
            try:
                loop.call_soon_threadsafe(shut_down)
            except RuntimeError:  # the loop has closed
                pass
            previous(signum, frame)

        signal.signal(sig, handler)
        installed[sig] = (handler, previous)

    def restore() -> None:
        for sig, (handler, previous) in installed.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, previous)

    return restore


def _end_to_error(end: End) -> ApiError:
    status = end.status if end.status >= 400 else (499 if end.reason == "cancelled" else 500)
    return ApiError(status, end.message or end.reason, None, end.reason)
