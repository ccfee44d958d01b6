"""Wiring: from names to running parts, in one place.

A `--draft` spec ("ngram", "models/prophet+ngram", "smollm2:int8", ...) is parsed here and
each part is built by the first prophet kind in the registry that claims it; models are
loaded here and wrapped for the engine (the lean Llama path or transformers'); dtypes are
resolved here. Prophets are handed the models they need and never import the loader.

    register(ProphetKind("mine", lambda part: part == "mine", build_mine, "my prophet"))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.coststore import BATCH_BUDGET_S
from specdec.errors import ModelLoadError, VocabularyMismatchError
from specdec.hf import HFLM
from specdec.prophets.base import Prophet


# ----------------------------------------------------------------- dtypes and devices
def default_draft_dtype(device: torch.device | None = None) -> torch.dtype:
    """bfloat16 where the device computes it natively (a CPU with AVX512-BF16 or AMX, a GPU
    that supports it), else float32."""
    if device is not None and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device is not None and device.type != "cpu":
        return torch.float32
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def resolve_dtype(name: str) -> torch.dtype | None:
    """default (None: `load` chooses, see default_target_int4), float32, bfloat16, auto
    (bfloat16 where the CPU computes it natively), or int4: a target's 4-bit weights on the
    lean path (specdec.int4), named torch.quint4x2 here."""
    from specdec.int4 import INT4

    if name == "default":
        return None
    if name == "auto":
        return default_draft_dtype()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int4": INT4}
    if name not in dtypes:
        raise ValueError(f"dtype must be default, float32, bfloat16, auto or int4, got {name!r}")
    return dtypes[name]


def default_target_int4(name: str, model: Any, device: torch.device, backend: str) -> bool:
    """Whether a target loaded with no dtype asked for runs its 4-bit weights (int4) rather
    than float32: yes where the target is a GGUF file (smollm2's, or a .gguf path) on the CPU's
    lean path with PyTorch's int4 kernel, of any family there. The 4-bit kernel multiplies the
    weights the file holds (Q4_1, Q8_0 blocks as they are; other formats quantized again, never to
    fewer bits: `specdec.int4.requantized`), several times faster per step than float32; greedy
    speculative output stays equal to plain int4 decoding. Other models keep float32 weights."""
    from specdec.defaults import is_alias
    from specdec.llama import supports

    return (device.type == "cpu" and backend != "hf" and (is_alias(name) or name.lower().endswith(".gguf"))
            and supports(model) and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def resolve_device(name: str | torch.device | None) -> torch.device:
    """"cpu", "cuda", "cuda:1", "mps" or "auto" (the first GPU when there is one, else the CPU);
    a device this machine lacks is a clear error, not a crash later."""
    if name is None or name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda, cuda:N, mps or auto, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but this machine has no CUDA GPU: use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r} was asked for but MPS is not available here: use --device cpu")
    elif device.type != "cpu":
        raise ValueError(f"device must be cpu, cuda, cuda:N, mps or auto, got {name!r}")
    return device


# ----------------------------------------------------------------- models
def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name and not _is_hub_id(name)


def _is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def one_line(error: BaseException, limit: int = 400) -> str:
    """An exception's message as one line (libraries' messages span several), at most `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_model_dir(name: str, role: str = "model") -> Path | None:
    """The local directory `name` names, checked for what loading reads (a config.json and
    tokenizer files), else None for a Hugging Face id; anything else a `ModelLoadError` saying
    what to pass instead."""
    path = Path(name).expanduser()
    if not path.exists():
        if _looks_like_path(name) or not _is_hub_id(name):
            raise ModelLoadError(f"{role} '{name}': no such directory, and not a Hugging Face id (owner/name)")
        return None
    what = "a model directory (config.json, weights and tokenizer files), a .gguf file or a Hugging Face id"
    if not path.is_dir():
        raise ModelLoadError(f"{role} '{name}' is a file, not a model: pass {what}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{role} '{name}' has no config.json: pass {what}")
    if not any(path.glob("tokenizer*")) and not (path / "vocab.json").is_file():
        raise ModelLoadError(f"{role} '{name}' has no tokenizer files (tokenizer.json, tokenizer_config.json, ...): "
                             "save its tokenizer beside it (tokenizer.save_pretrained(directory))")
    return path


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, role: str = "model") -> Any:
    """The tokenizer of a Hugging Face id, a local directory, a GGUF file, "smollm2" or "bundled",
    with clear errors."""
    from transformers import AutoTokenizer

    from specdec.defaults import resolve_bundled
    from specdec.gguf import resolve_model

    name_or_path = resolve_model(resolve_bundled(name_or_path))
    path = check_model_dir(name_or_path, role)
    try:  # a library reading files someone else wrote may raise anything: each becomes one line
        return AutoTokenizer.from_pretrained(str(path or name_or_path), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer of {role} '{name_or_path}': {one_line(e)}") from e


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                    role: str = "model", device: torch.device | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face id, a local directory, a GGUF file, "smollm2"
    (converted once, see specdec.gguf) or "bundled" (the small pair's target), on `device`
    (default: the CPU), with clear errors: a model whose cache specdec cannot roll back among
    them (`specdec.hf.attention_layout`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdec.defaults import resolve_bundled
    from specdec.gguf import resolve_model
    from specdec.hf import attention_layout

    hf_logging.disable_progress_bar()
    name_or_path = resolve_model(resolve_bundled(name_or_path))
    tokenizer = load_tokenizer(name_or_path, trust_remote_code, role)
    source = str(check_model_dir(name_or_path, role) or name_or_path)
    try:  # as in load_tokenizer: weights, configs and remote code from anywhere
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"could not load {role} '{name_or_path}': {one_line(e)}") from e
    attention_layout(model.config, name_or_path)  # before anything runs it
    if device is not None and device.type != "cpu":
        model = model.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
    return model.eval(), tokenizer


def shared_vocab_size(target_model: Any, target_tok: Any, draft_model: Any | None, draft_tok: Any | None,
                      target_name: str, draft_name: str | None) -> int:
    """The ids both models score. Embeddings padded past the tokenizer are sliced away;
    anything else that differs is an error naming both models."""
    n_tok = len(target_tok)
    if target_model.config.vocab_size < n_tok:
        raise VocabularyMismatchError(
            f"target '{target_name}' scores {target_model.config.vocab_size} ids but its tokenizer has {n_tok}")
    if draft_model is None or draft_tok is None:
        return n_tok
    if draft_tok.get_vocab() != target_tok.get_vocab():
        only_t = len(set(target_tok.get_vocab()) - set(draft_tok.get_vocab()))
        only_d = len(set(draft_tok.get_vocab()) - set(target_tok.get_vocab()))
        raise VocabularyMismatchError(
            f"target '{target_name}' and prophet '{draft_name}' have different vocabularies "
            f"({len(target_tok)} vs {len(draft_tok)} entries; {only_t} only in the target's, {only_d} only in the "
            f"prophet's). Speculative decoding needs a prophet with the target's tokenizer.")
    if draft_model.config.vocab_size < n_tok:
        raise VocabularyMismatchError(
            f"prophet '{draft_name}' scores {draft_model.config.vocab_size} ids but the shared tokenizer has {n_tok}")
    return n_tok


def wrap(model: Any, name: str, vocab_size: int, backend: str = "auto", kv_dtype: str | None = None) -> Any:
    """The engine's view of a model: the lean Llama path where it applies, else Hugging Face's.
    kv_dtype: the lean path's KV cache (`specdec.llama.kv_dtype_for`; transformers keeps its own)."""
    from specdec.llama import BatchLlama, supports

    if backend not in ("auto", "hf", "fast"):
        raise ValueError(f"backend must be auto, hf or fast, got {backend!r}")
    if backend == "fast" or (backend == "auto" and supports(model)):
        return BatchLlama(model, name, 1, vocab_size, kv_dtype=kv_dtype)
    return HFLM(model, name, vocab_size)


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end an answer: the generation config's, else the tokenizer's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def short_name(name: str) -> str:
    parts = [p for p in name.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else name


# ----------------------------------------------------------------- prophets
@dataclass(frozen=True)
class Wiring:
    """What a prophet builder may use: the wrapped target, its tokenizer and the settings."""

    target: Any
    tokenizer: Any
    dtype: torch.dtype = torch.float32  # a prophet model's weights
    trust_remote_code: bool = False
    retrieval_index: str | None = None
    backend: str = "auto"
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class ProphetKind:
    """One kind of `--draft` part: `claims(part)` says whether a part is of this kind,
    `build(part, wiring)` makes the prophet."""

    name: str
    claims: Callable[[str], bool]
    build: Callable[[str, Wiring], Prophet]
    help: str


_REGISTRY: list[ProphetKind] = []


def register(kind: ProphetKind, before: str | None = None) -> None:
    """Add a prophet kind (before the kind named `before`, else ahead of the catch-all
    model kind); the first kind that claims a part builds it."""
    names = [k.name for k in _REGISTRY]
    if kind.name in names:
        raise ValueError(f"prophet kind '{kind.name}' is registered already")
    at = names.index(before) if before in names else names.index("model") if "model" in names else len(names)
    _REGISTRY.insert(at, kind)


def prophet_kinds() -> list[ProphetKind]:
    return list(_REGISTRY)


def parse_draft(spec: str | None) -> list[str]:
    """The parts of a `--draft` spec: "none" / "" -> [], "a+b" -> ["a", "b"]."""
    if spec is None or spec.strip() in ("", "none"):
        return []
    parts = [p.strip() for p in spec.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"--draft {spec!r} has an empty part: join prophets with '+', e.g. models/prophet+ngram")
    if len(set(parts)) != len(parts):
        raise ValueError(f"each prophet may appear once in --draft, got {spec!r}")
    return parts


def build_prophets(spec: str | None, target: Any, tokenizer: Any, dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False, retrieval_index: str | None = None,
                   backend: str = "auto") -> list[Prophet]:
    """Prophets for a `--draft` spec, each built by the first registered kind that claims it.
    dtype: the prophets' weights; None: `default_draft_dtype` of the target's device."""
    wiring = Wiring(target, tokenizer, dtype if dtype is not None else default_draft_dtype(target.device),
                    trust_remote_code, retrieval_index, backend, target.device)
    from specdec.defaults import shipped

    prophets = []
    for part in map(shipped, parse_draft(spec)):  # models/NAME: a shipped prophet, as pages name it
        kind = next(k for k in _REGISTRY if k.claims(part))
        prophets.append(kind.build(part, wiring))
    names = [d.name for d in prophets]
    if len(set(names)) != len(names):
        raise ValueError(f"each prophet may appear once in --draft, got {spec!r}")
    return prophets


def _ngram(part: str, w: Wiring) -> Prophet:
    from specdec.prophets.ngram import NgramProphet

    if ":" not in part:
        return NgramProphet()
    try:
        n_max = int(part.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"ngram takes a longest match length, e.g. ngram:4, got {part!r}") from None
    return NgramProphet(n_max=n_max)


def _retrieval(part: str, w: Wiring) -> Prophet:
    from specdec.prophets.retrieval import Datastore, RetrievalProphet, build_default_datastore, default_index_path

    if part == "retrieval:context":  # each request's own context as the corpus
        return RetrievalProphet(None, name=part)
    if w.retrieval_index is not None:
        if not Path(w.retrieval_index).exists():
            raise ValueError(f"retrieval index '{w.retrieval_index}' does not exist: "
                             f"build it with `specdec index --out {w.retrieval_index}`")
        return RetrievalProphet(Datastore.load(Path(w.retrieval_index)))
    default = default_index_path(w.tokenizer)  # over the stdlib training split, built once
    store = Datastore.load(default) if default.exists() else build_default_datastore(w.tokenizer, default)
    return RetrievalProphet(store)


def _layerskip(part: str, w: Wiring) -> Prophet:
    """layerskip:L, or plain `layerskip` (= layerskip:auto) for the L that measurement favours."""
    from specdec.prophets.layerskip import LayerSkipProphet, choose_layers

    if part in ("layerskip", "layerskip:auto"):
        from specdec.data.prompts import build_suite

        calibration = "\n".join(p.text for p in build_suite(1))
        layers = choose_layers(w.target, list(w.tokenizer(calibration)["input_ids"]))[0]
    else:
        try:
            layers = int(part.split(":", 1)[1])
        except (IndexError, ValueError):
            raise ValueError(f"layerskip takes a layer count, e.g. layerskip:4, got {part!r}") from None
    return LayerSkipProphet(w.target, layers)


def _int8(part: str, w: Wiring) -> Prophet:
    """A compressed copy of a model (the target itself when it is named) with int8 weights
    and its own KV cache, drafting for the full-precision target."""
    from specdec.llama import BatchLlama, supports
    from specdec.prophets.model import ModelProphet

    name = part[: -len(":int8")]
    if name == w.target.name:
        model = w.target.model
    else:
        model, draft_tok = load_pretrained(name, torch.float32, w.trust_remote_code, role="prophet", device=w.device)
        shared_vocab_size(w.target.model, w.tokenizer, model, draft_tok, w.target.name, name)
    if not supports(model):
        raise ValueError(f"'{name}:int8' needs a plain Llama model (the lean path quantizes it)")
    return ModelProphet(BatchLlama(model, f"{name}:int8", 1, w.target.vocab_size, int8=True, act_dtype=w.dtype),
                        name=f"{short_name(name)}:int8")


def _feature(part: str, w: Wiring) -> Prophet:
    """A feature prophet (models/smollm2-eagle, ...), handed the target's embeddings and head."""
    from specdec.prophets.feature import FeatureProphet, load_head

    head, vocab_ids, cfg = load_head(Path(part))
    if head.kind != "kangaroo" and not w.target.offers_hidden:
        raise ValueError(f"feature prophet '{part}' needs a target that exposes its hidden states")
    lm_head = w.target.head()
    vocab = cfg.get("vocab_size", lm_head.shape[0])
    if lm_head.shape[1] != head.dim or lm_head.shape[0] != vocab or head.layers >= w.target.n_layers:
        needs = f" and more than {head.layers} layers" if head.layers else ""
        raise ValueError(f"prophet '{part}' was trained for a target with hidden size {head.dim}, {vocab} ids{needs}; "
                         f"'{w.target.name}' has {lm_head.shape[1]}, {lm_head.shape[0]} and {w.target.n_layers} layers")
    if head.kind == "kangaroo":  # early exit + adapter: the target's first layers draft
        from specdec.prophets.layerskip import AdaptedExitProphet

        return AdaptedExitProphet(w.target, head, vocab_ids, name=short_name(part), dtype=w.dtype)
    return FeatureProphet(head, w.target.embeddings(), lm_head, vocab_ids, w.target.vocab_size,
                          name=short_name(part), dtype=w.dtype, block_head=_block_head(w.target, vocab_ids))


def _block_head(target: Any, vocab_ids: torch.Tensor) -> Any:
    """A lean int4 target's head rows `vocab_ids` on its block kernel (`Int4Weight.block_rows`),
    or None (a float head, PyTorch's int4 kernel, a transformers target)."""
    from specdec.int4 import Int4Weight

    head = getattr(target, "lm_head", None)
    return head.block_rows(vocab_ids) if isinstance(head, Int4Weight) else None


def _eagle3(part: str, w: Wiring) -> Prophet:
    """An EAGLE-3-style prophet (models/smollm2-eagle3): one decoder layer over the target's
    fused features; it needs the lean Llama path (whose passes keep those features)."""
    from specdec.llama import BatchLlama
    from specdec.prophets.eagle3 import Eagle3Prophet, Eagle3Runtime, load_eagle3

    net, vocab_ids, cfg = load_eagle3(Path(part))
    target = w.target
    if not isinstance(target, BatchLlama):
        raise ValueError(f"prophet '{part}' needs a plain Llama target on the lean path (such as smollm2)")
    rows = target
    if rows.embed.shape[1] != net.dim or max(cfg["layers"]) >= rows.n_layers or rows.head_dim != net.head_dim:
        raise ValueError(f"prophet '{part}' was trained for a target with hidden size {net.dim} and more than "
                         f"{max(cfg['layers'])} layers; '{target.name}' has {rows.embed.shape[1]} and {rows.n_layers}")
    runtime = Eagle3Runtime(net, vocab_ids, tuple(cfg["layers"]), rows.embed, target.head(),
                            rows.cos, rows.sin, 1, int4=rows.int4, name=short_name(part))
    return Eagle3Prophet(runtime, target.vocab_size)


def _model(part: str, w: Wiring) -> Prophet:
    """A smaller model with the target's tokenizer (a path, a hub id or a GGUF file)."""
    from specdec.prophets.model import ModelProphet

    model, draft_tok = load_pretrained(part, w.dtype, w.trust_remote_code, role="prophet", device=w.device)
    vocab = shared_vocab_size(w.target.model, w.tokenizer, model, draft_tok, w.target.name, part)
    if vocab != w.target.vocab_size:
        raise ValueError(f"prophet '{part}' and target '{w.target.name}' share {vocab} ids, "
                         f"the target scores {w.target.vocab_size}")
    return ModelProphet(wrap(model, part, vocab, w.backend), name=short_name(part))


def _is_eagle3(part: str) -> bool:
    from specdec.prophets.eagle3 import is_eagle3

    return is_eagle3(part)


def _is_feature_prophet(part: str) -> bool:
    from specdec.prophets.feature import is_feature_prophet

    return is_feature_prophet(part)


for _kind in (
    ProphetKind("ngram", lambda p: p == "ngram" or p.startswith("ngram:"), _ngram,
                "prompt lookup: continue the longest earlier match of the last tokens (ngram:N, longest N)"),
    ProphetKind("retrieval", lambda p: p in ("retrieval", "retrieval:context"), _retrieval,
                "continuations of matching text in a datastore (--retrieval-index), or in the request's own "
                "context (retrieval:context)"),
    ProphetKind("layerskip", lambda p: p == "layerskip" or p.startswith("layerskip:"), _layerskip,
                "the target's first L layers and its own head (layerskip:L or layerskip:auto)"),
    ProphetKind("int8", lambda p: p.endswith(":int8"), _int8, "a model (the target's name: itself) with int8 weights"),
    ProphetKind("eagle3", lambda p: _is_eagle3(p), _eagle3,
                "one decoder layer over the target's fused low/middle/high features (EAGLE-3-style; prophet.json)"),
    ProphetKind("feature", _is_feature_prophet, _feature,
                "heads over the target's hidden states (a directory with prophet.json: EAGLE- or Medusa-style)"),
    ProphetKind("model", lambda p: True, _model, "a smaller model with the target's tokenizer (path, hub id, .gguf)"),
):
    _REGISTRY.append(_kind)


def resolve_multi(multi: str, prophets: list[Prophet]) -> str:
    """multi="auto": "first" when a feature prophet (eagle3 too) is among several, else "tree"."""
    if multi == "auto":
        return "first" if len(prophets) > 1 and any(d.reads_features or d.fused_layers for d in prophets) else "tree"
    return multi


__all__ = ["ProphetKind", "Wiring", "build_prophets", "default_draft_dtype", "eos_ids",
           "parse_draft", "prophet_kinds", "register", "resolve_device", "resolve_dtype", "resolve_multi",
           "short_name", "wrap"]


def engine_for(decoder: Any, slots: int, costs: bool = True) -> Any:
    """The BatchEngine of `slots` rows over a SpeculativeDecoder's own weights and prophets
    (cached on it): the one round loop its requests run on, alone or many at once. costs:
    hand it the decoder's stored step costs (measured on this engine the first time:
    `SpeculativeDecoder.calibrate`)."""
    if slots not in decoder.engines:
        decoder.engines[slots] = _new_engine(decoder, slots)
    engine = decoder.engines[slots]
    mb = getattr(decoder, "prefix_cache_mb", 0.0)
    if engine.prefix_mb != mb:  # the decoder's prompt prefix cache, one for its engines
        decoder.prefix_store = engine.slots.enable_prefix_cache(int(mb * (1 << 20)), decoder.prefix_store)
        engine.prefix_mb = mb
    if costs and engine.prophet is not None and decoder.policy.needs_costs and engine.kchoice.row_costs is None:
        # sampled rows decide K from the decoder's stored costs: a seeded row gives the same
        # tokens alone, in any batch, and in another process on this machine
        engine.kchoice.row_costs = decoder.decision_costs()
        engine.kchoice.cost_store = decoder.stored_batch_costs
        engine.measure_budget_s = BATCH_BUDGET_S
    return engine


def _new_engine(decoder: Any, slots: int) -> Any:
    from specdec.batch import BatchEngine
    from specdec.prophets.combine import combined

    # the same weights, caches of the engine's own: a plain Llama on the lean path scores its rows in
    # one batched pass, any other model (transformers, a toy) row by row (specdec.rows)
    target = decoder.target.view(slots)
    branches = getattr(decoder, "branches", 1)
    parts = [d.for_engine(target, slots, branches) for d in decoder.prophets]
    return BatchEngine(target, combined(parts, decoder.multi), decoder.eos_token_ids, decoder.tokenizer)
