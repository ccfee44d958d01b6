"""4-bit weights on the lean path (`--dtype int4`, specdec.int4): what the CPU int4 kernel
multiplies, the GGUF blocks it is handed, rows that never depend on the row count, and
speculative decoding of an int4 target that is plain int4 decoding's, token for token
(greedy) and in distribution (sampled)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import load, qgemm
from specdec.certify import goodness_of_fit
from specdec.defaults import models_dir
from specdec.int4 import (
    HEAD_PROBE_SIZES,
    INT4,
    KERNELS,
    BlockEmbedding,
    Codes,
    Int4Weight,
    block_embedding,
    quantize_q4_1,
    quantize_q8_0,
    read_q4_1,
    read_q8_0,
    rows_invariant,
    unpermute_rows,
)
from specdec.sequence import OneSequence
from tests.helpers import ALPHA, sample_continuations

QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that reverses a string.",
             "Copy this sentence exactly: the cat sat on the mat, and the cat sat on the mat."]


@pytest.fixture(scope="module")
def smollm2_int4():
    """SmolLM2 with its GGUF file's own 4-bit blocks, its default prophets at a fixed K of 8."""
    return load("smollm2", draft=f"ngram+{models_dir() / 'smollm2-eagle'}", policy="fixed", draft_tokens=8,
                dtype="int4")


