"""The transformers path (`specdec.hf.HFSequence`) on tiny random models of every family people
run, each built from its transformers config (tests/families.py): full attention (Llama, Qwen3),
sliding windows on every layer (Mistral, Phi-3), sliding and full layers mixed (Qwen2, Gemma 2,
Gemma 3), and generation configs asking transformers for its static, hybrid and quantized
caches. Contexts run several times past the window (8 positions).

Rollback as a contract: logits after truncating a rejected draft and feeding on equal one fresh
forward of the whole sequence (transformers' own, no cache), to 1e-4 (float32; the two differ
only in the order of sums); a token tree's logits equal the chains'. Through the one loop: greedy
speculative output equals plain decoding with drafts forced to be accepted in full, in part and
not at all, alone and batched."""

import pytest
import torch

from specdec import load
from specdec.decoder import SpeculativeDecoder
from specdec.hf import HFLM, HFSequence
from specdec.policy import Policy
from specdec.prophets.base import BatchDraft
from tests.families import FAMILIES, VOCAB, WINDOW, make_family_model, save_family_model

SLIDING = ["mistral", "qwen2", "gemma2", "gemma3", "phi3"]
ATOL = 1e-4


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, make_family_model(request.param)


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    """Transformers' own forward of the whole sequence, no cache: (len, V)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def test_truncate_then_feed_on_equals_a_fresh_forward(family):
    name, model = family
    seq = ids(5 * WINDOW, 0)
    want = fresh_logits(model, seq)
    lm = HFSequence(model, name)
    lm.forward(seq[:20], 1)
    lm.forward(ids(6, 1), 6)  # a draft past the window, rejected whole
    lm.truncate(20)
    got = lm.forward(seq[20:30], 10)
    lm.forward(ids(4, 2), 4)
    lm.truncate(27)  # three of the last chunk taken back too, as after a partial rejection
    assert lm.tokens == seq[:27] and lm.cache.get_seq_length() == 27
    again = lm.forward(seq[27:], len(seq) - 27)
    assert torch.allclose(got, want[20:30], atol=ATOL)
    assert torch.allclose(again, want[27:], atol=ATOL)


@pytest.mark.parametrize("name", SLIDING)
def test_transformers_own_sliding_cache_cannot_roll_back_past_the_window(name):
    """The negative control: the cache transformers builds for these configs evicts what leaves
    the window, so the test above would crash on it (the crash HFSequence's own cache avoids)."""
    from transformers import DynamicCache

    model = make_family_model(name)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids(3 * WINDOW, 0)]), cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-3)


def test_a_tree_pass_equals_its_chains_past_the_window(family):
    name, model = family
    ctx = ids(3 * WINDOW, 3)
    tokens, parents = ids(7, 4), [-1, 0, 1, -1, 3, 4, 0]  # branches 0-1, 3-4-5, 0-6
    lm = HFSequence(model, name)
    lm.forward(ctx[:-2], 1)
    tree = lm.forward_tree(ctx[-2:], tokens, parents)  # (1 + 7, V)
    for path in ([0, 1], [3, 4, 5], [0, 6]):
        want = fresh_logits(model, ctx + [tokens[n] for n in path])[-len(path) - 1 :]
        assert torch.allclose(tree[[0] + [n + 1 for n in path]], want, atol=ATOL), path
    lm.keep_tree_path(2, [3, 4, 5], tokens)
    assert lm.tokens == ctx + [tokens[3], tokens[4], tokens[5]]
    nxt = lm.forward([17], 1)
    assert torch.allclose(nxt, fresh_logits(model, lm.tokens)[-1:], atol=ATOL)


def test_features_are_what_the_head_read_and_logits_the_models_own(family):
    """forward_features returns the model's own logits (Gemma 2's soft-capping included) and the
    hidden states its head multiplied."""
    name, model = family
    seq = ids(2 * WINDOW, 5)
    logits, hidden = HFSequence(model, name).forward_features(seq, 3)
    assert torch.allclose(logits, fresh_logits(model, seq)[-3:], atol=ATOL)
    head = model.get_output_embeddings().weight.detach()
    raw = hidden @ head.T.float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    assert torch.allclose(torch.tanh(raw / cap) * cap if cap else raw, logits, atol=ATOL)


