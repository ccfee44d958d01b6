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
from types import SimpleNamespace

import pytest
import torch

from specdec.batch import BatchEngine
from specdec.certify import goodness_of_fit
from specdec.decoder import SpeculativeDecoder
from specdec.driver import Row, run_rows
from specdec.grammar import Grammar, GrammarError, Vocabulary, mask_draft, masks_for
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


def _rowwise_masks(reqs, drafts, trees=None) -> torch.Tensor:
    """The reference: each row's masks on its own (`masks_along` / `masks_tree`, one engine call a position)."""
    c0 = next(r.constraint for r in reqs if r.constraint is not None)
    allowed = torch.ones(len(reqs), max(map(len, drafts)) + 1, c0.vocab_size, dtype=torch.bool)
    for b, r in enumerate(reqs):
        if r.constraint is None:
            continue
        c = r.constraint
        masks = c.masks_tree(drafts[b], trees[b]) if trees and trees[b] else c.masks_along(drafts[b])
        c.mask(())
        allowed[b, : masks.shape[0]] = masks
    return allowed


def _rows_in_states(vocab, rows):
    """(requests, drafts): each row a constraint compiled from (kind, source), its committed tokens, its draft."""
    reqs, drafts = [], []
    for kind, source, committed, draft in rows:
        c = vocab.compile(Grammar(kind, source)) if kind else None
        if c is not None:
            c.commit(committed)
        reqs.append(SimpleNamespace(constraint=c))
        drafts.append(draft)
    return reqs, drafts


@pytest.mark.parametrize("background", [False, True])
def test_a_steps_masks_in_one_engine_call_equal_each_rows_own_bit_for_bit(background):
    """`masks_for` fills every chain row's masks in one call of the engine (on a worker thread
    when `background`); they equal the per-row masks bit for bit, with the rows in different
    grammar states: at the start, mid-draft, a draft with a token outside the grammar, an end
    token inside a draft (the position after it: only an end token), a complete grammar with
    an empty draft, an output already ended, another grammar, an unconstrained row, a tree."""
    rows = [("lark", GRAMMAR, [], [5, 4, 1]),
            ("lark", GRAMMAR, [5], [4, 2, 6, 0]),
            ("lark", GRAMMAR, [5, 4, 1], [6, EOS, 3]),  # an end token, then a token after it
            ("lark", GRAMMAR, [5, 4], [5, 1]),  # "{" leaves the grammar
            ("lark", GRAMMAR, [5, 4, 1, 6], []),  # complete: only the end token
            ("lark", GRAMMAR, [5, 4, 1, 6, EOS], [EOS]),  # ended
            ("regex", "(ab|c)+", [3], [4, 3, 3, 2]),
            (None, None, [], [1, 2, 3]),
            ("lark", 'start: /[abc]{2,9}/ "}"', [1, 2], [3, 6, 0, 1, 1])]
    vocab = vocabulary()
    reqs, drafts = _rows_in_states(vocab, rows)
    want = _rowwise_masks(reqs, drafts)
    before = [None if r.constraint is None else r.constraint.mask(()) for r in reqs]
    got = masks_for(reqs, drafts, background=background).wait()
    assert got is not None and got.shape == want.shape and torch.equal(got, want)
    assert bool(want[2, 2].sum() == 1) and bool(want[2, 2, EOS])  # the end row: only the end token
    assert bool(want[3, 2:].all())  # after the token outside: every token (never reached)
    after = [None if r.constraint is None else r.constraint.mask(()) for r in reqs]
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(before, after, strict=True))  # matchers back
    # a tree row beside chain rows: its masks from its paths, the chains' from the engine
    trees = [[], [-1, 0, 0, 1], []]
    treqs, tdrafts = _rows_in_states(vocab, [rows[0], ("lark", GRAMMAR, [5, 4], [1, 2, 6, 6]), rows[6]])
    want = _rowwise_masks(treqs, tdrafts, trees)
    assert torch.equal(masks_for(treqs, tdrafts, trees, background=background).wait(), want)
    # the logits masked as before, a new tensor
    logits = torch.randn(len(reqs), max(map(len, drafts)) + 2, V)
    masked = masks_for(reqs, drafts).apply(logits)
    assert torch.equal(masked[:, :-1].isinf(), ~_rowwise_masks(reqs, drafts)) and not masked[:, -1].isinf().any()
    assert not logits.isinf().any() and masks_for([SimpleNamespace(constraint=None)], [[1]]).wait() is None


def test_a_drafting_steps_masks_in_one_engine_call_equal_each_rows_own_bit_for_bit():
    """`mask_draft` (a prophet's q over all rows of a drafting step) equals masking each row
    alone with `Constraint.mask` after its prefix, over the full vocabulary and a draft
    vocabulary's ids; a row whose prefix left the grammar keeps its logits."""
    vocab = vocabulary()
    rows = [("lark", GRAMMAR, [], [5, 4]), ("lark", GRAMMAR, [5, 4, 1], [6, EOS]), ("lark", GRAMMAR, [5], [5]),
            ("regex", "(ab|c)+", [3], [4]), (None, None, [], [1])]
    reqs, prefixes = _rows_in_states(vocab, rows)
    logits = torch.randn(len(reqs), V)
    for ids in (None, torch.tensor([0, 1, 3, 6])):
        sub = logits if ids is None else logits[:, ids]
        want = sub.clone()
        for b, r in enumerate(reqs):
            m = None if r.constraint is None else r.constraint.mask(prefixes[b])
            if m is not None and bool((m if ids is None else m[ids]).any()):
                want[b] = want[b].masked_fill(~(m if ids is None else m[ids]), -float("inf"))
        assert torch.equal(mask_draft(sub, reqs, prefixes, ids), want)
    assert torch.equal(mask_draft(logits, reqs, prefixes)[2], logits[2])  # "{" after "{": outside, kept


def test_a_steps_masks_on_smollm2_json_rows_equal_each_rows_own():
    """The same on SmolLM2's 49,152-token vocabulary: eight rows of one JSON schema at
    different points of an answer, each drafting four tokens of it (the last two a token
    outside the grammar and an end token)."""
    from transformers import AutoTokenizer

    from specdec.gguf import resolve_model
    from specdec.grammar import json_schema_grammar

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    vocab = Vocabulary.of(tok, 49152, [tok.eos_token_id])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"]}
    ids = tok('{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}')["input_ids"]
    source = json_schema_grammar(schema).source
    rows = [("json_schema", source, ids[:i], ids[i: i + 4]) for i in range(0, 16, 2)]
    rows.append(("json_schema", source, ids[:3], [ids[3], tok("}")["input_ids"][0]]))  # a token outside
    rows.append(("json_schema", source, ids[:-1], [ids[-1], tok.eos_token_id, ids[0]]))  # the end, then more
    reqs, drafts = _rows_in_states(vocab, rows)
    want = _rowwise_masks(reqs, drafts)
    got = masks_for(reqs, drafts, background=True).wait()
    assert torch.equal(got, want)
    counts = want.sum(-1)  # (B, n): allowed tokens at each position
    assert int(counts[0, 1]) == 1 and int(counts.max()) == 49152  # a forced key; a position never reached
    assert ((counts > 1) & (counts < 49152)).any() and int(counts[-1, 2]) == 1  # a free string; the end row