def _random_codes(n: int, k: int, seed: int) -> Codes:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return Codes(q, torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3, torch.randn(n, k // 32, generator=gen) * 0.05)


# ----------------------------------------------------------------- (a) the product
@pytest.mark.parametrize("planes", [1, 2])
def test_the_kernel_multiplies_what_the_codes_hold(planes):
    """w = (q - 8) * scale + zero per group of 32 (the kernel's convention, not q * scale + zero),
    products summed over planes, within the bf16 rounding of activations and outputs; rows
    that are not a multiple of 16 are padded and sliced off."""
    codes = [_random_codes(100, 96, seed) for seed in range(planes)]
    weight = Int4Weight(codes)
    x = torch.randn(2, 3, 96)
    got = weight.mm(x)
    assert got.shape == (2, 3, 100) and got.dtype == torch.float32
    dense = sum(c.dequantize() for c in codes)
    want = x.bfloat16().float() @ dense.T
    tol = 2 ** -7 * float(want.abs().max())
    assert float((got - want).abs().max()) < tol
    other = sum(c.q.float() * c.scale.repeat_interleave(32, 1) + c.zero.repeat_interleave(32, 1) for c in codes)
    assert float((got - x @ other.T).abs().max()) > 10 * tol  # the other convention is far off
    assert weight.mm(torch.zeros(0, 96)).shape == (0, 100)
    assert torch.equal(weight.first_rows(40).mm(x), got[..., :40])


def test_q4_1_and_q8_0_quantizers_follow_llama_cpps_rules():
    """Q4_1: per block d = (max - min)/15, m = min, every weight within d/2 (+ fp16 rounding);
    Q8_0 as two 4-bit planes holds d*q exactly (up to bf16 scales)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    (q4,) = quantize_q4_1(w)
    d = q4.scale.repeat_interleave(32, 1)
    m = (q4.zero - 8 * q4.scale).repeat_interleave(32, 1)
    exact = (q4.q.float() - 8) * d + q4.zero.repeat_interleave(32, 1)
    assert bool(((exact - w).abs() <= d * (0.5 + 16 / 2048) + m.abs() / 2048 + 1e-6).all())  # fp16 d and m
    assert bool((m <= w.reshape(64, -1, 32).amin(-1).repeat_interleave(32, 1) + 1e-3).all())
    hi, lo = quantize_q8_0(w)
    blocks = w.reshape(64, -1, 32)
    d8 = blocks.abs().amax(-1) / 127  # codes from the float32 scale, the fp16 one stored (as llama.cpp)
    q8 = (blocks * (1 / d8)[..., None]).round().clamp(-127, 127)
    want = (q8 * d8.half().bfloat16().float()[..., None]).reshape(64, 128)
    assert torch.allclose(hi.dequantize() + lo.dequantize(), want, rtol=1e-6, atol=1e-7)


def test_smollm2_blocks_are_read_as_gguf_and_transformers_read_them(smollm2_int4):
    """The GGUF's Q4_1 and Q8_0 bytes decode to gguf's own de-quantization, and (q/k rows
    reordered as transformers does) to the float weights the converted model holds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.gguf import read_tensors, smollm2_gguf

    tensors = read_tensors(smollm2_gguf())
    model = smollm2_int4.target.model
    cfg = model.config
    layer = model.model.layers[1]
    cases = [("blk.1.attn_q.weight", read_q4_1, layer.self_attn.q_proj, cfg.num_attention_heads),
             ("blk.1.attn_k.weight", read_q4_1, layer.self_attn.k_proj, cfg.num_key_value_heads),
             ("blk.1.ffn_down.weight", read_q4_1, layer.mlp.down_proj, None),
             ("token_embd.weight", read_q8_0, model.lm_head, None)]
    for name, read, module, heads in cases:
        t = tensors[name]
        n, k = t.shape
        n = min(n, 4096)  # the head's first rows
        data = np.asarray(t.data[:n])
        reference = torch.from_numpy(dequantize(data, GGMLQuantizationType[t.kind]).reshape(n, k).copy())
        planes = read(data, n, k)
        held = sum((p.q.float() - 8) * p.scale.repeat_interleave(32, 1) + p.zero.repeat_interleave(32, 1)
                   for p in planes)
        assert torch.allclose(held, reference, rtol=1e-5, atol=1e-6), name
        index = unpermute_rows(n, heads) if heads else torch.arange(n)
        assert torch.allclose(held[index], module.weight.detach()[:n].float(), rtol=1e-5, atol=1e-6), name
    source = model.specdec_int4
    assert source.origin == "gguf" and source.formats == {"Q4_1": 210, "Q8_0": 1}
    assert smollm2_int4.target.int4 and isinstance(smollm2_int4.target.lm_head, Int4Weight)
    assert smollm2_int4.target.head().dtype == torch.float32  # prophets read the float head


# ----------------------------------------------------------------- (b) rows
def test_the_embedding_is_the_gguf_blocks_with_the_float_tables_bits(smollm2_int4):
    """The int4 target looks its tokens up in the file's Q8_0 blocks (a quarter of the float
    table's memory), and every row, in any index shape, has the float table's very bits."""
    rows = smollm2_int4.target
    table = rows.model.model.embed_tokens.weight.detach()
    assert isinstance(rows.embed, BlockEmbedding) and rows.embed.shape == table.shape
    assert rows.embed.nbytes < table.numel() * 4 / 3
    assert torch.equal(rows.embed.float(), table)
    ids = torch.tensor([[0, 5, 49151], [17, 17, 2]])
    assert torch.equal(rows.embed[ids], table[ids]) and torch.equal(rows.embed[7], table[7])
    assert torch.equal(rows.embed[-1], table[-1]) and torch.equal(rows.embed[torch.tensor(3)], table[3])
    # the extension's lookup (where it is loaded, as here) and torch's indexing give the same rows
    from specdec import qgemm

    assert qgemm.loaded() is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qgemm, "_module", None)
        assert torch.equal(rows.embed[ids], table[ids]) and torch.equal(rows.embed[-1], table[-1])
    # a file whose blocks do not hold the table is not used for it
    from specdec.gguf import read_tensors, smollm2_gguf

    t = read_tensors(smollm2_gguf())["token_embd.weight"]
    assert block_embedding(t, table) is not None
    assert block_embedding(t, table + 1e-3) is None and block_embedding(t, table[:, :64]) is None


def test_a_gguf_files_mapping_goes_with_its_last_tensor():
    """Nothing of a read GGUF file stays mapped once its tensors are dropped, without waiting for
    the garbage collector (a server may not run it for hours: it held ~94 MiB of SmolLM2's file)."""
    import gc

    from specdec.gguf import read_tensors, smollm2_gguf

    path = str(smollm2_gguf().resolve())

    def mapped() -> bool:
        return path in Path("/proc/self/maps").read_text()

    gc.collect()
    gc.disable()
    try:
        tensors = read_tensors(smollm2_gguf())
        assert mapped() and tensors["token_embd.weight"].kind == "Q8_0"
        del tensors
        assert not mapped()
    finally:
        gc.enable()


def test_each_row_is_computed_as_a_one_row_product_at_every_row_count(smollm2_int4):
    """On this machine's kernel: row r of a product of m rows (m = 1..17, 24, 33) has the bits
    of row r multiplied alone, for every product of SmolLM2 (and the head at the sizes that
    verification uses); so the lean path runs them unpadded."""
    lm = smollm2_int4.target
    assert lm.int4_rows == "none"
    for name in ("qkv", "o", "gate_up", "down"):
        assert rows_invariant(lm.layers[0][name], (*range(1, 18), 24, 33), 34), name
    assert rows_invariant(lm.lm_head, HEAD_PROBE_SIZES, 17)


def test_a_verification_pass_scores_what_one_token_steps_score(smollm2_int4):
    _assert_a_pass_scores_as_steps(smollm2_int4)


def _assert_a_pass_scores_as_steps(decoder) -> None:
    """The whole int4 forward: 9 tokens scored in one pass give, bit for bit, the logits of 9 one-token steps."""
    lm = OneSequence(decoder.target.view(1))
    prompt = decoder.chat_ids([{"role": "user", "content": QUESTIONS[0]}])
    tail = [504, 3458, 282, 4649, 314, 7042, 30, 216, 198]
    lm.forward(prompt, 1)
    together = lm.forward(tail, len(tail))
    lm.truncate(len(prompt))
    alone = torch.cat([lm.forward([t], 1) for t in tail])
    assert torch.equal(together, alone)


# ----------------------------------------------------------------- (c) greedy
def test_speculative_int4_is_plain_int4_token_for_token(smollm2_int4):
    plain = smollm2_int4.plain()
    jobs = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS]
    want = [plain.generate(**job, max_new_tokens=32, temperature=0).token_ids for job in jobs]
    drafted = 0
    for job, tokens in zip(jobs, want, strict=True):
        got = smollm2_int4.generate(**job, max_new_tokens=32, temperature=0)
        assert got.token_ids == tokens
        drafted += sum(len(e.drafted) for e in got.events)
    assert drafted > 32  # verification passes of many rows were scored
    # batched (BatchLlama reads the same 4-bit weights): every row is plain decoding's
    assert [g.token_ids for g in smollm2_int4.generate_many(jobs, max_new_tokens=32, temperature=0)] == want


