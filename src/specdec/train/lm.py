"""Training loops for the bundled pair: a target on the data, a prophet on the data or
distilled from a target (forward KL on the target's distributions).

Every loop is bounded by wall time (the schedule is a function of elapsed time, so a
resumed run continues the same curve), checkpoints atomically every few minutes and
resumes from its checkpoint when restarted.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)


@dataclass
class LoopSettings:
    seq_len: int
    batch_size: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    minutes: float
    seed: int
    checkpoint_minutes: float = 5.0
    max_steps: int | None = None  # for smoke runs: stop after this many steps
    distill_temperature: float = 1.0


def make_llama(cfg: dict[str, Any], vocab_size: int, eos_id: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rms_norm_eps=1e-5,
        **{k: cfg[k] for k in MODEL_KEYS},
    )
    return LlamaForCausalLM(config)


def loop_settings(cfg: dict[str, Any], minutes_key: str = "minutes") -> LoopSettings:
    return LoopSettings(
        seq_len=cfg["seq_len"],
        batch_size=cfg["batch_size"],
        lr=cfg["lr"],
        min_lr=cfg["min_lr"],
        warmup_steps=cfg["warmup_steps"],
        weight_decay=cfg["weight_decay"],
        minutes=cfg[minutes_key],
        seed=cfg["seed"],
        distill_temperature=cfg.get("distill_temperature", 1.0),
    )


def lr_at(step: int, elapsed_frac: float, s: LoopSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = min(1.0, elapsed_frac)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * frac))


def sample_windows(tokens: np.ndarray, n: int, seq_len: int, gen: np.random.Generator) -> torch.Tensor:
    """n random windows of seq_len + 1 tokens. Returns (n, seq_len + 1) int64."""
    starts = gen.integers(0, len(tokens) - seq_len - 1, size=n)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def fixed_eval_windows(tokens: np.ndarray, seq_len: int, n: int = 48) -> torch.Tensor:
    """The same evenly spaced held-out windows every time, so losses are comparable."""
    step = max(1, (len(tokens) - seq_len - 1) // n)
    starts = [i * step for i in range(n) if i * step + seq_len + 1 <= len(tokens)]
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over the windows (W, T+1)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Forward KL(teacher || student), per token, averaged. Logits (B, T, V)."""
    t = temperature
    teacher_logprobs = F.log_softmax(teacher_logits.float() / t, dim=-1)
    student_logprobs = F.log_softmax(student_logits.float() / t, dim=-1)
    kl = (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1)
    return kl.mean() * t * t


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def run_loop(
    model: torch.nn.Module,
    train_tokens: np.ndarray,
    eval_windows: torch.Tensor,
    s: LoopSettings,
    ckpt_path: Path,
    label: str,
    teacher: torch.nn.Module | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Train until s.minutes of (accumulated) wall time; resume from ckpt_path if present."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    torch.manual_seed(s.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
    )
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "tokens": 0, "history": []}
    rng = np.random.default_rng(s.seed)
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        rng = saved["rng"]
        log(f"[{label}] resumed at step {state['step']}, {state['elapsed'] / 60:.1f} min")
    if teacher is not None:
        teacher.eval()
    budget = s.minutes * 60
    last_ckpt = time.perf_counter()
    model.train()
    with Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}% step {task.fields[step]} loss {task.fields[loss]:.3f} "
                   "{task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=budget, completed=state["elapsed"], step=state["step"], loss=0.0, tps=0.0)
        while state["elapsed"] < budget and (s.max_steps is None or state["step"] < s.max_steps):
            t0 = time.perf_counter()
            batch = sample_windows(train_tokens, s.batch_size, s.seq_len, rng)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            for group in opt.param_groups:
                group["lr"] = lr_at(state["step"], state["elapsed"] / budget, s)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=inputs).logits
                if teacher is None:
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
                else:
                    with torch.no_grad():
                        teacher_logits = teacher(input_ids=inputs).logits
                    loss = distill_loss(logits, teacher_logits, s.distill_temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            dt = time.perf_counter() - t0
            state["step"] += 1
            state["elapsed"] += dt
            state["tokens"] += inputs.numel()
            bar.update(task, completed=state["elapsed"], step=state["step"], loss=loss.item(), tps=inputs.numel() / dt)
            if time.perf_counter() - last_ckpt > s.checkpoint_minutes * 60:
                ev = heldout_loss(model, eval_windows)
                state["history"].append((state["step"], state["elapsed"], state["tokens"], ev))
                log(f"[{label}] step {state['step']} tokens {state['tokens']} heldout {ev:.4f}")
                _save_checkpoint(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(),
                                             "state": state, "rng": rng})
                last_ckpt = time.perf_counter()
    ev = heldout_loss(model, eval_windows)
    state["history"].append((state["step"], state["elapsed"], state["tokens"], ev))
    state["heldout_loss"] = ev
    _save_checkpoint(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "rng": rng})
    log(f"[{label}] done: step {state['step']} tokens {state['tokens']} heldout loss {ev:.4f}")
    return state
