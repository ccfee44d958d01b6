"""Llama: Llama 2 / 3.x, SmolLM, TinyLlama, and Mistral (Llama with a sliding window)."""

from __future__ import annotations

from typing import Any

from specdec.families import Arch, layer_windows, split_parts, swiglu_refusal


class _Llama:
    def __init__(self, name: str, model_types: tuple[str, ...]) -> None:
        self.name, self.model_types = name, model_types

    def refuses(self, cfg: Any) -> str | None:
        if getattr(cfg, "attention_bias", False):
            return "biases in attention"
        return swiglu_refusal(cfg)

    def arch(self, cfg: Any) -> Arch:
        return Arch(family=self.name, windows=layer_windows(cfg))

    def parts(self, layer: Any) -> dict[str, Any]:
        return split_parts(layer)


LLAMA = _Llama("llama", ("llama",))
MISTRAL = _Llama("mistral", ("mistral",))
