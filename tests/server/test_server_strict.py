"""Strict request validation on both endpoints: a boolean or a string is never a number,
every integer is bounded, and OpenAI parameters the server does not implement get a 400
in OpenAI's shape naming them unless sent at their neutral value. Never a 500.
Tiny random models (the tiny tokenizer gets a chat template here, so chat requests run)."""

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import load
from specdec.server import ServerConfig, create_app
from tests.server_fixtures import serve_in_thread

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    decoder.tokenizer.chat_template = TEMPLATE
    config = ServerConfig(max_body_bytes=100_000, max_tokens=64, max_draft_tokens=8, warm_up=False)
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c


ENDPOINTS = {"completions": ("/v1/completions", {"prompt": "def f(", "max_tokens": 2}),
             "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})}


def post(client, endpoint, extra):
    """The endpoint's small valid body with `extra` on top (json.dumps writes NaN and Infinity
    as JavaScript does, which the server's JSON parser reads as floats)."""
    path, base = ENDPOINTS[endpoint]
    return client.post(path, content=json.dumps({**base, **extra}), headers={"content-type": "application/json"})


def bad_request(r, param):
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    assert param.split(".")[-1] in err["message"] or param in err["message"], err
    return err


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
# (extra body, param, the endpoints it applies to); the lenient cases of issue 20
LENIENT = [
    ({"max_tokens": True}, "max_tokens", "both"),
    ({"max_tokens": 1.0}, "max_tokens", "both"),
    ({"max_tokens": "8"}, "max_tokens", "both"),
    ({"max_tokens": 2**64}, "max_tokens", "both"),
    ({"max_completion_tokens": True}, "max_completion_tokens", "chat"),
    ({"stream": "yes"}, "stream", "both"),
    ({"stream": 1}, "stream", "both"),
    ({"specdec": {"draft_tokens": "4"}}, "specdec.draft_tokens", "both"),
    ({"specdec": {"draft_tokens": True}}, "specdec.draft_tokens", "both"),
    ({"specdec": {"draft_tokens": 2**64}}, "specdec.draft_tokens", "both"),
    ({"specdec": {"rounds": "no"}}, "specdec.rounds", "both"),
    ({"top_k": 2**64}, "top_k", "both"),
    ({"top_k": 1_000_001}, "top_k", "both"),
    ({"top_k": True}, "top_k", "both"),
    ({"seed": True}, "seed", "both"),
    ({"seed": "7"}, "seed", "both"),
    ({"temperature": True}, "temperature", "both"),
    ({"temperature": "1"}, "temperature", "both"),
    ({"top_p": False}, "top_p", "both"),
    ({"sampling": "gumbel"}, "sampling", "both"),
    ({"sampling": "Coupled"}, "sampling", "both"),
    ({"sampling": 1}, "sampling", "both"),
    ({"sampling": True}, "sampling", "both"),
    ({"sampling": ["coupled"]}, "sampling", "both"),
    ({"n": True}, "n", "both"),
    ({"n": 2}, "n", "both"),
    ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage", "both"),
    ({"presence_penalty": True}, "presence_penalty", "both"),
    ({"presence_penalty": 0.5}, "presence_penalty", "both"),
    ({"frequency_penalty": "0"}, "frequency_penalty", "both"),
    ({"logit_bias": {"5": 1}}, "logit_bias", "both"),
    ({"logit_bias": {"5": True}}, "logit_bias.5", "both"),
    ({"best_of": 2}, "best_of", "completions"),
    ({"echo": True}, "echo", "both"),
    ({"echo": 1}, "echo", "both"),
    ({"suffix": "x"}, "suffix", "completions"),
    ({"logprobs": True}, "logprobs", "both"),
    ({"logprobs": 2}, "logprobs", "both"),
    ({"top_logprobs": 3}, "top_logprobs", "both"),
    ({"tools": TOOLS}, "tools", "completions"),  # chat takes tools (test_server_structured.py)
    ({"tools": "none"}, "tools", "both"),
    ({"tool_choice": "required"}, "tool_choice", "both"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "both"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "both"),
    ({"function_call": {"name": "f"}}, "function_call", "both"),
    ({"response_format": {"type": "yaml"}}, "response_format", "both"),
    ({"response_format": "json"}, "response_format", "both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format", "both"),
    ({"modalities": ["text", "audio"]}, "modalities", "both"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "both"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "both"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "both"),
    ({"web_search_options": {}}, "web_search_options", "both"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                   {"role": "user", "content": "hi"}]}, "messages.0.tool_calls", "chat"),
]
LENIENT_CASES = [(e, extra, param) for extra, param, where in LENIENT for e in ENDPOINTS if where in ("both", e)]


@pytest.mark.parametrize("endpoint,extra,param", LENIENT_CASES,
                         ids=[f"{e}-{json.dumps(x)[:50]}" for e, x, _ in LENIENT_CASES])
def test_lenient_values_are_a_400_naming_the_param(server, endpoint, extra, param):
    err = bad_request(post(server, endpoint, extra), param)
    if err["code"] == "unsupported_parameter":
        assert "not supported" in err["message"] or "at most" in err["message"], err
    assert len(err["message"]) < 400  # never the input echoed back


