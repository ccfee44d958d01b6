"""Qwen 2 / 2.5 (biases on q, k and v) and Qwen 3 (RMSNorm over each head of q and k)."""

from __future__ import annotations

from typing import Any

from specdec.families import Arch, layer_windows, split_parts, swiglu_refusal


class _Qwen2:
    name: str = "qwen2"
    model_types: tuple[str, ...] = ("qwen2",)

    def refuses(self, cfg: Any) -> str | None:
        return swiglu_refusal(cfg)

    def arch(self, cfg: Any) -> Arch:
        return Arch(family=self.name, windows=layer_windows(cfg))

    def parts(self, layer: Any) -> dict[str, Any]:
        return split_parts(layer, qkv_bias=True)


class _Qwen3(_Qwen2):
    name: str = "qwen3"
    model_types: tuple[str, ...] = ("qwen3",)

    def refuses(self, cfg: Any) -> str | None:
        if getattr(cfg, "attention_bias", False):
            return "biases in attention"
        return super().refuses(cfg)

    def parts(self, layer: Any) -> dict[str, Any]:
        parts = split_parts(layer)
        parts["q_norm"], parts["k_norm"] = layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight
        return parts


QWEN2 = _Qwen2()
QWEN3 = _Qwen3()
