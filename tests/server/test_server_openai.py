"""The official `openai` client against the server: completions and chat, streaming and
not, errors. Chat uses the real chat model (SmolLM2-135M-Instruct) with short answers."""

import openai
import pytest

from specdec import load
from specdec.server import ServerConfig, create_app
from tests.server_fixtures import serve_in_thread


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    with serve_in_thread(create_app(decoder, "tiny")) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client, decoder


@pytest.fixture(scope="module")
def chat():
    decoder = load("smollm2", draft="none")
    config = ServerConfig(api_key="k-123")
    with serve_in_thread(create_app(decoder, "smollm2", config)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="k-123", max_retries=0, timeout=60) as client:
        yield client, decoder, url


def test_completions_plain_and_streaming(tiny):
    client, decoder = tiny
    want = decoder.plain().generate("def f(", max_new_tokens=10, temperature=0)
    out = client.completions.create(model="tiny", prompt="def f(", max_tokens=10, temperature=0)
    assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(model="tiny", prompt="def f(", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"


def test_errors_reach_the_client_as_openai_errors(tiny):
    client, _ = tiny
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", n=2)
    assert "n > 1" in e.value.message and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="model_not_found|not served"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_chat_plain_and_streaming(chat):
    client, decoder, _ = chat
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = decoder.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = decoder.generate(list(ids), max_new_tokens=8, temperature=0)
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text and "Paris" in want.text
    assert out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_completion_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_needs_the_key(chat):
    _, _, url = chat
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
