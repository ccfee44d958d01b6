"""Self-distillation data: the target answers chat prompts made from local text, in batches.

Every shard keeps, for each answered prompt, the token ids (prompt + answer) and the
target's last hidden state (after its final norm) at every position, in bfloat16. That is
all any prophet needs: the target's next-token distribution at a position is
softmax(lm_head(h)), recomputed from the stored h, so no logits are stored.

Shards are written one batch at a time (atomically), so an interrupted run resumes
where it stopped.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec.data.chat import chat_prompts


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """A user turn in the tokenizer's chat template, ready for the assistant's answer."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to path all at once: written beside it, then renamed (a reader, or a run that
    resumes after an interruption, never sees half a shard)."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def answer_into_shards(out_dir: Path, visit: list[int], deadline: float | None, label: str,
                       answer: Callable[[int], tuple[dict[str, Any], int]], log: Any = print) -> None:
    """Answer batch `bi` for each bi in `visit` into out_dir/shard-{bi}.pt, one batch at a time,
    written atomically: a batch already there is skipped (a rerun resumes) and none is started
    past `deadline` (time.monotonic()). answer(bi) returns the shard and its new tokens."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    total = 0
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tok]}"),
                  TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=len(visit), tok="")
        for done_batches, bi in enumerate(visit):
            path = out_dir / f"shard-{bi:05d}.pt"
            if path.exists():
                bar.update(task, advance=1)
                continue
            if deadline is not None and time.monotonic() > deadline:
                log(f"time budget reached after {done_batches} batches")
                break
            t0 = time.perf_counter()
            shard, new = answer(bi)
            total += new
            save_atomic(shard, path)
            bar.update(task, advance=1, tok=f"{new / (time.perf_counter() - t0):.0f} answer tok/s, {total:,} this run")


@torch.inference_mode()
def answer_batch(model: Any, prompts: list[list[int]], max_new: int, eos: int, temperature: float,
                 generator: torch.Generator) -> list[tuple[list[int], torch.Tensor]]:
    """Answers sampled from the target (greedy at temperature 0) for a batch of prompts.
    Returns per prompt (ids of prompt + answer, hidden states (len, D) in bf16)."""
    from transformers import DynamicCache

    b = len(prompts)
    ids, mask = _left_pad(prompts, eos)
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    hidden = [out.last_hidden_state[i, mask[i].bool()].to(torch.bfloat16) for i in range(b)]
    tokens = [list(p) for p in prompts]
    last = out.last_hidden_state[:, -1]
    done = torch.zeros(b, dtype=torch.bool)
    steps_h: list[torch.Tensor] = []
    steps_t: list[torch.Tensor] = []
    next_pos = positions[:, -1] + 1
    for _ in range(max_new):
        logits = model.lm_head(last).float()
        if temperature == 0:
            tok = logits.argmax(-1)
        else:
            tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        tok = torch.where(done, torch.full_like(tok, eos), tok)
        steps_t.append(tok.clone())
        done = done | (tok == eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
        out = model.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None], cache=cache,
                          use_cache=True)
        last = out.last_hidden_state[:, -1]
        steps_h.append(last.to(torch.bfloat16))
        next_pos = next_pos + 1
    result = []
    toks = torch.stack(steps_t, 1) if steps_t else torch.zeros(b, 0, dtype=torch.long)
    hs = torch.stack(steps_h, 1) if steps_h else torch.zeros(b, 0, model.config.hidden_size, dtype=torch.bfloat16)
    for i in range(b):
        row = toks[i].tolist()
        n = row.index(eos) + 1 if eos in row else len(row)  # the answer, its end token included
        # hidden states exist for every fed token: the prompt and the answer except its last token
        h = torch.cat([hidden[i], hs[i, : n - 1]]) if n > 1 else hidden[i]
        result.append((tokens[i] + row[:n], h))
    return result


def generate_data(target: str, out_dir: Path, n_prompts: int, batch_size: int, max_new: int,
                  temperatures: list[float], seed: int = 0, minutes: float | None = None,
                  dtype: torch.dtype = torch.float32, log: Any = print) -> Path:
    """Answer `n_prompts` training prompts (all four categories) into shards under out_dir."""
    from specdec.wiring import load_pretrained

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "DONE").exists():
        log(f"self-distillation data already in {out_dir}")
        return out_dir
    model, tokenizer = load_pretrained(target, dtype)
    model.eval()
    eos = int(tokenizer.eos_token_id)
    prompts = chat_prompts(n_prompts // 4 + 1, heldout=False, seed=seed)[:n_prompts]
    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch: less padding
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    # Batches of similar lengths, visited in a fixed random order: a run stopped by its time
    # budget still holds every category (shard names keep the batch number, for resuming).
    visit = list(range(len(batches)))
    random.Random(seed).shuffle(visit)
    deadline = time.monotonic() + minutes * 60 if minutes else None
    generator = torch.Generator().manual_seed(seed)

    def answer(bi: int) -> tuple[dict[str, Any], int]:
        batch = batches[bi]
        temperature = temperatures[bi % len(temperatures)]
        rows = answer_batch(model, [ids[i] for i in batch], max_new, eos, temperature, generator)
        new = sum(len(r[0]) - len(ids[i]) for r, i in zip(rows, batch, strict=True))
        return {"ids": [r[0] for r in rows], "hidden": [r[1] for r in rows],
                "prompt_len": [len(ids[i]) for i in batch], "category": [prompts[i].category for i in batch],
                "temperature": temperature}, new

    answer_into_shards(out_dir, visit, deadline, "self-distillation data", answer, log)
    done = len(list(out_dir.glob("shard-*.pt")))
    (out_dir / "DONE").write_text(f"{done} of {len(batches)} batches\n")
    return out_dir