# Unsupported parameters at their neutral values, and numbers written as integers where
# a float is meant: accepted.
NEUTRAL = [
    {"tools": []}, {"tools": None}, {"tool_choice": "none"}, {"tool_choice": None}, {"tool_choice": "auto"},
    {"parallel_tool_calls": True}, {"functions": []}, {"function_call": "none"},
    {"response_format": {"type": "text"}}, {"response_format": None}, {"modalities": ["text"]},
    {"response_format": {"type": "json_object"}},
    {"audio": None}, {"prediction": None}, {"reasoning_effort": None}, {"n": 1}, {"n": None},
    {"logprobs": None}, {"top_logprobs": 0}, {"top_logprobs": None}, {"echo": False},
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"logit_bias": {}}, {"logit_bias": None},
    {"temperature": 1}, {"temperature": 0}, {"top_p": 1}, {"top_k": 0}, {"top_k": 1_000_000}, {"seed": 2**63 - 1},
    {"stream": False}, {"stream_options": {"include_usage": False}}, {"user": "u-1"}, {"metadata": {"k": "v"}},
    {"specdec": {"draft_tokens": 2, "rounds": False}}, {"max_tokens": None},
    {"sampling": "rejection"}, {"sampling": "coupled"}, {"sampling": "coupled", "seed": 3}, {"sampling": None},
]
NEUTRAL_CASES = ([(e, x) for e in ENDPOINTS for x in NEUTRAL]
                 + [("chat", {"logprobs": False}), ("completions", {"logprobs": 0}),
                    ("completions", {"best_of": 1}), ("completions", {"suffix": ""}), ("completions", {"suffix": None}),
                    ("chat", {"max_completion_tokens": 2}),
                    ("chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": []},
                                           {"role": "user", "content": "hi"}]})])


@pytest.mark.parametrize("endpoint,extra", NEUTRAL_CASES, ids=[f"{e}-{json.dumps(x)[:50]}" for e, x in NEUTRAL_CASES])
def test_neutral_values_are_accepted(server, endpoint, extra):
    r = post(server, endpoint, extra)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_all_neutral_values_at_once_streaming(server):
    for endpoint in ENDPOINTS:
        extra = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "n": 1,
                 "logprobs": None, "temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0,
                 "logit_bias": {}, "stream": True, "stream_options": {"include_usage": True}}
        r = post(server, endpoint, extra)
        assert r.status_code == 200, r.text
        assert r.text.rstrip().endswith("data: [DONE]")


# Every numeric and boolean field, with values of the wrong type or out of any range.
INT_BAD = [True, False, "1", "x", 1.5, 1.0, [], {}, [1], 2**64, -(2**64), -1]
FLOAT_BAD = [True, False, "1", "0.5", "NaN", [], {}, [0.5], float("nan"), float("inf"), float("-inf"), 1e300, -1e300]
BOOL_BAD = [1, 0, 1.0, "true", "false", "yes", "", [], {}, [True]]
FIELDS = {  # field path: (kind, endpoints)
    "max_tokens": ("int", "both"), "max_completion_tokens": ("int", "chat"), "top_k": ("int", "both"),
    "seed": ("int", "both"), "n": ("int", "both"), "best_of": ("int", "completions"),
    "logprobs": ("int", "completions"), "top_logprobs": ("int", "chat"),
    "specdec.draft_tokens": ("int", "both"),
    "temperature": ("float", "both"), "top_p": ("float", "both"), "presence_penalty": ("float", "both"),
    "frequency_penalty": ("float", "both"), "logit_bias.7": ("float", "both"),
    "stream": ("bool", "both"), "echo": ("bool", "completions"), "logprobs ": ("bool", "chat"),
    "stream_options.include_usage": ("bool", "both"), "specdec.rounds": ("bool", "both"),
}
SWEEP = [(e, path.strip(), kind) for path, (kind, where) in FIELDS.items() for e in ENDPOINTS if where in ("both", e)]


def nested(path, value):
    head, _, rest = path.partition(".")
    return {head: nested(rest, value) if rest else value}


@pytest.mark.parametrize("endpoint,path,kind", SWEEP, ids=[f"{e}-{p}" for e, p, _ in SWEEP])
def test_wrong_values_of_every_numeric_and_boolean_field_are_400s(server, endpoint, path, kind):
    for value in {"int": INT_BAD, "float": FLOAT_BAD, "bool": BOOL_BAD}[kind]:
        r = post(server, endpoint, nested(path, value))
        assert r.status_code == 400, (path, value, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] in (path, path.split(".")[0]), (path, value, err)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)
ALL_FIELDS = sorted({p.strip() for p in FIELDS} | {"tools", "tool_choice", "functions", "function_call",
                                                     "response_format", "modalities", "audio", "prediction",
                                                     "stop", "user", "model", "suffix", "specdec.draft", "sampling",
                                                     "specdec.policy", "stream_options", "specdec", "messages",
                                                     "prompt", "logit_bias"})


@settings(max_examples=120, deadline=None)
@given(endpoint=st.sampled_from(sorted(ENDPOINTS)), path=st.sampled_from(ALL_FIELDS), value=JSON)
def test_any_value_of_any_field_is_never_a_500(server, endpoint, path, value):
    r = post(server, endpoint, nested(path, value))
    assert r.status_code in (200, 400), (path, value, r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
