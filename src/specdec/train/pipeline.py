"""`specdec train` and `specdec distill`: the steps that reproduce the bundled pair.

work_dir holds the intermediate state (token arrays, split, checkpoints); the exported
models are written as bf16 safetensors with the tokenizer beside them, loadable with
`from_pretrained(path)`.
"""

from __future__ import annotations

import json
import shutil
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.data import corpus as corpus_mod
from specdec.train.lm import fixed_eval_windows, heldout_loss, loop_settings, make_llama, run_loop


def load_config(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _texts(files: list[corpus_mod.CorpusFile]) -> list[str]:
    return [t for t in (corpus_mod.read_text(f.path) for f in files) if t]


def _encode(tokenizer: Any, texts: list[str], eos_id: int) -> np.ndarray:
    """All texts as one uint16 stream, each file followed by EOS."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


def prepare(cfg: dict[str, Any], work_dir: Path, corpus_root: Path | None = None, log: Any = print) -> None:
    """Split the corpus, train the tokenizer on the training files, tokenize both splits."""
    from transformers import AutoTokenizer

    from specdec.train.tokenizer import train_tokenizer

    work_dir.mkdir(parents=True, exist_ok=True)
    if (work_dir / "train.bin").exists() and (work_dir / "tokenizer").exists():
        log(f"data already prepared in {work_dir}")
        return
    c = cfg["corpus"]
    files = corpus_mod.list_files(c["heldout_percent"], c["seed"], corpus_root)
    corpus_mod.write_split(files, work_dir / "split.json")
    train_texts = _texts([f for f in files if not f.heldout])
    heldout_texts = _texts([f for f in files if f.heldout])
    log(f"corpus: {len(train_texts)} training files, {len(heldout_texts)} held-out files")
    t0 = time.perf_counter()
    train_tokenizer(iter(train_texts), cfg["tokenizer"]["vocab_size"], cfg["tokenizer"]["min_frequency"],
                    work_dir / "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(work_dir / "tokenizer"))
    log(f"tokenizer: {len(tok)} entries in {time.perf_counter() - t0:.0f}s")
    train_ids = _encode(tok, train_texts, tok.eos_token_id)
    heldout_ids = _encode(tok, heldout_texts, tok.eos_token_id)
    train_ids.tofile(work_dir / "train.bin")
    heldout_ids.tofile(work_dir / "heldout.bin")
    log(f"tokens: {len(train_ids):,} training, {len(heldout_ids):,} held-out")


def _tokens(work_dir: Path, name: str) -> np.ndarray:
    return np.fromfile(work_dir / f"{name}.bin", dtype=np.uint16)


def export(model: Any, tokenizer_dir: Path, out_dir: Path, meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    model.float()
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    (out_dir / "training.json").write_text(json.dumps(meta, indent=1))


def train_target(cfg: dict[str, Any], work_dir: Path, out_dir: Path, minutes: float | None = None,
                 max_steps: int | None = None, log: Any = print) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work_dir / "tokenizer"))
    tcfg = dict(cfg["target"])
    model = make_llama(tcfg, len(tok), tok.eos_token_id)
    s = loop_settings(tcfg)
    s.minutes = minutes if minutes is not None else s.minutes
    s.max_steps = max_steps
    windows = fixed_eval_windows(_tokens(work_dir, "heldout"), s.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.1f}M parameters")
    state = run_loop(model, _tokens(work_dir, "train"), windows, s, work_dir / "target.ckpt", "target", log=log)
    meta = {"kind": "target", "parameters": n_params, "steps": state["step"], "tokens": state["tokens"],
            "train_minutes": state["elapsed"] / 60, "heldout_loss": state["heldout_loss"],
            "history": state["history"], "config": tcfg}
    export(model, work_dir / "tokenizer", out_dir, meta)
    return meta


def distill(cfg: dict[str, Any], work_dir: Path, target_dir: Path, out_dir: Path, data_out_dir: Path | None = None,
            data_minutes: float | None = None, distill_minutes: float | None = None,
            max_steps: int | None = None, log: Any = print) -> dict[str, Any]:
    """Train the prophet on the data (warm start, also the data-only baseline), then
    distill it from the target on held-in text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    dcfg = dict(cfg["prophet"])
    train_ids = _tokens(work_dir, "train")
    model = make_llama(dcfg, len(tok), tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"prophet: {n_params / 1e6:.2f}M parameters")
    windows = fixed_eval_windows(_tokens(work_dir, "heldout"), dcfg["seq_len"])

    s = loop_settings(dcfg, "data_minutes")
    s.minutes = data_minutes if data_minutes is not None else s.minutes
    s.max_steps = max_steps
    data_state = run_loop(model, train_ids, windows, s, work_dir / "prophet-data.ckpt", "prophet (data)", log=log)
    data_meta = {"kind": "prophet-data", "parameters": n_params, "steps": data_state["step"],
                 "tokens": data_state["tokens"], "train_minutes": data_state["elapsed"] / 60,
                 "heldout_loss": data_state["heldout_loss"], "config": dcfg}
    if data_out_dir is not None:
        export(model, work_dir / "tokenizer", data_out_dir, data_meta)

    teacher = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16)
    s = loop_settings(dcfg, "distill_minutes")
    s.minutes = distill_minutes if distill_minutes is not None else s.minutes
    s.max_steps = None if max_steps is None else 2 * max_steps
    s.warmup_steps = 10
    s.lr = s.lr / 2
    state = run_loop(model, train_ids, windows, s, work_dir / "prophet-distill.ckpt", "prophet (distill)",
                     teacher=teacher, log=log)
    ev = heldout_loss(model, windows)
    meta = {"kind": "prophet-distilled", "parameters": n_params, "teacher": str(target_dir),
            "data_steps": data_state["step"], "distill_steps": state["step"], "distill_tokens": state["tokens"],
            "train_minutes": (data_state["elapsed"] + state["elapsed"]) / 60, "heldout_loss": ev,
            "data_only_heldout_loss": data_state["heldout_loss"], "config": dcfg}
    export(model, work_dir / "tokenizer", out_dir, meta)
    return {"distilled": meta, "data_only": data_meta}
