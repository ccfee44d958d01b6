"""Batched speculative decoding: the ragged verifier against its per-row specification,
the batched Llama path against the unbatched one, greedy equality per row with unbatched
plain decoding, and the exact statistical test per row of a batch with mixed settings."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import load
from specdec.api import batch_engine
from specdec.batch import BatchEngine, BatchLlama
from specdec.certify import goodness_of_fit
from specdec.costmodel import Costs
from specdec.coststore import measure, measure_rows
from specdec.policy import AutoPolicy
from specdec.prophets.combine import FirstProphet
from specdec.prophets.model import ModelProphet
from specdec.prophets.ngram import NgramProphet
from specdec.ragged import RaggedVerdict, verify_greedy_rows, verify_rows, verify_rows_reference
from specdec.request import Request
from specdec.rowpolicy import row_bucket
from specdec.sampling import SamplingParams
from specdec.sequence import OneSequence
from specdec.toy import MarkovLM, sequence_distribution
from tests.helpers import ALPHA, lean

# ----------------------------------------------------------------- the ragged verifier


@st.composite
def ragged_batches(draw):
    n_rows = draw(st.integers(1, 5))
    k_max = draw(st.integers(0, 4))
    vocab = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    lens = [draw(st.integers(0, k_max)) for _ in range(n_rows)]
    one_hot = torch.tensor([draw(st.booleans()) for _ in range(n_rows)])
    sharp = draw(st.sampled_from([0.5, 3.0, 30.0]))  # 30: near one-hot p and q (forced paths)
    target_probs = torch.softmax(torch.randn(n_rows, k_max + 1, vocab, generator=g) * sharp, -1)
    draft_probs = torch.softmax(torch.randn(n_rows, k_max, vocab, generator=g) * sharp, -1)
    if draw(st.booleans()):  # some rows whose q equals p exactly: everything accepted
        draft_probs[0] = target_probs[0, :k_max]
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(n_rows, k_max)
    for b, k in enumerate(lens):
        tokens[b, k:] = -1  # padding must never be read
    all_one_hot = draw(st.booleans())
    return tokens, lens, None if all_one_hot else draft_probs, None if all_one_hot else one_hot, target_probs, seed


@settings(max_examples=200, deadline=None)
@given(ragged_batches())
def test_vectorised_ragged_verifier_equals_the_per_row_reference(batch):
    tokens, lens, draft_probs, one_hot, target_probs, seed = batch
    gens_a = [torch.Generator().manual_seed(seed + b) for b in range(len(lens))]
    gens_b = [torch.Generator().manual_seed(seed + b) for b in range(len(lens))]
    expected = verify_rows_reference(tokens, lens, draft_probs, one_hot, target_probs, gens_a)
    got = verify_rows(tokens, lens, draft_probs, one_hot, target_probs, gens_b)
    assert got.rows() == expected
    # and both left every generator in the same state
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_a, gens_b, strict=True))
    assert all(v.n_accepted <= k for v, k in zip(expected, lens, strict=True))


def test_ragged_verifier_forced_paths():
    """Extreme p: row 0 accepts all 3 and takes a bonus, row 1 rejects at 1, row 2 drafts nothing."""
    v = 4
    p = torch.zeros(3, 4, v)
    p[0, :, 2] = 1.0  # the target wants token 2 everywhere
    p[1, 0, 1], p[1, 1:, 3] = 1.0, 1.0
    p[2, :, 0] = 1.0
    tokens = torch.tensor([[2, 2, 2], [1, 2, -1], [-1, -1, -1]])
    gens = [torch.Generator().manual_seed(b) for b in range(3)]
    out = verify_rows(tokens, [3, 2, 0], None, None, p, gens).rows()
    assert [(r.n_accepted, r.next_token, r.next_kind) for r in out] == [
        (3, 2, "bonus"), (1, 3, "recovered"), (0, 0, "bonus")]


@settings(max_examples=200, deadline=None)
@given(ragged_batches(), st.booleans())
def test_greedy_verifier_equals_the_specification_with_one_hot_p(batch, ties):
    """A greedy target's p is one-hot on its argmax: verify_greedy_rows, from the choices alone,
    gives the specification's verdict whatever q is (one-hot or not); drafts made to agree often."""
    tokens, lens, draft_probs, one_hot, target_probs, seed = batch
    n_rows, k_plus = target_probs.shape[:2]
    choices = target_probs.argmax(-1)  # (B, K+1)
    if ties:  # drafts that follow the target's choices up to a random point
        g = torch.Generator().manual_seed(seed)
        for b, k in enumerate(lens):
            cut = int(torch.randint(0, k + 1, (1,), generator=g))
            tokens[b, :cut] = choices[b, :cut]
    p = torch.nn.functional.one_hot(choices, target_probs.shape[-1]).float()
    gens = [torch.Generator().manual_seed(seed + b) for b in range(n_rows)]
    expected = verify_rows_reference(tokens, lens, draft_probs, one_hot, p, gens)
    assert verify_greedy_rows(tokens, lens, choices).rows() == expected


def test_a_step_verifies_greedy_and_sampled_rows_together_as_each_alone():
    """`_verdict` splits a batch into greedy rows (by choices) and sampled rows (by p and q)
    and puts the verdicts back in row order: the same as verifying each kind on its own."""
    from specdec.batch import _verdict

    g = torch.Generator().manual_seed(3)
    n_rows, k, vocab = 6, 3, 11
    logits = torch.randn(n_rows, k + 1, vocab, generator=g) * 3
    temps = [0.0, 1.0, 0.0, 0.7, 1.0, 0.0]
    rows = [Request([1, 2], 8, SamplingParams(t), k, seed=b) for b, t in enumerate(temps)]
    tokens = torch.randint(0, vocab, (n_rows, k), generator=g)
    tokens[0] = logits[0, :k].argmax(-1)  # a greedy row that accepts everything
    lens = [3, 2, 1, 3, 0, 2]
    got = _verdict(logits, rows, tokens, lens, None, None, "t").rows()
    for b, r in enumerate(rows):
        alone = Request([1, 2], 8, r.params, k, seed=b)
        want = _verdict(logits[b:b + 1], [alone], tokens[b:b + 1], lens[b:b + 1], None, None, "t").rows()[0]
        assert got[b] == want
    assert got[0].n_accepted == 3 and got[0].next_kind == "bonus"


@pytest.mark.parametrize("case", ["greedy rows", "a sampled row alone", "a one-hot row alone",
                                  "sampled plain steps", "mixed rows"])
