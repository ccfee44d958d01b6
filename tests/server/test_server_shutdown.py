"""SIGTERM with streams running and requests queued: `specdec serve` (the bundled small
pair, in a subprocess on a loopback port) ends each running stream with an error event in
OpenAI's shape and then [DONE], answers each queued request with a 503 in OpenAI's shape,
logs no traceback, and exits within --shutdown-timeout. Every wait is bounded."""

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from specdec.defaults import bundled_prophet, bundled_target
from tests.server_fixtures import ServerProcess

SHUTDOWN_TIMEOUT = 3.0
MAX_BATCH = 6
STREAMS = 14  # MAX_BATCH run; the others wait in the queue


@pytest.fixture
def proc(tmp_path):
    target, prophet = Path(bundled_target()), Path(bundled_prophet())
    if not (target / "model.safetensors").exists() or not (prophet / "model.safetensors").exists():
        pytest.skip("the bundled models are not here")
    args = ["--target", str(target), "--draft", str(prophet), "--policy", "fixed", "-k", "3",
            "--max-batch", str(MAX_BATCH), "--max-queue", "64", "--max-tokens-limit", "900",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    server = ServerProcess(args, tmp_path / "server.log", timeout=60)
    yield server
    server.stop()


def is_error(obj):
    return (isinstance(obj, dict) and set(obj) == {"error"}
            and set(obj["error"]) == {"message", "type", "param", "code"} and obj["error"]["message"])


async def one_stream(client, i, results, first_chunk):
    payload = {"prompt": f"def f{i}(", "max_tokens": 900, "temperature": 1.0, "seed": i, "stream": True}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        if r.status_code != 200:
            results[i] = (r.status_code, json.loads(await r.aread()))
            return
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                first_chunk[i] = True
        results[i] = (200, events)


def test_sigterm_ends_streams_with_an_error_and_done_and_queued_requests_with_503(proc):
    results: dict[int, tuple[int, object]] = {}
    first_chunk: dict[int, bool] = {}

    async def main() -> float:
        async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
            tasks = [asyncio.create_task(one_stream(client, i, results, first_chunk)) for i in range(STREAMS)]
            deadline = time.monotonic() + 15
            while True:  # every running stream has sent something, and the others are queued
                assert time.monotonic() < deadline, f"the streams did not start: {proc.log()[-2000:]}"
                assert not any(t.done() for t in tasks), f"a request ended before SIGTERM: {results}"
                health = (await client.get("/health")).json()
                if len(first_chunk) == MAX_BATCH and health["queued"] == STREAMS - MAX_BATCH:
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
            await asyncio.to_thread(proc.proc.wait, SHUTDOWN_TIMEOUT + 5)
            return time.monotonic() - t0

    took = asyncio.run(main())
    log = proc.log()
    assert took < SHUTDOWN_TIMEOUT, took  # nothing waited for the graceful timeout
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "Application shutdown complete" in log, log[-3000:]

    streamed = {i: r[1] for i, r in results.items() if r[0] == 200}
    refused = {i: r for i, r in results.items() if r[0] != 200}
    assert len(results) == STREAMS and len(streamed) == MAX_BATCH, results
    for i, events in streamed.items():
        assert isinstance(events, list) and len(events) >= 3, (i, events)
        assert events[-1] == "[DONE]" and is_error(events[-2]), (i, events[-2:])
        assert events[-2]["error"]["code"] == "shutdown" and "shutting down" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2]), (i, events)  # nothing else is an error
    for i, (status, body) in refused.items():
        assert status == 503 and is_error(body), (i, status, body)
        assert body["error"]["code"] == "shutdown"
