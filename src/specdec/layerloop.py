"""The lean Llama path's layer loop in C++ (src/specdec/kernels/step.cpp, built with `specdec.qgemm`).

`BatchLlama.forward_fused` runs its layers through here where it can (`stack_for`): the CPU,
float32 activations (float32 weights, or 4-bit ones on any kernel), token trees where each of their queries
attends alone (`exact_rows`, one pending token before the tree: a verification pass).
The C++ loop computes what the Python loop computes, in the same order and on the same shapes:
the same ATen operations, the same small kernels of the extension (`kernels`: RMSNorm and the
attention of one query, which the Python loop calls too, for float32 on the CPU), and the rotary
positions fused element for element as ATen computes them; so it computes the Python loop's bits
exactly (tested). It removes the interpreter's work around each operation (about 50 Python calls
a layer, 1,500 a SmolLM2 step) and a dozen small operations a layer; where every query attends
alone and every product is on specdec's block kernels (`Stack.raw`), its layers run on one
workspace of raw buffers, two ATen calls a layer instead of ~35.
Families run here with what they add (`specdec.families`: biases, q/k norms, output norms, GeGLU, their
attention scale, sliding windows, a rotary table per layer); soft-capped attention (Gemma 2), token trees
over sliding windows, other token trees, the int8 copy, bfloat16 and float16 models and other devices keep
the Python loop.

SPECDEC_LAYER_LOOP chooses: "auto" (the default: C++ where it applies and the extension builds
here) or "python" (always the Python loop, e.g. to compare).
"""

from __future__ import annotations

from typing import Any

import torch

from specdec import qgemm
from specdec.defaults import choice, fine_block
from specdec.families import EXTRAS
from specdec.int4 import Int4Weight

LOOPS = ("auto", "python")

_KINDS = {"float": 0, "torch": 1, "blocks": 2, "blocks8": 3, "blocks16": 4, "amx": 4}  # amx: blocks16's panels
_FORMATS = {"Q4_1": 0, "Q8_0": 1, "Q4_1x16": 0, "Q8_0x16": 1}  # ...x16: in panels (the bfloat16 kernel)


def loop_choice() -> str:
    """SPECDEC_LAYER_LOOP: "auto" (C++ where it applies) or "python"."""
    return choice("SPECDEC_LAYER_LOOP", LOOPS)


def kernels() -> Any:
    """The extension's small kernels (`rms_norm`, `attend_one`, `rope_heads`), or None where it
    does not build here. Both loops use them for float32 on the CPU, so both compute the same bits."""
    return qgemm.module() if qgemm.available() else None


def cpp_product(module: Any, weight: Any, int4_rows: str) -> Any:
    """The C++ product of one of a layer's weights, or None where the Python loop must multiply it."""
    if isinstance(weight, Int4Weight):
        if weight.kernel == "torch":
            return module.Product(_KINDS["torch"], torch.empty(0), 0, [p for p, _ in weight.planes],
                                  [s for _, s in weight.planes], weight.out_rows, weight.shape[1],
                                  int4_rows == "solo")
        assert weight.blocks is not None
        fmt = _FORMATS[weight.blocks.kind] + (qgemm.AMX_UNIT if weight.kernel == "amx" else 0)
        return module.Product(_KINDS[weight.kernel], weight.blocks.data, fmt, [], [],
                              weight.out_rows, weight.shape[1], int4_rows == "solo")
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
        return module.Product(_KINDS["float"], weight, 0, [], [], weight.shape[0], weight.shape[1], False)
    return None


def stack_for(lm: Any) -> Any:
    """The C++ layer stack for a `BatchLlama` (built once per weights and attention settings,
    shared by its views), or None where the Python loop runs: another device or dtype, the
    int8 copy, attention soft-capping (Gemma 2), float products padded by row policy,
    SPECDEC_LAYER_LOOP=python, or no extension."""
    if (loop_choice() == "python" or lm.device.type != "cpu" or lm.embed.dtype != torch.float32 or lm.int8
            or lm.arch.attn_softcap is not None or lm.arch.act not in ("silu", "gelu_tanh")):
        return None
    if lm.bucket_rows and lm.row_policy != "none":
        return None
    key = (id(lm.layers), lm.exact_rows, lm.attention_chunk, lm.int4_rows, lm.bucket_rows)
    cache = lm.__dict__.setdefault("_layer_stacks", {})  # views share it (and the layers list)
    if key not in cache:
        cache[key] = _build(lm)
    return cache[key]


def _build(lm: Any) -> Any:
    if not qgemm.available():
        return None
    module = qgemm.module()
    stack = module.Stack(lm.n_heads, lm.n_kv, lm.head_dim, float(lm.eps), lm.attention_chunk,
                         fine_block(lm.attention_chunk), lm.exact_rows)
    stack.set_family(lm.arch.act == "gelu_tanh", lm.arch.query_scale or 0.0)
    kinds = list(lm.ropes)  # the order `BatchLlama.forward_fused` hands the rotary tables in
    for i, w in enumerate(lm.layers):
        if any(t is not None and t.dtype != torch.float32 for t in (w.get(e) for e in EXTRAS)):
            return None
        products = [cpp_product(module, w[name], lm.int4_rows) for name in ("qkv", "o", "gate_up", "down")]
        if any(p is None for p in products) or w["in_norm"].dtype != torch.float32:
            return None
        if lm.bucket_rows and any(not isinstance(w[name], Int4Weight) for name in ("qkv", "o", "gate_up", "down")):
            return None  # a float product beside 4-bit ones is padded by row policy in the Python loop
        stack.add_layer(w["in_norm"], w["post_norm"], products)
        stack.set_extras(w.get("qkv_bias"), w.get("q_norm"), w.get("k_norm"), w.get("attn_out_norm"),
                         w.get("mlp_out_norm"), lm.arch.window(i) or 0, kinds.index(lm.arch.rope(i)))
    return stack
