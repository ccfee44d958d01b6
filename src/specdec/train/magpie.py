"""Broad self-distillation data with no outside data: the target writes the questions too.

Two prompt sources, mixed:
- Magpie (Xu et al., 2024): the chat template up to an empty user turn
  (`<|im_start|>system ...<|im_end|>\\n<|im_start|>user\\n`) is fed to the instruct target,
  which samples what a user would ask; questions are filtered (length, repetition, a
  closing end-of-turn token) and deduplicated;
- task templates over word lists (`specdec.data.tasks`): writing, role-play, reasoning, math
  word problems, code in several languages, extraction, STEM, humanities, translation and
  summaries / QA over a passage the target wrote itself.
Then the target answers every prompt (greedy, T=0.7 and T=1 in turn) and its last hidden
state is kept at every position: shards in the format of `specdec.train.selfdistill`, so
the prophets' training reads both alike.

Everything runs on the lean batched path (`specdec.batch.BatchLlama`, bf16 where the CPU
computes it natively): a row that finishes leaves the batch, so no step is spent on
padding. Shards are written atomically one batch at a time; an interrupted run resumes.
Spec-Bench's questions are never read here.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.batch import BatchLlama
from specdec.data.tasks import over_passage, passage_requests, task_prompts
from specdec.llama import LlamaWeights
from specdec.prophets.eagle3 import fused_layers
from specdec.train.selfdistill import answer_into_shards, chat_ids, save_atomic

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row of float32 logits (B, V): greedy at temperature 0, else nucleus."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:  # the nucleus among the 512 likeliest tokens (a data generator: no full sort)
        sorted_p, order = probs.topk(min(512, probs.shape[-1]), dim=-1)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p, 1, generator=gen)
        return order.gather(-1, choice)[:, 0]
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.inference_mode()
def continue_rows(lm: LlamaWeights, prompts: list[list[int]], max_new: int, stop: set[int], temperature: float,
                  top_p: float, gen: torch.Generator, keep_hidden: bool,
                  capture: tuple[int, ...] = ()) -> list[tuple[list[int], torch.Tensor | None]]:
    """Each prompt continued until a stop token (kept) or max_new tokens. Returns per row
    (new tokens, hidden states after the final norm at every fed position: the prompt and
    the new tokens but the last, bf16) or (new tokens, None). capture: layer indices whose
    output (the residual stream after them) is kept too, after the final hidden state:
    rows of (1 + len(capture)) * D.

    One left-padded batch with a preallocated cache and one attention call per layer (a
    data generator, not the exact path: rows may differ from one-row decoding in the last
    bits); finished rows are dropped from the batch when a quarter of it has finished."""
    n, hd, dev = len(prompts), lm.head_dim, lm.embed.device
    width = max(len(p) for p in prompts)
    cap = min(width + max_new, lm.max_length)
    pad = torch.tensor([width - len(p) for p in prompts], device=dev)  # (B,)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=dev)
    n_layers = len(lm.layers)
    keys = torch.zeros(n_layers, n, lm.n_kv, cap, hd, dtype=lm.embed.dtype, device=dev)
    values = torch.zeros_like(keys)
    rows = torch.arange(n, device=dev)  # which prompt each batch row is
    out: list[list[int]] = [[] for _ in range(n)]
    hidden: list[list[torch.Tensor]] = [[] for _ in range(n)]
    rep = lm.n_heads // lm.n_kv

    def run(x_ids: torch.Tensor, col: int) -> torch.Tensor:
        """Feed x_ids (B, m) at cache columns col.., return normed hidden (B, m, D)."""
        b, m = x_ids.shape
        kept: list[torch.Tensor] = []
        cols = col + torch.arange(m, device=dev)
        positions = (cols[None] - pad[:, None]).clamp(min=0)  # (B, m)
        allowed = torch.arange(col + m, device=dev)[None, None] >= pad[:, None, None]  # (B, 1, T): not padding
        allowed = allowed & (torch.arange(col + m, device=dev)[None, :] <= cols[:, None])[None]  # causal (B, m, T)
        mask = allowed[:, None]  # (B, 1, m, T)
        cos, sin = lm.cos[positions][:, None], lm.sin_signed[positions][:, None]
        x = lm.embed[x_ids]
        for i, w in enumerate(lm.layers):
            h = lm.rms_norm(x, w["in_norm"])
            q, k, v = lm.matmul(h, w["qkv"]).split([lm.n_heads * hd, lm.n_kv * hd, lm.n_kv * hd], dim=-1)
            q = lm.rotate(q.view(b, m, lm.n_heads, hd).transpose(1, 2), cos, sin)
            keys[i, :b, :, col : col + m] = lm.rotate(k.view(b, m, lm.n_kv, hd).transpose(1, 2), cos, sin)
            values[i, :b, :, col : col + m] = v.view(b, m, lm.n_kv, hd).transpose(1, 2)
            kk, vv = keys[i, :b, :, : col + m], values[i, :b, :, : col + m]
            if m == 1:  # the query heads sharing a key head attend together: no copy of the cache
                a = F.scaled_dot_product_attention(q.reshape(b, lm.n_kv, rep, hd), kk, vv, attn_mask=mask)
                a = a.reshape(b, lm.n_heads, 1, hd)
            else:
                a = F.scaled_dot_product_attention(q, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                                   attn_mask=mask)
            x = x + lm.matmul(a.transpose(1, 2).reshape(b, m, -1), w["o"])
            x = x + lm.mlp(x, w)
            if i in capture:
                kept.append(x)
        return torch.cat([lm.rms_norm(x, lm.final_norm), *kept], dim=-1) if kept else lm.rms_norm(x, lm.final_norm)

    h = run(ids, 0)
    if keep_hidden:
        for b in range(n):
            hidden[b].append(h[b, int(pad[b]) :].to(torch.bfloat16).cpu())
    d = lm.embed.shape[1]
    logits = lm.matmul(h[:, -1, :d], lm.lm_head).float()
    col = width
    alive = [True] * n  # per batch row: still generating
    for step in range(max_new):
        tok = _sample(logits, temperature, top_p, gen)
        for j, (r, t) in enumerate(zip(rows.tolist(), tok.tolist(), strict=True)):
            if alive[j]:
                out[r].append(t)
                alive[j] = t not in stop and step + 1 < max_new and col + 1 < cap
        if not any(alive):
            break
        if sum(alive) <= 0.75 * len(alive):  # drop finished rows
            keep = torch.tensor([j for j, a in enumerate(alive) if a], device=dev)
            keys[:, : len(keep)] = keys[:, keep]
            values[:, : len(keep)] = values[:, keep]
            rows, pad, tok = rows[keep], pad[keep], tok[keep]
            alive = [True] * len(keep)
        h = run(tok[:, None], col)[:, 0]
        col += 1
        if keep_hidden:
            for j, a in enumerate(alive):
                if a:
                    hidden[int(rows[j])].append(h[j : j + 1].to(torch.bfloat16).cpu())
        logits = lm.matmul(h[:, :d], lm.lm_head).float()
    result = []
    for b in range(n):
        hs = torch.cat(hidden[b]) if keep_hidden else None
        result.append((out[b], hs))
    return result


_BAD = re.compile(r"(https?://|<\||\bSmolLM\b|Hugging Face)", re.I)


def good_question(text: str) -> bool:
    """A sampled question worth answering: not too short or long, no repetition loops, no
    template tokens or self-reference."""
    words = text.split()
    if not 4 <= len(words) <= 120 or _BAD.search(text):
        return False
    if len(set(words)) < 0.5 * len(words):  # a repetition loop
        return False
    return any(c.isalpha() for c in text)


def magpie_questions(lm: BatchLlama, tokenizer: Any, n: int, batch: int, gen: torch.Generator,
                     log: Any = print) -> list[str]:
    """n distinct questions the target writes from an empty user turn (T=1, top-p 0.95)."""
    pre = tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    seen: set[str] = set()
    found: list[str] = []
    tries = 0
    while len(found) < n and tries < 20 * n:
        rows = continue_rows(lm, [pre] * batch, 96, {end, int(tokenizer.eos_token_id)}, 1.0, 0.95, gen, False)
        tries += batch
        for toks, _ in rows:
            if not toks or toks[-1] != end:
                continue  # no closing token: cut off or rambling
            text = tokenizer.decode(toks[:-1]).strip()
            key = prompt_key(text)
            if good_question(text) and key not in seen:
                seen.add(key)
                found.append(text)
        log(f"magpie: {len(found)} of {n} questions ({tries} sampled)")
    log(f"magpie: {len(found)} questions kept of {tries} sampled")
    return found[:n]


def build_prompts(lm: BatchLlama, tokenizer: Any, work: Path, n_magpie: int, n_tasks: int, seed: int,
                  log: Any = print) -> list[dict[str, str]]:
    """The prompt list (saved once in work/prompts.pt so resumed runs answer the same ones)."""
    path = work / "prompts.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    prompts = new_prompts(lm, tokenizer, n_magpie, n_tasks, seed, log)
    torch.save(prompts, path)
    return prompts


def prompt_key(text: str) -> str:
    """A prompt as deduplication compares it: lower case, runs of non-word characters as one space."""
    return re.sub(r"\W+", " ", text.lower()).strip()


def extend_prompts(lm: BatchLlama, tokenizer: Any, work: Path, n_magpie: int, n_tasks: int, seed: int,
                   log: Any = print) -> list[dict[str, str]]:
    """work/prompts.pt grown by a new list drawn with `seed` (which must differ from the seeds
    of the lists already there), less the prompts already in it (compared without case and
    punctuation). The old prompts keep their places, so their shards stay valid, and the new
    ones start at the next whole batch's place only if the old list fills its last batch: a
    partial last batch that was answered keeps its shard, and the new prompts that fall into
    it are not answered (at most batch_size - 1 of them). Each new prompt records its seed, so
    a rerun with the same seed (a resumed run) changes nothing."""
    path = work / "prompts.pt"
    old = torch.load(path, weights_only=False)
    if any(q.get("seed") == seed for q in old):
        return old  # this seed's prompts are there (a resumed run)
    seen = {prompt_key(q["text"]) for q in old}
    fresh = [{**q, "seed": seed} for q in new_prompts(lm, tokenizer, n_magpie, n_tasks, seed, log)
             if prompt_key(q["text"]) not in seen]
    prompts = old + fresh
    log(f"prompts: {len(fresh)} new ones after {len(old)}")
    save_atomic(prompts, path)
    return prompts


def new_prompts(lm: BatchLlama, tokenizer: Any, n_magpie: int, n_tasks: int, seed: int,
                log: Any = print) -> list[dict[str, str]]:
    """A shuffled prompt list drawn with `seed`: n_magpie questions the target writes, and
    n_tasks task prompts (templates, passages the target writes with requests over them, and
    some of the project's own chat prompts)."""
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    questions = magpie_questions(lm, tokenizer, n_magpie, min(128, max(1, n_magpie)), gen, log)
    log(f"magpie questions in {time.perf_counter() - t0:.0f}s")
    prompts = [{"category": "magpie", "text": q} for q in questions]
    prompts += [{"category": c, "text": t} for c, t in task_prompts(n_tasks - n_tasks // 4, seed)]
    # passages the target writes (T=0.7), then summaries / questions / extraction over them
    # (a passage cut off at 320 tokens ends at its last full sentence: 7 of 32 ended on their own)
    requests = passage_requests(n_tasks // 8, seed)
    passages = []
    end = int(tokenizer.eos_token_id)
    for i in range(0, len(requests), 64):
        enc = [chat_ids(tokenizer, r) for r in requests[i : i + 64]]
        for toks, _ in continue_rows(lm, enc, 320, {end}, 0.7, 1.0, gen, False):
            text = tokenizer.decode(toks[:-1] if toks and toks[-1] == end else toks).strip()
            if toks and toks[-1] != end:
                text = text[: max(text.rfind(". "), text.rfind(".\n")) + 1]
            if len(text.split()) > 40:
                passages.append(text)
    log(f"passages: {len(passages)} of {len(requests)} kept")
    prompts += [{"category": c, "text": t} for c, t in over_passage(passages, seed)]
    # some of the project's own chat prompts (stdlib-based), so its own suite does not regress
    from specdec.data.chat import chat_prompts

    own = chat_prompts(n_tasks // 12 + 1, heldout=False, seed=seed + 7)[: n_tasks // 3]
    prompts += [{"category": "own-" + p.category, "text": p.text} for p in own]
    random.Random(seed).shuffle(prompts)
    return prompts


def generate(target: str, out_dir: Path, n_magpie: int, n_tasks: int, batch_size: int = 128, max_new: int = 256,
             temperatures: tuple[float, ...] = (0.0, 0.7, 1.0), seed: int = 0, minutes: float | None = None,
             log: Any = print, engine: str = "bf16", more: bool = False) -> Path:
    """engine "bf16": the answers by this module's own batched bf16 pass, features kept as they
    are computed; "int4": by the decoder users run (`specdec.load(target, draft="none")`, the
    one loop's batched rows: on SmolLM2 the GGUF's 4-bit blocks), token ids only, the features
    added afterwards by `add_features` (one teacher-forced pass). On a 2-core AMD EPYC
    (avx512_bf16): bf16 answered ~115-220 tokens/s, int4 379 (64 rows), and the teacher-forced
    pass reads 600-970 positions/s. more: grow out_dir's prompt list with one drawn from
    `seed` (`extend_prompts`) and answer the new ones too."""
    from specdec.wiring import default_draft_dtype, load_pretrained

    if engine not in ("bf16", "int4"):
        raise ValueError(f"engine must be bf16 or int4, got {engine!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_pretrained(target, default_draft_dtype())
    lm = BatchLlama(model, target, batch_size)
    if more:
        prompts = extend_prompts(lm, tokenizer, out_dir, n_magpie, n_tasks, seed, log)
    else:
        prompts = build_prompts(lm, tokenizer, out_dir, n_magpie, n_tasks, seed, log)
    ids = [chat_ids(tokenizer, p["text"]) for p in prompts]
    batches = [list(range(i, min(i + batch_size, len(ids)))) for i in range(0, len(ids), batch_size)]
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None  # 0: answer nothing more
    stop = {int(tokenizer.eos_token_id)}
    capture = fused_layers(len(lm.layers))
    if engine == "int4":
        import specdec

        decoder = specdec.load(target, draft="none")
        del lm, model

        def answer_ids(bi: int) -> tuple[dict[str, Any], int]:
            batch = batches[bi]
            temperature = temperatures[bi % len(temperatures)]
            jobs = [{"prompt": ids[i], "max_new_tokens": max_new, "temperature": temperature, "stop": [],
                     "seed": int(hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[:8], 16)} for i in batch]
            gens = decoder.generate_many(jobs, max_batch=min(64, len(jobs)))
            return {"ids": [ids[i] + list(g.token_ids) for i, g in zip(batch, gens, strict=True)],
                    "prompt_len": [len(ids[i]) for i in batch], "category": [prompts[i]["category"] for i in batch],
                    "temperature": temperature}, sum(len(g.token_ids) for g in gens)

        answer_into_shards(out_dir, list(range(len(batches))), deadline, "broad self-distillation data (int4)",
                           answer_ids, log)
        return out_dir

    def answer(bi: int) -> tuple[dict[str, Any], int]:
        batch = batches[bi]
        temperature = temperatures[bi % len(temperatures)]
        gen = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}-{bi}".encode()).hexdigest()[:8], 16))
        rows = continue_rows(lm, [ids[i] for i in batch], max_new, stop, temperature, 1.0, gen, True, capture)
        d = lm.embed.shape[1]
        return {"ids": [ids[i] + r[0] for i, r in zip(batch, rows, strict=True)],
                "hidden": [r[1][:, :d].contiguous() for r in rows if r[1] is not None],
                # the outputs of the fused layers (specdec.prophets.eagle3) at every position
                "fused": [r[1][:, d:].contiguous() for r in rows if r[1] is not None], "fused_layers": capture,
                "prompt_len": [len(ids[i]) for i in batch],
                "category": [prompts[i]["category"] for i in batch],
                "temperature": temperature}, sum(len(r[0]) for r in rows)

    answer_into_shards(out_dir, list(range(len(batches))), deadline, "broad self-distillation data", answer, log)
    return out_dir


def export_ids(data_dir: Path, path: Path) -> dict[str, int]:
    """The shards' token ids, without their features, in one small compressed file that can
    live in the repository (a cache directory does not outlive a machine): per sequence its
    ids (prompt and answer), prompt length, category, temperature and shard, in the shards'
    order, so `features_from_ids` rebuilds the same shards and the same held-out split; and the
    whole prompt list, so that `generate` can go on answering where the shards stop."""
    import numpy as np

    ids: list[list[int]] = []
    meta: dict[str, list[Any]] = {"prompt_len": [], "category": [], "temperature": [], "shard": []}
    for shard_path in sorted(data_dir.glob("shard-*.pt")):
        shard = torch.load(shard_path, weights_only=False, mmap=True)  # its ids only are read
        bi = int(shard_path.stem.split("-")[1])
        for seq, p_len, cat in zip(shard["ids"], shard["prompt_len"], shard["category"], strict=True):
            ids.append(list(seq))
            meta["prompt_len"].append(int(p_len))
            meta["category"].append(str(cat))
            meta["temperature"].append(float(shard["temperature"]))
            meta["shard"].append(bi)
    if not ids:
        raise FileNotFoundError(f"no shards in {data_dir}: run specdec.train.magpie first")
    if max(max(s) for s in ids) >= 1 << 16:
        raise ValueError("token ids above 65535 do not fit the file's uint16")
    cats = sorted(set(meta["category"]))
    prompts = torch.load(data_dir / "prompts.pt", weights_only=False) if (data_dir / "prompts.pt").exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, prompt_texts=np.array([q["text"] for q in prompts]),
                        prompt_categories=np.array([q["category"] for q in prompts]),
                        prompt_seeds=np.array([q.get("seed", -1) for q in prompts], dtype=np.int64),  # -1: unmarked
                        tokens=np.array([t for s in ids for t in s], dtype=np.uint16),
                        lengths=np.array([len(s) for s in ids], dtype=np.int32),
                        prompt_len=np.array(meta["prompt_len"], dtype=np.int32),
                        category=np.array([cats.index(c) for c in meta["category"]], dtype=np.uint8),
                        categories=np.array(cats), temperature=np.array(meta["temperature"], dtype=np.float64),
                        shard=np.array(meta["shard"], dtype=np.int32))
    return {"sequences": len(ids), "tokens": sum(len(s) for s in ids),
            "answer_tokens": sum(len(s) - p for s, p in zip(ids, meta["prompt_len"], strict=True))}


def read_ids(path: Path) -> list[dict[str, Any]]:
    """The sequences of an `export_ids` file, in its order."""
    import numpy as np

    z = np.load(path)
    ends = np.cumsum(z["lengths"])
    cats = [str(c) for c in z["categories"]]
    return [{"ids": z["tokens"][e - n : e].astype(np.int64).tolist(), "prompt_len": int(p),
             "category": cats[int(c)], "temperature": float(t), "shard": int(b)}
            for e, n, p, c, t, b in zip(ends, z["lengths"], z["prompt_len"], z["category"], z["temperature"],
                                        z["shard"], strict=True)]


FEATURE_ENGINES = ("bf16", "int4")


def feature_model(target: str, rows: int, engine: str = "bf16") -> LlamaWeights:
    """The target whose features the prophets learn from: "bf16" its float weights (bf16 where the
    CPU computes it natively); "int4" the model users run by default (`specdec.load(target)`: on
    SmolLM2 its GGUF file's 4-bit blocks), whose features a prophet reads when it serves."""
    if engine not in FEATURE_ENGINES:
        raise ValueError(f"the feature engine must be one of {', '.join(FEATURE_ENGINES)}, got {engine!r}")
    if engine == "int4":
        import specdec

        loaded = specdec.load(target, draft="none").target
        if not isinstance(loaded, BatchLlama):
            raise ValueError(f"int4 features need a target on the lean path; '{target}' loads as "
                             f"{type(loaded).__name__}")
        return loaded.view(rows)
    from specdec.wiring import default_draft_dtype, load_pretrained

    model, _ = load_pretrained(target, default_draft_dtype())
    return BatchLlama(model, target, rows)


@torch.inference_mode()
def add_features(data_dir: Path, target: str = "smollm2", rows: int = 32, log: Any = print, engine: str = "bf16",
                 fused: bool = True) -> Path:
    """Each shard without features (answered by the int4 engine, or rebuilt from ids) gets
    them: the target (`feature_model`: its bf16 or int4 weights) reads each sequence once
    (teacher forcing), keeping its last feature (and, where `fused`, the fused layers' outputs an
    eagle3 prophet reads) at every position but the last; sequences of similar length share a
    pass. Each shard is rewritten atomically, so an interrupted run resumes."""
    # memory-mapped: which shards have features is seen without reading them (150 MB a shard)
    todo = [p for p in sorted(data_dir.glob("shard-*.pt"))
            if "hidden" not in torch.load(p, weights_only=False, mmap=True)]
    if not todo:
        return data_dir
    lm = feature_model(target, rows, engine)
    capture = fused_layers(len(lm.layers)) if fused else ()
    d = lm.embed.shape[1]
    gen = torch.Generator().manual_seed(0)
    for n, path in enumerate(todo):
        t0 = time.perf_counter()
        shard = torch.load(path, weights_only=False)
        seqs = [list(s) for s in shard["ids"]]
        feats: list[torch.Tensor | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        for j in range(0, len(order), rows):
            part = order[j : j + rows]
            done = continue_rows(lm, [seqs[i][:-1] for i in part], 0, set(), 0.0, 1.0, gen, True, capture)
            for i, (_, h) in zip(part, done, strict=True):
                feats[i] = h
        kept = [f for f in feats if f is not None]  # every one (keep_hidden)
        shard.update({"hidden": [f[:, :d].contiguous() for f in kept], "features": engine})
        if capture:
            shard.update({"fused": [f[:, d:].contiguous() for f in kept], "fused_layers": capture})
        save_atomic(shard, path)
        positions = sum(len(s) - 1 for s in seqs)
        log(f"features: {path.name} ({n + 1} of {len(todo)}), {positions / (time.perf_counter() - t0):.0f} positions/s")
    return data_dir


def id_files(sources: Path | Sequence[Path]) -> list[Path]:
    """The `export_ids`-format files named: a file as it is, a folder as its seed-*.npz files in
    order (`specdec.train.grow`'s shards)."""
    paths = [sources] if isinstance(sources, Path) else list(sources)
    return [f for p in paths for f in (sorted(p.glob("seed-*.npz")) if p.is_dir() else [p])]


def features_from_ids(sources: Path | Sequence[Path], out_dir: Path, target: str = "smollm2", rows: int = 32,
                      log: Any = print, features: bool = True, engine: str = "bf16", fused: bool = True) -> Path:
    """Shards as `generate` writes them, rebuilt from `export_ids` files (`id_files`: one file, or
    several and folders of them, their shards numbered on in order): the target reads each
    sequence once (`add_features`: teacher forcing on its bf16 or int4 weights). Resumable: a
    shard already there is skipped. From one file the prompt list goes to out_dir/prompts.pt,
    so `generate(out_dir, batch_size=128)` answers the rest."""
    import numpy as np

    files = id_files(sources)
    if not files:
        raise ValueError(f"no token-id files in {sources}")
    by_shard: dict[int, list[dict[str, Any]]] = {}
    offset = 0
    for f in files:
        seqs = read_ids(f)
        for s in seqs:
            by_shard.setdefault(offset + s["shard"], []).append(s)
        offset += max((s["shard"] for s in seqs), default=-1) + 1
    out_dir.mkdir(parents=True, exist_ok=True)
    z = np.load(files[0])
    if len(files) == 1 and "prompt_texts" in z and len(z["prompt_texts"]) and not (out_dir / "prompts.pt").exists():
        # the whole prompt list: `generate` into out_dir (same batch size) answers the batches not answered yet
        seeds = z["prompt_seeds"] if "prompt_seeds" in z else np.full(len(z["prompt_texts"]), -1, dtype=np.int64)
        torch.save([{"category": str(c), "text": str(t), **({"seed": int(s)} if s >= 0 else {})}
                    for c, t, s in zip(z["prompt_categories"], z["prompt_texts"], seeds, strict=True)],
                   out_dir / "prompts.pt")
    for bi, group in sorted(by_shard.items()):
        shard_path = out_dir / f"shard-{bi:05d}.pt"
        if shard_path.exists():
            continue
        save_atomic({"ids": [s["ids"] for s in group], "prompt_len": [s["prompt_len"] for s in group],
                     "category": [s["category"] for s in group], "temperature": group[0]["temperature"]}, shard_path)
    return add_features(out_dir, target, rows, log, engine, fused) if features else out_dir


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".cache/smollm2/broad"))
    ap.add_argument("--magpie", type=int, default=6000)
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 when other work shares a 2-core machine: spinning threads crawl)")
    ap.add_argument("--export", type=Path, default=None,
                    help="write the token ids of --out's shards to this .npz file (no generation)")
    ap.add_argument("--from-ids", type=Path, nargs="+", default=None,
                    help="rebuild --out's shards (features included) from --export files or folders of them "
                         "(data/broad: its seed-*.npz) (no generation)")
    ap.add_argument("--feature-engine", choices=FEATURE_ENGINES, default="bf16",
                    help="whose features: the target's bf16 weights, or the int4 model users run "
                         "(--from-ids, --features)")
    ap.add_argument("--no-fused", action="store_true", help="keep no fused-layer outputs (eagle3's; 3x the disk)")
    ap.add_argument("--engine", choices=("bf16", "int4"), default="bf16",
                    help="who answers: this module's bf16 pass (features kept), or the decoder users run (int4 on "
                         "SmolLM2, ~2-3x faster here; ids only, then --features)")
    ap.add_argument("--features", action="store_true", help="add features to --out's shards that lack them")
    ap.add_argument("--more", action="store_true",
                    help="grow --out's prompt list by --magpie and --tasks new prompts drawn with --seed (not a seed "
                         "used before), then answer the new ones")
    ap.add_argument("--ids-only", action="store_true",
                    help="with --from-ids: write the shards' ids and the prompt list, no features (then --engine int4 "
                         "--more answers more; --features adds them for all)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.export is not None:
        print(export_ids(a.out, a.export))
        raise SystemExit(0)
    if a.from_ids is not None:
        features_from_ids(a.from_ids, a.out, features=not a.ids_only, engine=a.feature_engine, fused=not a.no_fused)
        raise SystemExit(0)
    if a.features:
        add_features(a.out, engine=a.feature_engine, fused=not a.no_fused)
        raise SystemExit(0)
    generate("smollm2", a.out, a.magpie, a.tasks, a.batch_size, a.max_new, seed=a.seed, minutes=a.minutes,
             engine=a.engine, more=a.more)
