"""Grow the broad self-distillation data over many sessions, in committed shards.

Each unit of growth is one prompt seed: a fresh prompt list (Magpie questions the target
writes, task templates, passages; `specdec.train.magpie.new_prompts`), less every prompt
already answered in the committed data (compared without case and punctuation), answered by
the decoder users run (`specdec.load(target, draft="none")`: the int4 default on SmolLM2) at
greedy, T=0.7 and T=1 in turn. Its token ids only (features are rebuilt by one
teacher-forced pass, `magpie.add_features`) go to `data/broad/seed-<S>.npz`, rewritten as
the seed's batches are answered, and `data/broad/manifest.json` records every seed's
settings, counts and times. A stopped run resumes where the committed files stop: on a new
machine the seed's work folder is rebuilt from its npz file.

    python -m specdec.train.grow --minutes 150 --threads 1

Spec-Bench's questions are never read here.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DATA = Path("data/broad")
OLD = Path("data/smollm2-broad.npz")  # the first 2M answer tokens (bf16 and int4 engines, seed 0..)
WORK = Path(".cache/smollm2/grow")
FIRST_SEED = 1000


def _key(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_manifest(data: Path = DATA) -> dict[str, Any]:
    path = data / "manifest.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"target": "smollm2", "engine": "int4 (specdec.load(target, draft='none'))", "seeds": []}


def write_manifest(manifest: dict[str, Any], data: Path = DATA) -> None:
    seeds = manifest["seeds"]
    manifest["answer_tokens"] = sum(s.get("answer_tokens", 0) for s in seeds)
    manifest["sequences"] = sum(s.get("sequences", 0) for s in seeds)
    data.mkdir(parents=True, exist_ok=True)
    tmp = data / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, data / "manifest.json")


def answered_keys(data: Path = DATA, old: Path = OLD) -> set[str]:
    """The keys of every prompt in the committed data (the first file and every seed's)."""
    import numpy as np

    keys: set[str] = set()
    for path in [old, *sorted(data.glob("seed-*.npz"))]:
        if path.exists():
            keys.update(_key(str(t)) for t in np.load(path)["prompt_texts"])
    return keys


def prepare(seed: int, work: Path, data: Path, magpie_n: int, tasks_n: int, log: Any) -> int:
    """work/prompts.pt for this seed (rebuilt from the committed npz if there is one, else drawn
    fresh and deduplicated); returns the number of prompts."""
    import torch

    from specdec.train import magpie

    npz = data / f"seed-{seed}.npz"
    if (work / "prompts.pt").exists():
        return len(torch.load(work / "prompts.pt", weights_only=False))
    if npz.exists():
        magpie.features_from_ids(npz, work, log=log, features=False)
        return len(torch.load(work / "prompts.pt", weights_only=False))
    from specdec.batch import BatchLlama
    from specdec.wiring import default_draft_dtype, load_pretrained

    seen = answered_keys(data)
    model, tokenizer = load_pretrained("smollm2", default_draft_dtype())
    lm = BatchLlama(model, "smollm2", 128)
    drawn = magpie.new_prompts(lm, tokenizer, magpie_n, tasks_n, seed, log)
    prompts, kept = [], set()
    for q in drawn:
        k = _key(q["text"])
        if k not in seen and k not in kept:
            kept.add(k)
            prompts.append({**q, "seed": seed})
    log(f"seed {seed}: {len(prompts)} new prompts of {len(drawn)} drawn")
    work.mkdir(parents=True, exist_ok=True)
    magpie.save_atomic(prompts, work / "prompts.pt")
    return len(prompts)


def grow(minutes: float, magpie_n: int = 1500, tasks_n: int = 900, batch_size: int = 128, max_new: int = 256,
         chunk_minutes: float = 12.0, data: Path = DATA, work_root: Path = WORK, log: Any = print) -> dict[str, Any]:
    """Answer prompts for `minutes`, seed after seed, exporting each seed's ids after every
    chunk of `chunk_minutes` (so a run stopped at any time loses at most one chunk)."""
    from specdec.train import magpie

    deadline = time.monotonic() + minutes * 60
    manifest = read_manifest(data)
    while time.monotonic() < deadline:
        entry = next((s for s in manifest["seeds"] if not s.get("finished")), None)
        if entry is None:
            seed = max([s["seed"] for s in manifest["seeds"]], default=FIRST_SEED - 1) + 1
            entry = {"seed": seed, "file": f"seed-{seed}.npz", "temperatures": [0.0, 0.7, 1.0], "max_new": max_new,
                     "batch_size": batch_size, "magpie": magpie_n, "tasks": tasks_n, "started": _now(),
                     "minutes": 0.0, "finished": False}
            manifest["seeds"].append(entry)
        seed = entry["seed"]
        work = work_root / f"seed-{seed}"
        t0 = time.monotonic()
        entry["prompts"] = prepare(seed, work, data, entry["magpie"], entry["tasks"], log)
        n_batches = -(-entry["prompts"] // entry["batch_size"])
        left = (deadline - time.monotonic()) / 60
        if left > 0.5:
            magpie.generate("smollm2", work, entry["magpie"], entry["tasks"], entry["batch_size"], entry["max_new"],
                            tuple(entry["temperatures"]), seed=seed, minutes=min(chunk_minutes, left), log=log,
                            engine="int4")
        if any(work.glob("shard-*.pt")):
            counts = magpie.export_ids(work, data / entry["file"])
            entry.update(counts)
        entry["batches_done"] = len(list(work.glob("shard-*.pt")))
        entry["finished"] = entry["batches_done"] >= n_batches
        entry["minutes"] = round(entry["minutes"] + (time.monotonic() - t0) / 60, 1)
        entry["updated"] = _now()
        write_manifest(manifest, data)
        log(f"seed {seed}: {entry['batches_done']} of {n_batches} batches, {entry.get('answer_tokens', 0):,} answer "
            f"tokens; all seeds {manifest['answer_tokens']:,}")
    return manifest


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 beside other work on 2 cores)")
    ap.add_argument("--magpie", type=int, default=1500, help="Magpie questions drawn per seed")
    ap.add_argument("--tasks", type=int, default=900, help="task prompts drawn per seed")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    grow(a.minutes, a.magpie, a.tasks)
