"""Tiny GGUF files written by the tests themselves (with the `gguf` package)."""

from pathlib import Path

import numpy as np


def write_tiny_gguf(path: Path, arch: str = "llama", vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4,
                    kv: int = 2, ff: int = 64, seed: int = 0, quant: str | None = None) -> Path:
    """A random Llama-architecture model (GQA, tied embeddings: no output.weight) with a
    small byte-level BPE tokenizer, all tensors in float32, or the layers' matrices in `quant`
    (a format gguf-py quantizes: "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(dim // heads)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges([])
    w.add_token_scores([0.0] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def tensor(name: str, shape: tuple[int, ...]) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quant is None or not name.startswith("blk."):
            w.add_tensor(name, data)
            return
        from gguf.quants import quantize

        kind = gguf.GGMLQuantizationType[quant]
        w.add_tensor(name, quantize(data, kind), raw_dtype=kind)

    hd = dim // heads
    tensor("token_embd.weight", (vocab, dim))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, np.float32))
        tensor(f"blk.{i}.attn_q.weight", (heads * hd, dim))
        tensor(f"blk.{i}.attn_k.weight", (kv * hd, dim))
        tensor(f"blk.{i}.attn_v.weight", (kv * hd, dim))
        tensor(f"blk.{i}.attn_output.weight", (dim, heads * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", (ff, dim))
        tensor(f"blk.{i}.ffn_up.weight", (ff, dim))
        tensor(f"blk.{i}.ffn_down.weight", (dim, ff))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
