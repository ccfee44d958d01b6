"""The lean path's layer loop in C++ (specdec.layerloop, kernels/step.cpp) computes the Python
loop's results bit for bit: logits, features, fused features and every key and value it writes,
for one row and for ragged batches, one-token steps, verification passes, chunked prompts and
early exits; on PyTorch's int4 kernel, on specdec.qgemm's blocks kernels (where steps and passes
run on raw buffers) and in float32."""

import numpy as np
import pytest
import torch

from specdec import layerloop, load, qgemm
from specdec.llama import BatchLlama


def _both(lm: BatchLlama, monkeypatch, call):
    """call(model) on two fresh views of lm, with the C++ loop and with the Python loop."""
    results = []
    for loop in ("auto", "python"):
        monkeypatch.setenv("SPECDEC_LAYER_LOOP", loop)
        view = lm.view(4)
        assert (layerloop.stack_for(view) is not None) == (loop == "auto")
        results.append((call(view), [(k.clone(), v.clone()) for k, v in zip(view.k_slots, view.v_slots, strict=True)
                                     if k is not None and v is not None]))
    monkeypatch.delenv("SPECDEC_LAYER_LOOP")
    return results


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _passes(model: BatchLlama):
    """A sequence of passes as the one loop makes them: ragged prompts (one past the prefill
    chunk), a batched verification pass of 1, 5 and 9 tokens, one-token steps, an early exit,
    the eagle3 capture of three layers' outputs and token trees beside a chain."""
    chunk = model.attention_chunk
    prompts = [[1 + (7 * i) % 300 for i in range(n)] for n in (5, chunk + 9, 40)]
    out = [model.forward_features([0, 1, 2], [0, 0, 0], prompts, [1, 1, 1])]
    starts = [len(p) for p in prompts]
    feed = [[11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24, 25]]
    out.append(model.forward_features([0, 1, 2], starts, feed, [1, 5, 9]))
    out.append(model.forward([1], [starts[1] + 5], [[30]], [1]))
    out.append(model.forward_features([2], [starts[2] + 9], [[31, 32]], [2], layers=3, head=False))
    out.append(model.forward_fused([0, 2], [starts[0] + 1, starts[2] + 9], [[33], [34, 35]], [1, 2], (1, 5, 8)))
    # a prompt read from a block's end within the first chunk (as after a cached system turn), past the chunk
    out.append(model.forward([3], [0], [prompts[1][:24]], [1]))
    out.append(model.forward([3], [24], [prompts[1][24:]], [1]))
    # token trees beside a chain: each row's pending token then its nodes (a verification pass of a tree)
    at = [starts[0] + 2, starts[1] + 6]
    out.append(model.forward_features([0, 1, 3], [*at, 24 + len(prompts[1][24:])],
                                      [[40, 41, 42, 43, 44, 45], [46, 47, 48], [49, 50]], [6, 3, 2],
                                      trees=[[-1, -1, 0, 1, 3], None, [-1]]))
    return out


@pytest.fixture(scope="module")
def built():
    if not qgemm.available():
        pytest.skip(f"the extension does not build here: {qgemm.why_unavailable()}")


@pytest.mark.parametrize("kernel", ["torch", "blocks", "blocks16", "amx"])
def test_the_cpp_loop_computes_the_python_loops_bits_on_int4(monkeypatch, built, kernel):
    if kernel == "blocks16" and not qgemm.has_bf16_kernel():
        pytest.skip("no bfloat16 kernel on this CPU (avx512_bf16)")
    if kernel == "amx" and not qgemm.has_amx_kernel():
        pytest.skip("no AMX tile unit on this CPU (amx_bf16)")
    monkeypatch.setenv("SPECDEC_INT4_KERNEL", kernel)
    lm = load("smollm2", draft="none", dtype="int4").target
    assert lm.int4_kernel == kernel
    # on specdec's block kernels, steps and verification passes run on raw buffers (Stack.run_raw)
    assert layerloop.stack_for(lm).raw == (kernel != "torch")
    (cpp, cpp_cache), (python, python_cache) = _both(lm, monkeypatch, _passes)
    assert _equal(cpp, python)
    assert _equal(cpp_cache, python_cache) and len(cpp_cache) == 4


def test_a_token_trees_nodes_score_as_one_token_steps_in_the_cpp_loop(built, monkeypatch):
    """Through the C++ loop (4-bit SmolLM2, its default kernel), a tree's every node scores what the
    one-token step at its place computes: each node's logits equal the last ones of a verification
    pass of its path alone, bit for bit, and the tree pass runs in C++ (not the Python loop)."""
    lm = load("smollm2", draft="none", dtype="int4").target.view(1)
    assert layerloop.stack_for(lm) is not None and lm.exact_rows
    ctx = [1 + (37 * i) % 900 for i in range(75)]
    parents, tokens = [-1, -1, 0, 0, 1, 2, 5, -1], [11, 22, 33, 44, 55, 66, 77, 88]
    lm.forward([0], [0], [ctx[:-1]], [1])

    def python_loop(*args, **kwargs):
        raise AssertionError("the tree pass took the Python loop")

    with monkeypatch.context() as m:
        m.setattr(lm, "_attention", python_loop)
        tree = lm.forward([0], [len(ctx) - 1], [[ctx[-1], *tokens]], [len(tokens) + 1], trees=[parents])[0]
    for j in range(len(tokens)):
        path, a = [], j
        while a >= 0:
            path.insert(0, tokens[a])
            a = parents[a]
        alone = lm.forward([0], [len(ctx) - 1], [[ctx[-1], *path]], [len(path) + 1])[0, len(path)]
        assert torch.equal(tree[1 + j], alone), j


