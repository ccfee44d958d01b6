"""Constrained decoding on the whole loop (specdec.grammar): exact under the constraint.

The distribution to reproduce is the target's with the grammar's disallowed tokens at -inf,
then temperature / top-k / top-p, continuation by continuation until the end token or the
length (`exact_constrained`, enumerated on a toy Markov model over a 7-token vocabulary).
Each case runs Pearson's chi-square test at significance ALPHA = 0.001 with fixed seeds.
The negative control verifies a prophet's draws against its q masked after the draw (the
grammar applied to q too late) and must be caught by the same test. llguidance allows only
the canonical tokenization of text the grammar forces, so its forced strings are single
allowed tokens, committed with certainty.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from specdec.batch import BatchEngine
from specdec.certify import goodness_of_fit
from specdec.decoder import SpeculativeDecoder
from specdec.driver import Row, run_rows
from specdec.grammar import Grammar, GrammarError, Vocabulary
from specdec.policy import Policy
from specdec.prophets.base import BatchDraft
from specdec.prophets.model import ModelProphet
from specdec.sampling import SamplingParams, logits_to_probs, sample
from specdec.toy import MarkovLM
from specdec.wiring import engine_for
from tests.helpers import ALPHA

TOKENS = [b"<e>", b"a", b"b", b"c", b"ab", b"{", b"}"]
EOS, V, PROMPT, LENGTH, N = 0, len(TOKENS), [1, 2], 6, 3000
# "{" then "ab" are forced (one allowed token each: llguidance allows forced text's canonical tokens)
GRAMMAR = 'start: "{" "ab" /[abc]+/ "}"'
OUTSIDE = {5}  # "{" never follows the first token


def models() -> tuple[MarkovLM, MarkovLM, MarkovLM]:
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    good = target.blend(MarkovLM.random(V, order=2, seed=12), 0.35, "good")
    bad = MarkovLM.random(V, order=2, seed=13, sharpness=2.5, name="bad")
    return target, good, bad


def vocabulary() -> Vocabulary:
    return Vocabulary.of_tokens(TOKENS, EOS)


def decoder(prophets, k: int = 3, multi: str = "tree") -> SpeculativeDecoder:
    d = SpeculativeDecoder(models()[0], prophets, policy=Policy(k), multi=multi, eos_token_ids=[EOS])
    d.vocabulary = vocabulary()
    return d


def exact_constrained(target: MarkovLM, params: SamplingParams, grammar: str = GRAMMAR) -> dict[tuple[int, ...], float]:
    """Every continuation's probability under the constraint: at each position the target's
    logits masked by the grammar state after the continuation so far, then the sampling
    settings; a continuation ends at the end token or at LENGTH tokens."""
    constraint = vocabulary().compile(Grammar("lark", grammar))
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == LENGTH or (seq and seq[-1] == EOS):
            out[seq] = out.get(seq, 0.0) + prob
            return
        allowed = constraint.mask(seq)
        assert allowed is not None
        logits = target.logits_after(PROMPT + list(seq)).masked_fill(~allowed, -float("inf"))
        p = logits_to_probs(logits, params)
        for t in range(V):
            if float(p[t]) > 0:
                walk((*seq, t), prob * float(p[t]))

    walk((), 1.0)
    return out


def fit(d: SpeculativeDecoder, n: int = N, **settings):
    params = SamplingParams(settings.get("temperature", 1.0), settings.get("top_k"), settings.get("top_p", 1.0))
    counts: Counter = Counter()
    for i in range(n):
        g = d.generate(PROMPT, max_new_tokens=LENGTH, seed=i, grammar=GRAMMAR, **settings)
        counts[tuple(g.token_ids)] += 1
    return goodness_of_fit(counts, exact_constrained(d.target, params), alpha=ALPHA), counts


class UnmaskedProphet:
    """A sampling prophet that never looks at the grammar: its q puts most of its mass on
    "{" (outside the grammar after the first token) and the rest on every token."""

    name = "unmasked"
    vocab_size = V
    reads_features = False
    fused_layers = ()
    draft_lm = None
    is_lookup = False
    model_steps = False
    combine = None
    parts = property(lambda self: [self])

    def for_engine(self, target, slots, branches=1):
        return self

    def room(self, req):
        return 1 << 30

    def prefill(self, reqs):
        return None

    def free(self, slot):
        return None

    def settle(self, reqs, leave=0):
        return None

    def propose(self, reqs, ks, budget=None):
        q = torch.full((V,), 0.3 / (V - 1))
        q[5] = 0.7
        probs = torch.zeros(len(reqs), max(ks), V)
        tokens = []
        for b, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            probs[b, :k] = q
            tokens.append([int(sample(q, r.generator)) for _ in range(k)])
        return BatchDraft(tokens, probs)


CASES = [
    ("model", dict(temperature=1.0)),
    ("model", dict(temperature=0.7, top_p=0.9)),
    ("unmasked", dict(temperature=1.0)),
    ("unmasked", dict(temperature=0.7, top_p=0.9)),
    ("tree", dict(temperature=1.0)),
    ("plain", dict(temperature=0.7, top_p=0.9)),
]


@pytest.mark.parametrize("prophet,settings", CASES)
def test_constrained_speculative_sampling_matches_the_exact_masked_distribution(prophet, settings):
    _, good, bad = models()
    prophets = {"model": [ModelProphet(good)], "unmasked": [UnmaskedProphet()], "plain": [],
                "tree": [ModelProphet(good), ModelProphet(bad)]}[prophet]
    result, counts = fit(decoder(prophets), **settings)
    assert result.passed, result
    # the unmasked prophet proposed "{" after the first token in most rounds: it never got out
    assert not any(t in OUTSIDE for seq in counts for t in seq[1:])
    assert all(seq[0] == 5 for seq in counts)


def test_q_masked_after_the_draw_is_caught(monkeypatch):
    """Negative control: a prophet that draws from its own q but reports q masked and
    renormalized by the grammar (the mask applied after the draw instead of before it) makes
    the verifier test the wrong q: the chi-square test must reject it."""
    draft = BatchEngine._draft

    def renormalized(self, active, costs):
        d = draft(self, active, costs)
        for b, r in enumerate(active):
            for j in range(len(d.tokens[b])):
                allowed = r.constraint.mask(d.tokens[b][:j])
                if allowed is None:
                    break
                q = d.probs[b, j] * allowed
                d.probs[b, j] = q / q.sum()
            r.constraint.mask(())
        return d

    monkeypatch.setattr(BatchEngine, "_draft", renormalized)
    result, _ = fit(decoder([UnmaskedProphet()]), temperature=1.0)
    assert not result.passed, result


def test_forced_tokens_are_counted_apart_and_need_no_pass():
    _, good, _ = models()
    d = decoder([ModelProphet(good)])
    g = d.generate(PROMPT, max_new_tokens=LENGTH, temperature=0, grammar=GRAMMAR)
    first = g.events[0]
    assert first.forced == 2 and first.committed[:2] == [5, 4]  # "{" "ab" forced, before any pass
    s = g.stats
    assert s.forced + s.accepted + s.recovered + s.bonus + s.cut == s.new_tokens
    assert s.forced >= 1 and s.target_calls == sum(e.target_calls for e in g.events)


@pytest.mark.parametrize("prophets,multi", [("model", "tree"), ("unmasked", "tree"), ("two", "tree"),
                                            ("two", "first")])
def test_greedy_constrained_speculative_equals_greedy_constrained_plain(prophets, multi):
    _, good, bad = models()
    ps = {"model": [ModelProphet(good)], "unmasked": [UnmaskedProphet()],
          "two": [ModelProphet(good), ModelProphet(bad)]}[prophets]
    plain = decoder([])
    spec = decoder(ps, k=4, multi=multi)
    for grammar, prompt in itertools.product([GRAMMAR, 'start: /[abc]{2,9}/ "}"'], ([1, 2], [3], [4, 4, 1])):
        want = plain.generate(prompt, max_new_tokens=12, temperature=0, grammar=grammar)
        got = spec.generate(prompt, max_new_tokens=12, temperature=0, grammar=grammar)
        assert got.token_ids == want.token_ids
        req, finish = spec.request(prompt, max_new_tokens=12, temperature=0, grammar=grammar)
        req.constraint.jump = False  # no forced tokens: the target's passes choose them, the same
        list(run_rows(engine_for(spec, 1), [Row(req, finish)]))
        assert req.generated == want.token_ids


def test_many_rows_each_carry_their_own_grammar():
    _, good, _ = models()
    d = decoder([ModelProphet(good)])
    jobs = [{"prompt": [1, 2], "grammar": GRAMMAR}, {"prompt": [1, 2]}, {"prompt": [3], "regex": "(ab|c)+"},
            {"prompt": [4], "grammar": 'start: "}" "}"'}]
    many = d.generate_many(jobs, max_new_tokens=8, temperature=0)
    alone = [d.generate(**job, max_new_tokens=8, temperature=0) for job in jobs]
    assert [g.token_ids for g in many] == [g.token_ids for g in alone]
    assert many[3].token_ids == [6, 6, EOS] and many[3].stats.target_calls == 0  # all forced


@pytest.mark.parametrize("kwargs,message", [
    (dict(grammar="start: foo"), "invalid lark"),
    (dict(regex="a(b"), "invalid regex"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}),
     "invalid json schema"),
    (dict(response_format={"type": "xml"}), "response_format type"),
    (dict(regex="a", grammar='start: "a"'), "one of"),
])
def test_a_bad_grammar_is_a_clear_value_error(kwargs, message):
    with pytest.raises(GrammarError, match=message):
        decoder([]).generate(PROMPT, max_new_tokens=4, **kwargs)


@pytest.mark.slow
def test_greedy_constrained_speculative_equals_plain_on_smollm2():
    """SmolLM2 with its default prophets (prompt lookup, then its eagle, which catches up on
    forced tokens) against plain decoding under the same grammar, token for token, on JSON
    schemas of the structured suite, a regex and a tool call."""
    from specdec import load
    from specdec.bench.structured import items, load_suite

    spec = load("smollm2")
    plain = spec.plain()
    work = items(load_suite(), 51, 10)
    chosen = [w for w in work if w["shape"] in ("nested", "array", "patterns")][::3] + work[-3:]
    for w in chosen:
        want = plain.generate(messages=w["messages"], max_new_tokens=80, temperature=0, **w["constraint"])
        got = spec.generate(messages=w["messages"], max_new_tokens=80, temperature=0, **w["constraint"])
        assert got.token_ids == want.token_ids, w["name"]
        assert got.stats.forced > 0 or w["kind"] == "tool"
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    assert spec.generate(messages=ask, max_new_tokens=8, temperature=0, regex="(yes|no)").text in ("yes", "no")
