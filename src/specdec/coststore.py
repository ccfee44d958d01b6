"""The measured-cost store: what a decoder's steps cost on this machine, measured once and kept.

K policies choose K from measured step costs (`specdec.costmodel.Costs`). They are measured
on the one loop's own passes (`measure`, `measure_rows`) the first time a decoder needs them,
within a time budget, and stored under the cache directory keyed by everything a step's cost
depends on (`costs_key`): every decoder loaded later with the same settings on this machine
decides from the same numbers, so a seed fixes the output of every policy across loads and
processes, and no restart measures again. Each stored file records how busy the machine was
(`other_cores`) and how noisy the timings were (`Costs.spread`); `specdec calibrate` (or
deleting the cache's costs/ folder) measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdec import layerloop, qgemm
from specdec.costmodel import Costs, OtherLoad, interleaved_times, monotone, relative_spread
from specdec.defaults import cache_dir, cpu_model
from specdec.llama import BatchLlama
from specdec.lm import attention_backends
from specdec.request import TARGET, Request, row_slot
from specdec.rows import prefill_rows
from specdec.sampling import SamplingParams

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
    dtype = str(getattr(prophet, "dtype", "")).removeprefix("torch.")
    head = "" if getattr(prophet, "block_head", None) is None else ":block-head"
    return f"{type(prophet).__name__}:{prophet.name}" + (f":{dtype}" if dtype else "") + head


def costs_key(decoder: Any) -> dict[str, Any]:
    """What a decoder's step costs depend on: the models, prophets, K, precision, layer loop,
    KV cache dtype, kernels (their choice and their build: a changed kernel source measures
    again), device and machine. A lean float32 target whose products run on
    specdec's float32 kernel (`BatchLlama.f32_rows_exact`) names them too (`f32_products`)."""
    target = decoder.target
    model = getattr(target, "model", None)
    rows = target if isinstance(target, BatchLlama) else None  # a lean target: which layer loop runs it
    loop = "" if rows is None else "C++" if layerloop.stack_for(rows) is not None else "Python"
    key = {"version": KEY_VERSION, "target": target.name, "target_class": type(target).__name__,
           "dtype": str(getattr(model, "dtype", "")), "int4": bool(getattr(target, "int4", False)),
           "int4_kernel": str(getattr(target, "int4_kernel", "")), "kernel_build": qgemm.build_name(),
           "layer_loop": loop,
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


def _path(key: dict[str, Any]) -> Path:
    """The file that keeps the costs stored under `key`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def stored(key: dict[str, Any], measure: Callable[[], Costs], what: str = "step costs") -> Costs:
    """The costs stored under `key`, or measured now (`measure`) and stored with how busy the
    machine was and how long it took. A cache that cannot be written leaves them to this process."""
    path = _path(key)
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
    try:
        _path(key).unlink()
        return True
    except FileNotFoundError:
        return False


def calibrate(decoder: Any, engine: Any, n_context: int = 64, repeats: int = 7, long_context: int = 1024,
              budget_s: float | None = DECODER_BUDGET_S) -> Costs:
    """Time what a round of a decoder's requests costs on its one loop, `engine`
    (`measure`, one placeholder row of `n_context` tokens, and again of
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
        return measure(engine, 1, k, ctx, repeats)

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


def chains(part: Any) -> Callable[[Sequence[Request], Sequence[int]], Any]:
    """A prophet's drafting of chains (a branching eagle's without its trees): what a draft step costs."""
    return getattr(part, "propose_chains", part.propose)  # type: ignore[no-any-return]


def measure(engine: Any, size: int, k_max: int, prompt: Sequence[int], repeats: int = 3) -> Costs:
    """The step costs of `size` rows of this prompt (`measure_rows`), measured on placeholder
    rows in free slots, which are free again afterwards."""
    with engine.lock, attention_backends(engine.target.device):
        rows = [Request(list(prompt), 1, SamplingParams(0.0), k_max) for _ in range(size)]
        engine.slots.admit(rows)
        try:
            prefill_rows(engine.target, rows, TARGET, None, engine.fused_layers)
            return measure_rows(engine, rows, k_max, repeats)
        finally:
            for r in rows:
                engine.release(r)


def measure_rows(engine: Any, active: Sequence[Request], k_max: int, repeats: int = 3) -> Costs:
    """A step's costs per row at this batch size, measured on these rows with the step's
    own parts: the target pass over n = 1..1 + width * K tokens per row with its
    probabilities and the verification, and each prophet's `propose` at K = 1 and K
    (its fixed cost per call and per drafted token); greedy, and at temperature 1
    (`Costs.sampled`). Nothing of the rows changes: caches are written by position past
    their cached lengths, and each row's settings, generator, feature and draft-cache
    lengths are put back after every call."""
    greedy = _measure_at(engine, active, k_max, SamplingParams(0.0), repeats)
    greedy.sampled = _measure_at(engine, active, k_max, SamplingParams(1.0), repeats)
    return greedy


def _measure_at(engine: Any, rows: Sequence[Request], k_max: int, params: SamplingParams, repeats: int) -> Costs:
    slots, starts, n_rows = [row_slot(r) for r in rows], [r.target_cached for r in rows], len(rows)
    width = len(engine.parts) if engine.prophet is not None and engine.prophet.combine == "tree" else 1
    room = min(engine.target.max_length - s for s in starts)
    sizes = [n for n in range(1, 1 + width * k_max + 1) if n <= room]
    for part in engine.parts:  # an eagle3 prophet's cache caught up but for a round's worth of slots
        part.settle(rows, leave=2)
    saved = [(r.params, r.feature, dict(r.draft_cached), r.generator.get_state(), list(r.fused), r.fused_from)
             for r in rows]
    features = engine.prophet is not None and engine.prophet.reads_features
    fresh: list[torch.Tensor | None] = [None] * n_rows

    def put_back() -> None:  # after every timed call
        for r, (_, feature, cached, state, fused, fused_from), f in zip(rows, saved, fresh, strict=True):
            r.feature, r.draft_cached = f if f is not None else feature, dict(cached)
            r.generator.set_state(state)
            r.fused, r.fused_from = list(fused), fused_from

    q_max: torch.Tensor | None = None  # a sampled draft's q (the prophet allocates it, outside the pass)

    def score(n: int) -> None:  # a step's pass, probabilities and verification for n tokens per row
        nonlocal q_max
        args = (slots, starts, [[0] * n] * n_rows, [n] * n_rows)
        logits = engine.target.forward_features(*args)[0] if features else engine.target.forward(*args)
        if not params.greedy and q_max is None:
            q_max = torch.full((n_rows, max(sizes) - 1, logits.shape[-1]), 1.0 / logits.shape[-1],
                               device=logits.device)
        # the step's own verification (`_verify_chains`, its shorter ways included), so the costs are the step's
        engine.verify_chains(logits, rows, [[0] * (n - 1)] * n_rows, q_max, [params.greedy] * n_rows)

    def round_of(part: Any, k: int) -> None:  # a lookup has no weights: its drafting is timed alone
        chains(part)(rows, [k] * n_rows)
        if not part.is_lookup:
            score(1 + width * k)

    # Each prophet's round is timed as it runs, its drafting right after a target pass
    # (whose weights push the prophet's out of the processor's caches): alone, back to
    # back, an eagle's K=1 draft measured 1.0 ms against 1.6 ms inside rounds. A prophet with
    # no room drafts nothing.
    # A round less its pass is a difference of two noisy times: with many rows, where the pass
    # is long, it came out 0 for an eagle (8 rows of SmolLM2: drafts counted free, taken at a
    # loss), so each drafting is also timed alone, back to back: its floor.
    ks = {p.name: sorted({1, k}) for p in engine.parts
          if (k := min(k_max, (room - 1) // width, *(p.room(r) for r in rows))) >= 1}
    timed: dict[Any, Callable[[], object]] = {n: functools.partial(score, n) for n in sizes}
    timed.update({(p.name, j): functools.partial(round_of, p, j) for p in engine.parts for j in ks.get(p.name, [])})
    timed.update({(p.name, j, "alone"): functools.partial(chains(p), rows, [j] * n_rows) for p in engine.parts
                  if not p.is_lookup for j in ks.get(p.name, [])})
    try:
        for r in rows:
            r.params = params
        if features:  # a feature prophet drafts from the target's feature at the row's last position
            hidden = engine.target.forward_features(slots, starts, [[0]] * n_rows, [1] * n_rows)[1]
            fresh = [hidden[b, 0] for b in range(n_rows)]
        put_back()
        times = interleaved_times(timed, repeats, put_back, engine.measure_budget_s)
        t = {key: min(ts) / n_rows for key, ts in times.items()}
    finally:
        for r, (p, *_), in zip(rows, saved, strict=True):
            r.params = p
        fresh = [None] * n_rows
        put_back()
    t_verify = monotone({n: t[n] for n in sizes})
    per_token = {p.name: 0.0 for p in engine.parts}
    per_call: dict[str, float] = {}
    lookups = {p.name for p in engine.parts if p.is_lookup}
    for name, js in ks.items():
        drafting = {j: t[name, j] if name in lookups else max(t[name, j] - t[1 + width * j], t[name, j, "alone"])
                    for j in js}
        k = max(drafting)
        per_token[name] = max(0.0, (drafting[k] - drafting[1]) / (k - 1)) if k > 1 else drafting[1]
        per_call[name] = max(0.0, drafting[1] - per_token[name])
    t_draft = sum(per_token.values()) if width > 1 else max(per_token.values(), default=0.0)
    return Costs(t_verify[1], t_verify, t_draft, width, per_token, per_call,
                 context=max(r.length for r in rows), spread=relative_spread(times[1]))
