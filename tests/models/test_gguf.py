"""GGUF models and the packaged SmolLM2: conversion once into the cache, clear errors,
nothing half-written; the lean path on GQA models with tied embeddings."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import specdec.gguf as gguf_mod
from specdec.cli import main
from specdec.errors import ModelLoadError
from specdec.hf import HFSequence
from specdec.wiring import load_pretrained
from tests.gguf_writer import write_tiny_gguf
from tests.helpers import lean


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_is_converted_once_and_loads_like_transformers(tmp_path, cache, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tokenizer = load_pretrained(str(path))
    converted = list((cache / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    assert tokenizer.eos_token == "<|im_end|>"

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_mod, "_convert_into", no_second_conversion)
    again, _ = load_pretrained(str(path))
    assert torch.equal(again(ids).logits, reference(ids).logits)


def test_a_missing_corrupt_or_unsupported_file_is_a_clear_error_and_leaves_nothing(tmp_path, cache):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_pretrained(str(tmp_path / "missing.gguf"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_pretrained(str(corrupt))
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="specdec-unknown")
    with pytest.raises(ModelLoadError, match="'specdec-unknown' model"):
        load_pretrained(str(other))
    leftovers = list((cache / "gguf").iterdir()) if (cache / "gguf").exists() else []
    assert leftovers == []


def test_a_failed_conversion_leaves_nothing_half_written(tmp_path, cache, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        load_pretrained(str(path))
    assert list((cache / "gguf").iterdir()) == []


def test_cli_gives_one_line_and_exit_code_2_for_a_bad_gguf(tmp_path, cache, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    assert main(["generate", "hello", "--target", str(bad), "--draft", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable GGUF file" in err[0]


def smollm2_shaped(seed=0):
    """Random weights, SmolLM2's shape in miniature: 9 heads over 3 KV heads, tied
    embeddings, rope theta 1e5."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=144, intermediate_size=384, num_hidden_layers=3,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


def test_lean_path_equals_transformers_on_a_smollm2_shaped_model_and_grows_its_buffer():
    model = smollm2_shaped()
    fast, hf = lean(model, "fast"), HFSequence(model, "hf")
    rows = fast.lm
    capacity = lambda: 0 if rows.k_slots[0] is None else rows.k_slots[0].shape[2]  # noqa: E731
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (200,), generator=g).tolist()
    a, b = fast.forward(prompt, 3), hf.forward(prompt, 3)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for _ in range(20):  # past the first 256 positions: the buffer grows, logits stay equal
        chunk = torch.randint(0, 300, (5,), generator=g).tolist()
        (a, ha), (b, hb) = fast.forward_features(chunk, 5), hf.forward_features(chunk, 5)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4) and torch.allclose(ha, hb, atol=1e-4, rtol=1e-4)
    assert capacity() == 512 and len(fast.tokens) == 300  # grown by doubling, never the 8,192 the config allows
    fast.truncate(250)
    hf.truncate(250)
    assert torch.allclose(fast.forward([7], 1), hf.forward([7], 1), atol=1e-4, rtol=1e-4)


def test_formats_not_read_as_they_are_are_quantized_again_and_never_to_fewer_bits(tmp_path, cache):
    """A GGUF target whose tensors no reader takes as they are (here float32; Q4_0, Q4_K, Q6_K, F16 in
    llama.cpp's files) runs every product on the 4-/8-bit kernels (a float product beside them sent
    each step through the Python loop, 4x slower): 4-bit formats as Q4_1, every other as Q8_0; the
    C++ loop runs it, and greedy speculative output is plain decoding's."""
    from specdec import layerloop, load
    from specdec.int4 import ATTR, Int4Weight, requantized

    assert requantized(["Q4_0", "Q4_K"], torch.randn(4, 32))[0] == "Q4_1"
    assert requantized(["Q4_K", "Q6_K"], torch.randn(4, 32))[0] == "Q8_0"
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    plain = load(str(path), draft="none")
    rows = plain.target
    assert rows.int4 and all(isinstance(w[p], Int4Weight) for w in rows.layers for p in ("qkv", "o", "gate_up", "down"))
    assert layerloop.stack_for(rows) is not None
    assert getattr(rows.model, ATTR).formats.get("Q8_0 (from F32)") == 4 * 2  # 4 products, 2 layers
    spec = load(str(path), draft="ngram", draft_tokens=4)
    for prompt in ["ab", "abc abc abc", "hello"]:
        assert spec.generate(prompt, max_new_tokens=16, temperature=0).token_ids == \
            plain.generate(prompt, max_new_tokens=16, temperature=0).token_ids


@pytest.mark.parametrize(("kind", "held_as"), [("Q4_0", "Q4_1"), ("Q5_0", "Q8_0")])
def test_q4_0_and_q5_0_are_read_as_they_are(tmp_path, cache, kind, held_as):
    """Q4_0 (w = d (q - 8)) is Q4_1 with m = -8 d, exact in fp16; Q5_0 (w = d (q - 16), q in 0..31)
    is Q8_0 with codes q - 16: the file's codes and scales run on the block kernels with nothing
    quantized again, hold gguf's own de-quantization exactly, and greedy speculative output is
    plain decoding's."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from specdec import load, qgemm
    from specdec.int4 import ATTR, READERS

    x = (np.random.default_rng(1).standard_normal((8, 96)) * 0.05).astype(np.float32)
    raw = quantize(x, GGMLQuantizationType[kind])
    planes = READERS[kind](raw, 8, 96)
    assert planes is not None and planes[0].blocks is not None and planes[0].blocks.kind == held_as
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(8, 96).copy())
    held = sum((p.q.float() - 8) * p.scale.repeat_interleave(32, 1) + p.zero.repeat_interleave(32, 1) for p in planes)
    assert isinstance(held, torch.Tensor) and torch.equal(held, want)
    dense = qgemm.dequantize_q4_1 if held_as == "Q4_1" else qgemm.dequantize_q8_0
    assert torch.equal(dense(planes[0].blocks.data), want)
    path = write_tiny_gguf(tmp_path / f"{kind}.gguf", quant=kind)
    plain = load(str(path), draft="none")
    assert getattr(plain.target.model, ATTR).formats == {kind: 7 * 2, "F32 (float32)": 1}
    spec = load(str(path), draft="ngram", draft_tokens=4)
    for prompt in ["ab", "abc abc abc", "hello"]:
        assert spec.generate(prompt, max_new_tokens=16, temperature=0).token_ids == \
            plain.generate(prompt, max_new_tokens=16, temperature=0).token_ids
