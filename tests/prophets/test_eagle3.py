"""The EAGLE-3-style prophet: its drafting runtime computes what training unrolls, and on
the one loop it is exact (greedy equality with plain decoding, alone and batched; the
chi-square of the whole loop at T=1)."""

import pytest
import torch

from specdec import load
from specdec.api import batch_engine
from specdec.prophets.eagle3 import Eagle3Net, Eagle3Runtime, is_eagle3, load_eagle3, save_eagle3
from specdec.request import Request
from specdec.sampling import SamplingParams


def _net(dim=32, n_fused=3, seed=0):
    torch.manual_seed(seed)
    net = Eagle3Net(dim, n_heads=4, n_kv=2, head_dim=8, mlp=48, n_fused=n_fused)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return net.eval()


def _tables(t, hd=8):
    freqs = torch.arange(t).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("loop", ["C++", "python"])
def test_drafting_runs_the_layer_as_training_unrolls_it(split, loop):
    """Slots fed true features then the layer's own outputs (the runtime, caches by slot)
    give the outputs of the training-time test at the last origin, step by step; feeding the
    true slots in two calls (a catch-up after a round) changes nothing. Both ways of running
    the layer: as a one-layer stack of the C++ layer loop, and op by op."""
    net, dim, t, steps = _net(), 32, 9, 3
    cos, sin = _tables(t + steps)
    torch.manual_seed(1)
    fused = torch.randn(1, t, 3 * dim)
    vocab = 50
    embed = torch.randn(vocab, dim)
    ids = torch.randint(0, vocab, (t + steps,))
    with torch.no_grad():
        outs = net.unrolled(fused, embed[ids[1:]][None], cos, sin, steps)
    rt = Eagle3Runtime(net, torch.arange(vocab), (0, 1, 2), embed, torch.randn(vocab, dim), cos, sin, slots=2)
    if loop == "python":
        rt.stack = None
    else:
        from specdec import qgemm

        if not qgemm.available():
            pytest.skip("the C++ extension does not build here")
        assert rt.stack is not None
    toks = ids.tolist()
    if split is None:
        g = rt.run([1], [0], [fused[0]], [toks[1 : t + 1]], [True])
    else:
        rt.run([1], [0], [fused[0, :split]], [toks[1 : split + 1]], [True])
        g = rt.run([1], [split], [fused[0, split:]], [toks[split + 1 : t + 1]], [True])
    torch.testing.assert_close(g[0], outs[0][0, t - 1], rtol=1e-4, atol=1e-4)
    for j in range(2, steps + 1):  # slot t-1+j-1 takes the last output and x_{t+j-1}
        g = rt.run([1], [t - 2 + j], [g], [[toks[t - 1 + j]]], [False])
        torch.testing.assert_close(g[0], outs[j - 1][0, t - 1], rtol=1e-4, atol=1e-4)


def test_saved_and_loaded_weights_draft_alike(tmp_path):
    net = _net()
    save_eagle3(net, torch.arange(7), (0, 1, 2), tmp_path / "e3", {"note": "test"})
    assert is_eagle3(tmp_path / "e3")
    back, vocab, cfg = load_eagle3(tmp_path / "e3")
    assert vocab.tolist() == list(range(7)) and cfg["layers"] == [0, 1, 2]
    x = torch.randn(2, 5, 96)
    with torch.no_grad():  # int8 rows: within a percent
        a, b = net.fused(x), back.fused(x)
    assert (a - b).abs().max() < 0.02 * a.abs().max()


@pytest.fixture(scope="module")
def tiny_eagle3(tiny_pair, tmp_path_factory):
    """A random (imperfect) eagle3 layer over the tiny target's two layers, as shipped."""
    dim = load(tiny_pair["target"], draft="none").target.head().shape[1]
    torch.manual_seed(3)
    net = Eagle3Net(dim, n_heads=4, n_kv=2, head_dim=16, mlp=96, n_fused=2)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.2)
    path = tmp_path_factory.mktemp("eagle3") / "tiny-eagle3"
    save_eagle3(net, torch.arange(0, 300), (0, 1), path, {})
    return str(path)


@pytest.fixture(scope="module")
def plain_tiny(tiny_pair):
    return load(tiny_pair["target"], draft="none").plain()


@pytest.mark.parametrize("spec", ["{e3}", "ngram+{e3}"])
def test_eagle3_rows_are_greedy_equal_to_plain_decoding(tiny_pair, plain_tiny, tiny_eagle3, spec):
    """Rows of several prompt lengths (prefilled in chunks), joining and leaving, alone and
    batched: the tokens of plain decoding; the prophet drafts once a row's prompt is in."""
    engine = batch_engine(tiny_pair["target"], spec.format(e3=tiny_eagle3), slots=3, draft_dtype=torch.float32)
    engine.slots.set_prefill_chunk(16)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(1, engine.target.vocab_size, (n,), generator=g).tolist(), m, SamplingParams(0.0), 3)
            for n, m in ((5, 20), (40, 12), (3, 30), (70, 16), (9, 24))]
    drafted = 0
    running = list(reqs)
    while running:
        for e in engine.step(running[:3]):
            drafted += len(e.drafted) + e.tree_size
        running = [r for r in running if not r.done]
    for r in reqs:
        want = plain_tiny.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert (r.generated, r.finish_reason) == (want.token_ids, want.finish_reason)
        assert not r.fused  # a finished row keeps nothing
    assert drafted > 0


