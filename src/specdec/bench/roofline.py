"""The bench report's roofline line: how far a decode step is from the weight-reading floor.

A one-token step of a small model on a CPU reads every weight once, so its floor is the
bytes it reads over the bandwidth at which this machine streams memory into products. Both
are measured here: the bytes from the weights as they are held (4-bit blocks with their
scales, int8 rows, float tensors; the head; one embedding row; the KV cache at the context
the costs were timed at) and the bandwidth by a GEMV microbenchmark over a matrix far larger
than the caches. The measured step is the decoder's own (`Costs.t_plain`, timed on the one
loop: the target's pass, its probabilities and the verification), and each prophet's is its
drafting step (`Costs.t_draft_by`)."""

from __future__ import annotations

import time
from typing import Any

import torch


def weight_bytes(w: Any) -> int:
    """Bytes a product over w reads: a tensor's elements, an nn.Module's parameters, a 4-bit
    weight's packed codes with scales and zeros (`Int4Weight.nbytes`), an int8 weight's codes
    and scales, the sum over a dict or a sequence; 0 for anything else."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, torch.nn.Module):  # a module running its products on block weights reads those
        products = getattr(w, "products", None)
        if products is not None:
            return weight_bytes(products)
        return sum(weight_bytes(p) for p in w.parameters(recurse=False)) + sum(weight_bytes(m) for m in w.children())
    if isinstance(w, dict):
        return sum(weight_bytes(v) for v in w.values())
    if isinstance(w, (list, tuple)):
        return sum(weight_bytes(v) for v in w)
    nbytes = getattr(w, "nbytes", None)  # Int4Weight
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(w, "q") and hasattr(w, "scale"):  # Int8Weight
        return weight_bytes(w.q) + weight_bytes(w.scale)
    return 0


def llama_step_bytes(lw: Any) -> int:
    """Weight bytes one token's pass through a `LlamaWeights` model reads: every layer's
    products and norms, the final norm, the head (tied to the embedding or not, it is read
    in full) and the token's embedding row."""
    row = lw.embed.shape[1] * lw.embed.element_size()
    return sum(weight_bytes(layer) for layer in lw.layers) + weight_bytes(lw.final_norm) + \
        weight_bytes(lw.lm_head) + row


def kv_bytes(lw: Any, context: int) -> int:
    """Bytes of keys and values a one-token step attends over at `context` positions."""
    dtype = getattr(lw, "kv_dtype", None)  # a batched model's cache (float16 for a 4-bit target), else its own dtype
    if dtype is None:
        dtype = lw.embed.dtype if lw.embed.dtype in (torch.bfloat16, torch.float16) else torch.float32
    per = dtype.itemsize
    return 2 * lw.n_layers * lw.n_kv * lw.head_dim * context * per


def target_step_bytes(target: Any, context: int = 0) -> int | None:
    """The bytes a plain step of the decoder's target reads (weights, plus its KV cache at
    `context`), or None where the target has no weights of its own to count."""
    from specdec.llama import LlamaWeights

    if isinstance(target, LlamaWeights):
        return llama_step_bytes(target) + kv_bytes(target, context)
    model = getattr(target, "model", None)
    if isinstance(model, torch.nn.Module):  # a transformers model: every parameter once (tied ones once)
        return weight_bytes(model)
    return None


def prophet_step_bytes(prophet: Any) -> int | None:
    """The weight bytes one drafting step of a prophet reads, or None for a prophet without
    weights (prompt lookup, retrieval) or of a kind not counted here."""
    runtime = getattr(prophet, "runtime", None)
    if runtime is not None and hasattr(runtime, "w"):  # eagle3: its layer and its cut head (a draft
        # step feeds its own output back: the fusing product runs on true slots only)
        return weight_bytes({k: w for k, w in runtime.w.items() if k != "fuse"}) + \
            runtime.embed.shape[1] * runtime.embed.element_size()
    head, sub = getattr(prophet, "head", None), getattr(prophet, "head_weight", None)
    if isinstance(head, torch.nn.Module) and sub is not None:  # a feature prophet (eagle, medusa): its
        # layers, the head rows it multiplies (float rows, or the target's blocks) and one embedding row
        return weight_bytes(head) + weight_bytes(sub) + prophet.embed.shape[1] * prophet.embed.element_size()
    lm = getattr(prophet, "lm", None)
    if lm is not None:  # a draft model
        return target_step_bytes(lm)
    return None


def gemv_bandwidth(megabytes: int = 256, repeats: int = 7, device: torch.device | str = "cpu") -> float:
    """Bytes per second a float32 matrix-vector product streams on `device` (the fastest of
    `repeats`, after a warm-up), over a matrix of `megabytes` MB, far past the caches. On a GPU
    each timed product is bracketed by synchronizations, so the time is the kernel's."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cols = 4096
    rows = max(1, megabytes * (1 << 20) // (4 * cols))
    w = torch.full((rows, cols), 0.5, device=device)
    x = torch.full((cols,), 0.25, device=device)
    torch.mv(w, x)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        torch.mv(w, x)
        sync()
        times.append(time.perf_counter() - t0)
    return w.numel() * w.element_size() / min(times)


def roofline(decoder: Any, bandwidth: float | None = None) -> dict[str, Any]:
    """The floor and the measured step of the decoder's target and of each of its prophets
    with weights: bytes read, floor = bytes / bandwidth, measured seconds, measured / floor."""
    device = decoder.target.device
    bw = gemv_bandwidth(device=device) if bandwidth is None else bandwidth
    costs = decoder.decision_costs()
    out: dict[str, Any] = {"bandwidth_gb_s": bw / 1e9, "threads": torch.get_num_threads(), "device": str(device),
                           "context": costs.context, "parts": []}
    b = target_step_bytes(decoder.target, costs.context)
    if b is not None:
        out["parts"].append(_part("target", b, bw, costs.t_plain))
    for prophet in decoder.prophets:
        pb = prophet_step_bytes(prophet)
        measured = costs.t_draft_by.get(prophet.name)
        if pb is not None and measured:
            out["parts"].append(_part(f"prophet {prophet.name}", pb, bw, measured))
    return out


def _part(name: str, nbytes: int, bw: float, measured_s: float) -> dict[str, Any]:
    floor = nbytes / bw
    return {"name": name, "megabytes": nbytes / 1e6, "floor_ms": 1e3 * floor, "measured_ms": 1e3 * measured_s,
            "over_floor": measured_s / floor if floor > 0 else None}


def roofline_line(r: dict[str, Any]) -> str:
    """The report's line: bandwidth, then each part's bytes, floor, measured step and ratio."""
    parts = "; ".join(f"{p['name']}: {p['megabytes']:.1f} MB, floor {p['floor_ms']:.2f} ms, measured "
                      f"{p['measured_ms']:.2f} ms ({p['over_floor']:.2f}x the floor)" for p in r["parts"])
    device = r.get("device", "cpu")
    where = "this machine" if device == "cpu" else f"the GPU ({device})"
    how = f"{r['threads']} threads, " if device == "cpu" else ""
    return (f"Roofline: {where} streams {r['bandwidth_gb_s']:.1f} GB/s into a float32 GEMV "
            f"({how}256 MB matrix); a step's bytes are its weights as held (and the KV "
            f"cache at {r['context']} tokens for the target), measured steps the decoder's own timed costs. "
            + (parts or "no part with weights to count") + ".")
