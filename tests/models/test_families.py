"""Every model family on specdec's own decode path (`specdec.families`), on tiny random-weight
models built from each family's transformers config (no download): logits equal transformers'
forward in float32, token by token and in chunks; windows and soft-caps do matter (negative
control); greedy speculative output equals plain decoding (chains, trees, batched rows, int4);
and one chi-square run of the sampled loop per family against the model's exact distribution."""

from collections import Counter

import pytest
import torch

from specdec import families, load
from specdec.certify import goodness_of_fit
from specdec.llama import BatchLlama
from tests.helpers import ALPHA, lean

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
WINDOW = 8  # sliding windows this short, so that every test crosses them
TOLERANCE = 2e-5  # max |logit difference| against transformers in float32 (measured: <= 1e-6)


def family_model(family: str, vocab: int, seed: int, layers: int = 4, noise: float = 0.0):
    """A tiny random model of a family (4 heads over 2 kv heads; Gemma's and Mistral's sliding
    windows of WINDOW tokens; norms and biases away from their initial values)."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2)
    cfg = {
        "llama": lambda: T.LlamaConfig(**common),
        "mistral": lambda: T.MistralConfig(**common, sliding_window=WINDOW),
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=32),
        "gemma2": lambda: T.Gemma2Config(**common, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         layer_types=alternating),
        "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                             layer_types=alternating),
        "phi3": lambda: T.Phi3Config(**common),
    }[family]()
    cfg._attn_implementation = "eager"  # (Gemma 2's soft-capping needs it; the others compute alike)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).float().eval()
    other = torch.Generator().manual_seed(seed + 1)  # the noise's own draws: the rest is the same model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(3.0)  # peakier distributions than the initializer's
            if noise:
                p.add_(torch.randn(p.shape, generator=other) * noise)
    return model


@pytest.fixture(scope="module")
def family_dirs(tiny_pair, tmp_path_factory):
    """Per family a target and a close prophet (the target plus noise) saved with from_pretrained,
    with the tiny tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        for role, noise in (("target", 0.0), ("close", 0.02)):
            model = family_model(family, len(tok), 0, noise=noise)
            path = root / f"{family}-{role}"
            model.save_pretrained(str(path))
            tok.save_pretrained(str(path))
            out[family, role] = str(path)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_in_float32(family):
    model = family_model(family, 300, 1)
    assert families.why_not(model) is None
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    lm = lean(model, family)
    got = torch.cat([lm.forward(ids[:20], 20), lm.forward(ids[20:30], 10), *(lm.forward([t], 1) for t in ids[30:])])
    assert float((got - want).abs().max()) <= TOLERANCE
    lm.truncate(25)  # a rollback is a length change: re-scored tokens score as before
    again = torch.cat([lm.forward(ids[25:33], 8), *(lm.forward([t], 1) for t in ids[33:])])
    assert float((again - want[25:]).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_without_its_windows_a_family_scores_otherwise(family):
    """Negative control: the same model with its sliding windows dropped is far off transformers'."""
    import dataclasses

    model = family_model(family, 300, 1)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    lm = lean(model, family)
    lm.lm.arch = dataclasses.replace(lm.lm.arch, windows=())
    assert float((lm.forward(ids, 40) - want).abs().max()) > 100 * TOLERANCE


def test_a_model_no_family_runs_goes_to_transformers_with_a_reason():
    import transformers as T

    cfg = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2)
    model = T.GPT2LMHeadModel(cfg)
    assert "no family file" in (families.why_not(model) or "")
    with pytest.raises(ValueError, match="cannot run on the fast path"):
        lean(model, "gpt2")
    rope = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, rope_parameters={"rope_type": "dynamic",
                                                                                    "rope_theta": 10000.0,
                                                                                    "factor": 2.0}))
    assert "rotary kind dynamic" in (families.why_not(rope) or "")


