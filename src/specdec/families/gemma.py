"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by (1 + weight), norms on the attention and MLP
outputs too, GeGLU, embeddings scaled by sqrt(hidden size), a query scale of their own, sliding-window
layers between global ones; Gemma 2 soft-caps attention scores and logits, Gemma 3 normalizes each
head of q and k and gives its sliding layers a rotary table of their own."""

from __future__ import annotations

from typing import Any

from specdec.families import Arch, layer_windows, split_parts


class _Gemma2:
    name: str = "gemma2"
    model_types: tuple[str, ...] = ("gemma2",)

    def refuses(self, cfg: Any) -> str | None:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            return f"activation {act}"
        if getattr(cfg, "attention_bias", False):
            return "biases in attention"
        return None

    def arch(self, cfg: Any) -> Arch:
        layer_types = getattr(cfg, "layer_types", None)
        return Arch(family=self.name, norm_offset=1.0, act="gelu_tanh", embed_scale=float(cfg.hidden_size) ** 0.5,
                    query_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                    attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
                    final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
                    windows=layer_windows(cfg), rope_of_layer=self.ropes(layer_types, cfg))

    def ropes(self, layer_types: Any, cfg: Any) -> tuple[str, ...]:
        return ()

    def parts(self, layer: Any) -> dict[str, Any]:
        parts = split_parts(layer)
        parts["attn_out_norm"] = layer.post_attention_layernorm.weight
        parts["post_norm"] = layer.pre_feedforward_layernorm.weight
        parts["mlp_out_norm"] = layer.post_feedforward_layernorm.weight
        return parts


class _Gemma3(_Gemma2):
    name: str = "gemma3"
    model_types: tuple[str, ...] = ("gemma3_text",)

    def ropes(self, layer_types: Any, cfg: Any) -> tuple[str, ...]:
        return tuple(layer_types) if layer_types else ()

    def parts(self, layer: Any) -> dict[str, Any]:
        parts = super().parts(layer)
        parts["q_norm"], parts["k_norm"] = layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight
        return parts


GEMMA2 = _Gemma2()
GEMMA3 = _Gemma3()
