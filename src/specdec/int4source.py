"""Where a model's 4-bit products come from (`--dtype int4`): a GGUF file's own blocks
(`from_gguf`), weights quantized here (`from_float`), attached to a loaded model for the fast
path to read (`attach_int4`). The weights and kernels themselves: `specdec.int4`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.int4 import (
    ATTR,
    GGUF_PARTS,
    GROUP,
    HF_PARTS,
    LAYER_PARTS,
    READERS,
    BlockEmbedding,
    Codes,
    Int4Weight,
    block_embedding,
    cat_codes,
    quantize_q8_0,
    requantized,
    unpermute_rows,
)


@dataclass
class Int4Source:
    """The 4-bit products of a model, as the lean path fuses them: per layer some of "qkv",
    "o", "gate_up", "down" (the others stay float), and the head (or None: float); the embedding
    as the file's blocks where they hold it exactly (or None: the float table)."""

    layers: list[dict[str, Int4Weight]]
    head: Int4Weight | None
    origin: str  # "gguf" (the file's own blocks) or "quantized" (from float weights here)
    formats: dict[str, int] = field(default_factory=dict)  # tensors by how they are held, for reports
    embed: BlockEmbedding | None = None

    def nbytes(self) -> int:
        parts = [w for layer in self.layers for w in layer.values()] + ([self.head] if self.head else [])
        return sum(w.nbytes for w in parts)