PROMPTS = ["def main():\n    ", "import os\n", "class Foo(object):\n    def __init__(self", "for i in range("]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain_for_every_row_path(family, family_dirs):
    target, close = family_dirs[family, "target"], family_dirs[family, "close"]
    plain = load(target, draft="none")
    assert isinstance(plain.target, BatchLlama), "the family runs on the fast path"
    want = [plain.generate(p, max_new_tokens=24, temperature=0).token_ids for p in PROMPTS]
    chain = load(target, draft=close, draft_tokens=4, policy="fixed")
    tree = load(target, draft=f"{close}+ngram", draft_tokens=3, multi="tree", policy="fixed")
    for dec in (chain, tree):
        got = [dec.generate(p, max_new_tokens=24, temperature=0) for p in PROMPTS]
        assert [g.token_ids for g in got] == want
        assert sum(g.stats.accepted for g in got) > 0  # the prophet's drafts were verified, some kept
    rows = chain.generate_many([{"prompt": p, "max_new_tokens": 24, "temperature": 0} for p in PROMPTS], max_batch=4)
    assert [r.token_ids for r in rows] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_greedy_speculative_equals_int4_plain(family, family_dirs):
    target, close = family_dirs[family, "target"], family_dirs[family, "close"]
    plain = load(target, draft="none", dtype="int4")
    assert plain.target.int4
    spec = load(target, draft=close, draft_tokens=4, dtype="int4", policy="fixed")
    for p in PROMPTS[:2]:
        assert spec.generate(p, max_new_tokens=20, temperature=0).token_ids == \
            plain.generate(p, max_new_tokens=20, temperature=0).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_speculative_loop_reproduces_the_second_token_distribution(family, family_dirs):
    """T=1 with a close prophet (K=3): the second generated token's distribution (the first
    round's verification, acceptances, residuals) against its exact marginal computed from
    the model, sum over t1 of p(t1) p(t2 | t1), by Pearson's chi-square at ALPHA."""
    from transformers import AutoModelForCausalLM

    target, close = family_dirs[family, "target"], family_dirs[family, "close"]
    spec = load(target, draft=close, draft_tokens=3, policy="fixed")
    prompt = spec.prompt_ids("x = [")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = spec.target.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1, :vocab].double(), -1)
        both = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(model(both).logits[:, -1, :vocab].double(), -1)
    stops = sorted(spec.eos_token_ids)  # a first token that ends the request: its own outcome
    going = torch.ones(vocab, dtype=torch.double)
    going[stops] = 0
    exact: dict[object, float] = {t: float(p) for t, p in enumerate(((p1 * going)[:, None] * p2).sum(0))}
    exact["stop"] = float(p1[stops].sum())
    counts: Counter = Counter()
    for seed in range(1500):
        g = spec.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed)
        counts[g.token_ids[1] if len(g.token_ids) > 1 else "stop"] += 1
    result = goodness_of_fit(counts, exact, alpha=ALPHA)
    assert result.passed, result.verdict


@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"])
def test_the_cpp_loop_computes_the_python_loops_bits_for_every_family(family, dtype, family_dirs, monkeypatch):
    """Each family's extras in the C++ layer loop (biases, q/k norms, output norms, GeGLU, scale, windows, a
    rotary table per layer) compute the Python loop's bits: logits, features and every key and value, over
    ragged prompts, verification passes, steps, early exits and trees (Gemma 2's soft-capped attention stays
    in the Python loop)."""
    from specdec import layerloop, qgemm
    from tests.models.test_layerloop import _both, _equal, _passes

    if not qgemm.available():
        pytest.skip(f"the extension does not build here: {qgemm.why_unavailable()}")
    lm = load(family_dirs[family, "target"], draft="none", dtype=dtype).target
    assert layerloop.stack_for(lm) is not None
    (cpp, cpp_cache), (python, python_cache) = _both(lm, monkeypatch, _passes)
    assert _equal(cpp, python) and _equal(cpp_cache, python_cache)


def test_gemma2_keeps_the_python_loop(family_dirs):
    from specdec import layerloop

    assert layerloop.stack_for(load(family_dirs["gemma2", "target"], draft="none").target) is None
