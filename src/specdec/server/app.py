"""FastAPI app: POST /v1/completions (OpenAI-compatible, `stream: true` sends server-sent
events round by round), GET /v1/models, GET /health, GET /metrics (Prometheus text).

One decoder, one request at a time (batch size 1): a lock serialises generations, and it
is released when a streaming client disconnects, because the response generator is
closed and the engine stops at its next round.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from specdec.engine import SpeculativeDecoder
from specdec.errors import SpecdecError
from specdec.stats import summarize


class CompletionRequest(BaseModel):
    prompt: str
    model: str | None = None
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False


class Metrics:
    """Counters since start, exported in Prometheus text format."""

    def __init__(self) -> None:
        self.counts = {"requests": 0, "rounds": 0, "drafted": 0, "accepted": 0, "recovered": 0, "bonus": 0,
                       "generated_tokens": 0, "target_calls": 0, "draft_calls": 0, "disconnects": 0}
        self.lock = threading.Lock()

    def add(self, stats: Any) -> None:
        with self.lock:
            self.counts["requests"] += 1
            for key in ["rounds", "drafted", "accepted", "recovered", "bonus", "target_calls", "draft_calls"]:
                self.counts[key] += getattr(stats, key)
            self.counts["generated_tokens"] += stats.new_tokens

    def text(self) -> str:
        lines = []
        for key, value in self.counts.items():
            lines += [f"# TYPE specdec_{key}_total counter", f"specdec_{key}_total {value}"]
        drafted = self.counts["drafted"]
        rate = self.counts["accepted"] / drafted if drafted else 0.0
        lines += ["# TYPE specdec_acceptance_rate gauge", f"specdec_acceptance_rate {rate}"]
        return "\n".join(lines) + "\n"


def create_app(decoder: SpeculativeDecoder, model_name: str = "specdec") -> FastAPI:
    app = FastAPI(title="specdec", description="Lossless speculative decoding, OpenAI-compatible completions")
    busy = threading.Lock()
    metrics = Metrics()

    def settings(req: CompletionRequest) -> dict[str, Any]:
        return dict(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                    seed=req.seed, stop=req.stop)

    def check(req: CompletionRequest) -> None:
        if not req.prompt:
            raise HTTPException(400, "the prompt is empty")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdec"}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        return metrics.text()

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> Any:
        check(req)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(stream(req, rid), media_type="text/event-stream")
        with busy:
            try:
                out = decoder.generate(req.prompt, **settings(req))
            except (SpecdecError, ValueError) as e:
                raise HTTPException(400, str(e)) from e
        metrics.add(out.stats)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": out.text, "finish_reason": _finish(out.finish_reason)}],
                "usage": {"prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.token_ids),
                          "total_tokens": len(out.prompt_ids) + len(out.token_ids)},
                "specdec": out.stats.to_dict()}

    def stream(req: CompletionRequest, rid: str) -> Iterator[str]:
        events = []
        finished = False
        with busy:
            try:
                for event in decoder.stream(req.prompt, **settings(req)):
                    events.append(event)
                    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                             "choices": [{"index": 0, "text": event.text,
                                          "finish_reason": _finish(event.finish_reason)}],
                             "specdec": {"round": event.index, "accepted": event.accepted,
                                         "drafted": len(event.drafted), "next_kind": event.next_kind}}
                    yield f"data: {json.dumps(chunk)}\n\n"
                finished = True
                yield "data: [DONE]\n\n"
            except (SpecdecError, ValueError) as e:
                finished = True
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
            finally:
                if events:
                    metrics.add(summarize(events))
                if not finished:
                    with metrics.lock:
                        metrics.counts["disconnects"] += 1

    return app


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "stop" if reason in ("eos", "stop") else "length"