def test_the_steps_verification_gives_the_ragged_verdicts(case):
    """`BatchEngine.verify_chains` takes shorter ways (greedy rows from the target's choices, a
    sampled row alone by `verify_chain`, sampled rows that drafted nothing by one draw from p):
    the same verdicts, and the same draws from each row's generator, as `_verdict` on the
    padded batch."""
    from types import SimpleNamespace

    from specdec.batch import _verdict

    g = torch.Generator().manual_seed(5)
    vocab, k = 13, 3
    temps, lens = {"greedy rows": ([0.0, 0.0, 0.0], [3, 0, 2]), "a sampled row alone": ([1.0], [3]),
                   "a one-hot row alone": ([0.7], [2]), "sampled plain steps": ([1.0, 0.7, 1.0], [0, 0, 0]),
                   "mixed rows": ([0.0, 1.0, 1.0], [2, 3, 0])}[case]
    engine = SimpleNamespace(target=SimpleNamespace(name="t"))
    for trial in range(40):
        n_rows, k_max = len(temps), max(lens)
        logits = torch.randn(n_rows, k_max + 1, vocab, generator=g) * 2
        drafts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
        for b, n in enumerate(lens):  # greedy rows: drafts that agree for a while
            if temps[b] == 0.0 and n:
                drafts[b][: trial % (n + 1)] = logits[b, : trial % (n + 1)].argmax(-1).tolist()
        probs = torch.softmax(torch.randn(n_rows, max(k_max, 1), vocab, generator=g), -1)
        one_hot = [case == "a one-hot row alone" or t == 0.0 for t in temps]

        mine, theirs = ([Request([1, 2], 8, SamplingParams(t), k, seed=100 * trial + b) for b, t in enumerate(temps)]
                        for _ in range(2))
        got = BatchEngine.verify_chains(engine, logits, mine, drafts, probs, one_hot)  # type: ignore[arg-type]
        tokens = torch.tensor([d + [-1] * (k_max - len(d)) for d in drafts], dtype=torch.long).reshape(n_rows, k_max)
        want = _verdict(logits, theirs, tokens, lens, None if k_max == 0 else probs[:, :k_max], one_hot, "t").rows()
        assert got == want, (case, trial)
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.generator.get_state(), b.generator.get_state())


# ----------------------------------------------------------------- the batched Llama path


def smollm2_shaped(seed: int = 0):
    """Randomly initialised, shaped like SmolLM2: 9 heads / 3 KV heads, tied embeddings, rope theta 1e5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128,
                      rope_theta=1e5, tie_word_embeddings=True, initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


def assert_rows_match_unbatched(model, batch, slots, contexts, starts, n_logits):
    """Feed contexts[b][starts[b]:] into the batch; each row's logits must equal a fresh unbatched pass."""
    got = batch.forward(slots, starts, [c[s:] for c, s in zip(contexts, starts, strict=True)], n_logits)
    for b, (ctx, n) in enumerate(zip(contexts, n_logits, strict=True)):
        want = lean(model, "ref").forward(ctx, n)
        torch.testing.assert_close(got[b, :n], want, atol=1e-4, rtol=1e-4)


def check_batched_path(model, vocab):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(vocab, (n,), generator=g).tolist() for n in (5, 1, 12, 8)]
    batch = BatchLlama(model, "batch", slots=5)
    slots = [3, 0, 4, 1]  # not in order, one slot unused
    assert_rows_match_unbatched(model, batch, slots, ids, [0] * 4, [2, 1, 3, 1])  # ragged prefill
    # ragged extension: rows feed 1..4 new tokens after their cache, as drafts do
    longer = [c + torch.randint(vocab, (k,), generator=g).tolist() for c, k in zip(ids, (3, 1, 4, 2), strict=True)]
    assert_rows_match_unbatched(model, batch, slots, longer, [len(c) for c in ids], [3, 1, 4, 2])
    # rejected drafts: rewind row 2 by 3 positions and write different tokens there
    longer[2] = longer[2][:-3] + [7, 8]
    assert_rows_match_unbatched(model, batch, [4], [longer[2]], [len(longer[2]) - 2], [2])
    # a row leaves; a new, shorter request takes its slot over stale entries
    fresh = torch.randint(vocab, (3,), generator=g).tolist()
    assert_rows_match_unbatched(model, batch, [4, 0], [fresh, longer[1] + [5]], [0, len(longer[1])], [3, 1])


def test_batched_llama_matches_unbatched_on_tiny_llama(tiny_pair):
    from transformers import LlamaForCausalLM

    check_batched_path(LlamaForCausalLM.from_pretrained(tiny_pair["target"]).eval(), 512)


def test_batched_llama_matches_unbatched_smollm2_shaped():
    check_batched_path(smollm2_shaped(), 97)


