"""`specdec distill --config configs/smollm2.toml`: prophets for a real target, end to end.

Steps (each resumable): self-distillation data (specdec.train.selfdistill), then each
feature prophet (specdec.train.features), exported with int8 weights into models/, with
its held-out agreement written to models/<name>-evaluation.json for the model card.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from specdec.train.features import draft_vocabulary, early_features, export, load_shards, train_head
from specdec.train.selfdistill import generate_data

PROPHETS = ("eagle", "medusa", "kangaroo")


def _dtype(name: str) -> torch.dtype:
    if name == "bfloat16":
        from specdec.wiring import default_draft_dtype

        return default_draft_dtype()  # bf16 only where the CPU computes it natively
    return torch.float32


def run(cfg: dict[str, Any], work_dir: Path | None = None, models_dir: Path | None = None,
        only: list[str] | None = None, max_steps: int | None = None, data_minutes: float | None = None,
        train_minutes: float | None = None, log: Any = print) -> dict[str, Any]:
    from specdec.wiring import load_pretrained

    paths = cfg["paths"]
    work = work_dir or Path(paths["work_dir"])
    models = models_dir or Path(paths["models"])
    d = cfg["data"]
    t0 = time.perf_counter()
    minutes = data_minutes if data_minutes is not None else d.get("minutes")
    ids = [Path(p) for p in ([d["ids"]] if isinstance(d.get("ids"), str) else d.get("ids") or [])]
    engine, fused = str(d.get("features", "bf16")), bool(d.get("fused", True))
    if d.get("source", "chat") == "broad" and ids and all(p.exists() for p in ids):
        # the answers the repository keeps (token ids only): the features rebuilt by one teacher-forced pass of
        # the target's bf16 or int4 weights (`features`), into a folder of their own
        from specdec.train.magpie import features_from_ids

        data_dir = features_from_ids(ids, work / ("broad" if engine == "bf16" else f"broad-{engine}"), paths["target"],
                                     log=log, engine=engine, fused=fused)
    elif d.get("source", "chat") == "broad":  # Magpie questions + task templates (specdec.train.magpie)
        from specdec.train.magpie import add_features, generate

        data_dir = work / "broad"
        generate(paths["target"], data_dir, int(d["magpie"]), int(d["tasks"]), int(d["batch_size"]),
                 int(d["max_new_tokens"]), tuple(float(t) for t in d["temperatures"]), int(d.get("seed", 0)),
                 minutes, log=log, engine=str(d.get("engine", "bf16")))
        add_features(data_dir, paths["target"], log=log)  # shards the int4 engine answered: ids only so far
    else:  # the stdlib-based chat prompts (specdec.data.chat)
        data_dir = work / "data"
        generate_data(paths["target"], data_dir, n_prompts=int(d["prompts"]), batch_size=int(d["batch_size"]),
                      max_new=int(d["max_new_tokens"]), temperatures=[float(t) for t in d["temperatures"]],
                      seed=int(d.get("seed", 0)), minutes=minutes, dtype=_dtype(str(d.get("dtype", "float32"))),
                      log=log)
    log(f"data ready in {time.perf_counter() - t0:.0f}s")
    model, tokenizer = load_pretrained(paths["target"], torch.float32)
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    report: dict[str, Any] = {}
    for kind in only or list(PROPHETS):
        pc = cfg[kind]
        data = load_shards(data_dir, int(pc["unroll"]), vocab_size=lm_head.shape[0])
        if kind == "kangaroo":
            data.early = early_features(paths["target"], data_dir, int(pc["layers"]), log=log)
        vocab = draft_vocabulary(data.answer_counts, int(cfg["vocab"]["size"]), [int(tokenizer.eos_token_id)])
        coverage = float(data.answer_counts[vocab].sum()) / max(1, int(data.answer_counts.sum()))
        log(f"{kind}: {len(data.starts_train)} training positions, {len(data.starts_heldout)} held out; "
            f"draft vocabulary {len(vocab)} ids covering {coverage:.4f} of answer tokens")
        minutes = train_minutes if train_minutes is not None else float(pc["minutes"])
        head, info = train_head(kind, data, embed, lm_head, vocab, pc, work / f"{kind}.ckpt", minutes, max_steps,
                                log=log, targets_cache=data_dir / "targets.pt")
        name = f"smollm2-{kind}"
        meta = {"target": paths["target"], "vocab_size": int(lm_head.shape[0]), "draft_vocab": len(vocab),
                "draft_vocab_coverage": round(coverage, 4), "answer_tokens": data.n_answer_tokens,
                "training": info, "config": pc}
        export(head, vocab, models / name, meta)
        (models / f"{name}-evaluation.json").write_text(json.dumps(meta, indent=1) + "\n")
        report[kind] = meta
    return report
