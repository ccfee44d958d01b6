"""Structured output and tool calls through the official `openai` client against a live
server on SmolLM2-135M-Instruct with its default prophets (speculative): response_format
json_schema (strict) and json_object, tools with tool_choice auto / required / none / named,
streaming and not, and the errors a client gets for bad ones."""

import json

import jsonschema
import openai
import pytest

from specdec import load
from specdec.server import ServerConfig, create_app
from tests.server_fixtures import serve_in_thread

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Give me a JSON record for Alice, 30, who lives in Paris."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]


@pytest.fixture(scope="module")
def server():
    decoder = load("smollm2")
    with serve_in_thread(create_app(decoder, "smollm2", ServerConfig(warm_up=False))) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client, decoder


def test_json_schema_strict_plain_and_streaming(server):
    client, decoder = server
    want = decoder.plain().generate(messages=ASK, max_new_tokens=60, temperature=0, response_format=FORMAT)
    out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                         response_format=FORMAT)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert text == want.text and out.choices[0].finish_reason == "stop"  # greedy: plain decoding's tokens
    stream = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                            response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    completion = client.completions.create(model="smollm2", prompt="A person as JSON: ", max_tokens=60,
                                           temperature=0, extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_json_object(server):
    """Greedy: one JSON object, ended by the model. Sampled (which sample a seed gives depends on this machine's
    step costs, through the K each round drafts): every answer the model ended is a JSON object, and one cut by
    max_tokens is the start of one."""
    client, _ = server
    out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict) and out.choices[0].finish_reason == "stop"
    for seed in range(4):
        out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0.7,
                                             seed=seed, response_format={"type": "json_object"})
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert finish in ("stop", "length") and text.startswith("{")
        if finish == "stop":  # (3 of seeds 0-5 did, here)
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_plain_and_streaming(server, choice):
    client, _ = server
    out = client.chat.completions.create(model="smollm2", messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                         tool_choice=choice, max_tokens=80, temperature=0)
    message, finish = out.choices[0].message, out.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    chunks = list(client.chat.completions.create(model="smollm2", messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                                 tool_choice=choice, max_tokens=80, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(call.function.name, json.loads(call.function.arguments))]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the call and its result go back to the model as the conversation goes on
    history = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    reply = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=20, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_tool_choice_auto_answers_text_or_a_valid_call(server):
    client, _ = server
    for messages in (WEATHER_ASK, [{"role": "user", "content": "Say hello."}]):
        out = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60,
                                             temperature=0)
        message = out.choices[0].message
        if message.tool_calls:
            assert out.choices[0].finish_reason == "tool_calls" and message.content is None
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
        else:
            assert message.content and not message.content.startswith("<")
        streamed = list(client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                                       max_tokens=60, temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        calls = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert (text, len(calls)) == ((message.content or ""), len(message.tool_calls or []))


def test_bad_formats_and_tools_are_400s_naming_the_parameter(server):
    client, _ = server
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=5,
                                  extra_body={"tools": [WEATHER], "tool_choice": "required"})
    assert e.value.body["param"] == "tools"
