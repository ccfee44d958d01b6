"""Training feature prophets (specdec.prophets.feature) on self-distillation shards.

The data are the target's own answers with its hidden state at every position
(specdec.train.selfdistill). A training example starts at an answer position t and
unrolls U steps:
- eagle:  g_0 = h_t, g_j = step(g_{j-1}, embed(x_{t+j})), compared with h_{t+j};
- medusa: g_j = ahead(h_t, j), compared with h_{t+j};
- kangaroo: g = adapt(e_t), compared with h_t, where e_t is the target's early-exit
  feature after its first L layers (computed once from the stored ids, `early_features`).
The loss is the cross-entropy of the prophet's draft distribution (the target's head on
g_j, cut to the draft vocabulary) against the target's own distribution there (the head
on h_{t+j}), plus a small regression of g_j onto h_{t+j}. Sequences are split into
training and held-out ones; the held-out agreement (argmax of q == argmax of p over the
full vocabulary, at each step) is what the model card reports.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.prophets.feature import FeatureHead, save_head


@dataclass
class FeatureData:
    hidden: torch.Tensor  # (T, D) bf16, every position of every sequence, concatenated
    next_ids: torch.Tensor  # (T,) the token after each position
    starts_train: torch.Tensor  # answer positions with `unroll` positions after them in the same sequence
    starts_heldout: torch.Tensor
    answer_counts: torch.Tensor  # (V,) how often each token occurs in the answers
    n_answer_tokens: int
    p_ids: torch.Tensor | None = None  # (T, k) the target's k most probable next tokens at each position
    p_probs: torch.Tensor | None = None  # (T, k) their probabilities
    early: torch.Tensor | None = None  # (T, D) bf16: the target's early-exit features (kangaroo)

    @torch.no_grad()
    def add_targets(self, lm_head: torch.Tensor, k: int = 16, chunk: int = 4096, softcap: float | None = None) -> None:
        """The target's top-k next-token distribution at every position, computed once
        from the stored features (the head over the full vocabulary, in bf16; then the
        target's final logit soft-cap where it has one, as its own logits)."""
        w = lm_head.to(torch.bfloat16)
        ids, probs = [], []
        for i in range(0, len(self.hidden), chunk):
            logits = (self.hidden[i : i + chunk] @ w.T).float()
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            top = logits.topk(k, dim=-1)  # the largest logits are the largest probabilities
            ids.append(top.indices.to(torch.int32))
            probs.append(torch.exp(top.values - torch.logsumexp(logits, -1, keepdim=True)))
        self.p_ids, self.p_probs = torch.cat(ids), torch.cat(probs)

    def targets_from_cache(self, path: Path, lm_head: torch.Tensor, softcap: float | None = None) -> None:
        """add_targets, saved beside the shards and reused by the next prophet's training."""
        if path.exists():
            saved = torch.load(path, weights_only=True)
            if saved["n"] == len(self.hidden):
                self.p_ids, self.p_probs = saved["ids"], saved["probs"]
                return
        self.add_targets(lm_head, softcap=softcap)
        torch.save({"n": len(self.hidden), "ids": self.p_ids, "probs": self.p_probs}, path)


def load_shards(data_dir: Path, unroll: int, heldout_every: int = 20, vocab_size: int = 49152) -> FeatureData:
    shards = sorted(data_dir.glob("shard-*.pt"))
    if not shards:
        raise FileNotFoundError(f"no self-distillation shards in {data_dir}: generate them first")
    hidden: list[torch.Tensor] = []
    nxt: list[torch.Tensor] = []
    tr: list[torch.Tensor] = []
    ho: list[torch.Tensor] = []
    counts = torch.zeros(vocab_size, dtype=torch.long)
    offset, seq_no, n_answer = 0, 0, 0
    for path in shards:
        shard = torch.load(path, weights_only=True)
        for ids, h, p_len in zip(shard["ids"], shard["hidden"], shard["prompt_len"], strict=True):
            ids_t = torch.tensor(ids, dtype=torch.long)
            n = h.shape[0]  # = len(ids) - 1: positions with a token after them
            hidden.append(h)
            nxt.append(ids_t[1 : n + 1])
            answer = ids_t[p_len:]
            counts += torch.bincount(answer, minlength=vocab_size)[:vocab_size]
            n_answer += len(answer)
            first, last = p_len - 1, n - 1 - unroll  # h_{t+unroll} must exist
            if last >= first:
                starts = torch.arange(first, last + 1) + offset
                (ho if seq_no % heldout_every == 0 else tr).append(starts)
            offset += n
            seq_no += 1
    empty = torch.zeros(0, dtype=torch.long)
    return FeatureData(torch.cat(hidden), torch.cat(nxt), torch.cat(tr) if tr else empty,
                       torch.cat(ho) if ho else empty, counts, n_answer)


@torch.inference_mode()
def early_features(target: str, data_dir: Path, layers: int, log: Any = print) -> torch.Tensor:
    """The target's early-exit feature after its first `layers` layers (through its final
    norm) at every stored position, in the order of `load_shards`; computed once with the
    lean path and cached beside the shards (data_dir/early-L.pt)."""
    from rich.console import Console
    from rich.progress import Progress

    from specdec.llama import BatchLlama
    from specdec.sequence import OneSequence
    from specdec.wiring import load_pretrained

    path = data_dir / f"early-{layers}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    model, _ = load_pretrained(target, torch.float32)
    lm = OneSequence(BatchLlama(model, target, 1))
    out: list[torch.Tensor] = []
    shards = sorted(data_dir.glob("shard-*.pt"))
    t0 = time.perf_counter()
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"early-exit features after {layers} layers", total=len(shards))
        for shard_path in shards:
            shard = torch.load(shard_path, weights_only=True)
            for ids, h in zip(shard["ids"], shard["hidden"], strict=True):
                n = h.shape[0]
                lm.truncate(0)
                out.append(lm.early_exit_features(list(ids[:n]), layers, n_last=n).to(torch.bfloat16))
            bar.advance(task)
    early = torch.cat(out)
    torch.save(early, path)
    log(f"early-exit features after {layers} layers: {len(early)} positions in {time.perf_counter() - t0:.0f}s")
    return early