def test_int4_loads_by_name_and_dtype_and_refuses_what_it_cannot_run(tiny_pair):
    """A model that is not a GGUF file is quantized here (Q4_1's rule, Q8_0 for the head);
    the transformers backend has no int4 path."""
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", draft_tokens=4, dtype=INT4)
    assert decoder.target.model.specdec_int4.origin == "quantized" and decoder.target.int4
    plain = decoder.plain()
    for prompt in ("def main():", "import os\n"):
        want = plain.generate(prompt, max_new_tokens=24, temperature=0).token_ids
        assert decoder.generate(prompt, max_new_tokens=24, temperature=0).token_ids == want
    with pytest.raises(ValueError, match="lean path"):
        load(tiny_pair["target"], draft="none", dtype="int4", backend="hf")
    # the stored step costs of an int4 target are its own, never a float32 target's
    float32 = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", draft_tokens=4)
    assert decoder.costs_key()["int4"] and not float32.costs_key()["int4"]
    assert decoder.costs_key()["int4_kernel"] == decoder.target.int4_kernel in KERNELS[1:]
    assert (decoder.costs_key()["kv_dtype"], float32.costs_key()["kv_dtype"]) == ("torch.float16", "torch.float32")
    # a float32 target's few-row products run on specdec's float32 kernel: named in its key alone
    f32_products = f"f32mm-64-exact-{qgemm.f32_tile()}"
    assert float32.costs_key()["f32_products"] == f32_products and "f32_products" not in decoder.costs_key()
    assert {k: v for k, v in decoder.costs_key().items() if not k.startswith(("int4", "kv_dtype"))} == \
        {k: v for k, v in float32.costs_key().items() if not k.startswith(("int4", "kv_dtype", "f32_products"))}


def test_the_default_dtype_is_int4_for_a_gguf_target_and_float32_for_other_models(tiny_pair):
    """`load` with no dtype (`--dtype default`): a GGUF target's own 4-bit weights on the CPU;
    a model that is not a GGUF file keeps its float32 weights (int4 would quantize them); the
    transformers backend has no int4 path, so there the default is float32 too."""
    from specdec.wiring import resolve_dtype

    assert load("smollm2", draft="none").weights == "int4"
    assert load("smollm2", draft="none", backend="hf").weights == "float32"
    assert load("smollm2", draft="none", dtype="float32").weights == "float32"
    assert load(tiny_pair["target"], draft="none").weights == "float32"
    assert resolve_dtype("default") is None


