"""Training the EAGLE-3-style prophet (specdec.prophets.eagle3) on the broad
self-distillation shards (specdec.train.magpie: the target's answers with, at every
position, its last feature and the outputs of the fused layers).

A batch holds whole sequences (prompt and answer, at most `max_len` positions). The layer
runs unrolled `steps` times (training-time test, `Eagle3Net.unrolled`); output j at origin
t is scored against the target's distribution at position t+j (the target's head on its
stored last feature there), as a cross-entropy over the draft vocabulary, on positions
inside the answer. Every 20th answer is held out; held-out agreement per step (argmax of
q == the target's argmax over the full vocabulary) picks the checkpoint kept. Resumable:
a checkpoint every `eval_every` steps in `work/`.

    python -m specdec.train.eagle3 --data .cache/smollm2/broad --out models/smollm2-eagle3 --minutes 30
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.prophets.eagle3 import Eagle3Net, save_eagle3


@dataclass
class Seq:
    ids: torch.Tensor  # (n,) prompt and answer
    fused: torch.Tensor  # (n - 1, 3D) bf16
    hidden: torch.Tensor  # (n - 1, D) bf16: the target's last feature (after its final norm)
    prompt_len: int


def load_sequences(data_dir: Path, max_len: int, heldout_every: int = 20
                   ) -> tuple[list[Seq], list[Seq], tuple[int, ...]]:
    shards = sorted(data_dir.glob("shard-*.pt"))
    train: list[Seq] = []
    held: list[Seq] = []
    layers: tuple[int, ...] = ()
    n = 0
    for path in shards:
        shard = torch.load(path, weights_only=False)
        if "fused" not in shard:
            continue
        layers = tuple(shard["fused_layers"])
        for ids, fused, hidden, p_len in zip(shard["ids"], shard["fused"], shard["hidden"], shard["prompt_len"],
                                             strict=True):
            ids = torch.as_tensor(ids[: max_len + 1])
            m = len(ids) - 1
            if m < 2 or p_len >= len(ids) - 1:
                continue
            s = Seq(ids, fused[:m], hidden[:m], int(p_len))
            (held if n % heldout_every == heldout_every - 1 else train).append(s)
            n += 1
    if not train:
        raise FileNotFoundError(f"no shards with fused features in {data_dir}: run specdec.train.magpie first")
    return train, held, layers


def batches(seqs: list[Seq], tokens: int, rng: random.Random) -> list[list[Seq]]:
    """Sequences of similar length together, about `tokens` positions per batch."""
    order = sorted(seqs, key=lambda s: len(s.ids))
    out: list[list[Seq]] = []
    cur: list[Seq] = []
    for s in order:
        if cur and (len(cur) + 1) * len(s.ids) > tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(batch: list[Seq], steps: int, embed: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused (B, T, 3D), embeds of x_1..x_{T+steps-1} (B, T+steps-1, D), label features
    (B, T+steps-1, D) at positions 1.., valid (B, T+steps-1) where that position's
    distribution is the target's inside the answer, ids (B, T+steps) of x_0.."""
    t = max(len(s.ids) - 1 for s in batch)
    b, d = len(batch), embed.shape[1]
    fused = torch.zeros(b, t, batch[0].fused.shape[1], dtype=torch.bfloat16)
    ids = torch.zeros(b, t + steps, dtype=torch.long)
    labels = torch.zeros(b, t + steps - 1, d, dtype=torch.bfloat16)
    valid = torch.zeros(b, t + steps - 1, dtype=torch.bool)
    for i, s in enumerate(batch):
        m = len(s.ids) - 1
        fused[i, :m] = s.fused
        ids[i, : m + 1] = s.ids
        labels[i, : m - 1] = s.hidden[1:m]  # position p = 1..m-1: its distribution of x_{p+1}
        valid[i, max(0, s.prompt_len - 2) : m - 1] = True  # p >= prompt_len - 1 (index p - 1)
    return fused, embed[ids[:, 1:]].float(), labels, valid, ids


