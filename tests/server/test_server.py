"""The OpenAI-compatible server on a real loopback socket: answers, streams, bad input,
limits, authentication. Tiny random models; the chat model is in test_server_openai.py."""

import base64
import json
import threading
import time

import httpx
import pytest
import torch

from specdec import load
from specdec.server import ServerConfig, create_app
from specdec.wiring import engine_for
from tests.server_fixtures import serve_in_thread, sse_chunks


@pytest.fixture(scope="module")
def decoder(tiny_pair):
    return load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)


@pytest.fixture(scope="module")
def server(decoder):
    config = ServerConfig(max_body_bytes=100_000, max_tokens=300, max_draft_tokens=8)
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c


def plain_text(decoder, prompt, n):
    return decoder.plain().generate(prompt, max_new_tokens=n, temperature=0).text


def test_completion_matches_the_library(server, decoder):
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": "def f(", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == plain_text(decoder, "def f(", 12)
    assert body["usage"]["completion_tokens"] == 12 and body["specdec"]["rounds"] >= 1


def test_streaming_sends_rounds_then_usage_then_done(server, decoder):
    payload = {"prompt": "import ", "max_tokens": 16, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    with server.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r.iter_lines())
    assert chunks[-1] == "[DONE]"
    usage, rounds = chunks[-2], chunks[:-2]
    want = decoder.plain().generate("import ", max_new_tokens=16, temperature=0)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want.token_ids)
    assert all(ch["usage"] is None for ch in rounds)
    assert "".join(ch["choices"][0]["text"] for ch in rounds) == want.text
    assert rounds[-1]["choices"][0]["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
    assert all(ch["choices"][0]["finish_reason"] is None for ch in rounds[:-1])
    for ch in rounds:  # the per-round extension the web view draws
        s = ch["specdec"]
        assert len(s["drafted"]) == len(s["drafted_ids"]) <= 3 and 0 <= s["accepted"] <= len(s["drafted"])
        assert s["next_kind"] in ("recovered", "bonus") and s["target_ms"] > 0
    assert sum(ch["specdec"]["committed"] for ch in rounds) == len(want.token_ids)


def test_per_request_draft_tokens_and_plain_decoding(server, decoder):
    want = plain_text(decoder, "class ", 10)
    for spec, most in [({"draft_tokens": 1}, 1), ({"draft_tokens": 6}, 6), ({"draft": "none"}, 0)]:
        payload = {"prompt": "class ", "max_tokens": 10, "temperature": 0, "stream": True, "specdec": spec}
        with server.stream("POST", "/v1/completions", json=payload) as r:
            rounds = sse_chunks(r.iter_lines())[:-1]
        assert "".join(ch["choices"][0]["text"] for ch in rounds) == want
        assert max(len(ch["specdec"]["drafted"]) for ch in rounds) <= most
    assert max(len(ch["specdec"]["drafted"]) for ch in rounds) == 0


def test_seeded_sampling_is_reproducible(server):
    payload = {"prompt": "def ", "max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    a, b = (server.post("/v1/completions", json=payload).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["specdec"]["rounds"] == b["specdec"]["rounds"]


def _error(r, status, *words, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


RAW = "application/json"
BAD = [  # (raw JSON body, status, words in the message, param)
    ('{"prompt": "x", "temperature": NaN}', 400, ["finite"], "temperature"),
    ('{"prompt": "x", "top_p": NaN}', 400, ["finite"], "top_p"),
    ('{"prompt": "x", "temperature": Infinity}', 400, ["finite"], "temperature"),
    ('{"prompt": "x", "top_p": -Infinity}', 400, ["finite"], "top_p"),
    ('{"prompt": "x\\ud800y"}', 400, ["surrogate"], "prompt"),
    ('{"prompt": "x", "stop": ["\\udfff"]}', 400, ["surrogate"], "stop"),
    ('{"prompt": "x", "seed": 18446744073709551616}', 400, ["seed"], "seed"),
    ('{"prompt": "x", "seed": 9223372036854775808}', 400, ["seed"], "seed"),
    ('{"prompt": "x", "seed": -1}', 400, ["seed"], "seed"),
    ('{"prompt": ""}', 400, ["empty"], "prompt"),
    ('{"prompt": "x", "temperature": -1}', 400, ["temperature"], "temperature"),
    ('{"prompt": "x", "top_p": 0}', 400, ["top_p"], "top_p"),
    ('{"prompt": "x", "max_tokens": 0}', 400, ["max_tokens"], "max_tokens"),
    ('{"prompt": "x", "max_tokens": 301}', 400, ["at most 300"], "max_tokens"),
    ('{"prompt": "x", "n": 2}', 400, ["n > 1", "not supported"], "n"),
    ('{"prompt": "x", "best_of": 3}', 400, ["best_of", "not supported"], "best_of"),
    ('{"prompt": "x", "logprobs": 2}', 400, ["logprobs", "not supported"], "logprobs"),
    ('{"prompt": "x", "echo": true}', 400, ["echo", "not supported"], "echo"),
    ('{"prompt": "x", "model": "gpt-4"}', 400, ["gpt-4", "tiny"], "model"),
    ('{"prompt": ["a", "b"]}', 400, ["list of prompts"], "prompt"),
    ('{"prompt": [1, 99999]}', 400, ["token ids"], "prompt"),
    ('{"prompt": "x", "specdec": {"draft_tokens": 9}}', 400, ["at most 8"], "specdec.draft_tokens"),
    ('{"prompt": "x", "specdec": {"draft": "ngram"}}', 400, ["'none'"], "specdec.draft"),
    ('{"prompt": "x", "specdec": {"policy": "no-such"}}', 400, ["choose one of auto, fixed"], "specdec.policy"),
    ('{"prompt": "x", "specdec": {"K": 3}}', 400, ["specdec.K"], "specdec.K"),
    ('{"prompt": "x", "stop": [""]}', 400, ["non-empty"], "stop"),
    ('{"prompt": "x", ', 400, ["JSON"], None),
    ('{"prompt": "' + "x = 1\\n" * 400 + '"}', 400, ["context"], "prompt"),
    ('{"prompt": "' + "x = 1\\n" * 400 + '", "stream": true}', 400, ["context"], "prompt"),
]


@pytest.mark.parametrize("body,status,words,param", BAD, ids=[b[:40] for b, *_ in BAD])
def test_bad_input_is_a_clear_4xx(server, body, status, words, param):
    r = server.post("/v1/completions", content=body.encode("utf-8", "surrogatepass"),
                    headers={"content-type": RAW})
    _error(r, status, *words, param=param)


def test_bad_chat_input(server):
    _error(server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
           400, "no chat template", param="messages")
    _error(server.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    _error(server.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400)


def test_a_keep_alive_connection_survives_bad_input(server):
    with httpx.Client(base_url=str(server.base_url), timeout=30) as c:
        for body in ['{"prompt": "x", "temperature": NaN}', '{"prompt": "x\\ud800"}']:
            _error(c.post("/v1/completions", content=body, headers={"content-type": RAW}), 400)
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_large_bodies_get_413_and_errors_never_echo_the_input(server):
    big = "y" * 200_000
    _error(server.post("/v1/completions", json={"prompt": big}), 413, "100000 bytes")
    r = server.post("/v1/completions", json={"prompt": "x", "stop": {"a": "z" * 90_000}})
    _error(r, 400, param="stop")
    assert len(r.content) < 2000
    assert server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_models(server):
    data = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"] and data[0]["specdec"]["draft_tokens"] == 3
    assert server.get("/v1/models/tiny").json()["id"] == "tiny"
    err = _error(server.get("/v1/models/gpt-4"), 404, "gpt-4")
    assert err["code"] == "model_not_found"
    _error(server.get("/no/such/path"), 404)


def test_health_and_metrics(server):
    assert server.get("/health").json()["status"] == "ok"
    text = server.get("/metrics").text
    for name in ["specdec_requests_total", "specdec_queue_depth", "specdec_batch_size", "specdec_drafted_tokens_total",
                 "specdec_accepted_tokens_total", "specdec_recovered_tokens_total", "specdec_bonus_tokens_total",
                 "specdec_acceptance_rate", "specdec_tokens_per_round_bucket",
                 "specdec_time_to_first_token_seconds_bucket", "specdec_request_latency_seconds_bucket"]:
        assert name in text, name


def test_the_web_view_is_served(server):
    r = server.get("/")
    assert r.status_code == 200 and "<html" in r.text.lower()
    assert 'src="http' not in r.text and 'href="http' not in r.text and "@import" not in r.text  # no CDN


@pytest.fixture
def slow_decoder(tiny_pair):
    """A decoder whose rounds take 20 ms and that never meets EOS: requests of known length."""
    slow = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=1)
    slow.eos_token_ids = set()
    engine = engine_for(slow, 1)  # the one loop's engine (cached on the decoder: the server gets this one)
    step = engine.step

    def slow_step(requests):
        time.sleep(0.02)
        return step(requests)

    engine.step = slow_step
    return slow


def test_a_full_queue_gets_429_and_a_deadline_ends_a_request(slow_decoder):
    config = ServerConfig(max_batch=1, max_queue=1, timeout_s=1.5)
    with serve_in_thread(create_app(slow_decoder, "tiny", config)) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        long = {"prompt": "a", "max_tokens": 200, "temperature": 0}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(c.post("/v1/completions", json=long)))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        assert c.get("/health").json() == {"status": "ok", "queued": 1, "running": 1}
        err = _error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 429, "queue is full")
        assert err["type"] == "rate_limit_error"
        for t in threads:
            t.join(30)
        first = min(results, key=lambda r: r.status_code)
        assert first.status_code == 200 and first.json()["specdec"]["deadline_exceeded"]
        assert 0 < first.json()["usage"]["completion_tokens"] < 200
        assert sorted(r.status_code for r in results) in ([200, 200], [200, 503])
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_deadline_before_the_first_token_is_a_503_not_a_500(slow_decoder):
    # a row still waiting for its prompt's prefill (a token a step here) when its deadline passes:
    # as a request timed out in the queue, a 503 (64 concurrent 1,000-token prompts on a default
    # server got 500s "server_error" so)
    config = ServerConfig(max_batch=1, timeout_s=0.5, prefill_chunk=1)
    with serve_in_thread(create_app(slow_decoder, "tiny", config)) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": list(range(3, 83)), "max_tokens": 4, "stream": stream})
            err = _error(r, 503, "timed out before its first token")
            assert err["code"] == "deadline"
        metrics = c.get("/metrics").text
        assert 'specdec_requests_total{endpoint="completions",outcome="deadline"} 2.0' in metrics
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key(decoder):
    key = "s3cret-key"
    config = ServerConfig(api_key=key)
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        for path in ["/v1/models", "/metrics", "/docs", "/openapi.json", "/"]:
            err = _error(c.get(path), 401, "API key")
            assert err["type"] == "authentication_error"
            _error(c.get(path, headers={"Authorization": "Bearer wrong"}), 401, "not valid")
            assert c.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert "basic" in c.get("/").headers["www-authenticate"].lower()
        basic = base64.b64encode(f"me:{key}".encode()).decode()
        assert c.get("/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        _error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 401)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200


def test_interleaved_requests_are_each_identical_to_plain_decoding(server, decoder):
    prompts = ["def ", "import os\n", "class A:", "for i in", "x = [", "return "]
    want = {p: plain_text(decoder, p, 24) for p in prompts}
    got: dict[str, str] = {}

    def ask(p):
        payload = {"prompt": p, "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.Client(base_url=str(server.base_url), timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=payload) as r:
            got[p] = "".join(ch["choices"][0]["text"] for ch in sse_chunks(r.iter_lines())[:-1])

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_json_error_bodies_are_json(server):
    r = server.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": RAW})
    assert r.status_code == 400 and json.loads(r.text)["error"]["message"]


def _step_sizes(client):
    """(steps, rows in all) from the specdec_step_batch_size histogram."""
    text = client.get("/metrics").text
    count = sum_ = 0.0
    for line in text.splitlines():
        if line.startswith("specdec_step_batch_size_count "):
            count = float(line.split()[1])
        elif line.startswith("specdec_step_batch_size_sum "):
            sum_ = float(line.split()[1])
    return count, sum_


def test_concurrent_requests_run_in_batched_steps_identical_to_plain_decoding(server, decoder):
    assert server.get("/v1/models/tiny").json()["specdec"]["batching"] == "batched"
    cases = [(p, n, spec) for p, n, spec in [("def ", 30, {}), ("import os\n", 17, {"draft_tokens": 1}),
                                             ("class A:", 25, {"draft": "none"}), ("for i in", 9, {}),
                                             ("x = [", 28, {"draft_tokens": 6}), ("return ", 22, {}),
                                             ("if __name__", 14, {"draft_tokens": 2}), ("print(", 30, {})]]
    want = {p: plain_text(decoder, p, n) for p, n, _ in cases}
    got: dict[str, str] = {}
    steps0, rows0 = _step_sizes(server)
    start = threading.Barrier(len(cases))

    def ask(p, n, spec):
        payload = {"prompt": p, "max_tokens": n, "temperature": 0, "stream": True, "specdec": spec}
        with httpx.Client(base_url=str(server.base_url), timeout=60) as c:
            start.wait(10)
            with c.stream("POST", "/v1/completions", json=payload) as r:
                got[p] = "".join(ch["choices"][0]["text"] for ch in sse_chunks(r.iter_lines())[:-1])

    threads = [threading.Thread(target=ask, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert got == want
    steps, rows = _step_sizes(server)
    print(f"{steps - steps0:.0f} steps, {(rows - rows0) / (steps - steps0):.2f} rows per step")
    assert steps > steps0 and (rows - rows0) / (steps - steps0) > 1.5, "the requests were not batched"
    engine = engine_for(decoder, 8)
    assert engine is not None and sorted(engine.slots.free) == list(range(8)), "a cache slot was not freed"


def test_stop_strings_on_the_batched_path_match_the_library(server, decoder):
    plain = decoder.plain()
    full = plain.generate("def ", max_new_tokens=40, temperature=0).text
    stop = full[12:15]
    want = plain.generate("def ", max_new_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert want.finish_reason == "stop" and stop not in want.text
    payload = {"prompt": "def ", "max_tokens": 40, "temperature": 0, "stop": [stop, "\x00never"]}
    body = server.post("/v1/completions", json=payload).json()
    assert body["choices"][0]["text"] == want.text and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    with server.stream("POST", "/v1/completions", json={**payload, "stream": True}) as r:
        rounds = sse_chunks(r.iter_lines())[:-1]
    assert "".join(ch["choices"][0]["text"] for ch in rounds) == want.text
    assert rounds[-1]["choices"][0]["finish_reason"] == "stop"
    assert sum(ch["specdec"]["committed"] for ch in rounds) == len(want.token_ids)
    engine = engine_for(decoder, 8)
    assert engine is not None and sorted(engine.slots.free) == list(range(8))


@pytest.mark.parametrize("spec,multi", [("ngram+{close}", "tree"), ("{close}:int8", "auto")])
def test_token_trees_and_int8_copies_are_rows_of_batched_steps(tiny_pair, spec, multi):
    """Every prophet kind runs batched in the server (once served round-robin): concurrent
    requests share steps, each answer plain decoding's."""
    _served_together(load(tiny_pair["target"], draft=spec.format(**tiny_pair), multi=multi, draft_tokens=3))


def _served_together(dec) -> None:
    """Four concurrent greedy requests to a server of dec: each answer plain decoding's, and some
    steps scored several requests' rows."""
    import concurrent.futures

    prompts = ["def f(", "import os\n", "class A:", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["]
    want = [plain_text(dec, p, 16) for p in prompts]
    with serve_in_thread(create_app(dec, "tiny", ServerConfig(max_batch=4, warm_up=False))) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/v1/models/tiny").json()["specdec"]["batching"] == "batched"

        def one(p):
            return c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0}).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, prompts))
        assert [g["choices"][0]["text"] for g in got] == want
        steps, rows = _step_sizes(c)
        assert rows > steps


def test_grown_trees_are_rows_of_batched_steps(tiny_pair, tiny_eagle, monkeypatch):
    """--branches: an eagle's grown trees (every node pays here, up to 6) beside prompt lookup's
    chains in the server's batched steps; each concurrent answer is plain decoding's."""
    from specdec.batch import BatchEngine
    from specdec.branching import TreeBudget

    monkeypatch.setattr(TreeBudget, "pays", lambda self, s, new_step=False, nodes=1.0: self.nodes < 6)
    wide = []  # trees of several nodes the server's steps scored
    tree_step = BatchEngine._tree_step

    def counted(self, active, draft, d0, d1):
        wide.extend(len(t.tokens) for t in draft.trees if len(t.tokens) > 1)
        return tree_step(self, active, draft, d0, d1)

    monkeypatch.setattr(BatchEngine, "_tree_step", counted)
    _served_together(load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", branches=3, policy="fixed",
                          draft_tokens=3, draft_dtype=torch.float32))
    assert wide


def test_the_batched_step_costs_are_measured_before_serving(tiny_pair):
    """With the auto policy, every batch-size bucket's costs are measured at startup, so no
    request waits for a measurement, and requests reuse them."""
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto", draft_tokens=3)
    with serve_in_thread(create_app(dec, "tiny", ServerConfig(max_batch=6))) as url:
        engine = engine_for(dec, 6)
        assert engine is not None and sorted(engine.kchoice.by_bucket) == [1, 2, 4, 6]
        measured = dict(engine.kchoice.by_bucket)
        assert all(max(c.t_verify) == 4 for c in measured.values())  # n = 1..K+1 tokens per row
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "def ", "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == plain_text(dec, "def ", 12)
        assert engine.kchoice.by_bucket == measured and sorted(engine.slots.free) == list(range(6))


def test_the_default_kind_of_prophets_serve_in_batched_steps(tiny_pair, tiny_eagle):
    """Lookup first, a feature prophet elsewhere (smollm2's default shape) runs batched:
    concurrent greedy streams equal plain decoding, and each round says whose draft it was.
    Policy fixed: with auto, whether lookup drafts at all depends on the step costs measured
    at startup (a noisy machine once paused it for the whole run)."""
    dec = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", policy="fixed", draft_tokens=3)
    prompts = ["def ", "import os\nimport os\nimport", "class A:", "x = [1, 2, 1, 2, 1,"]
    want = {p: plain_text(dec, p, 20) for p in prompts}
    got: dict[str, str] = {}
    prophets: set = set()
    with serve_in_thread(create_app(dec, "tiny", ServerConfig(max_batch=4))) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/v1/models/tiny").json()["specdec"]["batching"] == "batched"
        start = threading.Barrier(len(prompts))

        def ask(p):
            with httpx.Client(base_url=url, timeout=60) as c:
                start.wait(10)
                payload = {"prompt": p, "max_tokens": 20, "temperature": 0, "stream": True}
                with c.stream("POST", "/v1/completions", json=payload) as r:
                    chunks = sse_chunks(r.iter_lines())[:-1]
            got[p] = "".join(ch["choices"][0]["text"] for ch in chunks)
            prophets.update(ch["specdec"]["prophet"] for ch in chunks if ch.get("specdec"))

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with httpx.Client(base_url=url, timeout=30) as c:
            body = {"prompt": prompts[1], "max_tokens": 20, "temperature": 0, "stream": True,
                    "specdec": {"draft": "tiny-eagle"}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                chunks = sse_chunks(r.iter_lines())[:-1]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == want[prompts[1]]
            assert {ch["specdec"]["prophet"] for ch in chunks} <= {"tiny-eagle", None}
            bad = c.post("/v1/completions", json={"prompt": "x", "specdec": {"draft": "medusa"}})
            assert bad.status_code == 400 and "ngram, tiny-eagle joined by '+'" in bad.json()["error"]["message"]
    assert got == want
    assert {"ngram", "tiny-eagle", None} <= prophets


def test_a_request_may_ask_for_another_policy(tiny_pair):
    """specdec.policy per request: greedy answers stay plain decoding's, and
    the policy really differs (fixed K=3 drafts 3 every round; the decoder's auto may not)."""
    dec = load(tiny_pair["target"], draft=tiny_pair["far"], policy="auto", draft_tokens=3)
    want = plain_text(dec, "def ", 24)
    with serve_in_thread(create_app(dec, "tiny", ServerConfig(max_batch=2))) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        for pol in ("fixed", "adaptive", "confidence", "optimal", "auto"):
            body = {"prompt": "def ", "max_tokens": 24, "temperature": 0, "stream": True,
                    "specdec": {"policy": pol, "draft_tokens": 3}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                chunks = sse_chunks(r.iter_lines())[:-1]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == want, pol
            if pol == "fixed":
                ks = [len(ch["specdec"]["drafted_ids"]) for ch in chunks if ch.get("specdec")]
                assert len(ks) > 4 and set(ks[1:-3]) == {3}, ks  # every round but the last few drafts K


def test_startup_frees_the_openmp_pools_of_the_threads_that_ran_the_model_before_the_scheduler(decoder, monkeypatch):
    """The warm-up's thread (after measuring the step costs) and the lifespan's own thread free
    their OpenMP workers before the scheduler's thread runs the model (specdec.openmp: with more
    pools than CPUs a step's workers sleep and wake at every parallel region); the server then
    answers as before."""
    from specdec.openmp import release_pool
    from specdec.server import app as app_module

    calls: list[int] = []

    def recorded() -> bool:
        calls.append(threading.get_ident())
        return release_pool()

    monkeypatch.setattr(app_module, "release_pool", recorded)
    app = create_app(decoder, "tiny", ServerConfig())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert len(calls) == 2 and calls[0] != calls[1]  # the warm-up's thread, then the lifespan's
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "def f(", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain_text(decoder, "def f(", 6)
    assert len(calls) == 2  # serving and shutting down free nothing more
