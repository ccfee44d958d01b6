"""Loading a decoder from Hugging Face ids or local paths: the usual entry point.

    from specdec import load
    decoder = load()                                  # the bundled pair
    decoder = load("path/to/target", draft="path/to/drafter", policy="adaptive")
    out = decoder.generate("def fib(n):", max_new_tokens=64, temperature=0)
    print(out.text, out.stats.tokens_per_round)
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.defaults import default_drafter_for, default_target
from specdec.engine import SpeculativeDecoder
from specdec.lm import HFCausalLM, load_pretrained, shared_vocab_size
from specdec.policy import make_policy


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def default_draft_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def resolve_dtype(name: str) -> torch.dtype:
    """float32, bfloat16, or auto (bfloat16 where the CPU computes it natively)."""
    if name == "auto":
        return default_draft_dtype()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be float32, bfloat16 or auto, got {name!r}")
    return dtypes[name]


def wrap(model: Any, name: str, vocab_size: int, backend: str = "auto") -> Any:
    """The engine's view of a model: the lean Llama path where it applies, else Hugging Face's."""
    from specdec.fastllama import FastLlamaLM, supports

    if backend not in ("auto", "hf", "fast"):
        raise ValueError(f"backend must be auto, hf or fast, got {backend!r}")
    if backend == "fast" or (backend == "auto" and supports(model)):
        return FastLlamaLM(model, name, vocab_size)
    return HFCausalLM(model, name, vocab_size)


def load(target: str | None = None, draft: str | None = "default", policy: str = "auto", draft_tokens: int = 4,
         multi: str = "tree", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
         retrieval_index: str | None = None, backend: str = "auto",
         draft_dtype: torch.dtype | None = None) -> SpeculativeDecoder:
    """A decoder for `target` with the drafter(s) described by `draft`.

    draft: "default" (the bundled drafter when the target is the bundled one), "none"
    (plain decoding), a model id or path, "ngram", "retrieval", "layerskip:L", or several
    joined with "+" (e.g. "models/drafter+ngram") for several prophets at once.
    backend: "auto" runs plain Llama models on specdec's lean decode path (same weights,
    same logits, less Python per step) and anything else through transformers; "hf" forces
    transformers' own forward and DynamicCache.
    draft_dtype: the drafter's weights (default: bfloat16 where the CPU has native bf16,
    else float32). A drafter's precision never affects exactness (the verifier tests the q
    it sampled from), only its speed and acceptance; bfloat16 halves the bytes its head
    reads each step.
    """
    from specdec.drafters import build_drafters

    target_name = target or default_target()
    if draft == "default":  # a shipped prophet only fits the target it was made for
        draft = default_drafter_for(target_name)
    model, tokenizer = load_pretrained(target_name, dtype, trust_remote_code, role="target")
    vocab = shared_vocab_size(model, tokenizer, None, None, target_name, None)
    target_lm = wrap(model, target_name, vocab, backend)
    drafters = build_drafters(draft or "none", target_lm, tokenizer, dtype=draft_dtype or default_draft_dtype(),
                              trust_remote_code=trust_remote_code, retrieval_index=retrieval_index, backend=backend)
    return SpeculativeDecoder(target_lm, drafters, tokenizer, make_policy(policy, draft_tokens), multi,
                              _eos_ids(model, tokenizer))