class ForcedProphet:
    """Drafts what plain greedy decoding gives (`want`), then one wrong token: round by round
    j = 0, 1, ..., K correct tokens first, so drafts are rejected at once, in part, or accepted
    whole (j = K: no wrong token). Deterministic, as prompt lookup is (q one-hot)."""

    reads_features, fused_layers, draft_lm, is_lookup, model_steps, combine, vocab_size = (
        False, (), None, True, False, None, None)

    def __init__(self, want: dict[tuple[int, ...], list[int]]) -> None:
        self.want, self.name, self.rounds = want, "forced", 0

    @property
    def parts(self):
        return [self]

    def for_engine(self, target, slots, branches=1):
        return self

    def room(self, req):
        return 1 << 30

    def prefill(self, reqs):
        pass

    def free(self, slot):
        pass

    def settle(self, reqs, leave=0):
        pass

    def propose(self, reqs, ks, budget=None):
        drafts = []
        for r, k in zip(reqs, ks, strict=True):
            self.rounds += 1
            right = self.want[tuple(r.prompt)][len(r.generated) :]
            j = self.rounds % (k + 1)
            drafts.append((right[:j] + [(right[j] + 1) % VOCAB if j < len(right) else 1])[:k] if k else [])
        return BatchDraft(drafts, None)


def test_greedy_speculative_equals_plain_with_forced_rejections(family):
    name, model = family
    prompts = [ids(5, 10 + i) for i in range(3)]
    plain = SpeculativeDecoder(HFLM(model, name))
    want = {tuple(p): plain.generate(p, max_new_tokens=4 * WINDOW, temperature=0).token_ids for p in prompts}
    prophet = ForcedProphet(want)
    spec = SpeculativeDecoder(HFLM(model, name), prophet, policy=Policy(4))
    for p in prompts:
        out = spec.generate(p, max_new_tokens=4 * WINDOW, temperature=0)
        assert out.token_ids == want[tuple(p)]
        assert 0 < out.stats.accepted < out.stats.drafted  # some drafts taken, some refused
    batched = spec.generate_many(prompts, max_new_tokens=4 * WINDOW, temperature=0, max_batch=3)
    assert [g.token_ids for g in batched] == [want[tuple(p)] for p in prompts]


@pytest.mark.parametrize("name,cache", [("llama", "static"), ("gemma2", "hybrid"), ("mistral", "sliding_window"),
                                        ("qwen3", "quantized"), ("gemma3", None)])
def test_a_saved_model_loads_and_speculates_whatever_cache_its_generation_config_asks_for(tmp_path, name, cache):
    """A local directory (save_pretrained + a tokenizer) loads with `specdec.load`; the cache
    its generation config names for transformers' generate is not the one specdec rolls back, so
    speculation stays exact with the default prophets (prompt lookup and the suffix index over the
    context, the better one drafting) and with an early exit beside prompt lookup (a token tree)."""
    path = save_family_model(name, tmp_path, cache_implementation=cache)
    prompt = "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\na = 1\n"
    plain = load(path, draft="none").generate(prompt, max_new_tokens=3 * WINDOW, temperature=0)
    for draft, multi in [("default", "best"), ("ngram+layerskip:1", "tree")]:
        dec = load(path, draft=draft, policy="fixed", draft_tokens=4)
        out = dec.generate(prompt, max_new_tokens=3 * WINDOW, temperature=0)
        assert dec.multi == multi and out.token_ids == plain.token_ids, draft
        assert out.stats.drafted > 0


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sampled_speculation_past_the_window_keeps_the_distribution(tmp_path, name):
    """The chi-square of `specdec check` on a sliding family, its context past the window."""
    from specdec.check import certify

    dec = load(save_family_model(name, tmp_path), draft="ngram+retrieval:context+layerskip:1", policy="fixed",
               draft_tokens=3)
    report = certify(dec, dec.plain(), "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny =", tokens=2, samples=300,
                     temperature=1.0)
    assert report.result.passed, report.result
