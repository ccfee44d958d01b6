"""`specdec serve --replicas`: the same API as a Ray Serve application of replica processes.

A one-node Ray cluster started here (2 logical CPUs, a small object store, no dashboard)
runs two replicas of the bundled pair, one torch thread each. Concurrent greedy streams
must equal the one-process library's answers and be spread over both replicas; killing one
replica's process in the middle of a load ends only its streams, each with an error event
and [DONE]; new requests are served at once and Ray starts a replacement. Plain `specdec
serve` must not import ray at all. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import httpx
import pytest

from specdec.cli import main
from tests.server_fixtures import free_port

PROMPTS = ["def ", "import os\n", "class A:", "for i in", "x = [", "return ", "if __name__", "print(",
           "def main(", "while True:", "try:\n", "with open(", "self.", "raise ", "elif ", "lambda x",
           "from collections import", "async def ", "assert ", "yield ", "except ", "global ", "del ", "not "]
TOKENS = 48
KEY = "replica-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ no Ray needed
def test_plain_serve_never_imports_ray():
    code = textwrap.dedent("""
        import sys
        import uvicorn
        from specdec.cli import main
        served = []
        uvicorn.run = lambda app, **kw: served.append(app)
        assert main(["serve", "--target", "bundled"]) == 0 and served
        print("ray imported" if any(m == "ray" or m.startswith("ray.") for m in sys.modules) else "no ray")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "no ray"


