"""The OpenAI-compatible server, in process: completions, streaming, errors, disconnects."""

import json

import pytest
from fastapi.testclient import TestClient

from specdec import load
from specdec.server import create_app


@pytest.fixture(scope="module")
def client(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    return TestClient(create_app(decoder, "tiny")), decoder


def test_completion_matches_the_library(client):
    c, decoder = client
    r = c.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    want = decoder.plain().generate("def f(", max_new_tokens=12, temperature=0)
    assert body["choices"][0]["text"] == want.text
    assert body["usage"]["completion_tokens"] == 12 and body["specdec"]["rounds"] >= 1


def test_streaming_sends_rounds_then_done(client):
    c, decoder = client
    with c.stream("POST", "/v1/completions",
                  json={"prompt": "import ", "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    want = decoder.plain().generate("import ", max_new_tokens=16, temperature=0)
    assert text == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])


@pytest.mark.parametrize("payload", [{"prompt": ""}, {"prompt": "x", "temperature": -1}, {"prompt": "x", "top_p": 0},
                                     {"prompt": "x", "max_tokens": 0}])
def test_bad_requests_are_clear_errors(client, payload):
    r = client[0].post("/v1/completions", json=payload)
    assert r.status_code in (400, 422)


def test_prompt_past_the_context_is_a_400(client):
    r = client[0].post("/v1/completions", json={"prompt": "x = 1\n" * 400, "max_tokens": 4})
    assert r.status_code == 400 and "context" in r.json()["detail"]


def test_a_client_that_disconnects_loses_nothing(client):
    c, _ = client
    with c.stream("POST", "/v1/completions", json={"prompt": "def ", "max_tokens": 60, "stream": True}) as r:
        next(r.iter_lines())  # read one event, then hang up
    r = c.post("/v1/completions", json={"prompt": "def ", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    metrics = c.get("/metrics").text
    assert "specdec_requests_total" in metrics and "specdec_acceptance_rate" in metrics
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
