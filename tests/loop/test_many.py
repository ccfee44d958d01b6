"""generate_many and `specdec generate --prompts-file`: many prompts as one batch, each
result equal to generating it alone."""

import json

import pytest

from specdec import load
from specdec.cli import main


@pytest.mark.parametrize("draft", ["close", "ngram", "none", "eagle", "ngram+eagle", "layerskip:1", "ngram+close"])
def test_generate_many_equals_one_at_a_time_greedy(tiny_pair, tiny_eagle, draft):
    """Batched for every prophet kind: a model, lookup, a feature prophet, lookup and a
    feature prophet (first), early exit, and a token tree per row (ngram+close)."""
    from specdec.wiring import engine_for

    spec = "+".join(tiny_eagle if p == "eagle" else tiny_pair.get(p, p) for p in draft.split("+"))
    decoder = load(tiny_pair["target"], draft=spec, draft_tokens=3)
    assert engine_for(decoder, 2) is not None
    prompts = ["def f(", {"prompt": "import os\n", "max_new_tokens": 7, "draft_tokens": 1},
               [5, 6, 7, 8, 9, 10, 11], {"prompt": "class A:", "max_new_tokens": 30, "draft_tokens": 5}]
    outs = decoder.generate_many(prompts, max_batch=2, max_new_tokens=20, temperature=0.0)
    plain = decoder.plain()
    for p, out in zip(prompts, outs, strict=True):
        job = p if isinstance(p, dict) else {"prompt": p}
        want = plain.generate(job["prompt"], max_new_tokens=job.get("max_new_tokens", 20), temperature=0.0)
        assert out.token_ids == want.token_ids and out.text == want.text and out.finish_reason == want.finish_reason


def test_generate_many_with_stop_strings_runs_batched_and_stops_as_generate_does(tiny_pair, monkeypatch):
    """Stop strings are finished in one place (specdec.finish) for every path: the batched
    rows stop where `generate` stops, with the same tokens, text, finish reason and stats."""
    from specdec.decoder import SpeculativeDecoder

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"])
    prompts = ["def f(", "import ", "class A:", {"prompt": "x = [", "stop": ["]", ","]}]
    want = [decoder.generate(**({"prompt": p} if isinstance(p, str) else p), max_new_tokens=24, temperature=0.0,
                             **({} if isinstance(p, dict) else {"stop": ["\n", "):"]})) for p in prompts]
    assert sum(w.finish_reason == "stop" for w in want) >= 2  # the case this test is about
    called = []
    monkeypatch.setattr(SpeculativeDecoder, "generate", lambda *a, **k: called.append(1))  # no fallback
    outs = decoder.generate_many(prompts, max_new_tokens=24, temperature=0.0, stop=["\n", "):"])
    assert not called
    for out, w in zip(outs, want, strict=True):
        assert (out.token_ids, out.text, out.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert out.stats.new_tokens == len(out.token_ids) == sum(len(e.committed) for e in out.events)


def test_generate_many_rejects_unknown_settings(tiny_pair):
    decoder = load(tiny_pair["target"], draft="none")
    with pytest.raises(ValueError, match="unknown generation setting"):
        decoder.generate_many([{"prompt": "x", "temprature": 0.5}])


def test_prompts_file_cli(tiny_pair, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text('def main():\n{"prompt": "class A:", "max_new_tokens": 5, "temperature": 0}\n')
    assert main(["generate", "--prompts-file", str(f), "--target", tiny_pair["target"], "--draft",
                 tiny_pair["close"], "--max-new-tokens", "9", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [len(o["token_ids"]) for o in out] == [9, 5]
    bad = tmp_path / "bad.txt"
    bad.write_text('{"prompt": \n')
    assert main(["generate", "--prompts-file", str(bad), "--target", tiny_pair["target"]]) == 2
    assert "not valid JSON" in capsys.readouterr().err
