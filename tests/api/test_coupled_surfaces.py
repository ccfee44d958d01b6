"""Coupled sampling through the command line and the server: `specdec generate --sampling
coupled` and the request field `"sampling": "coupled"` on both endpoints, through
the scheduler's batched rows. A seeded coupled speculative answer is seeded
plain coupled sampling's, token for token, whatever K or the requests beside it; bad values
are one line and exit 2 (CLI) or a 400 in OpenAI's shape (server). Tiny random models."""

import json
import threading

import httpx
import pytest

from specdec import load
from specdec.cli import main
from specdec.server import ServerConfig, create_app
from tests.server_fixtures import serve_in_thread, sse_chunks

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SEEDS = (1, 2, 3)


# ----------------------------------------------------------------- the command line
def cli(tiny_pair, capsys, *args):
    argv = ["generate", "--target", tiny_pair["target"], "--policy", "fixed", "-k", "3", *args]
    assert main(argv) == 0
    return capsys.readouterr()


@pytest.mark.parametrize("seed", SEEDS)
def test_cli_coupled_speculation_is_plain_coupled_sampling(tiny_pair, capsys, seed):
    """--json, with --compare's plain run and a separate --draft none run: the same tokens."""
    common = ["def f(", "--max-new-tokens", "16", "--temperature", "1", "--seed", str(seed), "--json"]
    spec = json.loads(cli(tiny_pair, capsys, *common, "--draft", tiny_pair["close"], "--sampling", "coupled",
                          "--compare").out)
    plain = json.loads(cli(tiny_pair, capsys, *common, "--draft", "none", "--sampling", "coupled").out)
    assert spec["stats"]["drafted"] > 0  # speculation really ran
    assert spec["token_ids"] == spec["plain"]["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"] and len(plain["token_ids"]) == 16


def test_cli_text_output_and_compare_say_identical(tiny_pair, capsys):
    common = ["import ", "--max-new-tokens", "12", "--temperature", "1", "--seed", "4", "--sampling", "coupled"]
    spec = cli(tiny_pair, capsys, *common, "--draft", tiny_pair["close"], "--compare")
    plain = cli(tiny_pair, capsys, *common, "--draft", "none")
    assert spec.out == plain.out and spec.out.startswith("import ")
    assert "(identical tokens)" in spec.err


def test_cli_prompts_file_runs_coupled_rows(tiny_pair, capsys, tmp_path):
    """--prompts-file (one batch): each coupled row is that prompt's seeded plain coupled
    answer; a JSON line may choose its own seed and sampling."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('def f(\nclass A:\n{"prompt": "import ", "seed": 9}\n'
                       '{"prompt": "x = [", "sampling": "coupled", "seed": 5}\n', encoding="utf-8")
    common = ["--prompts-file", str(prompts), "--max-new-tokens", "12", "--temperature", "1", "--seed", "7",
              "--sampling", "coupled", "--json"]
    spec = json.loads(cli(tiny_pair, capsys, *common, "--draft", tiny_pair["close"]).out)
    plain = load(tiny_pair["target"], draft="none")
    for out, (prompt, seed) in zip(spec, [("def f(", 7), ("class A:", 7), ("import ", 9), ("x = [", 5)], strict=True):
        want = plain.generate(prompt, max_new_tokens=12, temperature=1.0, seed=seed, sampling="coupled")
        assert out["token_ids"] == want.token_ids, prompt
    assert sum(o["stats"]["drafted"] for o in spec) > 0


@pytest.mark.parametrize("value", ["gumbel", "Coupled", ""])
def test_cli_bad_sampling_is_one_line_and_exit_2(tiny_pair, capsys, value):
    # checked before anything loads: the missing target is never reached
    assert main(["generate", "x", "--target", "/no/such/model", "--sampling", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: --sampling must be one of rejection, coupled")


# ----------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def decoder(tiny_pair):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", draft_tokens=3)
    dec.tokenizer.chat_template = TEMPLATE  # this decoder's own tokenizer: chat requests run too
    return dec


@pytest.fixture(scope="module")
def server(decoder):
    config = ServerConfig(max_batch=4, max_tokens=64, max_draft_tokens=8, warm_up=False)
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c, url


def want_text(decoder, prompt, seed, n=16):
    return decoder.plain().generate(prompt, max_new_tokens=n, temperature=1.0, seed=seed, sampling="coupled")


def test_server_coupled_completions_are_plain_coupled_sampling(server, decoder):
    """Whatever K the request asks (or plain decoding on the server), the same answer."""
    c, _ = server
    drafted = 0
    for seed in SEEDS:
        want = want_text(decoder, "def f(", seed)
        for opts in ({"draft_tokens": 1}, {"draft_tokens": 4}, {"draft": "none"}):
            r = c.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 16, "temperature": 1, "seed": seed,
                                                "sampling": "coupled", "specdec": opts})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == want.text, (seed, opts)
            assert body["usage"]["completion_tokens"] == len(want.token_ids)
            drafted += body["specdec"]["drafted"]
    assert drafted > 0


def test_server_coupled_chat_streams_plain_coupled_sampling(server, decoder):
    c, _ = server
    messages = [{"role": "user", "content": "hi"}]
    ids = decoder.chat_ids(messages)
    for seed in SEEDS:
        want = want_text(decoder, ids, seed)
        body = {"messages": messages, "max_tokens": 16, "temperature": 1, "seed": seed, "sampling": "coupled",
                "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = sse_chunks(r.iter_lines())
        assert chunks[-1] == "[DONE]"
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-1] if ch["choices"])
        assert text == want.text, seed
        assert sum(ch["specdec"]["committed"] for ch in chunks[:-1] if ch.get("specdec")) == len(want.token_ids)


def test_server_concurrent_coupled_requests_are_each_their_plain_answer(server, decoder):
    """Four requests at once (rows of one batch on the batched path, interleaved rounds on
    the other), two coupled and two rejection-sampled: the coupled ones are unchanged."""
    _, url = server
    prompts = ["def main():", "import os\n", "class A:", "x = ["]
    got: dict[int, str] = {}
    start = threading.Barrier(len(prompts))

    def ask(i):
        with httpx.Client(base_url=url, timeout=60) as c:
            start.wait(10)
            r = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 16, "temperature": 1,
                                                "seed": 20 + i, "sampling": "coupled" if i % 2 == 0 else "rejection"})
            got[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [0, 1, 2, 3]
    for i in (0, 2):
        assert got[i] == want_text(decoder, prompts[i], 20 + i).text, prompts[i]


@pytest.mark.parametrize("value", ["gumbel", "Coupled", "", 1, 0, True, 1.5, ["coupled"], {"mode": "coupled"}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_bad_sampling_is_an_openai_400(server, path, value):
    c, _ = server
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = c.post(path, json={**base, "max_tokens": 2, "sampling": value})
    assert r.status_code == 400, (value, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == "sampling" and "sampling" in err["message"]


@pytest.mark.parametrize("value", ["rejection", "coupled", None])
def test_server_accepts_each_mode_and_null(server, value):
    c, _ = server
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "sampling": value})
    assert r.status_code == 200, r.text
