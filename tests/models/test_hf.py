"""The engine on real (small, random) Llama models loaded from disk with from_pretrained."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import load
from specdec.errors import ContextLengthError, ModelLoadError, VocabularyMismatchError
from specdec.hf import HFSequence
from specdec.sequence import OneSequence
from specdec.wiring import wrap

PROMPTS = ["def main():\n    ", "import os\n", "class Foo(object):\n    def __init__(self", "# Copyright",
           "return x + ", "for i in range(", "    if not ", '"""Return the', "x = [", "raise ValueError("]


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return load(tiny_pair["target"], draft="none", backend="hf")


@pytest.mark.parametrize("prophet", ["close", "far"])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_greedy_equals_plain_decoding(tiny_pair, plain, prophet, k, backend):
    spec = load(tiny_pair["target"], draft=tiny_pair[prophet], draft_tokens=k, backend=backend)
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40, temperature=0)
        got = spec.generate(prompt, max_new_tokens=40, temperature=0)
        assert got.token_ids == want.token_ids, prompt
        assert got.text == want.text
        assert got.stats.new_tokens == len(want.token_ids)
        assert got.stats.target_calls == got.stats.rounds


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_plain_greedy_equals_transformers_generate(tiny_pair, backend):
    plain = load(tiny_pair["target"], draft="none", backend=backend)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    for prompt in PROMPTS[:5]:
        ids = tok(prompt, return_tensors="pt").input_ids
        hf = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours = plain.generate(prompt, max_new_tokens=30, temperature=0)
        assert ours.token_ids == hf[0, ids.shape[1] :].tolist()[: len(ours.token_ids)]


@pytest.mark.slow
def test_close_prophet_accepts_more_than_far(tiny_pair):
    rates = {}
    for name in ["close", "far"]:
        dec = load(tiny_pair["target"], draft=tiny_pair[name], draft_tokens=4)
        out = [dec.generate(p, max_new_tokens=30, temperature=0).stats for p in PROMPTS]
        rates[name] = sum(s.accepted for s in out) / sum(s.drafted for s in out)
    assert rates["close"] > rates["far"]


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_cache_truncate_then_reextend_matches_fresh_forward(tiny_pair, backend):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    ids = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    fresh = HFSequence(model, "t").forward(ids, len(ids))  # (30, V), transformers' own forward
    lm = OneSequence(wrap(model, "t", model.config.vocab_size, backend))
    lm.forward(ids[:12], 1)
    lm.forward([7, 8, 9, 10, 11], 5)  # a draft that will be rejected
    lm.truncate(12)
    assert lm.tokens == ids[:12]
    again = lm.forward(ids[12:], len(ids) - 12)
    assert torch.allclose(again, fresh[12:], atol=1e-4)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_tree_forward_matches_chain_forward_and_keeps_the_path(tiny_pair, backend):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    ctx = [5, 6, 7, 8, 9, 10]
    tokens, parents = [11, 12, 13, 14, 15], [-1, 0, -1, 2, 3]  # two branches: 11-12 and 13-14-15
    lm = OneSequence(wrap(model, "t", model.config.vocab_size, backend))
    lm.forward(ctx[:4], 1)
    tree_logits = lm.forward_tree(ctx[4:], tokens, parents)
    for path in ([0, 1], [2, 3, 4]):
        ref = HFSequence(model, "r").forward(ctx + [tokens[n] for n in path], len(path) + 1)
        assert torch.allclose(tree_logits[[0] + [n + 1 for n in path]], ref, atol=1e-4)
    lm.keep_tree_path([2, 3])
    assert lm.tokens == ctx + [13, 14]
    nxt = lm.forward([99], 1)
    ref = HFSequence(model, "r").forward(ctx + [13, 14, 99], 1)
    assert torch.allclose(nxt, ref, atol=1e-4)


def test_seeded_sampling_is_deterministic(tiny_pair):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"])
    a = dec.generate("def f(", max_new_tokens=30, temperature=1.0, seed=7)
    b = dec.generate("def f(", max_new_tokens=30, temperature=1.0, seed=7)
    c = dec.generate("def f(", max_new_tokens=30, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_new_tokens_is_never_overshot(tiny_pair):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=8)
    dec.eos_token_ids = set()
    for n in [1, 2, 5, 9, 17]:
        out = dec.generate("import ", max_new_tokens=n, temperature=0)
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stop_strings_cut_text(tiny_pair, plain):
    full = plain.generate("def main():\n    ", max_new_tokens=40, temperature=0).text
    stop = full[10:13]
    assert stop
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=4)
    out = dec.generate("def main():\n    ", max_new_tokens=40, temperature=0, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    streamed = "".join(e.text for e in dec.stream("def main():\n    ", max_new_tokens=40, temperature=0, stop=stop))
    assert streamed == out.text


def test_eos_stops_generation(tiny_pair):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=4)
    first = dec.generate("import ", max_new_tokens=20, temperature=0).token_ids
    dec.eos_token_ids = {first[5]}
    out = dec.generate("import ", max_new_tokens=20, temperature=0)
    assert out.finish_reason == "eos"
    assert out.token_ids == first[: first.index(first[5]) + 1]