def _check_against(codes: list[Codes], weight: torch.Tensor, name: str) -> None:
    """The planes must hold what transformers de-quantized (a wrong row order or block
    layout would be far off): a few rows, within the bf16 rounding of scales and zeros."""
    with torch.no_grad():
        rows = torch.arange(0, weight.shape[0], max(1, weight.shape[0] // 8))
        got = sum(p.rows(rows).dequantize() for p in codes)
        want = weight[rows].float()
        assert isinstance(got, torch.Tensor)
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6):
            raise ValueError(f"int4: '{name}' does not hold the model's weights (max difference "
                             f"{float((got - want).abs().max()):.3g})")


def from_gguf(path: Path, model: Any) -> Int4Source:
    """The 4-bit products of a llama GGUF file, read from its blocks (see the module doc)."""
    from specdec.gguf import read_tensors

    tensors = read_tensors(path)
    cfg = model.config
    formats: dict[str, int] = {}

    def codes(name: str, shape: tuple[int, ...], heads: int | None = None) -> list[Codes] | None:
        t = tensors.get(name)
        kind = t.kind if t is not None else "missing"
        read = READERS.get(kind)
        n, k = shape
        planes = None if t is None or read is None or t.shape != (n, k) or k % GROUP else read(t.data, n, k)
        if planes is None:
            formats[f"{kind} (float32)"] = formats.get(f"{kind} (float32)", 0) + 1
            return None
        formats[kind] = formats.get(kind, 0) + 1
        if heads is not None:
            index = unpermute_rows(n, heads)
            planes = [p.rows(index) for p in planes]
        return planes

    layers = []
    for i, layer in enumerate(model.model.layers):
        quantized = {}
        for fused, parts in LAYER_PARTS.items():
            got = []
            for part in parts:
                weight = layer.get_submodule(HF_PARTS[part]).weight
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(part)
                planes = codes(f"blk.{i}.{part}.weight", tuple(weight.shape), heads)
                if planes is not None and i == 0:
                    _check_against(planes, weight, f"blk.{i}.{part}.weight")
                got.append(planes)
            if all(g is not None for g in got) and len({len(g) for g in got if g is not None}) == 1:
                quantized[fused] = Int4Weight(cat_codes([g for g in got if g is not None]))
                continue
            weight = torch.cat([layer.get_submodule(HF_PARTS[p]).weight for p in parts])
            if weight.shape[1] % GROUP == 0:  # parts in a format not read here, or in two: quantized again, all alike
                held = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
                kinds = [t.kind if t is not None else "unknown" for t in held]
                kind, planes = requantized(kinds, weight)
                label = f"{kind} (from {'/'.join(sorted(set(kinds)))})"
                formats[label] = formats.get(label, 0) + 1
                quantized[fused] = Int4Weight(planes)
        layers.append(quantized)
    head_weight = model.lm_head.weight
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head_codes = codes(head_name, tuple(head_weight.shape))
    if head_codes is not None:
        _check_against(head_codes, head_weight, head_name)
    elif head_weight.shape[1] % GROUP == 0:
        head_codes = quantize_q8_0(head_weight)  # (Q8_0 whatever the file holds: the head decides every token)
    head = Int4Weight(head_codes) if head_codes is not None else None
    embed = block_embedding(tensors.get("token_embd.weight"), model.model.embed_tokens.weight)
    return Int4Source(layers, head, "gguf", formats, embed)


def from_float(model: Any, gguf: Path | None = None) -> Int4Source:
    """4-bit products quantized here from a float model of any family on the lean path (its family
    file's parts, `specdec.families`): Q4_1's rule for the layers, Q8_0's for the head. gguf: the
    file a model of another family than Llama was converted from: each product then as
    `requantized` says for the formats the file holds its parts in (never fewer bits)."""
    from specdec.families import PRODUCTS, family_of, fused

    family = family_of(model.config)
    assert family is not None
    held: dict[str, str] = {}
    if gguf is not None:
        from specdec.gguf import read_tensors

        held = {name: t.kind for name, t in read_tensors(gguf).items()}
    layers = []
    formats: dict[str, int] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            quantized = {}
            parts = family.parts(layer)
            for name in PRODUCTS:
                weight = fused(parts[name])
                if weight.shape[1] % GROUP == 0:
                    kinds = ([held[f"blk.{i}.{p}.weight"] for p in GGUF_PARTS[name] if f"blk.{i}.{p}.weight" in held]
                             or ["unknown"]) if gguf else ["Q4_1"]  # (unknown: Q8_0, never fewer bits)
                    kind, planes = requantized(kinds, weight)
                    label = f"{kind} (from {'/'.join(sorted(set(kinds)))})" if gguf else f"{kind} (quantized here)"
                    formats[label] = formats.get(label, 0) + 1
                    quantized[name] = Int4Weight(planes)
            layers.append(quantized)
        head_weight = model.lm_head.weight
        head = Int4Weight(quantize_q8_0(head_weight)) if head_weight.shape[1] % GROUP == 0 else None
    formats["Q8_0 head"] = 1
    return Int4Source(layers, head, "quantized", formats)


def attach_int4(model: Any, name: str, backend: str = "auto", device: torch.device | None = None,
                lean: bool = True) -> Int4Source:
    """Give a loaded float32 model its 4-bit products (read by the lean path, `BatchLlama`): from
    the GGUF file's blocks when `name` is one ("smollm2" or a .gguf path), else quantized here.
    lean: whether a model family file runs `model` on the lean path
    (`specdec.llama.supports`). Clear errors where int4 cannot run."""
    from specdec.defaults import is_alias
    from specdec.gguf import smollm2_gguf

    if device is not None and device.type != "cpu":
        raise ValueError("dtype int4 runs on the CPU only (PyTorch's CPU int4 kernel): use --device cpu")
    if backend == "hf":
        raise ValueError("dtype int4 runs on specdec's lean path only: leave --backend at auto or fast")
    if not lean:
        from specdec.families import why_not

        raise ValueError(f"dtype int4 runs on specdec's lean path, which cannot run '{name}' ({why_not(model)})")
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(f"dtype int4 needs PyTorch's CPU int4 kernel (PyTorch >= 2.6), this is {torch.__version__}")
    if is_alias(name):
        source = from_gguf(smollm2_gguf(), model)
    elif name.lower().endswith(".gguf") and model.config.model_type == "llama":
        source = from_gguf(Path(name).expanduser(), model)
    elif name.lower().endswith(".gguf"):
        source = from_float(model, Path(name).expanduser())
    else:
        source = from_float(model)
    model.__dict__[ATTR] = source  # a plain attribute (not a module or parameter of the model)
    return source
