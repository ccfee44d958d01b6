"""Figures for the model card: held-out loss of each model, and each prophet's greedy and
temperature-1 acceptance rate against the target on held-out prompts, and c.

    python -m specdec.train.evaluate models/target models/prophet .cache/bundled/prophet-data
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from specdec.data.corpus import list_files, read_text
from specdec.data.prompts import build_suite
from specdec.hf import HFLM
from specdec.sequence import OneSequence
from specdec.train.lm import fixed_eval_windows, heldout_loss

SPLIT = (4, "specdec-split-v1")


def heldout_tokens(tokenizer: Any) -> np.ndarray:
    ids: list[int] = []
    for f in list_files(*SPLIT):
        if f.heldout and (text := read_text(f.path)):
            ids.extend(tokenizer(text, verbose=False)["input_ids"])
            ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.uint16)


def step_time(model: Any, context: list[int], repeats: int = 30) -> float:
    lm = OneSequence(HFLM(model, "m"))
    lm.forward(context, 1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lm.forward([context[-1]], 1)
        times.append(time.perf_counter() - t0)
        lm.truncate(len(context))
    return statistics.median(times)


def evaluate(target_path: str, prophet_paths: list[str], prompts: int = 4, max_new_tokens: int = 64,
             k: int = 4) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.api import load

    tok = AutoTokenizer.from_pretrained(target_path)
    windows = fixed_eval_windows(heldout_tokens(tok), 512)
    suite = build_suite(prompts)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    ctx = list(tok(suite[0].text)["input_ids"])
    report: dict[str, Any] = {"target": {"path": target_path, "heldout_loss": heldout_loss(target, windows),
                                         "parameters": sum(p.numel() for p in target.parameters()),
                                         "step_ms": 1e3 * step_time(target, ctx)}}
    for path in prophet_paths:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        entry: dict[str, Any] = {"heldout_loss": heldout_loss(model, windows),
                                 "parameters": sum(p.numel() for p in model.parameters()),
                                 "step_ms": 1e3 * step_time(model, ctx)}
        entry["c"] = entry["step_ms"] / report["target"]["step_ms"]
        dec = load(target_path, draft=path, draft_tokens=k)
        for name, temperature in [("greedy", 0.0), ("t1", 1.0)]:
            drafted = accepted = 0
            for i, p in enumerate(suite):
                s = dec.generate(p.text, max_new_tokens=max_new_tokens, temperature=temperature, seed=i).stats
                drafted += s.drafted
                accepted += s.accepted
            entry[f"acceptance_{name}"] = accepted / drafted
        report[path] = entry
    report["settings"] = {"prompts": len(suite), "max_new_tokens": max_new_tokens, "k": k}
    return report


if __name__ == "__main__":
    from specdec.defaults import shipped

    print(json.dumps(evaluate(shipped(sys.argv[1]), [shipped(p) for p in sys.argv[2:]]), indent=1))