# ----------------------------------------------------------------- (d) sampled
def test_sampled_int4_speculation_fits_the_int4_targets_exact_distribution(tiny_pair):
    """Chi-square (alpha 0.001): two-token continuations sampled speculatively (K = 3, a close
    prophet) against the exact distribution of the int4 target, computed from its one-token
    steps."""
    _assert_two_token_samples_fit(tiny_pair)


def _assert_two_token_samples_fit(tiny_pair) -> None:
    """Chi-square of the int4 tiny pair's speculative two-token continuations (K 3, a close
    prophet) against the exact distribution of its one-token steps."""
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", draft_tokens=3, dtype="int4")
    assert decoder.target.kv_dtype == torch.float16  # so this certifies the float16 cache too
    prompt = decoder.tokenizer("def add(a, b):\n    return")["input_ids"]
    lm = OneSequence(decoder.target.view(1))
    first = torch.softmax(lm.forward(prompt, 1)[0], -1)
    exact = {}
    for t1 in torch.nonzero(first > 0).flatten().tolist():
        if t1 in decoder.eos_token_ids:  # the continuation ends there
            exact[(t1,)] = float(first[t1])
            continue
        second = torch.softmax(lm.forward([t1], 1)[0], -1)
        lm.truncate(len(prompt))
        for t2 in torch.nonzero(second > 0).flatten().tolist():
            exact[(t1, t2)] = float(first[t1] * second[t2])
    counts = sample_continuations(decoder, prompt, 2, 600, temperature=1.0)
    result = goodness_of_fit(counts, exact, alpha=ALPHA)
    assert result.passed, result.verdict


# ----------------------------------------------------------------- (f) the kernel choice
def test_the_kernel_is_chosen_by_the_environment_and_both_multiply_the_same_weights(monkeypatch):
    """SPECDEC_INT4_KERNEL picks PyTorch's kernel or the blocks one (where it builds); a bad
    name is an error that lists the choices. Both multiply what the codes hold: the blocks
    kernel within float32 rounding of the exact product (weights de-quantized exactly, float32
    activations), PyTorch's within bfloat16's; the head's rows sliced off are never multiplied."""
    from specdec import qgemm
    from specdec.int4 import kernel_choice

    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    for make in (quantize_q4_1, quantize_q8_0):
        codes = make(w)
        blocks = codes[0].blocks
        dense = (qgemm.dequantize_q4_1 if blocks.kind == "Q4_1" else qgemm.dequantize_q8_0)(blocks.data)
        exact = x.double() @ dense.double().T
        monkeypatch.setenv("SPECDEC_INT4_KERNEL", "torch")
        assert kernel_choice() == "torch"
        slow = Int4Weight(codes)
        assert slow.kernel == "torch" and slow.blocks is None
        scale = float(exact.abs().max())
        assert float((slow.mm(x).double() - exact).abs().max()) < 2 ** -6 * scale
        if not qgemm.available():
            continue
        # float32 activations: within float32 rounding; int8 activations: within their quantization
        # bfloat16 activations (Q4_1 and Q8_0 weights in panels): within bfloat16's rounding
        kernels = [("blocks", 2 ** -18 * scale * 96), ("blocks8", 2 ** -6 * scale)]
        if qgemm.has_bf16_kernel():
            kernels.append(("blocks16", 2 ** -6 * scale))
        if qgemm.has_amx_kernel():
            kernels.append(("amx", 2 ** -6 * scale))
        for kernel, tol in kernels:
            monkeypatch.setenv("SPECDEC_INT4_KERNEL", kernel)
            fast = Int4Weight(codes)
            runs_on = kernel
            assert fast.kernel == runs_on and not fast.planes
            assert float((fast.mm(x).double() - exact).abs().max()) < tol
            head = fast.first_rows(150)
            assert head.blocks is not None and head.kernel == runs_on and head.out_rows == 150
            assert torch.equal(head.mm(x), fast.mm(x)[:, :150])
            if fast.blocks is not None and fast.blocks.kind in ("Q4_1x16", "Q8_0x16"):  # panels: 200 rows -> 208
                assert fast.nbytes == 208 * codes[0].blocks.data[0].numel()
                assert torch.equal(fast.blocks.file_blocks().data[:200], codes[0].blocks.data)
                assert head.nbytes == 160 * codes[0].blocks.data[0].numel()
            else:
                assert fast.nbytes == codes[0].blocks.data.numel() and head.blocks.data.shape[0] == 150
    monkeypatch.delenv("SPECDEC_INT4_KERNEL")  # the default (see kernel_choice: the measurements)
    if not qgemm.available():
        assert kernel_choice() == "torch"
    else:
        best = "amx" if qgemm.has_amx_kernel() else "blocks16" if qgemm.has_bf16_kernel() else "blocks"
        assert kernel_choice() == best
        monkeypatch.setattr(qgemm, "has_amx_kernel", lambda: False)  # a CPU without AMX
        assert kernel_choice() == ("blocks16" if qgemm.has_bf16_kernel() else "blocks")
        monkeypatch.setattr(qgemm, "has_bf16_kernel", lambda: False)  # a CPU without avx512_bf16
        assert kernel_choice() == "blocks"
        monkeypatch.setenv("SPECDEC_INT4_KERNEL", "blocks16")
        with pytest.raises(ValueError, match="blocks16 needs a CPU with avx512_bf16"):
            kernel_choice()
        monkeypatch.setenv("SPECDEC_INT4_KERNEL", "amx")
        with pytest.raises(ValueError, match="amx needs a CPU with amx_bf16"):
            kernel_choice()
    monkeypatch.setenv("SPECDEC_INT4_KERNEL", "fastest")
    with pytest.raises(ValueError, match="auto, amx, blocks16, blocks8, blocks, torch"):
        kernel_choice()


