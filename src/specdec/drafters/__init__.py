"""Prophets. Every drafter implements `specdec.drafters.base.Drafter`; `build_drafters`
turns a `--draft` spec into drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.feature import FeatureDrafter, is_feature_prophet, load_head
from specdec.drafters.layerskip import LayerSkipDrafter, choose_layers
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.retrieval import Datastore, RetrievalDrafter, build_default_datastore, default_index_path
from specdec.lm import load_pretrained, shared_vocab_size

__all__ = ["Draft", "Drafter", "FeatureDrafter", "ModelDrafter", "NgramDrafter", "RetrievalDrafter", "LayerSkipDrafter",
           "build_drafters"]


def _layers(part: str, target: Any, tokenizer: Any) -> int:
    """layerskip:L, or plain `layerskip` (= layerskip:auto) for the L that measurement favours."""
    if part in ("layerskip", "layerskip:auto"):
        from specdec.data.prompts import build_suite

        calibration = "\n".join(p.text for p in build_suite(1))
        return choose_layers(target, list(tokenizer(calibration)["input_ids"]))[0]
    try:
        return int(part.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"layerskip takes a layer count, e.g. layerskip:4, got {part!r}") from None


def _datastore(tokenizer: Any, path: str | None) -> Datastore:
    """The given index, or the default one over the stdlib training split, built once."""
    if path is not None:
        if not Path(path).exists():
            raise ValueError(f"retrieval index '{path}' does not exist: build it with `specdec index --out {path}`")
        return Datastore.load(Path(path))
    default = default_index_path(tokenizer)
    if default.exists():
        return Datastore.load(default)
    return build_default_datastore(tokenizer, default)


def _feature_drafter(path: str, target: Any, dtype: torch.dtype) -> FeatureDrafter:
    """A feature prophet (models/smollm2-eagle, ...), handed the target's embeddings and head."""
    head, vocab_ids, cfg = load_head(Path(path))
    if not target.offers_hidden:
        raise ValueError(f"feature prophet '{path}' needs a target that exposes its hidden states")
    embed, lm_head = target.embeddings(), target.head()
    if embed.shape[1] != head.dim or lm_head.shape[0] != cfg.get("vocab_size", lm_head.shape[0]):
        raise ValueError(f"feature prophet '{path}' was trained for a target with hidden size {head.dim} and "
                         f"{cfg.get('vocab_size')} ids; '{target.name}' has {embed.shape[1]} and {lm_head.shape[0]}")
    return FeatureDrafter(head, embed, lm_head, vocab_ids, target.vocab_size, name=_short(path), dtype=dtype)


def _int8_drafter(name: str, target: Any, tokenizer: Any, dtype: torch.dtype, trust_remote_code: bool) -> ModelDrafter:
    """A compressed copy of a model (the target itself when it is named) with int8 weights
    and its own KV cache, drafting for the full-precision target."""
    from specdec.fastllama import FastLlamaLM, supports

    if name == target.name:
        model = target.model
    else:
        model, draft_tok = load_pretrained(name, torch.float32, trust_remote_code, role="drafter")
        shared_vocab_size(target.model, tokenizer, model, draft_tok, target.name, name)
    if not supports(model):
        raise ValueError(f"'{name}:int8' needs a plain Llama model (the lean path quantizes it)")
    return ModelDrafter(FastLlamaLM(model, f"{name}:int8", target.vocab_size, int8=True, act_dtype=dtype),
                        name=f"{_short(name)}:int8")


def _model_drafter(name: str, target: Any, tokenizer: Any, dtype: torch.dtype,
                   trust_remote_code: bool, backend: str) -> ModelDrafter:
    from specdec.api import wrap

    model, draft_tok = load_pretrained(name, dtype, trust_remote_code, role="drafter")
    vocab = shared_vocab_size(target.model, tokenizer, model, draft_tok, target.name, name)
    if vocab != target.vocab_size:
        raise ValueError(f"drafter '{name}' and target '{target.name}' share {vocab} ids, "
                         f"the target scores {target.vocab_size}")
    return ModelDrafter(wrap(model, name, vocab, backend), name=_short(name))


def _short(name: str) -> str:
    parts = [p for p in name.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else name


def build_drafters(spec: str, target: Any, tokenizer: Any, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False, retrieval_index: str | None = None,
                   backend: str = "auto") -> list[Drafter]:
    if spec in ("", "none"):
        return []
    drafters: list[Drafter] = []
    for part in spec.split("+"):
        part = part.strip()
        if part == "ngram" or part.startswith("ngram:"):
            n_max = int(part.split(":")[1]) if ":" in part else 4
            drafters.append(NgramDrafter(n_max=n_max))
        elif part == "retrieval":
            drafters.append(RetrievalDrafter(_datastore(tokenizer, retrieval_index)))
        elif part.startswith("layerskip"):
            drafters.append(LayerSkipDrafter(target, _layers(part, target, tokenizer)))
        elif part.endswith(":int8"):
            drafters.append(_int8_drafter(part[: -len(":int8")], target, tokenizer, dtype, trust_remote_code))
        elif is_feature_prophet(part):
            drafters.append(_feature_drafter(part, target, dtype))
        else:
            drafters.append(_model_drafter(part, target, tokenizer, dtype, trust_remote_code, backend))
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"each drafter may appear once in --draft, got {spec!r}")
    return drafters
