"""The measured-cost store: what a decoder's steps cost on this machine, measured once and kept.

K policies choose K from measured step costs (`specdec.costmodel.Costs`). They are measured
on the one loop's own passes (`BatchEngine.measure`) the first time a decoder needs them,
within a time budget, and stored under the cache directory keyed by everything a step's cost
depends on (`costs_key`): every decoder loaded later with the same settings on this machine
decides from the same numbers, so a seed fixes the output of every policy across loads and
processes, and no restart measures again. Each stored file records how busy the machine was
(`other_cores`) and how noisy the timings were (`Costs.spread`); `specdec calibrate` (or
deleting the cache's costs/ folder) measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec import layerloop, qgemm
from specdec.costmodel import Costs, OtherLoad
from specdec.defaults import cache_dir, cpu_model

log = logging.getLogger(__name__)
KEY_VERSION = 25  # raised when a step itself changes, so that costs stored before are measured again
ONE_LOOP_SLOTS = 64  # rows of a decoder's own batched engine (interleaved streams, threads)
# Seconds each measurement (greedy or sampled, one context length or batch size) may repeat for:
# a decoder's own costs take four, a server's batch sizes two each, before the first answer.
DECODER_BUDGET_S = 2.5
BATCH_BUDGET_S = 1.5


def prophet_key(prophet: Any) -> str:
    """What a prophet's step costs depend on: its kind, name, dtype and (a feature prophet)
    whether its head multiplies the target's 4-bit blocks or float rows."""
    kind = getattr(prophet, "cost_kind", type(prophet).__name__)
    dtype = str(getattr(prophet, "dtype", "")).removeprefix("torch.")
    head = "" if getattr(prophet, "block_head", None) is None else ":block-head"
    return f"{kind}:{prophet.name}" + (f":{dtype}" if dtype else "") + head


def costs_key(decoder: Any) -> dict[str, Any]:
    """What a decoder's step costs depend on: the models, prophets, K, precision, layer loop,
    KV cache dtype, kernels, device and machine. A lean float32 target whose products run on
    specdec's float32 kernel (`BatchLlama.f32_rows_exact`) names them too (`f32_products`)."""
    target = decoder.target
    model = getattr(target, "model", None)
    rows = getattr(target, "rows", None)  # a lean target's BatchLlama: which layer loop runs it
    loop = "" if rows is None else "C++" if layerloop.stack_for(rows) is not None else "Python"
    key = {"version": KEY_VERSION, "target": target.name, "target_class": type(target).__name__,
           "dtype": str(getattr(model, "dtype", "")), "int4": bool(getattr(target, "int4", False)),
           "int4_kernel": str(getattr(target, "int4_kernel", "")), "layer_loop": loop,
           "kv_dtype": str(getattr(rows, "kv_dtype", "")),
           "device": str(target.device),
           "prophets": [prophet_key(d) for d in decoder.prophets], "multi": decoder.multi,
           "k": decoder.policy.k0, "cpu": cpu_model(), "machine": platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    if rows is not None and rows.f32_rows_exact():  # its products on kernels/f32mm.cpp, scored rows alone
        key["f32_products"] = f"f32mm-{qgemm.f32_rows()}-exact-{qgemm.f32_tile()}"
    return key


def _notice(message: str) -> None:
    """Progress a person at a terminal sees (a first load measures for some seconds); a log line otherwise."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)
    log.info(message)


def stored(key: dict[str, Any], measure: Callable[[], Costs], what: str = "step costs") -> Costs:
    """The costs stored under `key`, or measured now (`measure`) and stored with how busy the
    machine was and how long it took. A cache that cannot be written leaves them to this process."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "costs" / f"{digest}.json"
    try:
        return Costs.from_dict(json.loads(path.read_text())["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet (or unreadable): measure now
    _notice(f"specdec: measuring {what} on this machine (once; stored in {path.parent})")
    load, t0 = OtherLoad(), time.perf_counter()
    costs = measure()
    took, busy = time.perf_counter() - t0, load.cores()
    if busy > 0.25:
        log.warning("step costs measured while other processes used %.2f cores (spread %.2f): stored all the same; "
                    "`specdec calibrate` measures again", busy, costs.spread)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "costs": costs.to_dict(),
                                   "measured": {"seconds": round(took, 2), "other_cores": round(busy, 2),
                                                "spread": round(costs.spread, 3)}}, indent=1))
        os.replace(tmp, path)  # atomic: a process reading it sees all or nothing
    except OSError:
        pass  # a read-only cache: this decoder still decides from its own measurement
    return costs


def forget(key: dict[str, Any]) -> bool:
    """Remove the costs stored under `key` (the next load measures again). True if there were some."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "costs" / f"{digest}.json"
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def calibrate(decoder: Any, engine: Any, n_context: int = 64, repeats: int = 7, long_context: int = 1024,
              budget_s: float | None = DECODER_BUDGET_S) -> Costs:
    """Time what a round of a decoder's requests costs on its one loop, `engine`
    (`BatchEngine.measure`, one placeholder row of `n_context` tokens, and again of
    `long_context` tokens where the target's context allows: `Costs.at` weighs the two by a
    request's length): a plain step, steps scoring n = 2.. tokens (up to a round of the
    policy's largest K) and each prophet's drafting, greedy and at temperature 1. Each figure
    is the fastest of up to `repeats` calls taken in turn (fewer once a measurement took
    `budget_s`), and the verification curve never falls with n."""
    k = decoder.policy.k0
    room = decoder.target.max_length - 2 * (1 + len(decoder.prophets) * k)
    before, engine.measure_budget_s = engine.measure_budget_s, budget_s

    def at(n: int) -> Costs:
        ctx = [1 + i % max(1, decoder.target.vocab_size - 1) for i in range(n)]
        return engine.measure(1, k, ctx, repeats)  # type: ignore[no-any-return]

    try:
        short = at(max(2, min(n_context, room)))
        if min(long_context, room) >= 2 * short.context:
            long = at(min(long_context, room))
            short.long = long
            if short.sampled is not None:
                short.sampled.long = long.sampled
    finally:
        engine.measure_budget_s = before
    return short