def draft_vocabulary(counts: torch.Tensor, n: int, always: list[int]) -> torch.Tensor:
    """The n ids most frequent in the target's answers (plus `always`, e.g. the end token), sorted."""
    top = torch.argsort(counts, descending=True)[:n].tolist()
    ids = sorted(set(top[: n - len(always)]) | set(always))
    return torch.tensor(ids, dtype=torch.long)


def _unroll(head: FeatureHead, data: FeatureData, idx: torch.Tensor, embed: torch.Tensor,
            unroll: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(guess g_j, true h_{t+j})] for j = 1..unroll."""
    if head.kind == "kangaroo":
        assert data.early is not None, "kangaroo training needs the early-exit features (early_features)"
        return [(head.adapt(data.early[idx + 1].float()), data.hidden[idx + 1].float())]
    h = data.hidden[idx].float()
    out = []
    g = h
    for j in range(1, unroll + 1):
        true = data.hidden[idx + j].float()
        if head.kind == "eagle":
            g = head.step(g, embed[data.next_ids[idx + j - 1]].float())
            out.append((g, true))
        else:
            out.append((head.ahead(h, j), true))
    return out


def _loss(pairs: list[tuple[torch.Tensor, torch.Tensor]], data: FeatureData, idx: torch.Tensor,
          sub_head: torch.Tensor, position_of: torch.Tensor, reg_weight: float) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy against the target's top-k distribution (mass outside the draft
    vocabulary is dropped and the rest renormalised), plus feature regression."""
    assert data.p_ids is not None and data.p_probs is not None
    total = torch.zeros(())
    agree = []
    for j, (g, true) in enumerate(pairs, start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q_logits = (g @ sub_head.T).float()
        pos = position_of[data.p_ids[idx + j].long()]  # (B, k) index in the draft vocabulary, or -1
        p = data.p_probs[idx + j] * (pos >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        logq = torch.log_softmax(q_logits, -1).gather(-1, pos.clamp(min=0))
        total = total - (p * logq).sum(-1).mean() + reg_weight * F.smooth_l1_loss(g, true)
        agree.append(float((q_logits.argmax(-1) == pos[:, 0]).float().mean()))
    return total / len(pairs), agree


@torch.no_grad()
def heldout_agreement(head: FeatureHead, data: FeatureData, embed: torch.Tensor, lm_head: torch.Tensor,
                      vocab_ids: torch.Tensor, unroll: int, limit: int = 4096) -> list[float]:
    """Per step j: how often the prophet's greedy draft (argmax over the draft vocabulary)
    equals the target's greedy token (argmax over the full vocabulary) on held-out answers,
    when the prophet was given the true tokens before."""
    idx = data.starts_heldout[:limit]
    if len(idx) == 0:
        return []
    head.eval()
    pairs = _unroll(head, data, idx, embed, unroll)
    sub = lm_head[vocab_ids].float()
    out = []
    for g, true in pairs:
        q_tok = vocab_ids[(g @ sub.T).argmax(-1)]
        p_tok = (true @ lm_head.float().T).argmax(-1)  # the full vocabulary, in float32
        out.append(float((q_tok == p_tok).float().mean()))
    head.train()
    return out


def train_head(kind: str, data: FeatureData, embed: torch.Tensor, lm_head: torch.Tensor, vocab_ids: torch.Tensor,
               cfg: dict[str, Any], ckpt: Path, minutes: float, max_steps: int | None = None,
               log: Any = print, targets_cache: Path | None = None) -> tuple[FeatureHead, dict[str, Any]]:
    """Train (resuming from ckpt if it exists) for `minutes` of wall time or max_steps."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    unroll = int(cfg["unroll"])
    head = FeatureHead(kind, embed.shape[1], int(cfg["rank"]), int(cfg.get("depth", 2)), unroll,
                       int(cfg.get("layers", 0)))
    opt = torch.optim.AdamW(head.parameters(), lr=float(cfg["lr"]), weight_decay=0.0)
    step, elapsed = 0, 0.0
    eval_every = int(cfg.get("eval_every", 250))
    best: dict[str, torch.Tensor] | None = None
    best_score: list[float] = []
    best_step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, elapsed = int(state["step"]), float(state["elapsed"])
        best, best_score, best_step = state.get("best"), list(state.get("best_score", [])), state.get("best_step", 0)
        log(f"{kind}: resumed at step {step} ({elapsed / 60:.1f} min done)")
    elif cfg.get("init"):  # warm start from a shipped prophet of the same shape (its int8 weights)
        from specdec.defaults import shipped
        from specdec.prophets.feature import load_head

        init, _, _ = load_head(Path(shipped(str(cfg["init"]))))
        head.load_state_dict(init.state_dict())
        log(f"{kind}: warm start from {cfg['init']}")
    sub_head = lm_head[vocab_ids].to(torch.bfloat16)
    if data.p_ids is None:
        log("the target's distributions at every position (computed once, then cached)")
        if targets_cache is not None:
            data.targets_from_cache(targets_cache, lm_head)
        else:
            data.add_targets(lm_head)
    position_of = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
    position_of[vocab_ids] = torch.arange(len(vocab_ids))
    g = torch.Generator().manual_seed(int(cfg.get("seed", 0)) + step)
    budget = minutes * 60
    batch = int(cfg["batch_size"])
    lr_max = float(cfg["lr"])
    est_steps = max(1, int(cfg.get("est_steps", 4000)))
    t_start = time.perf_counter() - elapsed
    agree: list[float] = []
    with Progress(TextColumn(f"{kind} prophet"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=budget, completed=int(elapsed), info="")
        while (time.perf_counter() - t_start) < budget and (max_steps is None or step < max_steps):
            lr = lr_max * 0.5 * (1 + math.cos(math.pi * min(1.0, step / est_steps)))
            for group in opt.param_groups:
                group["lr"] = max(lr, lr_max * 0.05)
            idx = data.starts_train[torch.randint(len(data.starts_train), (batch,), generator=g)]
            pairs = _unroll(head, data, idx, embed, unroll)
            loss, agree = _loss(pairs, data, idx, sub_head, position_of, float(cfg.get("reg_weight", 0.1)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - t_start
            bar.update(task, completed=min(elapsed, budget),
                       info=f"step {step} loss {loss.item():.3f} agree {' '.join(f'{a:.2f}' for a in agree)}")
            if step % eval_every == 0:  # keep the head that agrees best on held-out answers (no overfitting)
                score = heldout_agreement(head, data, embed, lm_head, vocab_ids, unroll, limit=2048)
                if sum(score) > sum(best_score):
                    best, best_score, best_step = copy.deepcopy(head.state_dict()), score, step
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                            "best": best, "best_score": best_score, "best_step": best_step}, ckpt)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "best": best, "best_score": best_score, "best_step": best_step}, ckpt)
    if best is not None:
        head.load_state_dict(best)
    log(f"{kind}: keeping the head of step {best_step}")
    held = heldout_agreement(head, data, embed, lm_head, vocab_ids, unroll)
    log(f"{kind}: {step} steps in {elapsed / 60:.1f} min; held-out greedy agreement by step: "
        + " ".join(f"{a:.3f}" for a in held))
    return head, {"steps": step, "best_step": best_step, "minutes": round(elapsed / 60, 1), "heldout_agreement": held,
                  "train_agreement_last_batch": agree}


def export(head: FeatureHead, vocab_ids: torch.Tensor, out: Path, info: dict[str, Any]) -> None:
    save_head(head, vocab_ids, out, info)
