"""One front door: every path's requests are made and checked by `SpeculativeDecoder.request`,
and one driver (`specdec.driver`) steps them: the API alone and in batches, and the server."""

from __future__ import annotations

import httpx
import pytest

from specdec import load
from specdec.driver import Row, run_rows
from specdec.server import ServerConfig, create_app
from specdec.server.scheduler import Job
from tests.server_fixtures import serve_in_thread


def test_the_server_counts_the_prompt_and_max_tokens_against_the_context(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"])
    context = decoder.target.max_length
    with serve_in_thread(create_app(decoder, "tiny", ServerConfig(max_tokens=4096))) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        ids = [1 + i % 50 for i in range(context - 3)]
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "at most 3 new tokens" in error["message"]
        r = c.post("/v1/completions", json={"prompt": ids, "temperature": 0})  # no max_tokens: the room left
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 3
        r = c.post("/v1/completions", json={"prompt": ids + [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_job_is_made_by_the_decoders_front_door(tiny_pair):
    """The scheduler runs what `decoder.request` makes of a job: the same checks and the same
    seeded tokens as `generate`."""
    from specdec.server.metrics import ServerMetrics
    from specdec.server.scheduler import Scheduler

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"])
    scheduler = Scheduler(decoder, ServerMetrics(), max_batch=2)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        scheduler.admit(Job(ids=[1, 2, 3], max_tokens=0))
    with pytest.raises(ValueError, match="not loaded"):
        scheduler.admit(Job(ids=[1, 2, 3], max_tokens=4, prophets=["nobody"]))
    req, finish = scheduler.admit(Job(ids=[5, 6, 7], max_tokens=12, temperature=1.0, seed=3))
    assert req.k > 0 and req.policy is not None and req.policy is not decoder.policy
    plain, _ = scheduler.admit(Job(ids=[5, 6, 7], max_tokens=12, plain=True))
    assert plain.k == 0 and plain.policy is None
    for _ in run_rows(scheduler.engine, [Row(req, finish)]):
        pass
    assert req.generated == decoder.generate([5, 6, 7], max_new_tokens=12, temperature=1.0, seed=3).token_ids


def test_the_driver_frees_every_row_when_its_caller_stops_early(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"])
    stream = decoder.stream([5, 6, 7], max_new_tokens=40, temperature=0)
    next(stream)
    engine = next(iter(decoder.engines.values()))
    held = engine.target.slots - len(engine.slots.free)
    assert held == 1
    stream.close()  # the caller stops: the row's slot is free again
    assert len(engine.slots.free) == engine.target.slots