def test_the_cpp_loop_computes_the_python_loops_bits_in_float32(monkeypatch, built, tiny_pair):
    lm = load(tiny_pair["target"], draft="none", dtype="float32").target
    (cpp, cpp_cache), (python, python_cache) = _both(lm, monkeypatch, _passes)
    assert _equal(cpp, python) and _equal(cpp_cache, python_cache)


def test_the_python_loop_runs_where_the_cpp_one_does_not_apply(monkeypatch, built, tiny_pair):
    """bfloat16 weights, the int8 copy and SPECDEC_LAYER_LOOP=python keep the Python loop; an
    unknown choice is an error naming the choices."""
    assert layerloop.stack_for(load(tiny_pair["target"], draft="none", dtype="bfloat16").target) is None
    lm = load(tiny_pair["target"], draft="none", dtype="float32").target
    assert layerloop.stack_for(lm) is not None
    assert layerloop.stack_for(BatchLlama(lm.model, "copy", 2, int8=True)) is None
    monkeypatch.setenv("SPECDEC_LAYER_LOOP", "python")
    assert layerloop.stack_for(lm) is None
    monkeypatch.setenv("SPECDEC_LAYER_LOOP", "fast")
    with pytest.raises(ValueError, match="auto, python"):
        layerloop.stack_for(lm)


def test_the_small_kernels_compute_what_pytorch_does_within_float_rounding(built):
    """The extension's RMSNorm and one-query attention (both loops use them for float32) agree
    with PyTorch's to float32 rounding, with grouped heads and keys read from a longer buffer;
    its rotary positions are PyTorch's three operations bit for bit."""
    import torch.nn.functional as F

    ext = layerloop.kernels()
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 576, generator=gen) * 3, torch.rand(576, generator=gen)
    assert torch.allclose(ext.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)
    for end in (1, 37, 256, 1029):
        q = torch.randn(1, 9, 1, 64, generator=gen)
        keys, values = torch.randn(2, 1, 3, 1100, 64, generator=gen) * 2
        want = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], enable_gqa=True)
        assert torch.allclose(ext.attend_one(q, keys, values, end), want, rtol=1e-5, atol=1e-6)
    heads = torch.randn(2, 7, 5, 64, generator=gen).transpose(1, 2)  # (B, H, n, hd), (B, n, H, hd) in memory
    cos, sin = torch.randn(2, 2, 1, 7, 64, generator=gen)
    want = heads * cos + torch.roll(heads, 32, dims=-1) * sin
    assert torch.equal(ext.rope_heads(heads, cos, sin), want)


def _exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """step.cpp's exp of x <= 0 (Cephes' expf), operation for operation in float32."""
    f = np.float32
    keep = x >= f(-87.0)
    x = np.maximum(x, f(-87.0))
    n = np.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    y = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + f(c)
    y = ((y * r) * r + r) + f(1.0)
    e = ((n.astype(np.int32) + 127) << 23).view(np.float32)
    return np.where(keep, y * e, f(0.0)).astype(np.float32)


def _attend_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, end: int) -> np.ndarray:
    """One query's attention as step.cpp documents its arithmetic, in float32 one operation at a
    time: per head, each score from eight running sums (position d % 8, the first a product)
    summed as ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)), times 1/sqrt(hd); exponentials
    of the scores less the largest; the weights' total and the weighted values summed in key order
    from 0; values over total. q (Hq, hd), keys and values (Hkv, T, hd)."""
    f = np.float32
    hq, hd = q.shape
    group = hq // keys.shape[0]
    scale = f(1.0) / np.sqrt(f(hd))
    out = np.empty_like(q)
    for h in range(hq):
        k, v = keys[h // group, :end], values[h // group, :end]
        s = q[h, 0:8] * k[:, 0:8]
        for d in range(8, hd, 8):
            s = s + q[h, d:d + 8] * k[:, d:d + 8]
        scores = (((s[:, 0] + s[:, 4]) + (s[:, 1] + s[:, 5])) + ((s[:, 2] + s[:, 6]) + (s[:, 3] + s[:, 7]))) * scale
        p = _exp_nonpositive(scores - scores.max())
        total, acc = f(0.0), np.zeros(hd, np.float32)
        for t in range(end):
            total = f(total + p[t])
            acc = acc + p[t] * v[t]
        out[h] = acc / total
    return out


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="the vectorized kernels")
def test_one_query_attention_is_its_documented_arithmetic_bit_for_bit(built):
    """attend_one (every path's attention of a query alone: one-token steps and the scored rows
    of a verification pass) computes exactly the arithmetic step.cpp documents, whatever the
    number of keys (a multiple of 8 or not: 8 at a time, then one at a time), for head sizes on
    the vectorized paths (64, 128) and off them (32), with grouped heads."""
    ext = layerloop.kernels()
    gen = torch.Generator().manual_seed(11)
    for hd in (64, 128, 32):
        for end in (1, 7, 8, 9, 37, 200):
            q = torch.randn(1, 6, 1, hd, generator=gen)
            keys, values = torch.randn(2, 1, 2, 210, hd, generator=gen) * 2
            got = ext.attend_one(q, keys, values, end)[0, :, 0].numpy()
            want = _attend_reference(q[0, :, 0].numpy(), keys[0].numpy(), values[0].numpy(), end)
            assert np.array_equal(got, want), (hd, end, np.abs(got - want).max())