def test_padded_target_embeddings_are_sliced(tiny_pair):
    dec = load(tiny_pair["padded"], draft=tiny_pair["far"])
    assert dec.target.vocab_size == len(AutoTokenizer.from_pretrained(tiny_pair["padded"]))
    out = dec.generate("x = ", max_new_tokens=10, temperature=1.0, seed=0)
    assert max(out.token_ids) < dec.target.vocab_size


def test_mismatched_vocabularies_are_a_clear_error(tiny_pair):
    with pytest.raises(VocabularyMismatchError, match="different vocabularies") as e:
        load(tiny_pair["target"], draft=tiny_pair["other"])
    assert tiny_pair["target"] in str(e.value) and tiny_pair["other"] in str(e.value)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        load(str(tmp_path / "nope"), draft="none")
    with pytest.raises(ModelLoadError, match="no such directory"):
        load("./not/here", draft="none")


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=""), "empty"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.2), "top_p"),
    (dict(draft_tokens=0), "K must be"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_settings_are_clear_errors(tiny_pair, kwargs, match):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"])
    args = dict(prompt="x", max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dec.generate(**args)


def test_prompt_past_the_context_is_a_clear_error(tiny_pair):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"])
    with pytest.raises(ContextLengthError, match="context is 256"):
        dec.generate(list(range(1, 300)), max_new_tokens=5)


def test_the_prompt_and_max_new_tokens_together_must_fit_the_context(tiny_pair):
    """As OpenAI and vLLM count it: 249 prompt tokens and 50 new ones do not fit 256 (a clear error
    naming the room); with no max_new_tokens the answer may fill the room the prompt leaves."""
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=5)
    with pytest.raises(ContextLengthError, match="249 tokens and max_new_tokens 50: 299 in all.*at most 7 new"):
        dec.generate(list(range(1, 250)), max_new_tokens=50, temperature=0)
    with pytest.raises(ContextLengthError):
        dec.generate_many([{"prompt": list(range(1, 250)), "max_new_tokens": 8}])
    out = dec.generate(list(range(1, 250)), temperature=0)
    assert len(out.prompt_ids) + len(out.token_ids) <= 256 and len(out.token_ids) == 7 or out.finish_reason == "eos"
    assert len(dec.generate(list(range(1, 249)), max_new_tokens=8, temperature=0).token_ids) <= 8  # 256: fits


@pytest.mark.parametrize("spec,multi", [("layerskip:1", "auto"), ("{close}+ngram", "tree"), ("ngram+{eagle}", "first")])
@pytest.mark.slow
def test_a_transformers_target_runs_every_row_path_of_the_one_loop(tiny_pair, tiny_eagle, plain, spec, multi):
    """A transformers target scores its rows one after another through views of its own
    (specdec.rows.RowsLM): the early exit's provisional entries, token trees and the features
    an eagle reads all go through it. Greedy rows equal plain decoding, alone and batched;
    the chi-square of batched rows at T=1 holds."""
    from specdec.check import certify
    from specdec.rows import RowsLM
    from specdec.wiring import engine_for

    dec = load(tiny_pair["target"], draft=spec.format(eagle=tiny_eagle, **tiny_pair), multi=multi, policy="fixed",
               draft_tokens=3, backend="hf")
    assert isinstance(engine_for(dec, 4).target, RowsLM)
    want = [plain.generate(p, max_new_tokens=24, temperature=0).token_ids for p in PROMPTS[:4]]
    alone = [dec.generate(p, max_new_tokens=24, temperature=0) for p in PROMPTS[:4]]
    assert [g.token_ids for g in alone] == want and sum(g.stats.drafted for g in alone) > 0
    assert [g.token_ids for g in dec.generate_many(PROMPTS[:4], max_new_tokens=24, temperature=0)] == want
    report = certify(dec, dec.plain(), "def ", tokens=2, samples=300, temperature=1.0)
    assert report.result.passed, report.result


def test_a_feature_prophet_in_a_tree_on_a_transformers_target_is_a_clear_error(tiny_pair, tiny_eagle):
    dec = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", multi="tree", policy="fixed", draft_tokens=3,
               backend="hf")
    with pytest.raises(ValueError, match="needs a plain Llama target"):
        dec.generate("def main():", max_new_tokens=8, temperature=0)
