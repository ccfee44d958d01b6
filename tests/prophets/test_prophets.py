"""Every prophet and policy: unit behaviour, greedy equality with plain decoding on real
models, and the statistical losslessness test on toy models (or `check` on real ones)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import load
from specdec.check import certify
from specdec.costmodel import expected_gain
from specdec.decoder import SpeculativeDecoder
from specdec.policy import AdaptivePolicy, ConfidencePolicy, OptimalPolicy, Policy
from specdec.prophets.base import BatchDraft
from specdec.prophets.model import ModelProphet
from specdec.prophets.ngram import NgramProphet, lookup, lookup_reference
from specdec.prophets.retrieval import WIDTH, Datastore, RetrievalProphet
from specdec.request import Request
from specdec.sampling import SamplingParams, sample
from specdec.sequence import OneSequence
from specdec.toy import MarkovLM
from tests.helpers import fit_against_exact
from tests.models.test_hf import PROMPTS

# ---------------------------------------------------------------- prompt lookup


def test_ngram_proposes_what_followed_the_latest_match():
    ctx = np.array([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    assert lookup(ctx, 3, 3, 1) == [9, 2, 5]  # "5 6" last seen before 9 2 5
    rows = [Request(ctx.tolist(), 8, SamplingParams(0)), Request([1, 2, 3], 8, SamplingParams(0))]
    assert NgramProphet(3, 1).propose(rows, [3, 3]) == BatchDraft([[9, 2, 5], []], None)  # each row's own lookup
    assert lookup(np.array([1, 2, 3]), 3, 3, 1) == []
    assert lookup(np.array([4, 4, 4]), 5, 2, 1) == [4]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=80), st.integers(1, 9), st.integers(1, 4), st.integers(0, 3))
def test_ngram_lookup_is_its_specification(ctx, k, n_min, extra):
    """The fast lookup (candidate ends first) proposes what comparing every window proposes."""
    c = np.array(ctx, dtype=np.int64)
    assert lookup(c, k, n_min + extra, n_min) == lookup_reference(c, k, n_min + extra, n_min)


# ---------------------------------------------------------------- retrieval


def brute_find(tokens, pattern):
    n = len(pattern)
    return sorted(i for i in range(len(tokens) - n + 1) if list(tokens[i : i + n]) == list(pattern))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=20, max_size=300), st.integers(1, WIDTH), st.integers(0, 10**6))
def test_datastore_find_matches_brute_force(tokens, m, seed):
    tokens = np.array(tokens, dtype=np.uint16)
    store = Datastore.build(tokens)
    start = seed % (len(tokens) - 1)
    pattern = tokens[start : start + m].tolist()
    lo, hi = store.find(pattern)
    assert sorted(store.sa[lo:hi].tolist()) == brute_find(tokens, pattern)


def test_datastore_save_load_and_most_frequent_continuation(tmp_path):
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 7], dtype=np.uint16)
    store = Datastore.build(tokens)
    store.save(tmp_path / "x.npz")
    store = Datastore.load(tmp_path / "x.npz")
    prophet = RetrievalProphet(store)
    draft = prophet.propose([Request([5, 1, 2], 8, SamplingParams(0)), Request([7], 8, SamplingParams(0))], [3, 3])
    assert draft.tokens == [[3, 9, 1], []] and draft.probs is None


def context_lookup_reference(context: list[int], k: int, min_match: int = 2) -> list[int]:
    """The specification of the suffix index over a request's own context: the longest suffix
    (min_match..WIDTH tokens) with an earlier occurrence that a token follows, continued token
    by token with the likeliest next token (ties: the smallest id) after the last WIDTH tokens."""
    from collections import Counter

    n = len(context)

    def followers(pattern: list[int]) -> list[int]:
        m = len(pattern)
        return [context[i + m] for i in range(n - m) if context[i : i + m] == pattern]

    pattern = next((context[-m:] for m in range(min(WIDTH, n), min_match - 1, -1) if followers(context[-m:])), [])
    out: list[int] = []
    while pattern and len(out) < k and followers(pattern):
        counts = Counter(followers(pattern))
        out.append(min(t for t in counts if counts[t] == max(counts.values())))
        pattern = (pattern + [out[-1]])[-WIDTH:]
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([3, 70_000, 70_001, 262_143]), min_size=1, max_size=60), st.integers(1, 8))
def test_the_suffix_index_over_the_context_is_its_specification(ctx, k):
    """retrieval:context over ids past 16 bits (Gemma's 262k vocabulary), renumbered in its store;
    built again as the context grows."""
    prophet = RetrievalProphet(None, name="retrieval:context")
    req = Request(ctx[:1], 8, SamplingParams(0))
    for n in range(1, len(ctx) + 1):
        req.prompt = ctx[:n]
        assert prophet.propose([req], [k]).tokens == [context_lookup_reference(ctx[:n], k)], n


# ---------------------------------------------------------------- layer skip


def test_early_exit_never_edits_the_models_config(tiny_pair):
    """Early exit on a Hugging Face model runs a cut copy of its decoder stack: the model
    (which another request's decoder may share) keeps all its layers, during and after."""
    from transformers import AutoModelForCausalLM

    from specdec.hf import HFSequence

    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    lm = HFSequence(model, "t")
    seen = []
    last = model.model.layers[-1]
    first = model.model.layers[0]
    first.register_forward_hook(lambda *a: seen.append(("first", model.config.num_hidden_layers)))
    last.register_forward_hook(lambda *a: seen.append(("last", model.config.num_hidden_layers)))
    lm.forward([1, 2, 3], 1)
    assert seen == [("first", 3), ("last", 3)]
    seen.clear()
    logits = lm.early_exit([4], 1)
    assert seen == [("first", 3)] and model.config.num_hidden_layers == 3  # layer 0 only, config untouched
    hidden = model(input_ids=torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states[1]
    want = model.lm_head(model.model.norm(hidden[0, -1]))
    assert torch.allclose(logits, want[: lm.vocab_size].float(), atol=1e-4)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_early_exit_equals_a_truncated_model(tiny_pair, backend):
    from transformers import AutoModelForCausalLM

    from specdec.wiring import wrap

    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    lm = OneSequence(wrap(model, "t", model.config.vocab_size, backend))
    lm.forward([5, 6, 7], 1)
    got = lm.early_exit([8, 9], 2)
    lm.end_early_exit(3)
    assert lm.tokens == [5, 6, 7]
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), output_hidden_states=True).hidden_states[2]
        want = model.lm_head(model.model.norm(hidden))[0, -1]
    assert torch.allclose(got, want, atol=1e-4)
    # the full pass after drafting sees only the committed tokens
    fresh = OneSequence(wrap(model, "r", model.config.vocab_size, backend)).forward([5, 6, 7, 10], 1)
    assert torch.allclose(lm.forward([10], 1), fresh, atol=1e-4)


def test_layerskip_rejects_bad_layer_counts(tiny_pair):
    for spec in ["layerskip:0", "layerskip:3", "layerskip:x"]:
        with pytest.raises(ValueError, match="layerskip"):
            load(tiny_pair["target"], draft=spec)


# ---------------------------------------------------------------- policies


def test_adaptive_grows_and_shrinks():
    from specdec.policy import RoundOutcome

    p = AdaptivePolicy(4, k_min=1, k_max=8)
    p.observe(RoundOutcome(4, 4, 0, 0, 4))
    assert p.next_k() == 6
    p.observe(RoundOutcome(6, 1, 0, 0, 6))
    assert p.next_k() == 5


def test_optimal_k_grows_with_acceptance_and_shrinks_with_cost():
    assert max(range(1, 17), key=lambda k: expected_gain(0.9, k, 0.05, 1 + 0.06 * k)) > \
        max(range(1, 17), key=lambda k: expected_gain(0.5, k, 0.05, 1 + 0.06 * k))
    assert max(range(1, 17), key=lambda k: expected_gain(0.8, k, 0.3, 1.0)) < \
        max(range(1, 17), key=lambda k: expected_gain(0.8, k, 0.02, 1.0))


# ---------------------------------------------------------------- greedy equality on real models

SPECS = ["ngram", "layerskip:1", "layerskip:2", "{close}+ngram", "{far}+{close}", "ngram+layerskip:2",
         "{target}:int8"]


@pytest.fixture(scope="module")
def plain_outputs(tiny_pair):
    plain = load(tiny_pair["target"], draft="none")
    prompts = PROMPTS + ["x = [1, 2, 3]\nx = [1, 2, 3]\nx = [1,", "import os\nimport os\nimport"]
    return {p: plain.generate(p, max_new_tokens=32, temperature=0).token_ids for p in prompts}


@pytest.mark.parametrize("spec,multi", [(s, "tree") for s in SPECS] + [(s, "best") for s in SPECS if "+" in s])
def test_every_prophet_is_greedy_exact(tiny_pair, plain_outputs, spec, multi):
    dec = load(tiny_pair["target"], draft=spec.format(**tiny_pair), draft_tokens=4, multi=multi)
    for prompt, want in plain_outputs.items():
        assert dec.generate(prompt, max_new_tokens=32, temperature=0).token_ids == want, prompt


@pytest.mark.parametrize("policy", ["adaptive", "confidence", "optimal"])
def test_every_policy_is_greedy_exact(tiny_pair, plain_outputs, policy):
    dec = load(tiny_pair["target"], draft=tiny_pair["close"], policy=policy, draft_tokens=3)
    for prompt, want in plain_outputs.items():
        assert dec.generate(prompt, max_new_tokens=32, temperature=0).token_ids == want, prompt


def test_retrieval_is_greedy_exact(tiny_pair, plain_outputs, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    from tests.tiny import tiny_texts

    ids = [t for text in tiny_texts(20) for t in tok(text)["input_ids"]]
    Datastore.build(np.array(ids, dtype=np.uint16)).save(tmp_path / "idx.npz")
    dec = load(tiny_pair["target"], draft="retrieval", retrieval_index=str(tmp_path / "idx.npz"), draft_tokens=4)
    for prompt, want in plain_outputs.items():
        assert dec.generate(prompt, max_new_tokens=32, temperature=0).token_ids == want, prompt
    assert dec.generate(PROMPTS[0], max_new_tokens=32, temperature=0).stats.drafted > 0
    # retrieval drafts for rows of the one loop (a lookup prophet), alone and batched
    from specdec.wiring import engine_for

    assert engine_for(dec, 4) is not None
    outs = dec.generate_many(list(plain_outputs), max_new_tokens=32, temperature=0)
    assert [o.token_ids for o in outs] == list(plain_outputs.values())


@pytest.mark.parametrize("spec,multi", [("layerskip:2", "auto"), ("{target}:int8", "auto"),
                                        ("ngram+{close}", "first"), ("ngram+{close}", "best"),
                                        ("{far}+{close}", "best"), ("{far}+{close}", "tree"),
                                        ("ngram+layerskip:2", "tree")])
def test_layerskip_passes_check_on_a_real_model(tiny_pair, spec, multi):
    """`specdec check`'s chi-square on the batched rows of the one loop (certify samples
    through generate_many): the target's early exit, its int8 copy, a draft model beside
    prompt lookup, two draft models (a draft cache each per row), and token trees of two
    draft models and of prompt lookup with the early exit (the tree verifier on rows)."""
    from specdec.wiring import engine_for

    dec = load(tiny_pair["target"], draft=spec.format(**tiny_pair), draft_tokens=3, multi=multi)
    assert engine_for(dec, 2) is not None
    report = certify(dec, dec.plain(), "def ", tokens=2, samples=300, temperature=1.0)
    assert report.result.passed, report.result
    assert report.acceptance_rate > 0


# ---------------------------------------------------------------- statistical losslessness on toy models

V, LENGTH, N = 5, 3, 3000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def toy_target():
    return MarkovLM.random(V, order=2, seed=21, sharpness=1.5, name="target")


def markov_corpus(lm, n, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = [1, 2]
    params = SamplingParams(1.0)
    from specdec.sampling import logits_to_probs

    for _ in range(n):
        ctx.append(int(sample(logits_to_probs(lm.logits_after(ctx), params), g)))
    return np.array(ctx, dtype=np.uint16)


@pytest.mark.parametrize("which", ["ngram", "retrieval", "ngram+model", "retrieval+ngram", "ngram+context"])
def test_deterministic_prophets_are_lossless(which):
    target = toy_target()
    model = ModelProphet(target.blend(MarkovLM.random(V, order=2, seed=22), 0.3, "model"))
    store = Datastore.build(markov_corpus(target, 4000, 0))
    parts = {"ngram": NgramProphet(3), "retrieval": RetrievalProphet(store, min_match=1), "model": model,
             "context": RetrievalProphet(None, min_match=1, name="retrieval:context")}
    prophets = [parts[p] for p in which.split("+")]
    decoder = SpeculativeDecoder(target, prophets, policy=Policy(3))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0, top_p=0.9)
    assert result.passed, result


@pytest.mark.parametrize("policy", [AdaptivePolicy(2), ConfidencePolicy(6, 0.6), OptimalPolicy(2)],
                         ids=["adaptive", "confidence", "optimal"])
def test_policies_with_a_deterministic_prophet_are_lossless(policy):
    target = toy_target()
    decoder = SpeculativeDecoder(target, NgramProphet(3), policy=policy)
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=0.8)
    assert result.passed, result


def test_layerskip_auto_picks_a_measured_layer_count(tiny_pair):
    from specdec.prophets.layerskip import choose_layers

    dec = load(tiny_pair["target"], draft="layerskip")
    layers = dec.prophets[0].layers
    best, table = choose_layers(dec.target, list(range(1, 120)))
    assert 1 <= layers < 3 and [row["layers"] for row in table] == [1, 2]
    assert all(0 <= row["agreement"] <= 1 for row in table)
    assert best == max(table, key=lambda r: r["expected_gain"])["layers"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 30),
       st.lists(st.integers(0, 3), max_size=40), st.integers(1, 9), st.integers(1, 4), st.integers(0, 3))
def test_ngram_index_proposes_what_lookup_proposes_as_a_context_grows(prompt, cut, grown, k, n_min, extra):
    """The incremental index (a request's prompt, then its tokens one commit at a time, some
    commits several tokens long) equals the scanning lookup at every length; a context that
    is not the same sequence grown (another request's) is indexed afresh."""
    from specdec.prophets.ngram import NgramIndex

    index = NgramIndex(n_min + extra, n_min)
    generated: list[int] = []
    for i in range(0, len(grown) + 1, 1 + cut % 3):
        generated = grown[:i]
        want = lookup(np.array(prompt + generated, dtype=np.int64), k, n_min + extra, n_min)
        assert index.propose(prompt, generated, k) == want
    other = [t ^ 1 for t in prompt]  # not the same sequence
    assert index.propose(other, [], k) == lookup(np.array(other, dtype=np.int64), k, n_min + extra, n_min)