def test_a_float16_cache_is_read_as_its_exact_float32_values(built):
    """attend_one over float16 keys and values computes exactly what it computes over the same
    values converted to float32 (every float16 value is a float32 one): the cache's dtype changes
    what is stored, never the arithmetic; on and off the vectorized paths; mixed dtypes are an error."""
    ext = layerloop.kernels()
    gen = torch.Generator().manual_seed(12)
    for hd in (64, 128, 32):
        for end in (1, 9, 37, 200):
            q = torch.randn(1, 6, 1, hd, generator=gen)
            keys, values = (torch.randn(2, 1, 2, 210, hd, generator=gen) * 2).half()
            got = ext.attend_one(q, keys, values, end)
            assert torch.equal(got, ext.attend_one(q, keys.float(), values.float(), end)), (hd, end)
    with pytest.raises(RuntimeError, match="float16"):
        ext.attend_one(q, keys, values.float(), 5)


def test_a_4bit_target_keeps_its_cache_in_float16_and_both_loops_agree(monkeypatch, built, tiny_pair):
    """The cache's dtype (SPECDEC_KV_DTYPE, "auto": float16 for a 4-bit target on the CPU): a
    float32 model with a float16 cache computes the same bits in the C++ and Python loops (keys
    and values rounded alike as they are written); its memory per position is half; the
    float32 choice keeps float32; an unknown choice is an error naming the choices."""
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "float16")
    lm = load(tiny_pair["target"], draft="none", dtype="float32").target
    assert lm.kv_dtype == torch.float16
    (cpp, cpp_cache), (python, python_cache) = _both(lm, monkeypatch, _passes)
    assert cpp_cache[0][0].dtype == torch.float16
    assert _equal(cpp, python) and _equal(cpp_cache, python_cache)
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "float32")
    wide = load(tiny_pair["target"], draft="none", dtype="float32").target
    assert wide.kv_dtype == torch.float32 and wide.position_bytes() == 2 * lm.position_bytes()
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "auto")
    assert load(tiny_pair["target"], draft="none", dtype="float32").target.kv_dtype == torch.float32
    assert load("smollm2", draft="none", dtype="int4").target.kv_dtype == torch.float16
    assert load(tiny_pair["target"], draft="none", dtype="bfloat16").target.kv_dtype == torch.bfloat16
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "half")
    with pytest.raises(ValueError, match="auto, float32, float16"):
        load(tiny_pair["target"], draft="none", dtype="float32")


def test_load_and_the_cli_choose_the_cache_dtype(monkeypatch, tiny_pair):
    """`load(kv_dtype=...)` chooses the cache's dtype over $SPECDEC_KV_DTYPE; a bad name is an
    error naming the choices before anything loads; the CLI's --kv-dtype reaches the model a
    command runs (a whole `specdec generate`), and an unknown value exits 2."""
    from specdec import api
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_KV_DTYPE", "float32")
    lm = load(tiny_pair["target"], draft="none", dtype="float32", kv_dtype="float16").target
    assert lm.kv_dtype == torch.float16 and lm.view(2).kv_dtype == torch.float16
    assert load(tiny_pair["target"], draft="none", dtype="float32").target.kv_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float32, float16"):
        load(tiny_pair["target"], draft="none", kv_dtype="half")
    seen = []
    real_load = api.load

    def spy(*args, **kwargs):
        decoder = real_load(*args, **kwargs)
        seen.append(decoder.target.kv_dtype)
        return decoder

    monkeypatch.setattr("specdec.api.load", spy)
    assert main(["generate", "def f(", "--target", tiny_pair["target"], "--draft", tiny_pair["close"],
                 "--kv-dtype", "float16", "--temperature", "0", "--max-new-tokens", "8", "--compare"]) == 0
    assert seen == [torch.float16]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "x", "--kv-dtype", "half"])
    assert exit_.value.code == 2
