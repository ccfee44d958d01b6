"""Prophets. Every drafter implements `specdec.drafters.base.Drafter`; `build_drafters`
turns a `--draft` spec into drafters."""

from __future__ import annotations

from typing import Any

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.model import ModelDrafter
from specdec.lm import HFCausalLM, load_pretrained, shared_vocab_size

__all__ = ["Draft", "Drafter", "ModelDrafter", "build_drafters"]


def _model_drafter(name: str, target: HFCausalLM, tokenizer: Any, dtype: torch.dtype,
                   trust_remote_code: bool) -> ModelDrafter:
    model, draft_tok = load_pretrained(name, dtype, trust_remote_code, role="drafter")
    vocab = shared_vocab_size(target.model, tokenizer, model, draft_tok, target.name, name)
    if vocab != target.vocab_size:
        raise ValueError(f"drafter '{name}' and target '{target.name}' share {vocab} ids, "
                         f"the target scores {target.vocab_size}")
    return ModelDrafter(HFCausalLM(model, name, vocab), name=_short(name))


def _short(name: str) -> str:
    parts = [p for p in name.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else name


def build_drafters(spec: str, target: HFCausalLM, tokenizer: Any, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False, retrieval_index: str | None = None) -> list[Drafter]:
    if spec in ("", "none"):
        return []
    drafters: list[Drafter] = []
    for part in spec.split("+"):
        part = part.strip()
        drafters.append(_model_drafter(part, target, tokenizer, dtype, trust_remote_code))
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"each drafter may appear once in --draft, got {spec!r}")
    return drafters
