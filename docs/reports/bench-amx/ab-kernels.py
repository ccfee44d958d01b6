#!/usr/bin/env python3
"""The default SmolLM2 decoder on two 4-bit kernels in one process, side by side: each Spec-Bench
first turn decoded plain and with the default prophets on kernel A, then on kernel B, in turn;
greedy and at temperature 1. Prints tokens/s per task and overall against A's plain decoding.

usage: PYTHONPATH=src python docs/reports/bench-amx/ab-kernels.py [--a blocks16] [--b amx] [--per-task 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from specdec.api import load

MT = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="blocks16")
    ap.add_argument("--b", default="amx")
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--questions", default="../shared/specbench/question-dev.jsonl")
    args = ap.parse_args()
    qs = [json.loads(line) for line in open(args.questions)]
    by_task = collections.defaultdict(list)
    for q in qs:
        by_task[q["category"]].append(q)
    by_task["mt_bench"] = [q for q in qs if q["category"] in MT][::5]
    decoders = {}
    for kernel in (args.a, args.b):
        os.environ["SPECDEC_INT4_KERNEL"] = kernel  # read when the weights load
        decoders[kernel] = load("smollm2")
        print(kernel, "->", decoders[kernel].target.int4_kernel, flush=True)
    runs = {}
    for kernel, d in decoders.items():
        d.generate("hi", max_new_tokens=4)  # warm-up (and its step costs, measured if missing)
        runs[f"{kernel} plain"], runs[f"{kernel} default"] = d.plain(), d
    names = list(runs)
    for mode, temperature in (("greedy", 0.0), ("T=1", 1.0)):
        sums = {t: {n: [0.0, 0] for n in names} for t in TASKS}
        for task in TASKS:
            for i, q in enumerate(by_task[task][: args.per_task]):
                ids = decoders[args.a].chat_ids([{"role": "user", "content": q["turns"][0]}])
                for name in names:
                    t0 = time.perf_counter()
                    g = runs[name].generate(ids, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=i)
                    sums[task][name][0] += time.perf_counter() - t0
                    sums[task][name][1] += len(g.token_ids)
        rows = {**sums, "overall": {n: [sum(sums[t][n][k] for t in TASKS) for k in (0, 1)] for n in names}}
        base = names[0]
        for task, s in rows.items():
            rate = {n: s[n][1] / s[n][0] for n in names}
            print(f"{mode:6s} {task:15s} {base} {rate[base]:.1f} t/s | "
                  + " ".join(f"{n} {rate[n] / rate[base]:.3f}" for n in names[1:]), flush=True)


if __name__ == "__main__":
    main()