def step_losses(net: Eagle3Net, batch: list[Seq], steps: int, embed: torch.Tensor, head_sub: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, lm_head: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Per step j the mean cross-entropy against the target's distribution at t+j; with
    lm_head, also (agreeing, counted) per step against the target's full-vocabulary argmax."""
    fused, embeds, labels, valid, _ = collate(batch, steps, embed)
    t = fused.shape[1]
    with torch.no_grad():  # the target's distribution at every labelled position, once for every step
        p_all = torch.zeros(*valid.shape, head_sub.shape[0], dtype=torch.bfloat16)
        p_all[valid] = torch.softmax(labels[valid].float() @ head_sub.T.float(), -1).to(torch.bfloat16)
    outs = net.unrolled(fused.float(), embeds, cos, sin, steps)
    losses, agree = [], []
    for j, g in enumerate(outs, 1):  # output j at origin t guesses position t + j (index t + j - 1)
        lab, ok = labels[:, j - 1 : j - 1 + t], valid[:, j - 1 : j - 1 + t]
        q_logits = net.out(g)[ok] @ head_sub.T
        p = p_all[:, j - 1 : j - 1 + t][ok].float()
        losses.append(-(p * torch.log_softmax(q_logits.float(), -1)).sum(-1).mean())
        if lm_head is not None:
            with torch.no_grad():
                target = (lab[ok].float() @ lm_head.T.float()).argmax(-1)
                agree.append((int((vocab_of(head_sub)[q_logits.argmax(-1)] == target).sum()), int(ok.sum())))
    return losses, agree


_VOCAB: dict[int, torch.Tensor] = {}


def vocab_of(head_sub: torch.Tensor) -> torch.Tensor:
    return _VOCAB[id(head_sub)]


@torch.no_grad()
def init_from_target(net: Eagle3Net, model: Any, seqs: list[Seq]) -> None:
    """Start at the target's own scales: the layer is the target's last one (its norms and
    products), its input the highest fused layer's output plus the next token's embedding
    at that output's typical size, norm_out the target's final norm. (Not a good draft yet:
    it must learn to move one position ahead; it starts where the sizes are right.)"""
    last = model.model.layers[-1]
    att, mlp = last.self_attn, last.mlp
    d = net.dim
    net.qkv.weight.copy_(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
    net.o.weight.copy_(att.o_proj.weight)
    net.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    net.down.weight.copy_(mlp.down_proj.weight)
    net.norm_attn.copy_(last.input_layernorm.weight)
    net.norm_mlp.copy_(last.post_attention_layernorm.weight)
    net.norm_out.copy_(model.model.norm.weight)
    net.fuse.weight.zero_()
    net.fuse.weight[:, (net.n_fused - 1) * d :] = torch.eye(d)
    high = torch.cat([s.fused[:, (net.n_fused - 1) * d :] for s in seqs[:200]]).float()
    scale = float(high.pow(2).mean(-1).sqrt().mean())
    net.norm_h.fill_(1.0)
    net.norm_e.fill_(1.0)
    net.inp.weight.zero_()  # u = (the high feature + the next token's embedding) at that scale, halved
    net.inp.weight[:, :d] = torch.eye(d) * scale / 2
    net.inp.weight[:, d:] = torch.eye(d) * scale / 2


def train(data_dir: Path, out: Path, work: Path, minutes: float, steps: int = 4, lr: float = 1e-3,
          tokens: int = 4096, max_len: int = 768, eval_every: int = 100, est_steps: int = 300,
          seed: int = 0, target: str = "smollm2", vocab_from: Path = Path("models/smollm2-eagle"),
          log: Any = print) -> dict[str, Any]:
    from safetensors.torch import load_file

    from specdec.defaults import shipped
    from specdec.llama import LlamaWeights
    from specdec.wiring import load_pretrained

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, _ = load_pretrained(target, torch.float32)
    lw = LlamaWeights(model, target, int4=False)
    embed, lm_head = lw.embed.detach(), model.lm_head.weight.detach()[: lw.vocab_size]
    cos, sin = lw.cos.float(), lw.sin.float()
    vocab_ids = load_file(str(Path(shipped(str(vocab_from))) / "prophet.safetensors"))["vocab_ids"].long()
    head_sub = lm_head[vocab_ids].contiguous()
    _VOCAB[id(head_sub)] = vocab_ids
    train_seqs, held, layers = load_sequences(data_dir, max_len)
    n_tok = sum(len(s.ids) - s.prompt_len for s in train_seqs)
    log(f"{len(train_seqs)} training sequences ({n_tok:,} answer tokens), {len(held)} held out; layers {layers}")
    cfg = model.config
    net = Eagle3Net(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, lw.head_dim,
                    cfg.intermediate_size, len(layers), cfg.rms_norm_eps)
    init_from_target(net, model, train_seqs)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "eagle3-ckpt.pt"
    state: dict[str, Any] = {"step": 0, "best": -1.0, "best_state": None, "best_step": 0, "history": [],
                             "seconds": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        net.load_state_dict(saved["net"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed at step {state['step']}")
    held_batches = batches(held, tokens, random.Random(1))[:12]

    def evaluate() -> list[float]:
        net.eval()
        counts = [[0, 0] for _ in range(steps)]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for hb in held_batches:
                _, agree = step_losses(net, hb, steps, embed, head_sub, cos, sin, lm_head)
                for j, (a, c) in enumerate(agree):
                    counts[j][0] += a
                    counts[j][1] += c
        net.train()
        return [a / max(1, c) for a, c in counts]

    t_start = time.monotonic() - state["seconds"]
    deadline = t_start + minutes * 60
    epoch_batches: list[list[Seq]] = []
    warm = 30
    while time.monotonic() < deadline:
        if not epoch_batches:
            epoch_batches = batches(train_seqs, tokens, rng)
        batch = epoch_batches.pop()
        s = state["step"]
        scale = min(1.0, (s + 1) / warm) * max(0.05, 0.5 * (1 + math.cos(math.pi * min(1.0, s / est_steps))))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses, _ = step_losses(net, batch, steps, embed, head_sub, cos, sin)
        loss = sum(w * x for w, x in zip([1.0, 0.9, 0.8, 0.7, 0.6, 0.5][:steps], losses, strict=False))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        state["step"] = s + 1
        if state["step"] % 20 == 0:
            el = time.monotonic() - t_start
            log(f"step {state['step']} loss {[round(float(x.detach()), 3) for x in losses]} lr {lr * scale:.2e} "
                f"{el / 60:.1f} min")
        if state["step"] % eval_every == 0:
            agree = evaluate()
            state["history"].append((state["step"], agree))
            log(f"step {state['step']} held-out agreement {[round(a, 3) for a in agree]}")
            if sum(agree) > state["best"]:
                state["best"], state["best_step"] = sum(agree), state["step"]
                state["best_state"] = copy.deepcopy(net.state_dict())
            state["seconds"] = time.monotonic() - t_start
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    agree = evaluate()
    state["history"].append((state["step"], agree))
    if sum(agree) > state["best"]:
        state["best"], state["best_step"], state["best_state"] = sum(agree), state["step"], net.state_dict()
    state["seconds"] = time.monotonic() - t_start
    torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    net.load_state_dict(state["best_state"])
    best = dict(state["history"])[state["best_step"]]
    info = {"target": target, "draft_vocab": len(vocab_ids), "answer_tokens": n_tok,
            "training": {"steps": state["step"], "best_step": state["best_step"],
                         "minutes": round(state["seconds"] / 60, 1), "heldout_agreement": best, "unroll": steps,
                         "lr": lr, "tokens_per_batch": tokens}}
    save_eagle3(net, vocab_ids, layers, out, info)
    log(f"saved {out}: best step {state['best_step']}, held-out agreement {[round(a, 3) for a in best]}")
    return info


@torch.no_grad()
def compare(data_dir: Path, eagle3: Path, eagle: Path, steps: int = 4, max_len: int = 768, limit: int = 60,
            target: str = "smollm2") -> dict[str, Any]:
    """Held-out answers (the trainer's split), per draft step j given the true tokens before:
    agreement (the prophet's argmax == the target's argmax over the full vocabulary) and the
    mean of sum_x min(p, q) at T=1 (the expected acceptance of a drafted token), for the
    eagle3 prophet and the residual-MLP eagle, on the same positions."""
    from specdec.defaults import shipped
    from specdec.llama import LlamaWeights
    from specdec.prophets.eagle3 import load_eagle3
    from specdec.prophets.feature import load_head
    from specdec.wiring import load_pretrained

    model, _ = load_pretrained(target, torch.float32)
    lw = LlamaWeights(model, target, int4=False)
    embed, lm_head = lw.embed.float(), model.lm_head.weight[: lw.vocab_size].float()
    cos, sin = lw.cos.float(), lw.sin.float()
    _, held, _ = load_sequences(data_dir, max_len)
    held = held[:limit]
    net, vocab3, _ = load_eagle3(eagle3)
    head, vocab1, _ = load_head(Path(shipped(str(eagle))))
    out: dict[str, Any] = {"positions": 0, "eagle3": {"agreement": [0.0] * steps, "min_pq": [0.0] * steps},
                           "eagle": {"agreement": [0.0] * steps, "min_pq": [0.0] * steps}}
    n_total = [0] * steps
    for seq in held:
        m = len(seq.ids) - 1
        lo = max(0, seq.prompt_len - 2)  # origins whose first guess is an answer position
        origins = torch.arange(lo, m - steps)
        if len(origins) == 0:
            continue
        embeds = F.pad(embed[seq.ids[1:]], (0, 0, 0, steps - 1))[None]  # past the end: unused origins
        outs = net.unrolled(seq.fused[None].float(), embeds, cos, sin, steps)
        g1 = seq.hidden[origins].float()
        for j in range(1, steps + 1):
            true = seq.hidden[origins + j].float()
            p = torch.softmax(true @ lm_head.T, -1)
            p_tok = p.argmax(-1)
            g3 = net.out(outs[j - 1][0, origins])
            g1 = head.step(g1, embed[seq.ids[origins + j]])
            for name, g, vocab in (("eagle3", g3, vocab3), ("eagle", g1, vocab1)):
                q_sub = torch.softmax(g @ lm_head[vocab].T, -1)
                q = torch.zeros_like(p).index_copy_(-1, vocab, q_sub)
                out[name]["agreement"][j - 1] += float((vocab[q_sub.argmax(-1)] == p_tok).sum())
                out[name]["min_pq"][j - 1] += float(torch.minimum(p, q).sum(-1).sum())
            n_total[j - 1] += len(origins)
    for name in ("eagle3", "eagle"):
        for key in ("agreement", "min_pq"):
            out[name][key] = [round(v / max(1, n), 3) for v, n in zip(out[name][key], n_total, strict=True)]
    out["positions"] = n_total[0]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="train the EAGLE-3-style prophet for SmolLM2")
    ap.add_argument("--data", type=Path, default=Path(".cache/smollm2/broad"))
    ap.add_argument("--out", type=Path, default=Path("models/smollm2-eagle3"))
    ap.add_argument("--work", type=Path, default=Path(".cache/smollm2/eagle3"))
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--est-steps", type=int, default=300, help="steps the cosine schedule spans")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare", type=Path, default=None,
                    help="no training: held-out agreement and sum min(p, q) per step of --out against this eagle")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.compare is not None:
        import json

        print(json.dumps(compare(a.data, a.out, a.compare, a.steps), indent=1))
        raise SystemExit(0)
    train(a.data, a.out, a.work, a.minutes, a.steps, a.lr, a.tokens, est_steps=a.est_steps)
