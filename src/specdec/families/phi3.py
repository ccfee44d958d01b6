"""Phi-3 (and Phi-3.5 / Phi-4-mini where their rotary is whole): q|k|v and gate|up already fused."""

from __future__ import annotations

from typing import Any

from specdec.families import Arch, layer_windows, swiglu_refusal


class _Phi3:
    name: str = "phi3"
    model_types: tuple[str, ...] = ("phi3",)

    def refuses(self, cfg: Any) -> str | None:
        return swiglu_refusal(cfg)

    def arch(self, cfg: Any) -> Arch:
        return Arch(family=self.name, windows=layer_windows(cfg))

    def parts(self, layer: Any) -> dict[str, Any]:
        att, mlp = layer.self_attn, layer.mlp
        return {"qkv": att.qkv_proj.weight, "o": att.o_proj.weight, "gate_up": mlp.gate_up_proj.weight,
                "down": mlp.down_proj.weight, "in_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight}


PHI3 = _Phi3()