@pytest.mark.parametrize("args, words", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--replicas", "-2"], "--replicas must be at least 1"),
    (["--autoscale", "4"], "--autoscale must be MIN:MAX"),
    (["--autoscale", "a:b"], "--autoscale must be MIN:MAX"),
    (["--autoscale", "3:1"], "--autoscale must be MIN:MAX"),
    (["--autoscale", "0:2"], "--autoscale must be MIN:MAX"),
    (["--autoscale", ":"], "--autoscale must be MIN:MAX"),
    (["--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--replicas", "2", "--gpus-per-replica", "1"], "--device cuda"),
    (["--replicas", "2", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0"),
])
def test_bad_replica_options_are_one_line_and_exit_2(args, words, capsys):
    assert main(["serve", "--target", "bundled", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: ") and words in err, err


# ------------------------------------------------------------------ a Ray cluster of two replicas
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(scope="module")
def expected():
    """The one-process library's greedy answers (computed before the cluster takes the CPUs)."""
    import torch

    from specdec import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoder = load("bundled")
        return {p: decoder.generate(p, max_new_tokens=TOKENS, temperature=0).text for p in PROMPTS}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster(expected):
    ray = pytest.importorskip("ray")
    from ray import serve

    from specdec.server.app import ServerConfig
    from specdec.server.replicas import APP_NAME, ReplicaSpec, Scale, application

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on loopback
    ray.init(num_cpus=2, object_store_memory=100 * 1024 ** 2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False, _node_ip_address="127.0.0.1")  # loopback only
    try:
        port = free_port()
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
        # a queue that holds a whole test burst of 24 streams even when the router sends most to one
        # replica (a kill test failed once on 429s: 16 waiting, 6 running on the survivor)
        config = ServerConfig(api_key=KEY, max_batch=16, max_queue=32, warm_up=False, timeout_s=120)
        spec = ReplicaSpec(load={"target": "bundled"}, config=config, threads=1)
        serve.run(application(spec, Scale(replicas=2), cpus_per_replica=1.0, shutdown_timeout_s=1.0),
                  name=APP_NAME, route_prefix="/", logging_config=quiet)
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(url, 2, timeout=60)
        yield url
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _replicas(url: str) -> dict[str, int]:
    """{replica: pid} from /metrics' specdec_replica_info."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    found = re.findall(r'^specdec_replica_info\{node="[^"]*",pid="(\d+)",replica="([^"]+)"\} 1\.0$', text, re.M)
    return {name: int(pid) for pid, name in found}


def _wait_for_replicas(url: str, n: int, timeout: float, without: str | None = None) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = {k: v for k, v in _replicas(url).items() if k != without}
            if len(seen) >= n:
                return seen
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{n} replicas did not report within {timeout}s"
        time.sleep(0.5)


class Stream:
    """One streamed completion: the replica that answered, its text, how it ended."""

    def __init__(self, prompt: str) -> None:
        self.prompt, self.replica, self.parts, self.errors = prompt, None, [], []
        self.chunks, self.done, self.ended_at, self.status = 0, False, None, None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    async def run(self, client: httpx.AsyncClient) -> Stream:
        payload = {"prompt": self.prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=payload, headers=AUTH) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.errors.append(json.loads(await r.aread())["error"])
                self.ended_at = time.monotonic()
                return self
            self.replica = r.headers["x-specdec-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                assert not self.done, "data after [DONE]"
                if line == "data: [DONE]":
                    self.done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                else:
                    self.parts.append(chunk["choices"][0]["text"])
                    self.chunks += 1
        self.ended_at = time.monotonic()
        return self


async def _streams(url: str, prompts: list[str], during: Any = None) -> tuple[list[Stream], Any]:
    streams = [Stream(p) for p in prompts]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        tasks = [asyncio.create_task(s.run(client)) for s in streams]
        side = await during(streams) if during else None
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return streams, side


@pytest.mark.slow
def test_concurrent_greedy_streams_equal_one_process_and_use_both_replicas(cluster, expected):
    streams, _ = asyncio.run(_streams(cluster, PROMPTS))
    for s in streams:
        assert s.status == 200 and s.done and not s.errors and s.text == expected[s.prompt], (s.prompt, s.errors)
    assert len({s.replica for s in streams}) == 2
    metrics = httpx.get(cluster + "/metrics", headers=AUTH, timeout=10).text
    tokens = dict(re.findall(r'^specdec_generated_tokens_total\{replica="([^"]+)"\} ([0-9.e+]+)$', metrics, re.M))
    assert len(tokens) == 2 and all(float(v) > 0 for v in tokens.values()), tokens


@pytest.mark.slow
def test_the_same_api_through_the_replicas(cluster, expected):
    with httpx.Client(base_url=cluster, timeout=60) as c:
        assert c.post("/v1/completions", json={"prompt": "def ", "max_tokens": 4}).status_code == 401
        assert c.get("/health").json()["status"] == "ok"  # open, as in one process
        r = c.post("/v1/completions", headers=AUTH, json={"prompt": "def ", "max_tokens": TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["def "]
        assert r.headers["x-specdec-replica"]
        r = c.post("/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # bundled has no chat template
        r = c.post("/v1/completions", headers=AUTH, content=b"x" * 2_000_100)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert c.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "specdec"
        assert "<html" in c.get("/", headers=AUTH).text.lower()

    async def burst() -> list[int]:  # beyond a replica's queue: its 429s come through, the rest are answered
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            payload = {"prompt": "def ", "max_tokens": 12, "temperature": 0}
            rs = await asyncio.gather(*[client.post("/v1/completions", json=payload, headers=AUTH)
                                        for _ in range(120)])
        assert all(r.status_code == 200 or r.json()["error"]["type"] == "rate_limit_error" for r in rs)
        return [r.status_code for r in rs]

    codes = asyncio.run(burst())
    assert 429 in codes and codes.count(200) >= 16, codes

    def disconnects() -> float:
        text = httpx.get(cluster + "/metrics", headers=AUTH, timeout=10).text
        return sum(float(v) for v in re.findall(r"^specdec_disconnects_total\{.*\} ([0-9.e+]+)$", text, re.M))

    before = disconnects()  # a client that hangs up mid-stream: its replica drops the request
    with httpx.Client(base_url=cluster, timeout=60) as c:
        payload = {"prompt": "def ", "max_tokens": 400, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=payload, headers=AUTH) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
    deadline = time.monotonic() + 20
    while disconnects() < before + 1:
        assert time.monotonic() < deadline, "the replica did not notice the disconnect"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_replica_that_dies_ends_only_its_streams_and_is_replaced(cluster, expected):
    pids = _wait_for_replicas(cluster, 2, timeout=30)
    killed: dict[str, Any] = {}

    async def kill_one_mid_stream(streams: list[Stream]) -> None:
        deadline = time.monotonic() + 60
        while True:  # both replicas have streams under way
            running = [s for s in streams if s.chunks and not s.done]
            if len({s.replica for s in running}) == 2:
                break
            assert time.monotonic() < deadline, "the streams did not start on both replicas"
            await asyncio.sleep(0.02)
        victim = running[0].replica
        os.kill(pids[victim], signal.SIGKILL)
        killed.update(replica=victim, at=time.monotonic())

    streams, _ = asyncio.run(_streams(cluster, PROMPTS, kill_one_mid_stream))
    victim = killed["replica"]
    cut = [s for s in streams if s.errors]
    assert cut, "no stream was cut by the kill"
    for s in streams:
        assert s.status == 200 and s.done, f"{s.prompt!r} ended without [DONE]: {s.errors}"
        if s.errors:  # only the victim's, mid-stream: what it had sent, an error event, then [DONE]
            assert s.replica == victim and len(s.errors) == 1, (s.replica, s.errors)
            assert s.errors[0]["code"] == "replica_failed" and s.errors[0]["type"] == "server_error"
            assert expected[s.prompt].startswith(s.text)
        else:  # the other replica's, and any the victim had not started (sent again): untouched
            assert s.text == expected[s.prompt], (s.prompt, s.replica)
    assert any(s.replica != victim and not s.errors for s in streams)

    t0 = time.monotonic()  # new requests: served at once by the replica left
    for p in PROMPTS[:3]:
        r = httpx.post(cluster + "/v1/completions", headers=AUTH, timeout=30,
                       json={"prompt": p, "max_tokens": TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[p]
        assert r.headers["x-specdec-replica"] != victim
    assert time.monotonic() - t0 < 15

    replaced = _wait_for_replicas(cluster, 2, timeout=90, without=victim)  # Ray started a new one
    assert victim not in replaced and len(replaced) == 2


@pytest.mark.slow
def test_stopping_ends_every_stream_with_an_error_event_then_done(cluster, expected):
    """What `specdec serve --replicas` does on SIGTERM or Ctrl-C (the last test: it stops them)."""
    from specdec.server.replicas import APP_NAME, stop_replicas

    async def stop_when_streaming(streams: list[Stream]) -> float:
        deadline = time.monotonic() + 60
        while not any(s.chunks for s in streams):
            assert time.monotonic() < deadline, "no stream started"
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await asyncio.to_thread(stop_replicas, APP_NAME, 0.0)
        return t0

    streams, t0 = asyncio.run(_streams(cluster, PROMPTS[:8], stop_when_streaming))
    ended = [s for s in streams if s.errors and s.chunks]
    assert ended
    for s in streams:  # running: what it had, then the error event and [DONE]; not yet answered: a 503
        assert (s.status == 200 and s.done) or (s.status == 503 and not s.chunks), (s.status, s.errors)
        assert all(e["code"] == "shutdown" for e in s.errors) and expected[s.prompt].startswith(s.text)
    assert max(s.ended_at for s in streams) - t0 < 15
    r = httpx.post(cluster + "/v1/completions", headers=AUTH, timeout=30, json={"prompt": "def ", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown"
