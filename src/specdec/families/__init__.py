"""Model families on specdec's own decode path: one file per family, one protocol for all.

A family file says, for the models of its `model_types`, three things and nothing else:
- `refuses(config)`: why this path cannot run a model of the family (None: it can), so
  that such a model runs on transformers' forward instead (`specdec.hf`), never wrongly;
- `arch(config)`: how its layers compute beyond the Llama baseline (`Arch`: norm offset,
  activation, sandwich norms, q/k norms, biases, attention scale, soft-capping, sliding
  windows, rotary tables per layer);
- `parts(layer)`: a layer's weights under the path's names (`PARTS`), the products fused
  (q|k|v, gate|up) as the family's modules hold them.

The decode path (`specdec.llama`: the ragged batched pass, the one-sequence view, the C++
layer loop, which takes every family's extras but Gemma 2's soft-capping) reads only these,
so a new family is one file here plus its line in `_families()`; the 4-bit products
(`specdec.int4source`) are quantized from the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# A layer's weights as the path names them: products ("qkv" and "gate_up" as lists of the parts
# fused in that order, or one tensor already fused), norms, and what some families add.
PRODUCTS = ("qkv", "o", "gate_up", "down")
NORMS = ("in_norm", "post_norm")  # before attention, before the MLP (Llama's post_attention_layernorm)
EXTRAS = ("qkv_bias", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
PARTS = PRODUCTS + NORMS + EXTRAS


@dataclass(frozen=True)
class Arch:
    """How a family's layers compute where they differ from Llama's (the defaults are Llama)."""

    family: str = "llama"
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's is 1
    act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden size))
    query_scale: float | None = None  # attention scores scaled by it where not 1/sqrt(head dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise (Gemma 2)
    windows: tuple[int | None, ...] = ()  # per layer: keys a query sees (itself included), None: all
    rope_of_layer: tuple[str, ...] = ()  # per layer: the rotary table it reads (`rope_tables`' keys)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope(self, layer: int) -> str:
        return self.rope_of_layer[layer] if self.rope_of_layer else ""


class Family(Protocol):
    name: str
    model_types: tuple[str, ...]

    def refuses(self, cfg: Any) -> str | None: ...

    def arch(self, cfg: Any) -> Arch: ...

    def parts(self, layer: Any) -> dict[str, Any]: ...


# rotary kinds computed once from the inverse frequencies alone (no dependence on the sequence length)
STATIC_ROPE = ("default", "llama3", "linear", "yarn")


def rope_types(cfg: Any) -> set[str]:
    """Every rope type a config names (one, or one per layer type as Gemma 3's)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return {str(v.get("rope_type", "default")) for v in params.values()}
    return {str(params.get("rope_type", "default"))}


def common_refusal(cfg: Any) -> str | None:
    """What no family file runs: dynamic rotary kinds, partial rotary, biased MLPs or outputs."""
    kinds = rope_types(cfg) - set(STATIC_ROPE)
    if kinds:
        return f"rotary kind {sorted(kinds)[0]} (the fast path computes {', '.join(STATIC_ROPE)})"
    if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "partial rotary embeddings"
    if getattr(cfg, "mlp_bias", False):
        return "biases in the MLP"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def swiglu_refusal(cfg: Any) -> str | None:
    """Why a family of SwiGLU MLPs cannot run a config whose activation is another (None: it can)."""
    act = getattr(cfg, "hidden_act", "silu")
    return None if act == "silu" else f"activation {act}"


def layer_windows(cfg: Any) -> tuple[int | None, ...]:
    """Per layer, the sliding window a layer attends within (None: the whole context), from the
    config's layer_types where it has them, else its sliding_window for every layer."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return (int(window),) * n if window else ()


def rope_tables(model: Any) -> dict[str, tuple[torch.Tensor, float]]:
    """The rotary inverse frequencies and scaling of a loaded model, by the name its layers use
    (Gemma 3: one per layer type; else one, named "")."""
    rotary = model.model.rotary_emb
    types = getattr(rotary, "layer_types", None)
    if types:
        return {t: (getattr(rotary, f"{t}_inv_freq"), float(getattr(rotary, f"{t}_attention_scaling")))
                for t in types}
    return {"": (rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))}


def split_parts(layer: Any, qkv_bias: bool = False) -> dict[str, Any]:
    """The parts of a layer whose attention and MLP keep q, k, v and gate, up apart (Llama's modules)."""
    att, mlp = layer.self_attn, layer.mlp
    parts: dict[str, Any] = {
        "qkv": [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], "o": att.o_proj.weight,
        "gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight], "down": mlp.down_proj.weight,
        "in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight}
    if qkv_bias:
        parts["qkv_bias"] = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
    return parts


def fused(part: Any) -> torch.Tensor:
    """One tensor of a part (the list's tensors concatenated along their first dimension)."""
    if isinstance(part, (list, tuple)):
        return torch.cat(list(part)).contiguous()
    return part  # type: ignore[no-any-return]


def _families() -> list[Family]:
    from specdec.families import gemma, llama, phi3, qwen

    return [llama.LLAMA, llama.MISTRAL, qwen.QWEN2, qwen.QWEN3, gemma.GEMMA2, gemma.GEMMA3, phi3.PHI3]


def family_of(cfg: Any) -> Family | None:
    """The family file for a config's model type, or None."""
    return next((f for f in _families() if cfg.model_type in f.model_types), None)


def why_not(model: Any) -> str | None:
    """Why the fast path cannot run a loaded model (None: it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "not a transformers model"
    family = family_of(cfg)
    if family is None:
        names = sorted({t for f in _families() for t in f.model_types})
        return f"model type {cfg.model_type!r} has no family file (the fast path runs {', '.join(names)})"
    return common_refusal(cfg) or family.refuses(cfg)


def supports(model: Any) -> bool:
    """Whether the fast path runs this loaded model (a family file takes it)."""
    return why_not(model) is None


def family_names() -> list[str]:
    return [f.name for f in _families()]