def test_eagle3_drafts_of_a_row_do_not_depend_on_the_rows_beside_it(tiny_pair, tiny_eagle3):
    """A row's drafts, round by round, are the same beside two other rows and beside two
    different ones (its slots, caches and pending features are its own)."""
    engine = batch_engine(tiny_pair["target"], tiny_eagle3, slots=3, draft_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    vocab = engine.target.vocab_size

    def prompt(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    row, others = prompt(11), [[prompt(4), prompt(30)], [prompt(25), prompt(6)]]
    seen = []
    for pair in others:
        reqs = [Request(p, m, SamplingParams(0.0), 3) for p, m in zip([row, *pair], (20, 8, 14), strict=True)]
        drafts = []
        while not reqs[0].done:
            drafts += [e.drafted for e in engine.step(reqs) if e.request is reqs[0]]
        seen.append(drafts)
    assert seen[0] == seen[1] and any(seen[0])


@pytest.mark.parametrize("multi", ["first", "tree"])
def test_eagle3_on_the_one_loop_is_exact_at_temperature_1(tiny_pair, tiny_eagle3, multi):
    """The chi-square of certify (the whole loop against plain decoding's exact distribution
    over 2 tokens) with the eagle3 prophet alone, and in a token tree with prompt lookup."""
    from specdec.check import certify

    spec = tiny_eagle3 if multi == "first" else f"ngram+{tiny_eagle3}"
    dec = load(tiny_pair["target"], draft=spec, multi=multi, policy="fixed", draft_tokens=3,
               draft_dtype=torch.float32)
    report = certify(dec, dec.plain(), "def f(x):\n    return x", tokens=2, samples=300, temperature=1.0)
    assert report.result.passed, report.result
    got = dec.generate("def f(x):\n    return x", max_new_tokens=12, temperature=1.0, seed=0)
    assert any(e.drafted for e in got.events)


def test_eagle3_needs_the_lean_llama_path(tiny_pair, tiny_eagle3):
    with pytest.raises(ValueError, match="lean path"):
        load(tiny_pair["target"], draft=tiny_eagle3, backend="hf")


def test_rows_of_different_lengths_run_in_one_stack_pass_as_alone():
    """The C++ stack runs every row's slots in one padded pass: rows fed 5, 1 and 3 slots at
    once give the outputs each gives alone, and leave the same keys in its cache."""
    from specdec import qgemm

    if not qgemm.available():
        pytest.skip("the C++ extension does not build here")
    net, dim = _net(), 32
    cos, sin = _tables(16)
    torch.manual_seed(2)
    embed = torch.randn(50, dim)
    rt = Eagle3Runtime(net, torch.arange(50), (0, 1, 2), embed, torch.randn(50, dim), cos, sin, slots=3)
    alone = rt.view(3)
    feats = [torch.randn(m, 3 * dim) for m in (5, 1, 3)]
    toks = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]
    starts = [0, 4, 2]
    together = rt.run([0, 1, 2], starts, feats, toks, [True] * 3)
    for b in range(3):
        one = alone.run([b], [starts[b]], [feats[b]], [toks[b]], [True])
        torch.testing.assert_close(together[b], one[0], rtol=1e-5, atol=1e-5)
        end = starts[b] + len(toks[b])
        torch.testing.assert_close(rt.k_slots[b][:, :, starts[b]:end], alone.k_slots[b][:, :, starts[b]:end])


def test_a_layer_of_q8_0_products_runs_alike_in_the_stack_and_op_by_op():
    """Beside a 4-bit target the layer's products are Q8_0 blocks on the target's block kernel: the C++ stack
    (one-token draft steps through its raw layers, products into buffers) and the op-by-op loop give the same
    outputs, up to the order of float32 additions outside the products."""
    from specdec import qgemm

    if not qgemm.available():
        pytest.skip("the C++ extension does not build here")
    torch.manual_seed(3)
    net = Eagle3Net(64, n_heads=4, n_kv=2, head_dim=16, mlp=96, n_fused=3)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cos, sin = _tables(24, hd=16)
    embed = torch.randn(50, 64)
    rt = Eagle3Runtime(net.eval(), torch.arange(50), (0, 1, 2), embed, torch.randn(50, 64), cos, sin, slots=2,
                       int4=True)
    assert rt.stack is not None and not isinstance(rt.w["qkv"], torch.Tensor)
    slow = rt.view(2)
    slow.stack = None
    feats = torch.randn(6, 192)
    g_fast = rt.run([1], [0], [feats], [[1, 2, 3, 4, 5, 6]], [True])
    g_slow = slow.run([1], [0], [feats], [[1, 2, 3, 4, 5, 6]], [True])
    torch.testing.assert_close(g_fast, g_slow, rtol=1e-4, atol=1e-4)
    for j in range(3):  # one-token steps: the raw layers
        g_fast = rt.run([1], [6 + j], [g_fast], [[7 + j]], [False])
        g_slow = slow.run([1], [6 + j], [g_slow], [[7 + j]], [False])
        torch.testing.assert_close(g_fast, g_slow, rtol=1e-4, atol=1e-4)