@pytest.mark.parametrize("kernel", ["blocks", "blocks8", "blocks16", "amx"])
@pytest.mark.slow
def test_specdecs_own_kernels_keep_every_exactness_rule(monkeypatch, tiny_pair, kernel):
    """On each of specdec.qgemm's kernels (SPECDEC_INT4_KERNEL): SmolLM2's 9 tokens scored in one
    pass give the logits of 9 one-token steps bit for bit; greedy speculative decoding (default
    prophets, K 8) equals plain decoding, alone and batched; and sampled speculation fits the
    int4 target's exact distribution (chi-square at the suite's alpha, the tiny pair quantized here)."""
    from specdec import qgemm

    if not qgemm.available():
        pytest.skip(f"qgemm unavailable: {qgemm.why_unavailable()}")
    if kernel == "blocks16" and not qgemm.has_bf16_kernel():
        pytest.skip("no bfloat16 kernel on this CPU (avx512_bf16)")
    if kernel == "amx" and not qgemm.has_amx_kernel():
        pytest.skip("no AMX tile unit on this CPU (amx_bf16)")
    monkeypatch.setenv("SPECDEC_INT4_KERNEL", kernel)
    decoder = load("smollm2", draft=f"ngram+{models_dir() / 'smollm2-eagle'}", policy="fixed", draft_tokens=8,
                   dtype="int4")
    assert decoder.target.int4_kernel == kernel and decoder.weights_detail == f"int4 ({kernel} kernel)"
    _assert_a_pass_scores_as_steps(decoder)
    jobs = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS[1:]]
    plain = decoder.plain()
    want = [plain.generate(**job, max_new_tokens=24, temperature=0).token_ids for job in jobs]
    assert [decoder.generate(**job, max_new_tokens=24, temperature=0).token_ids for job in jobs] == want
    assert [g.token_ids for g in decoder.generate_many(jobs, max_new_tokens=24, temperature=0)] == want
    assert load(tiny_pair["target"], draft="none", dtype="int4").target.int4_kernel == kernel
    _assert_two_token_samples_fit(tiny_pair)


def test_a_blocks_kernel_that_cannot_build_is_an_error_that_says_why(monkeypatch):
    """SPECDEC_INT4_KERNEL=blocks (or blocks8) where the extension does not build: a ValueError
    naming the build's error; the default ("auto") then takes PyTorch's kernel, on any CPU."""
    from specdec import qgemm
    from specdec.int4 import kernel_choice

    monkeypatch.setattr(qgemm, "available", lambda: False)
    monkeypatch.setattr(qgemm, "why_unavailable", lambda: "RuntimeError: no compiler")
    for kernel in ("blocks", "blocks8", "blocks16", "amx"):
        monkeypatch.setenv("SPECDEC_INT4_KERNEL", kernel)
        with pytest.raises(ValueError, match=f"SPECDEC_INT4_KERNEL={kernel}.*no compiler"):
            kernel_choice()
    monkeypatch.setenv("SPECDEC_INT4_KERNEL", "auto")
    assert kernel_choice() == "torch"