def test_bfloat16_products_meet_few_row_counts_and_padding_changes_no_row():
    """In bfloat16 on a CPU, oneDNN builds and keeps a kernel per row count it meets (an LRU of
    1,024): a server meeting every rows x new-tokens count grew for thousands of requests. The
    lean paths pad the rows of each product to a bucket instead."""
    assert all(m <= row_bucket(m) <= m + m // 8 for m in range(1, 40_000))
    # every batch of 1..64 rows x 1..512 new tokens: few enough kernels for the 5 weight shapes
    assert 5 * len({row_bucket(b * n) for b in range(1, 65) for n in range(1, 513)}) < 1024
    model = smollm2_shaped().to(torch.bfloat16)
    batch, fast = BatchLlama(model, "b", slots=2), lean(model, "f")
    assert batch.bucket_rows and fast.lm.bucket_rows and not BatchLlama(smollm2_shaped(), "f32", 1).bucket_rows
    w = batch.layers[0]["gate_up"]
    for shape in [(1, 72), (3, 7, 72), (2, 17, 72)]:  # 21 and 34 rows are padded to 22 and 36 (or 32, 48)
        x = torch.randn(shape).to(torch.bfloat16)
        rows = x.reshape(-1, 72)  # each row as a product of its own: the padding changes no row
        each = torch.cat([batch.matmul(r[None], w) for r in rows])
        assert torch.equal(batch.matmul(x, w).reshape(len(rows), -1), each)
    # and the bfloat16 lean paths still agree with each other row by row
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(97, (n,), generator=g).tolist() for n in (19, 4)]
    got = batch.forward([0, 1], [0, 0], ids, [2, 2])
    for b, ctx in enumerate(ids):
        torch.testing.assert_close(got[b], lean(model, "ref").forward(ctx, 2), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verification_scores_exactly_what_one_token_steps_score(tiny_pair, dtype):
    """In bfloat16 (and float32), attention over n queries at once rounds differently from n
    one-token steps; the lean path attends the scored rows one by one (and float32 products of
    up to 64 rows keep each row's bits: kernels/f32mm.cpp), so a verification pass returns, bit
    for bit, the logits plain decoding computes, and greedy speculative output equals plain."""
    from specdec import load

    model = smollm2_shaped().to(dtype)
    g = torch.Generator().manual_seed(3)
    ctx, new = torch.randint(97, (40,), generator=g).tolist(), torch.randint(97, (9,), generator=g).tolist()
    for prefix in (ctx[:1], ctx):
        fast = lean(model, "f")
        assert fast.lm.exact_rows
        fast.forward(prefix, 1)
        singles = torch.cat([fast.forward([t], 1) for t in new])
        fast.truncate(len(prefix))
        for n in (2, 5, 9):
            assert torch.equal(fast.forward(new[:n], n), singles[:n]), n
            fast.truncate(len(prefix))
        if dtype == torch.bfloat16:  # leading rows together (as a prompt block), the scored ones alone: in
            # bfloat16 the leading rows' hidden states round alike; in float32 an ulp of the block's attention stays
            assert torch.equal(fast.forward(new, 3), singles[-3:])
    spec = load(tiny_pair["target"], draft=tiny_pair["far"], draft_tokens=5, dtype=dtype)
    plain = spec.plain()
    for prompt in ("def ", "import os\n", "class A:"):
        want = plain.generate(prompt, max_new_tokens=40, temperature=0).token_ids
        got = spec.generate(prompt, max_new_tokens=40, temperature=0)
        assert got.token_ids == want and got.stats.drafted > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_rows_score_exactly_what_the_request_alone_scores(dtype):
    """Each row of a bfloat16 (or float32) batch attends on its own (and its products round as one row's):
    whatever shares the batch and however its rows are padded, a row's logits are, bit for
    bit, those of the same tokens through the one-request path."""
    model = smollm2_shaped().to(dtype)
    g = torch.Generator().manual_seed(4)
    contexts = [torch.randint(97, (n,), generator=g).tolist() for n in (3, 30, 11, 17)]
    feeds = [torch.randint(97, (n,), generator=g).tolist() for n in (9, 1, 5, 3)]
    batch = BatchLlama(model, "b", slots=4)
    assert batch.exact_rows
    if dtype == torch.bfloat16:
        batch.forward([0, 1, 2, 3], [0] * 4, contexts, [0] * 4)  # prefill, rows padded to the longest
    else:  # in float32 a prompt read of more than qgemm.f32_rows() rows in all runs on ATen's matmul, whose
        # rows are not invariant, and a prompt's last query attends alone where its logits are asked for (an ulp
        # apart from the block's): each prompt read as the one-request path reads it
        for b, ctx in enumerate(contexts):
            batch.forward([b], [0], [ctx], [1])
    got = batch.forward([0, 1, 2, 3], [len(c) for c in contexts], feeds, [len(f) for f in feeds])
    for b, (ctx, feed) in enumerate(zip(contexts, feeds, strict=True)):
        fast = lean(model, "f")
        fast.forward(ctx, 1)
        want = torch.cat([fast.forward([t], 1) for t in feed])  # one-token steps: plain decoding
        assert torch.equal(got[b, : len(feed)], want), b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_rows_score_exactly_what_one_token_steps_score(tiny_pair, dtype):
    """A token tree in a bfloat16 (or float32) batch (each node seeing its ancestors only): the chain's last
    token and every node score, bit for bit, what a one-token step at that place scores, so
    greedy speculative decoding with --multi tree equals plain bfloat16 decoding."""
    from specdec import load

    model = smollm2_shaped().to(dtype)
    g = torch.Generator().manual_seed(6)
    ctx, chain = torch.randint(97, (23,), generator=g).tolist(), torch.randint(97, (2,), generator=g).tolist()
    tokens, parents = [5, 7, 9, 11, 13, 2], [-1, 0, 0, 1, -1, 3]
    batch = BatchLlama(model, "b", slots=2)
    batch.forward([1], [0], [ctx], [0 if dtype == torch.bfloat16 else 1])  # float32: the prompt read as alone
    got = batch.forward([1], [len(ctx)], [chain + tokens], [len(tokens) + 1], trees=[parents])[0]

    def one_token_steps(seq):
        fast = lean(model, "f")
        fast.forward(ctx, 1)
        return [fast.forward([t], 1)[0] for t in seq][-1]

    assert torch.equal(got[0], one_token_steps(chain))
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        assert torch.equal(got[i + 1], one_token_steps(chain + path)), i
    spec = load(tiny_pair["target"], draft=f"{tiny_pair['far']}+ngram", multi="tree", policy="fixed", draft_tokens=4,
                dtype=dtype)
    plain = spec.plain()
    for prompt in ("def ", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["):
        got_ids = spec.generate(prompt, max_new_tokens=32, temperature=0)
        assert got_ids.token_ids == plain.generate(prompt, max_new_tokens=32, temperature=0).token_ids
        assert max(e.tree_size for e in got_ids.events) > 1


def test_a_float32_verification_tree_runs_in_the_cpp_loop_and_scores_as_one_token_steps(monkeypatch):
    """In float32 (specdec's float32 kernel, scored rows alone) a verification pass's token tree (one
    pending token, then the nodes) runs in the C++ layer loop: the Python loop's tree attention is
    never called, and every node scores what a one-token step at its place scores."""
    from specdec import layerloop

    monkeypatch.setenv("SPECDEC_LAYER_LOOP", "auto")  # the default, whatever the environment forces
    model = smollm2_shaped().to(torch.float32)
    batch = BatchLlama(model, "b", slots=1)
    assert batch.exact_rows and layerloop.stack_for(batch) is not None

    def python_tree(*args, **kwargs):
        raise AssertionError("the tree pass ran the Python layer loop")

    monkeypatch.setattr(BatchLlama, "_tree_attention", python_tree)
    ctx, tokens, parents = list(range(3, 30)), [5, 7, 9, 11], [-1, 0, 0, 1]
    batch.forward([0], [0], [ctx[:-1]], [1])
    got = batch.forward([0], [len(ctx) - 1], [ctx[-1:] + tokens], [len(tokens) + 1], trees=[parents])[0]
    for i, seq in enumerate([[], [5], [5, 7], [5, 9], [5, 7, 11]]):
        fast = lean(model, "f")
        fast.forward(ctx[:-1], 1)
        want = [fast.forward([t], 1)[0] for t in ctx[-1:] + seq][-1]
        assert torch.equal(got[i], want), i


# ----------------------------------------------------------------- greedy equality per row

PROMPT_LENGTHS, MAX_NEW, KS = (3, 9, 17, 5, 1, 30), (12, 20, 7, 16, 10, 14), (0, 1, 3, 5, 4, 2)


def mixed_requests(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return [Request(p, m, SamplingParams(0.0), k) for p, m, k in zip(prompts, MAX_NEW, KS, strict=True)]


@pytest.fixture(scope="module")
def plain_tiny(tiny_pair):
    from specdec import load

    return load(tiny_pair["target"], draft="none").plain()


@pytest.mark.parametrize("draft", [None, "close", "far", "ngram"])
def test_greedy_rows_equal_unbatched_plain_decoding(tiny_pair, plain_tiny, draft):
    """Mixed prompt lengths, K and max_new_tokens; 6 requests through 4 slots (rows join and leave)."""
    engine = batch_engine(tiny_pair["target"], draft if draft in (None, "ngram") else tiny_pair[draft],
                                         slots=4, draft_dtype=torch.float32)
    requests = engine.generate(mixed_requests(engine.target.vocab_size))
    for r in requests:
        want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert (r.generated, r.finish_reason) == (want.token_ids, want.finish_reason)


def test_a_row_that_stops_early_does_not_disturb_the_others(tiny_pair, plain_tiny):
    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=6, draft_dtype=torch.float32)
    first = engine.generate(mixed_requests(engine.target.vocab_size))
    eos = first[2].generated[2]  # row 2 will now end at its third token
    engine.commits.eos_token_ids = {eos}
    requests = engine.generate(mixed_requests(engine.target.vocab_size))
    saved = plain_tiny.eos_token_ids
    try:
        plain_tiny.eos_token_ids = {eos}
        for r in requests:
            want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
            assert (r.generated, r.finish_reason) == (want.token_ids, want.finish_reason)
    finally:
        plain_tiny.eos_token_ids = saved
    assert requests[2].finish_reason == "eos" and len(requests[2].generated) <= 3
    assert {r.finish_reason for r in requests} == {"eos", "length"}


def test_a_request_the_engine_refuses_ends_alone(tiny_pair, plain_tiny):
    """A prompt past the context or outside the vocabulary ends with its reason; the rows
    beside it in the same step run to the same tokens as they would alone."""
    engine = batch_engine(tiny_pair["target"], "ngram", slots=4)
    good = mixed_requests(engine.target.vocab_size)[:3]
    too_long = Request([5] * engine.target.max_length, 4, SamplingParams(0.0), 2)
    bad_id = Request([1, engine.target.vocab_size + 3], 4, SamplingParams(0.0), 2)
    requests = engine.generate([good[0], too_long, good[1], bad_id, good[2]])
    assert too_long.finish_reason == bad_id.finish_reason == "error"
    assert "context" in too_long.error and "token ids" in bad_id.error and not too_long.generated
    for r in good:
        want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert (r.generated, r.finish_reason, r.error) == (want.token_ids, want.finish_reason, None)
    assert len(requests) == 5 and len(engine.slots.free) == engine.target.slots  # every slot back


# ----------------------------------------------------------------- the exact statistical test, per row


class MarkovBatch:
    """specdec.toy.MarkovLM behind the batched interface: each slot keeps its tokens, cut to
    `start` on every call, so a wrong cache length in the engine changes the logits."""

    def __init__(self, lm: MarkovLM, slots: int) -> None:
        self.lm, self.slots, self.name = lm, slots, lm.name
        self.device = lm.device
        self.vocab_size, self.max_length = lm.vocab_size, lm.max_length
        self.tokens: list[list[int]] = [[] for _ in range(slots)]

    def free(self, slot):  # a freed slot holds nothing: a row that trusted it would fail the assert below
        self.tokens[slot] = []

    def forward(self, slots, starts, new_ids, n_logits, trees=None):
        return self.forward_features(slots, starts, new_ids, n_logits, trees=trees)[0]

    def forward_features(self, slots, starts, new_ids, n_logits, trees=None):
        assert not any(trees or []), "no token trees in these tests"
        out = torch.zeros(len(slots), max(n_logits), self.vocab_size)
        hidden = torch.zeros(len(slots), max(n_logits), MarkovLM.FEATURE_DIM)
        for b, (slot, start, ids, n) in enumerate(zip(slots, starts, new_ids, n_logits, strict=True)):
            assert start <= len(self.tokens[slot])
            toks = self.tokens[slot] = self.tokens[slot][:start] + list(ids)
            for j in range(n):
                out[b, j] = self.lm.logits_after(toks[: len(toks) - n + j + 1])
                hidden[b, j] = self.lm.feature_after(toks[: len(toks) - n + j + 1])
        return out, hidden


def markov_models():
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    good = target.blend(MarkovLM.random(V, order=2, seed=12), 0.35, "good")
    return target, good


V, PROMPT, LENGTH, N, SLOTS = 5, [1, 2], 3, 3000, 15
ROWS = [  # (K, settings), all in every batch
    (3, dict(temperature=1.0)),
    (1, dict(temperature=0.6)),
    (0, dict(temperature=1.0)),
    (4, dict(temperature=0.8, top_p=0.7)),
    (2, dict(temperature=1.2, top_k=4, top_p=0.9)),
]


def toy_engine(prophet: str) -> tuple[BatchEngine, MarkovLM]:
    """prophet: model, ngram, eagle, medusa (feature prophets with a reduced vocabulary) or
    ngram+eagle (multi="first": lookup where it matches, eagle elsewhere)."""
    from tests.prophets.test_feature import toy_prophet

    target, good = markov_models()
    parts = {"model": lambda: ModelProphet(good, rows=MarkovBatch(good, SLOTS)), "ngram": lambda: NgramProphet(2),
             "eagle": lambda: toy_prophet(target, "eagle", (0, 1, 3)),
             "medusa": lambda: toy_prophet(target, "medusa", (0, 2, 3, 4))}
    names = prophet.split("+")
    d = parts[names[0]]() if len(names) == 1 else FirstProphet([parts[n]() for n in names])
    return BatchEngine(MarkovBatch(target, SLOTS), d), target


def row_params(settings) -> SamplingParams:
    return SamplingParams(settings["temperature"], settings.get("top_k"), settings.get("top_p", 1.0))


@pytest.mark.parametrize("prophet", ["model", "ngram", "eagle", "medusa", "ngram+eagle"])
@pytest.mark.slow
def test_every_row_of_a_mixed_batch_matches_the_exact_distribution(prophet):
    engine, target = toy_engine(prophet)
    requests = [Request(PROMPT, LENGTH, row_params(s), k, seed=i) for i in range(N) for k, s in ROWS]
    engine.generate(requests)
    for j, (k, s) in enumerate(ROWS):
        counts = Counter(tuple(r.generated) for r in requests[j :: len(ROWS)])
        result = goodness_of_fit(counts, sequence_distribution(target, PROMPT, LENGTH, row_params(s)), alpha=ALPHA)
        assert result.passed, (k, s, result)


def test_first_hands_a_lone_prophets_q_on_and_pads_the_others():
    """prompt lookup first, eagle after it, rows sampling: where the eagle sampled every row that has
    a q, the step's q is the eagle's own tensor (not copied); where lookup drafted longer than the
    eagle, each sampled row's q is copied into a padded tensor; either way every row the eagle drafted
    reads the eagle's q (the distributions themselves: the mixed-batch chi-square above)."""
    engine, _ = toy_engine("ngram+eagle")
    first = engine.prophet
    eagle = first.parts[1]
    seen: list[tuple[object, object]] = []
    propose, eagle_propose = first.propose, eagle.propose

    def eagle_spy(reqs, ks):
        got = eagle_propose(reqs, ks)
        seen.append((got, None))
        return got

    def first_spy(reqs, ks, budget):
        seen.clear()
        out = propose(reqs, ks, budget)
        eagle_q = seen[0][0].probs if seen else None
        if eagle_q is not None and out.probs is not None:
            shared = out.probs.untyped_storage().data_ptr() == eagle_q.untyped_storage().data_ptr()
            counts["shared" if shared else "copied"] += 1
            for b, name in enumerate(out.names or []):
                if name == eagle.name and not out.one_hot[b]:
                    n = len(out.tokens[b])
                    assert torch.equal(out.probs[b, :n], eagle_q[b, :n])
        return out

    counts = Counter()
    eagle.propose, first.propose = eagle_spy, first_spy
    requests = [Request([1, 2, 3] * (1 + i % 3), 8, SamplingParams(1.0), 1 if i % 2 else 6, seed=i) for i in range(90)]
    engine.generate(requests)
    assert counts["shared"] > 0 and counts["copied"] > 0, counts


@pytest.mark.parametrize("prophet", ["model", "ngram+eagle"])
@pytest.mark.slow
def test_rows_prefilled_a_chunk_per_step_match_the_exact_distribution(prophet):
    """Long prompts go in 2 tokens a step while short rows beside them sample (the chunked
    prefill of a server): each row still follows the target's exact distribution."""
    engine, target = toy_engine(prophet)
    engine.slots.set_prefill_chunk(2)
    long_prompt = [3, 1, 4, 1, 0, 2, 3]
    settings = {"temperature": 1.0}
    requests = [Request(long_prompt if i % 2 else PROMPT, LENGTH, row_params(settings), 3, seed=i)
                for i in range(2 * N)]
    engine.generate(requests)
    for prompt, rows in ((PROMPT, requests[0::2]), (long_prompt, requests[1::2])):
        counts = Counter(tuple(r.generated) for r in rows)
        result = goodness_of_fit(counts, sequence_distribution(target, prompt, LENGTH, row_params(settings)), ALPHA)
        assert result.passed, (prompt, result)


@pytest.mark.parametrize("prophet", ["model", "ngram", "ngram+eagle"])
def test_rows_with_their_own_auto_policy_match_the_exact_distribution(prophet):
    """Each row owns an AutoPolicy (K from its own acceptance, pauses when no K pays)."""
    engine, target = toy_engine(prophet)
    engine.kchoice.set_costs(Costs(1.0, {1: 1.0, 5: 1.4}, 0.05))  # K=1 at low acceptance, K=4 at high
    settings = dict(temperature=0.9, top_p=0.95)
    requests = [Request(PROMPT, LENGTH, row_params(settings), 4, seed=i, policy=AutoPolicy(4, min_rounds=1))
                for i in range(N)]
    engine.generate(requests)
    counts = Counter(tuple(r.generated) for r in requests)
    result = goodness_of_fit(counts, sequence_distribution(target, PROMPT, LENGTH, row_params(settings)), ALPHA)
    assert result.passed, result
    if prophet == "model":
        assert len({k for r in requests for k in r.policy.ks}) > 1  # K really varied with each row's acceptance


def test_auto_rows_stop_drafting_when_no_k_pays_and_stay_greedy_equal(tiny_pair, plain_tiny):
    engine = batch_engine(tiny_pair["target"], tiny_pair["far"], slots=4, draft_dtype=torch.float32)
    engine.kchoice.set_costs(Costs(1.0, {1: 1.0, 2: 2.0, 5: 5.0}, 1.0))  # drafting can never pay
    requests = [Request(r.prompt, 24, SamplingParams(0.0), 4, policy=AutoPolicy(4, min_rounds=1))
                for r in mixed_requests(engine.target.vocab_size)[:4]]
    engine.generate(requests)
    for r in requests:
        assert r.generated == plain_tiny.generate(r.prompt, max_new_tokens=24, temperature=0).token_ids
        assert not r.policy.gains  # no step drafted: no K could pay for the longer pass
    measured = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    auto = [Request(r.prompt, 16, SamplingParams(0.0), 4, policy=AutoPolicy(4)) for r in
            mixed_requests(engine.target.vocab_size)[:4]]
    measured.generate(auto)  # costs measured on the rows themselves, at this batch size
    assert 4 in measured.kchoice.by_bucket
    for r in auto:
        assert r.generated == plain_tiny.generate(r.prompt, max_new_tokens=16, temperature=0).token_ids


def test_one_k_per_step_pays_for_the_padding_of_every_row():
    """Rows are padded to the longest feed: one row's draft makes the whole step longer."""
    engine, _ = toy_engine("ngram")
    costs = Costs(1.0, {1: 1.0, 2: 1.2, 5: 1.8}, 0.0)
    rows = [Request(PROMPT, 8, SamplingParams(0.0), 4, policy=AutoPolicy(4)) for _ in range(4)]
    assert engine.kchoice.step_k(rows, [4, 0, 0, 0], costs) == [0, 0, 0, 0]  # 1 row of 4 cannot pay for it
    assert engine.kchoice.step_k(rows, [4, 4, 4, 4], costs)[0] > 0  # all 4 rows drafting can


def test_negative_control_wrong_residual_is_caught(monkeypatch):
    """Recovering from p instead of norm(max(0, p - q)) must fail the same test."""
    import specdec.batch as batch_mod

    def from_p(draft_tokens, lens, draft_probs, one_hot, target_probs, generators):
        verdict = verify_rows(draft_tokens, lens, draft_probs, one_hot, target_probs, generators)
        rows = torch.arange(len(lens))
        redraw = torch.multinomial(target_probs[rows, verdict.n_accepted], 1).squeeze(-1)
        return RaggedVerdict(verdict.n_accepted, torch.where(verdict.bonus, verdict.next_tokens, redraw),
                             verdict.bonus)

    monkeypatch.setattr(batch_mod, "verify_rows", from_p)
    engine, target = toy_engine("model")
    k, s = ROWS[0]
    requests = engine.generate([Request(PROMPT, LENGTH, row_params(s), k, seed=i) for i in range(N)])
    counts = Counter(tuple(r.generated) for r in requests)
    assert not goodness_of_fit(counts, sequence_distribution(target, PROMPT, LENGTH, row_params(s)), ALPHA).passed


def test_a_row_is_independent_of_its_neighbours_and_of_earlier_requests():
    """Same seed -> same output: alone, in a batch of others, and after other requests used the slots."""
    engine, _ = toy_engine("model")
    alone = engine.generate([Request(PROMPT, 8, row_params(ROWS[0][1]), 3, seed=5)])[0].generated
    others = [Request([i % V, 3], 6, row_params(s), k, seed=100 + i) for i, (k, s) in enumerate(ROWS * 3)]
    mixed = engine.generate([*others[:7], Request(PROMPT, 8, row_params(ROWS[0][1]), 3, seed=5), *others[7:]],
                            max_batch=6)
    assert mixed[7].generated == alone
    assert engine.generate([Request(PROMPT, 8, row_params(ROWS[0][1]), 3, seed=5)])[0].generated == alone


def test_first_prophet_per_row_lookup_then_eagle():
    """ngram+eagle, multi="first": each row drafts with the first prophet that proposes for
    it, the step records whose draft each row verified, and a row's feature is fresh."""
    engine, _ = toy_engine("ngram+eagle")
    requests = [Request([1, 2, 3, 1, 2], 8, SamplingParams(1.0), 3, seed=i) for i in range(12)]
    prophets, running = Counter(), list(requests)
    while running:
        for e in engine.step(running):
            prophets[e.prophet] += 1
            assert e.prophet is None or len(e.drafted) > 0
        running = [r for r in running if not r.done]
    assert prophets["ngram"] > 0 and prophets["eagle"] > 0 and prophets[None] > 0
    assert all(r.feature is None for r in requests)  # finished rows keep no feature


@pytest.mark.parametrize("spec", ["{eagle}", "ngram+{eagle}"])
def test_batched_feature_prophets_are_greedy_equal(tiny_pair, plain_tiny, tiny_eagle, spec):
    engine = batch_engine(tiny_pair["target"], spec.format(eagle=tiny_eagle), slots=4, draft_dtype=torch.float32)
    requests = engine.generate(mixed_requests(engine.target.vocab_size))
    for r in requests:
        want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert (r.generated, r.finish_reason) == (want.token_ids, want.finish_reason)


def test_a_feature_prophet_in_a_token_tree_is_exact(tiny_pair, plain_tiny, tiny_eagle):
    """An eagle head and prompt lookup (or a draft model) in one token tree per row: the tree
    pass also returns each node's feature, and the next drafts start from the last accepted
    node's. Greedy rows equal plain decoding; the chi-square of the batched rows at T=1 holds."""
    from specdec.check import certify

    both = 0  # rounds whose tree holds both prophets' chains
    for other in ("ngram", tiny_pair["close"]):
        dec = load(tiny_pair["target"], draft=f"{other}+{tiny_eagle}", multi="tree", policy="fixed",
                   draft_tokens=3, draft_dtype=torch.float32)
        for prompt in ("def main():", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["):
            got = dec.generate(prompt, max_new_tokens=24, temperature=0)
            assert got.token_ids == plain_tiny.generate(prompt, max_new_tokens=24, temperature=0).token_ids
            both += sum(len(e.proposals) == 2 for e in got.events)
    assert both > 0
    report = certify(dec, dec.plain(), "def ", tokens=2, samples=300, temperature=1.0)
    assert report.result.passed, report.result


def test_a_batched_feature_prophet_drafts_what_it_drafts_alone(tiny_pair, tiny_eagle):
    """The feature each row drafts from is the one the unbatched engine uses (the target's
    hidden state at the last accepted position): the same drafts, round by round."""
    from specdec import load

    alone = load(tiny_pair["target"], draft=tiny_eagle, policy="fixed", draft_tokens=3, draft_dtype=torch.float32)
    engine = batch_engine(tiny_pair["target"], tiny_eagle, slots=3, draft_dtype=torch.float32)
    prompts = [r.prompt for r in mixed_requests(engine.target.vocab_size)][:3]
    reqs = [Request(p, 16, SamplingParams(0.0), 3) for p in prompts]
    drafts: dict[int, list[list[int]]] = {id(r): [] for r in reqs}
    while not all(r.done for r in reqs):
        for e in engine.step(reqs):
            drafts[id(e.request)].append(e.drafted)
    for r in reqs:
        single = [e.drafted for e in alone.generate(r.prompt, max_new_tokens=16, temperature=0).events]
        assert drafts[id(r)] == single and any(single)


def test_a_row_may_keep_to_some_of_the_prophets(tiny_pair, plain_tiny, tiny_eagle):
    """Request.prophets: a row drafts only with the named prophets (none: plain steps); the
    others in the step are unaffected; all stay greedy-equal."""
    engine = batch_engine(tiny_pair["target"], f"ngram+{tiny_eagle}", slots=3, draft_dtype=torch.float32)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    reqs = [Request(prompt, 16, SamplingParams(0.0), 3, prophets=frozenset(only)) if only is not None
            else Request(prompt, 16, SamplingParams(0.0), 3) for only in (["ngram"], [], None)]
    seen: dict[int, set] = {id(r): set() for r in reqs}
    while not all(r.done for r in reqs):
        for e in engine.step(reqs):
            seen[id(e.request)].add(e.prophet)
    assert seen[id(reqs[0])] <= {"ngram", None} and "ngram" in seen[id(reqs[0])]
    assert seen[id(reqs[1])] == {None}
    assert "tiny-eagle" in seen[id(reqs[2])]
    want = plain_tiny.generate(prompt, max_new_tokens=16, temperature=0).token_ids
    assert all(r.generated == want for r in reqs)


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "confidence", "optimal", "auto"])
def test_every_policy_per_row_is_greedy_equal(tiny_pair, plain_tiny, policy):
    """Each row owns a policy of this kind (as the server gives them); mixed prompts and K."""
    from specdec.policy import make_policy

    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    requests = [Request(r.prompt, r.max_new_tokens, r.params, r.k, policy=make_policy(policy, r.k) if r.k else None)
                for r in mixed_requests(engine.target.vocab_size)]
    engine.generate(requests)
    for r in requests:
        want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert (r.generated, r.finish_reason) == (want.token_ids, want.finish_reason)


@pytest.mark.parametrize("prophet", ["eagle", "ngram+eagle"])
def test_greedy_and_sampled_rows_side_by_side_are_each_exact(prophet):
    """Greedy rows draft argmax tokens whose q is one-hot (no full distribution is built for
    them); sampled rows in the same steps keep their q. Each kind stays exact."""
    engine, target = toy_engine(prophet)
    hot = SamplingParams(1.0)
    requests = [Request(PROMPT, LENGTH, SamplingParams(0.0) if i % 2 else hot, 3, seed=i) for i in range(2 * N)]
    engine.generate(requests)
    ctx = list(PROMPT)
    for _ in range(LENGTH):
        ctx.append(int(target.logits_after(ctx).argmax()))
    assert all(r.generated == ctx[len(PROMPT):] for r in requests[1::2])
    counts = Counter(tuple(r.generated) for r in requests[::2])
    result = goodness_of_fit(counts, sequence_distribution(target, PROMPT, LENGTH, hot), ALPHA)
    assert result.passed, result


def test_a_rows_policy_observes_its_share_of_the_steps_time(tiny_pair):
    """A row's policy sees each drafted round with a draft and a target time of its own (the
    step's times shared by its rows), never zeros: a policy that reads timings decides from
    what the batched step really cost."""
    from specdec.policy import Policy

    class Recording(Policy):
        def __init__(self, k: int) -> None:
            super().__init__(k)
            self.seen: list = []

        def observe(self, outcome) -> None:
            self.seen.append(outcome)

    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    requests = [Request(r.prompt, r.max_new_tokens, r.params, r.k, policy=Recording(r.k) if r.k else None)
                for r in mixed_requests(engine.target.vocab_size)]
    engine.generate(requests)
    outcomes = [o for r in requests if r.policy is not None for o in r.policy.seen]
    drafted = [o for o in outcomes if o.drafted]
    assert drafted and all(o.draft_s > 0 and o.target_s > 0 and o.draft_calls == 1 for o in drafted)
    assert all(o.target_s > 0 for o in outcomes)


def alone_and_together(decoder, prompts, **settings):
    """Each prompt generated alone (a batch of one), then all as rows of one batch
    (generate_many, the same settings and seed); asserts that each row verified, round for
    round, the same prophets' drafts and gave the same tokens as the request alone: the
    batched drafting (early stops, per-row choices, draft caches) depends on the row only.
    Returns (alone, together)."""
    alone = [decoder.generate(p, **settings) for p in prompts]
    together = decoder.generate_many(prompts, max_batch=len(prompts), **settings)
    for a, t in zip(alone, together, strict=True):
        assert [(e.prophet, e.drafted) for e in t.events] == [(e.prophet, e.drafted) for e in a.events]
        assert t.token_ids == a.token_ids
    return alone, together


REPEATING_PROMPTS = ["def main():", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = [1,", "import os\nimport os\nimport"]


@pytest.mark.parametrize("draft", ["close", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_confidence_policy_stops_batched_drafts_as_it_stops_a_request_alone(tiny_pair, tiny_eagle, draft,
                                                                                 temperature):
    """The confidence policy's early stop runs in batched drafting (a model's rows, a feature
    prophet's rows): each row drafts, round for round, the tokens its request drafts alone
    with the same policy, seed and settings, and some drafts do stop early."""
    spec = {"close": tiny_pair["close"], "eagle": tiny_eagle}[draft]
    decoder = load(tiny_pair["target"], draft=spec, policy="confidence", draft_tokens=6, draft_dtype=torch.float32)
    decoder.policy.threshold = 0.6 if temperature == 0 else 0.3
    alone, _ = alone_and_together(decoder, ["def main():", "import os\n"], max_new_tokens=40,
                                  temperature=temperature, seed=3)
    # drafts shorter than K=6 while the length left allowed K: the early stop (not the length's cut)
    short = sum(0 < len(e.drafted) < 6 for a in alone for e in a.events if e.index < len(a.events) - 3
                and sum(len(x.committed) for x in a.events[: e.index]) + 7 <= 40)
    assert short > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_best_chooses_per_row_as_for_a_request_alone(tiny_pair, tiny_eagle, temperature):
    """--multi best on the one loop: each row's prophet is the one with the best recent tokens
    per round in its own request (Request.recent), so each row verifies, round for round,
    the drafts of the prophets its request picks alone, with the same tokens."""
    decoder = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", multi="best", policy="fixed", draft_tokens=3,
                   draft_dtype=torch.float32)
    batched, _ = alone_and_together(decoder, REPEATING_PROMPTS, max_new_tokens=40, temperature=temperature,
                                    seed=5)
    assert len({e.prophet for b in batched for e in b.events if e.drafted}) == 2  # both prophets drafted somewhere


@pytest.mark.parametrize("prophet", ["layerskip:1", "kangaroo"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_early_exit_drafts_for_rows_as_for_a_request_alone(tiny_pair, prophet, temperature, tmp_path):
    """layerskip and kangaroo on the one loop: the target's first layers draft in each row's
    own slot (entries past its committed tokens, overwritten by verification); round for
    round a row drafts as its request alone, the same tokens, greedy equal to plain."""
    from specdec.prophets.feature import FeatureHead, save_head

    spec = prophet
    if prophet == "kangaroo":
        plain = load(tiny_pair["target"], draft="none")
        dim = plain.target.head().shape[1]
        torch.manual_seed(3)
        head = FeatureHead("kangaroo", dim, rank=8, depth=1, layers=1)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.05)
        save_head(head, torch.arange(0, plain.target.vocab_size, 2), tmp_path / "k",
                  {"vocab_size": plain.target.vocab_size})
        spec = str(tmp_path / "k")
    decoder = load(tiny_pair["target"], draft=spec, policy="fixed", draft_tokens=3, draft_dtype=torch.float32)
    prompts = ["def main():", "import os\nimport os\nimport"]
    settings = dict(max_new_tokens=24, temperature=temperature, seed=2)
    batched, _ = alone_and_together(decoder, prompts, **settings)
    assert all(sum(len(e.drafted) for e in b.events) > 0 for b in batched)
    if temperature == 0:
        plain = decoder.plain()
        assert [b.token_ids for b in batched] == [plain.generate(p, **settings).token_ids for p in prompts]


def test_seeded_sampled_rows_keep_request_costs_and_the_others_follow_the_batch(tiny_pair):
    """K policies that read costs: a greedy row and an unseeded sampled row decide from the
    costs of a step at the batch's size (and take the step's common K); a seeded sampled row
    from costs fixed for the request (`row_costs`), so its tokens never depend on the batch."""
    from specdec.policy import make_policy

    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    alone, shared = Costs(1.0, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, 0.1), Costs(1.0, {1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}, 0.1)
    engine.kchoice.by_bucket = {1: alone, 2: shared, 4: shared}
    engine.kchoice.row_costs = alone
    rows = [Request([5, 6, 7, 8], 6, SamplingParams(temperature), 3, seed, make_policy("auto", 3))
            for temperature, seed in ((0.0, None), (1.0, None), (1.0, 7))]
    engine.step(rows)
    assert rows[0].policy.costs is shared and rows[1].policy.costs is shared
    assert rows[2].policy.costs is alone
    engine.generate(rows)
    assert all(r.done for r in rows)


def test_batched_step_costs_are_measured_once_per_machine_and_stored(tiny_pair, tmp_path, monkeypatch):
    """The costs of a step of each batch-size bucket are stored with the decoder's own stored
    costs: a decoder loaded again (another process) reads them and never measures again."""
    import specdec.kchoice as kchoice

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    prompts = ["def main():", "import os\n", "class A:", "x = ["]

    def run() -> None:
        load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3, draft_dtype=torch.float32).generate_many(
            prompts, max_new_tokens=6, temperature=0.0)

    run()
    assert len(list((tmp_path / "cache" / "costs").glob("*.json"))) >= 2  # the decoder's, and bucket 4's at least
    monkeypatch.setattr(kchoice, "measure_rows", lambda *a, **k: pytest.fail("measured again"))
    run()


@pytest.mark.parametrize("multi", ["first", "best"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_beside_prompt_lookup_drafts_for_rows_as_for_a_request_alone(tiny_pair, multi, temperature):
    """A draft model among several prophets (here after prompt lookup) on the one loop: its own
    cache per row catches up on the tokens of rounds another prophet drafted; round for round
    a row's drafts and tokens are its request's alone, greedy and T=1."""
    decoder = load(tiny_pair["target"], draft=f"ngram+{tiny_pair['close']}", multi=multi, policy="fixed",
                   draft_tokens=3, draft_dtype=torch.float32)
    batched, _ = alone_and_together(decoder, REPEATING_PROMPTS, max_new_tokens=30, temperature=temperature,
                                    seed=4)
    assert len({e.prophet for b in batched for e in b.events if e.drafted}) == 2  # both prophets drafted somewhere


@pytest.mark.parametrize("recent", [0.2, 0.95])
def test_a_prophet_that_does_not_pay_at_the_batch_size_is_not_asked(tiny_pair, recent):
    """Every row's recent acceptance of a prophet (pooled over rows) against the step costs at
    this batch size: where no K pays, greedy and unseeded rows do not ask it at all (its
    drafting would be paid for, then cut); a seeded sampled row keeps its own policy's K, and
    a prophet that pays drafts as before."""
    from specdec.policy import make_policy

    engine = batch_engine(tiny_pair["target"], f"ngram+{tiny_pair['close']}", slots=4,
                          draft_dtype=torch.float32, multi="first")  # lookup first: drafts are cut after
    model = engine.prophet.parts[1]
    asked: list[list[int]] = []
    propose = model.propose
    model.propose = lambda reqs, ks: (asked.append(list(ks)), propose(reqs, ks))[1]
    engine.kchoice.set_costs(Costs(1.0, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.3))
    engine.kchoice.row_costs = Costs(1.0, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.01)
    engine.kchoice.pooled[model.name] = [100.0, 100.0 * recent]
    rows = [Request([5, 6, 7, 8 + i], 12, SamplingParams(t), 3, seed, make_policy("fixed", 3))
            for i, (t, seed) in enumerate(((0.0, None), (1.0, None), (1.0, 7)))]
    for r in rows:
        r.policy.needs_costs = True  # read costs as auto does, with a fixed K
    events = {id(e.request): e for e in engine.step(rows)}
    drafted = [len(events[id(r)].drafted) for r in rows]
    if recent < 0.5:  # never asked for the batch-free rows
        assert [ks[:2] for ks in asked] == [[0, 0]] and drafted[0] == drafted[1] == 0 and drafted[2] > 0
    else:
        assert asked[0][:2] == [3, 3] and all(d > 0 for d in drafted)


@pytest.mark.parametrize("pays", [False, True])
def test_a_prophet_never_pooled_is_not_asked_where_the_rows_expectations_do_not_pay(tiny_pair, pays):
    """Before any acceptance of a prophet is pooled (its drafts so far all cut by the step), the
    rows' own policies' expectations stand in for it: where no K pays at this batch size the
    greedy rows do not ask it (else a prophet whose drafts are always cut is paid for at every
    step and never pools the evidence that would stop it: 0.90x batched plain at 64 server
    clients); where drafting is cheap it is asked as before."""
    from specdec.policy import make_policy

    engine = batch_engine(tiny_pair["target"], f"ngram+{tiny_pair['close']}", slots=4,
                          draft_dtype=torch.float32, multi="first")
    model = engine.prophet.parts[1]
    asked: list[list[int]] = []
    propose = model.propose
    model.propose = lambda reqs, ks: (asked.append(list(ks)), propose(reqs, ks))[1]
    engine.kchoice.set_costs(Costs(1.0, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.01) if pays else
                     Costs(1.0, {1: 1.0, 2: 1.6, 3: 2.2, 4: 2.8}, 0.9))
    assert model.name not in engine.kchoice.pooled
    rows = [Request([5, 6, 7, 8 + i], 12, SamplingParams(0.0), 3, None, make_policy("auto", 3)) for i in range(3)]
    engine.step(rows)
    if pays:
        assert asked and any(asked[0])
    else:  # prior 0.6 a position: no K pays 1.6 plain steps a token verified and 0.9 a drafted one
        assert all(not any(ks) for ks in asked)


def test_a_prophets_measured_drafting_is_at_least_its_drafting_timed_alone(tiny_pair, monkeypatch):
    """A round less its pass is a difference of two noisy times (with many rows it came out 0 for
    eagle: drafts counted free): the drafting each round implies is floored by the same drafting
    timed alone. Timings made up so the difference is 0: the per-token cost is the alone time's."""
    import specdec.coststore as coststore_module

    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=2, draft_dtype=torch.float32)
    name = engine.parts[0].name

    def made_up(fns, repeats, after=lambda: None, budget_s=None):  # pass n: 10 ms; a round: its pass' time;
        out = {}                                                     # alone: 2 ms a token
        for key in fns:
            fns[key]()
            after()
            out[key] = [0.010 if not isinstance(key, tuple) or len(key) == 2 else 0.002 * key[1]]
        return out

    monkeypatch.setattr(coststore_module, "interleaved_times", made_up)
    costs = measure(engine, 2, 3, [5, 6, 7, 8])
    assert costs.t_draft_by[name] == pytest.approx(0.002 / 2) and costs.t_call_by[name] == pytest.approx(0.0)
    assert costs.sampled is not None and costs.sampled.t_draft_by[name] == pytest.approx(0.002 / 2)


@pytest.mark.parametrize("prophet", ["model", "ngram+eagle"])
def test_measuring_costs_on_running_rows_changes_nothing_they_do(prophet):
    """A bucket's costs are measured on the rows of its first step (each prophet's propose,
    the pass, probabilities and verification, greedy and at T=1): every row's settings,
    generator, feature and cache lengths come back as they were, so its tokens are those
    of the same request on an engine that never measured."""
    runs = []
    for measured in (False, True):
        engine, _ = toy_engine(prophet)
        reqs = [Request(PROMPT, 24, SamplingParams(0.8), 3, seed=s) for s in (1, 2)]
        for _ in range(2):
            engine.step(reqs)
        if measured:
            before = [(r.params, r.generator.get_state().clone(), r.feature, dict(r.draft_cached), r.target_cached)
                      for r in reqs]
            costs = measure_rows(engine, reqs, 3)
            assert costs.sampled is not None and costs.context == max(len(r.context) for r in reqs)
            for r, (params, state, feature, cached, target_cached) in zip(reqs, before, strict=True):
                assert r.params == params and torch.equal(r.generator.get_state(), state)
                assert (r.feature is None) == (feature is None) and (feature is None or r.feature is feature)
                assert r.draft_cached == cached and r.target_cached == target_cached
        while not all(r.done for r in reqs):
            engine.step(reqs)
        runs.append([r.generated for r in reqs])
    assert runs[0] == runs[1]


def test_one_llama_path_the_decoders_views_share_the_weights_read_once(tiny_pair):
    """The decoder's target is a one-slot BatchLlama; its views (another decoder's, the engine's)
    read the same weights (nothing fused, quantized or probed again), each with caches of its own."""
    from specdec import load
    from specdec.wiring import engine_for

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_dtype=torch.float32)
    target, engine = decoder.target, engine_for(decoder, 4)
    assert isinstance(target, BatchLlama) and target.slots == 1
    other = OneSequence(target.view(1))
    for view in (other.lm, engine.target):
        assert view.layers is target.layers and view.embed is target.embed
        assert view.k_slots is not target.k_slots
    assert engine.target.slots == 4 and other.tokens == [] and other.lm.forward_calls == 0
    ids = decoder.prompt_ids("def f(x):")
    torch.testing.assert_close(other.forward(ids, 1)[0], engine.target.forward([2], [0], [ids], [1])[0, 0])


def test_a_request_knows_its_length_and_context_tail_without_building_it():
    from specdec.request import Request

    r = Request([5, 6, 7], 8)
    r.generated += [8, 9]
    assert r.length == len(r.context) == 5
    assert [r.context_from(i) for i in range(7)] == [r.context[i:] for i in range(7)]


def test_prompt_lookup_in_the_loop_drafts_from_each_requests_index(tiny_pair):
    """Prompt lookup drafts from an index kept in each request (`Request.lookups`); its greedy
    output is plain decoding's."""
    from specdec import load

    decoder = load(tiny_pair["target"], draft="ngram", draft_tokens=4, policy="fixed")
    assert type(decoder._one_loop().prophet) is NgramProphet
    prompt = "import os\nimport sys\nimport os\nimport sys\nimport"
    out = decoder.generate(prompt, max_new_tokens=16, temperature=0.0)
    assert out.stats.drafted > 0
    assert out.token_ids == decoder.plain().generate(prompt, max_new_tokens=16, temperature=0.0).token_ids
