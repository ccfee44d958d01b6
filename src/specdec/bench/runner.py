"""The benchmark harness: configurations run side by side, interleaved, after a warm-up.

For every prompt the configurations run one after another in a rotated order, so slow
drift of a shared machine hits all of them alike; the speedup of a configuration is the
median over prompts of (plain time per token) / (its time per token), with the min-max
spread. In greedy mode every configuration's token ids must equal plain decoding's
before its ratio is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.costmodel import expected_tokens_per_round
from specdec.data.prompts import BenchPrompt
from specdec.decoder import SpeculativeDecoder
from specdec.lm import LM, attention_backends
from specdec.sequence import OneSequence


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "ours", "hf-plain", "hf-assisted", "hf-lookup"
    draft: str = "none"  # --draft spec for ours
    policy: str = "fixed"
    k: int = 4
    multi: str = "tree"
    branches: int = 1  # specdec.load's branches (> 1: an eagle grows token trees)
    # draft, policy, K and multi go to specdec.load as a user passes them, K 0 meaning load's own
    # default, so that draft "default" is the target's shipped prophets (not the bench's --prophet)
    as_given: bool = False


@dataclass
class Run:
    config: str
    prompt: int
    category: str
    tokens: list[int]
    wall_s: float
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Runner:
    """Holds the loaded decoders / HF models and runs one (config, prompt) at a time."""

    settings: dict[str, Any]  # temperature, top_k, top_p, max_new_tokens
    decoders: dict[str, SpeculativeDecoder] = field(default_factory=dict)
    hf: dict[str, Callable[[list[int], int], list[int]]] = field(default_factory=dict)

    def run(self, cfg: Config, prompt_ids: list[int], seed: int) -> tuple[list[int], float, dict[str, Any]]:
        if cfg.kind == "ours":
            dec = self.decoders[cfg.name]
            t0 = time.perf_counter()
            out = dec.generate(prompt_ids, seed=seed, **self.settings)
            wall = time.perf_counter() - t0
            stats = out.stats.to_dict()
            stats["accepted_per_round"] = [e.accepted for e in out.events]
            # when the first token was out (the prompt read, one round): what follows it is decoding alone
            stats["first_token_s"] = out.events[0].end if out.events else None
            return out.token_ids, wall, stats
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        ids = self.hf[cfg.name](prompt_ids, seed)
        return ids, time.perf_counter() - t0, {}


def hf_generate_fn(model: Any, settings: dict[str, Any], eos: list[int], **extra: Any) -> Callable[..., list[int]]:
    """transformers' own generate() with the same settings, returning the new token ids."""
    t = settings["temperature"]
    kwargs: dict[str, Any] = dict(max_new_tokens=settings["max_new_tokens"], do_sample=t > 0,
                                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    if t > 0:
        kwargs.update(temperature=t, top_k=settings.get("top_k") or 0, top_p=settings.get("top_p", 1.0))

    @torch.inference_mode()
    def run(prompt_ids: list[int], seed: int) -> list[int]:
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **extra)
        new = out[0, len(prompt_ids) :].tolist()
        # cut at the first EOS, as our decoder does (generate pads finished sequences)
        for i, tok in enumerate(new):
            if tok in eos:
                return new[: i + 1]
        return new

    return run


def measure_costs(target: LM, prophet_lm: LM | None, context: list[int], ks: list[int],
                  repeats: int = 15) -> dict[str, float]:
    """c = t_draft(1) / t_target(1) and v(K) = t_target(K+1) / t_target(1), medians. The
    context is cut from the left to leave room for the longest pass within the target's context."""
    context = context[max(0, len(context) + max(ks, default=0) + 1 - target.max_length):]
    def timed(model: LM, n: int) -> float:
        lm = OneSequence(model.view(1))
        lm.forward(context, 1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lm.forward(context[:n] if n <= len(context) else [1] * n, n)
            times.append(time.perf_counter() - t0)
            lm.truncate(len(context))
        return statistics.median(times)

    with attention_backends(target.device):  # as the loop attends (specdec.lm.attention_backends)
        t1 = timed(target, 1)
        out = {"t_target_1": t1}
        for k in ks:
            out[f"v_{k}"] = timed(target, k + 1) / t1
        if prophet_lm is not None:
            out["t_draft_1"] = timed(prophet_lm, 1)
            out["c"] = out["t_draft_1"] / t1
    return out


def predicted_speedup(a: float, drafted_per_round: float, draft_s_per_round: float, t_target_1: float,
                      v: float) -> float:
    """specdec.costmodel's gain with the draft time per round measured instead of K c."""
    return expected_tokens_per_round(a, drafted_per_round) / (draft_s_per_round / t_target_1 + v)


def interleaved(runner: Runner, configs: list[Config], prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                repeats: int, on_run: Callable[[Run], None]) -> list[Run]:
    runs: list[Run] = []
    for rep in range(repeats):
        for i, (bp, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
            shift = (i + rep) % len(configs)
            for cfg in configs[shift:] + configs[:shift]:
                tokens, wall, stats = runner.run(cfg, ids, seed=1000 * rep + i)
                run = Run(cfg.name, i, bp.category, tokens, wall, stats)
                runs.append(run)
                on_run(run)
    return runs
