"""An EAGLE-3-style prophet: one decoder layer over the target's fused features, with
attention over its own past (after Li et al., "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", 2025).

Terms. The target reads token x_t at position t; its residual stream after a low, a middle
and a high layer (`fused_layers`) at t is the fused feature F_t (3 x D). Slot t of the
prophet's layer takes (a feature of position t, the embedding of x_{t+1}); its output g_t is
a guess of the target's last feature at position t+1, whose head (the target's own, cut to
the draft vocabulary) gives q(x_{t+2}).
- A true slot (t below the target's committed length) takes fuse(F_t): the target computed
  it in a verification pass. Its keys and values go to the prophet's own small cache (one
  layer), kept per cache slot like a draft model's, its length `Request.draft_cached[name]`.
- Drafting from a context of N tokens: slot N-2 (true) gives g, hence d_1; slot N-1 takes
  (g, embedding of d_1) and attends over the true slots and itself, giving d_2; and so on.
  Drafted slots' entries lie past the true ones and are overwritten later.
- Training-time test: the layer is trained unrolled on its own outputs as drafting runs it
  (`Eagle3Net.unrolled`): at step j a query attends to the true slots up to its origin and
  to the slots of its own earlier steps.
The draft vocabulary keeps q exact as for the other feature prophets (see feature.py).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.lm import LM
from specdec.prophets.base import BatchDraft, Budget, Prophet, probs_by_params
from specdec.request import Request, keep_drafting_rows, row_cached, row_slot, set_row_cached
from specdec.sampling import check_logits, draw

KIND = "eagle3"


def fused_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers whose outputs (the residual stream after them) are fused: a low, a
    middle and a high one, as EAGLE-3 takes them (SmolLM2's 30 layers: 2, 14 and 27)."""
    return 2, n_layers // 2 - 1, n_layers - 3


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the Llama convention: halves rotated), cos/sin broadcast to x."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Eagle3Net(nn.Module):
    """fuse: 3D -> D; inp: [norm(feature); norm(embedding)] 2D -> D; then one Llama decoder
    layer (grouped-query attention with rotary positions, SiLU-gated MLP); norm_out before
    the target's head. Attention shapes follow the target's (heads, KV heads, head size),
    so the target's rotary tables serve."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int, mlp: int, n_fused: int = 3,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.n_heads, self.n_kv, self.head_dim, self.mlp_dim = dim, n_heads, n_kv, head_dim, mlp
        self.n_fused, self.eps = n_fused, eps
        self.fuse = nn.Linear(n_fused * dim, dim, bias=False)
        self.inp = nn.Linear(2 * dim, dim, bias=False)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv) * head_dim, bias=False)
        self.o = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, dim, bias=False)
        self.norm_h = nn.Parameter(torch.ones(dim))
        self.norm_e = nn.Parameter(torch.ones(dim))
        self.norm_attn = nn.Parameter(torch.ones(dim))
        self.norm_mlp = nn.Parameter(torch.ones(dim))
        self.norm_out = nn.Parameter(torch.ones(dim))
        for lin in (self.fuse, self.inp, self.qkv, self.gate_up):
            nn.init.normal_(lin.weight, std=1 / math.sqrt(lin.in_features))
        for lin in (self.o, self.down):
            nn.init.normal_(lin.weight, std=0.2 / math.sqrt(lin.in_features))

    def config(self) -> dict[str, Any]:
        return {"kind": KIND, "dim": self.dim, "n_heads": self.n_heads, "n_kv": self.n_kv,
                "head_dim": self.head_dim, "mlp": self.mlp_dim, "n_fused": self.n_fused, "eps": self.eps}

    # -------------------------------------------------------------- the layer's parts
    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """(..., 3D) fused target features -> (..., D) the feature a true slot takes."""
        return self.fuse(features)

    def start(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The layer's residual stream u from a feature h and the next token's embedding e."""
        return self.inp(torch.cat([rms(h, self.norm_h, self.eps), rms(e, self.norm_e, self.eps)], dim=-1))

    def project(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u (B, n, D) at rotary cos/sin (B, n, hd) -> q (B, H, n, hd), k, v (B, Hkv, n, hd)."""
        b, n, hd = u.shape[0], u.shape[1], self.head_dim
        q, k, v = self.qkv(rms(u, self.norm_attn, self.eps)).split(
            [self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        c, s = cos[:, None], sin[:, None]
        q = rope(q.view(b, n, self.n_heads, hd).transpose(1, 2), c, s)
        k = rope(k.view(b, n, self.n_kv, hd).transpose(1, 2), c, s)
        return q, k, v.view(b, n, self.n_kv, hd).transpose(1, 2)

    def finish(self, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output g from its residual u and the attention output (B, H, n, hd)."""
        b, n = u.shape[0], u.shape[1]
        x = u + self.o(attended.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
        gate, up = self.gate_up(rms(x, self.norm_mlp, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def out(self, g: torch.Tensor) -> torch.Tensor:
        """The layer's output as the target's head reads it (its final norm's place)."""
        return rms(g, self.norm_out, self.eps)

    # -------------------------------------------------------------- training-time test
    def unrolled(self, fused: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
        """Training: fused (B, T, 3D) at slots 0..T-1, embeds (B, T + steps - 1, D) of tokens
        x_1.. (slot t's next token and those after), cos/sin (T + steps - 1, hd) by position.
        Returns per step j = 1..steps the outputs (B, T, D) for every origin t: step 1 is slot
        t itself (true), step j slot t+j-1 fed the step before's output and x_{t+j}, attending
        to the true slots <= t and to its own chain's slots (EAGLE-3's training-time test).
        Output j at origin t guesses the target's feature at position t+j."""
        b, t = fused.shape[0], fused.shape[1]
        rep = self.n_heads // self.n_kv
        scale = 1 / math.sqrt(self.head_dim)
        pos_c, pos_s = cos[:t].expand(b, t, -1), sin[:t].expand(b, t, -1)
        u = self.start(self.fused(fused), embeds[:, :t])
        q, k1, v1 = self.project(u, pos_c, pos_s)
        k1r, v1r = k1.repeat_interleave(rep, 1), v1.repeat_interleave(rep, 1)  # (B, H, T, hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=fused.device).tril()
        g = self.finish(u, F.scaled_dot_product_attention(q, k1r, v1r, attn_mask=causal))
        outs = [g]
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for j in range(2, steps + 1):
            c, s = cos[j - 1 : j - 1 + t].expand(b, t, -1), sin[j - 1 : j - 1 + t].expand(b, t, -1)
            u = self.start(g, embeds[:, j - 1 : j - 1 + t])
            q, k, v = self.project(u, c, s)
            chain_k.append(k.repeat_interleave(rep, 1))
            chain_v.append(v.repeat_interleave(rep, 1))
            true = (q @ k1r.transpose(-1, -2)) * scale  # (B, H, T, T)
            true = true.masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * ck).sum(-1) * scale for ck in chain_k], dim=-1)  # (B, H, T, j-1)
            w = torch.softmax(torch.cat([true, diag], dim=-1).float(), dim=-1).to(q.dtype)
            attended = w[..., :t] @ v1r + sum(w[..., t + i, None] * cv for i, cv in enumerate(chain_v))
            g = self.finish(u, attended)
            outs.append(g)
        return outs


def save_eagle3(net: Eagle3Net, vocab_ids: torch.Tensor, layers: tuple[int, ...], out: Path,
                info: dict[str, Any]) -> None:
    """Products as int8 with one scale per output row, norms in float32, the draft
    vocabulary, the fused layers and the config; loadable with `load_eagle3`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"vocab_ids": vocab_ids.to(torch.int32).contiguous()}
    for name, w in net.state_dict().items():
        w = w.float()
        if w.dim() == 2:
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            tensors[name + ".int8"] = (w / scale).round().clamp(-127, 127).to(torch.int8).contiguous()
            tensors[name + ".scale"] = scale.contiguous()
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(out / "prophet.safetensors"))
    (out / "prophet.json").write_text(json.dumps({**net.config(), "layers": list(layers), **info}, indent=2) + "\n")


def load_eagle3(path: Path) -> tuple[Eagle3Net, torch.Tensor, dict[str, Any]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "prophet.json").read_text())
    tensors = load_file(str(path / "prophet.safetensors"))
    net = Eagle3Net(cfg["dim"], cfg["n_heads"], cfg["n_kv"], cfg["head_dim"], cfg["mlp"], cfg.get("n_fused", 3),
                    cfg.get("eps", 1e-5))
    state = {name[: -len(".int8")]: tensors[name].float() * tensors[name[: -len(".int8")] + ".scale"]
             for name in tensors if name.endswith(".int8")}
    state.update({name: t for name, t in tensors.items()
                  if not name.endswith((".int8", ".scale")) and name != "vocab_ids"})
    net.load_state_dict(state)
    return net.eval(), tensors["vocab_ids"].long(), cfg


def is_eagle3(path: str | Path) -> bool:
    f = Path(path) / "prophet.json"
    return f.is_file() and json.loads(f.read_text()).get("kind") == KIND


class Eagle3Runtime:
    """The trained layer for drafting: its products (float32, or 4-bit through the CPU int4
    kernel where `int4`), the target's embedding, rotary tables and head cut to the draft
    vocabulary, and one small KV cache per cache slot (1, Hkv, T, hd), grown by doubling."""

    def __init__(self, net: Eagle3Net, vocab_ids: torch.Tensor, layers: tuple[int, ...], embed: torch.Tensor,
                 lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: int, int4: bool = False,
                 name: str = KIND) -> None:
        self.net = net.float().eval()
        self.name, self.layers = name, tuple(layers)
        self.vocab_ids = vocab_ids.to(embed.device)
        self.embed = embed
        self.cos, self.sin = cos.float(), sin.float()
        self.int4 = int4
        with torch.no_grad():
            weights = {"fuse": net.fuse.weight, "inp": net.inp.weight, "qkv": net.qkv.weight, "o": net.o.weight,
                       "gate_up": net.gate_up.weight, "down": net.down.weight,
                       "head": lm_head[vocab_ids].float().contiguous()}
            self.w: dict[str, Any] = {k: self._product(v) for k, v in weights.items()}
        self.k_slots: list[torch.Tensor | None] = [None] * slots
        self.v_slots: list[torch.Tensor | None] = [None] * slots
        half = self.sin.shape[-1] // 2
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)  # rope as roll(x) * sin_signed
        self.stack = self._stack()

    def _stack(self) -> Any:
        """The layer as a one-layer stack of the target's C++ layer loop (specdec.layerloop: its
        RMSNorm, rotary positions, attention of one query and products, without the interpreter's
        ~40 operations a draft step), or None where the extension does not build or a product
        is not on its kernels (then `run` runs the layer op by op)."""
        from specdec import layerloop

        module = layerloop.kernels()
        if module is None or layerloop.loop_choice() == "python" or self.embed.device.type != "cpu":
            return None
        from specdec.defaults import PREFILL_CHUNK, fine_block

        products = [layerloop.cpp_product(module, self.w[name], "") for name in ("qkv", "o", "gate_up", "down")]
        if any(p is None for p in products):
            return None
        n = self.net
        stack = module.Stack(n.n_heads, n.n_kv, n.head_dim, float(n.eps), PREFILL_CHUNK, fine_block(PREFILL_CHUNK),
                             False)
        stack.add_layer(n.norm_attn.detach().float().contiguous(), n.norm_mlp.detach().float().contiguous(), products)
        return stack

    def _product(self, w: torch.Tensor) -> Any:
        if not self.int4:
            return w.detach().float().contiguous()
        from specdec.int4 import Int4Weight, quantize_q8_0

        return Int4Weight(quantize_q8_0(w.detach().float()))

    def mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[name]
        return x @ w.T if isinstance(w, torch.Tensor) else w.mm(x)

    def view(self, slots: int) -> Eagle3Runtime:
        """The same weights with empty caches of `slots` slots."""
        other = copy.copy(self)
        other.k_slots, other.v_slots = [None] * slots, [None] * slots
        return other

    def free(self, slot: int) -> None:
        self.k_slots[slot] = self.v_slots[slot] = None

    def _reserve(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_old, v_old = self.k_slots[slot], self.v_slots[slot]
        cap = 0 if k_old is None else k_old.shape[2]
        if k_old is not None and v_old is not None and end <= cap:
            return k_old, v_old
        size = max(256, cap)
        while size < end:
            size *= 2
        n = self.net
        k = torch.zeros(1, n.n_kv, size, n.head_dim, device=self.embed.device)
        v = torch.zeros_like(k)
        if k_old is not None and v_old is not None:
            k[:, :, :cap], v[:, :, :cap] = k_old, v_old
        self.k_slots[slot], self.v_slots[slot] = k, v
        return k, v

    @torch.inference_mode()
    def run(self, slots: list[int], starts: list[int], feats: list[torch.Tensor], tokens: list[list[int]],
            fused: list[bool]) -> torch.Tensor:
        """One pass of the layer for each row b: feats[b] (m_b, 3D if fused[b] else D) at slots
        starts[b].. of its cache, with the embeddings of tokens[b] (m_b, each slot's next
        token); keys and values written there, queries attending causally over the row's
        cache (only the last slot's output is computed). Returns each row's last output (B, D)."""
        net, dev = self.net, self.embed.device
        if self.stack is not None:
            if self.int4 or len(slots) == 1:  # block products: rows invariant by construction
                return self._run_stack(slots, starts, feats, tokens, fused)
            # float products (torch's kernels change with the row count): each row alone, so that a row's
            # drafts never depend on the rows beside it
            return torch.cat([self._run_stack([s], [a], [f], [t], [u])
                              for s, a, f, t, u in zip(slots, starts, feats, tokens, fused, strict=True)])
        outs = []
        rep = net.n_heads // net.n_kv
        for slot, start, f, toks, is_fused in zip(slots, starts, feats, tokens, fused, strict=True):
            m = len(toks)
            h = self.mm(f.float(), "fuse") if is_fused else f.float()
            e = self.embed[torch.tensor(toks, device=dev)].float()
            u = self.mm(torch.cat([rms(h, net.norm_h, net.eps), rms(e, net.norm_e, net.eps)], -1), "inp")[None]
            hd = net.head_dim
            q, k, v = self.mm(rms(u, net.norm_attn, net.eps), "qkv").split(
                [net.n_heads * hd, net.n_kv * hd, net.n_kv * hd], dim=-1)
            c, s = self.cos[start : start + m][None, None], self.sin[start : start + m][None, None]
            q = rope(q.view(1, m, net.n_heads, hd).transpose(1, 2), c, s)
            k = rope(k.view(1, m, net.n_kv, hd).transpose(1, 2), c, s)
            v = v.view(1, m, net.n_kv, hd).transpose(1, 2)
            keys, values = self._reserve(slot, start + m)
            keys[:, :, start : start + m], values[:, :, start : start + m] = k, v
            end = start + m
            # only the last slot's output is wanted (earlier slots only leave their keys and
            # values): its query attends over everything before it, with no mask
            a = F.scaled_dot_product_attention(q[:, :, -1:].reshape(1, net.n_kv, rep, hd), keys[:, :, :end],
                                               values[:, :, :end]).reshape(1, net.n_heads, 1, hd)
            x = u[:, -1:] + self.mm(a[:, :, -1:].transpose(1, 2).reshape(1, 1, -1), "o")
            gate, up = self.mm(rms(x, net.norm_mlp, net.eps), "gate_up").chunk(2, dim=-1)
            outs.append((x + self.mm(F.silu(gate) * up, "down"))[0, 0])
        return torch.stack(outs)

    def _run_stack(self, slots: list[int], starts: list[int], feats: list[torch.Tensor], tokens: list[list[int]],
                   fused: list[bool]) -> torch.Tensor:
        """`run` through the C++ stack: every row's slots in one (B, n, D) pass, padded to the
        longest row (the padding's keys land past the row's slots and are overwritten later)."""
        net, dev = self.net, self.embed.device
        counts = [len(t) for t in tokens]
        n = max(counts)
        h = torch.cat([self.mm(f.float(), "fuse") if is_fused else f.float() for f, is_fused in zip(feats, fused,
                                                                                                   strict=True)])
        e = self.embed[torch.tensor([t for row in tokens for t in row], device=dev)].float()
        u = self.mm(torch.cat([rms(h, net.norm_h, net.eps), rms(e, net.norm_e, net.eps)], -1), "inp")  # (sum m, D)
        if all(m == n for m in counts):
            x = u.view(len(tokens), n, -1)
        else:
            x = u.new_zeros(len(tokens), n, u.shape[-1])
            at = 0
            for b, m in enumerate(counts):
                x[b, :m] = u[at : at + m]
                at += m
        positions = (torch.tensor(starts, device=dev)[:, None] + torch.arange(n, device=dev)).clamp_max(
            self.cos.shape[0] - 1)
        buffers = [self._reserve(slot, start + n) for slot, start in zip(slots, starts, strict=True)]
        out, _ = self.stack.run(x.contiguous(), self.cos[positions][:, None], self.sin_signed[positions][:, None],
                                [k for k, _ in buffers], [v for _, v in buffers], list(starts), counts, counts, -1,
                                [])
        return out[torch.arange(len(tokens), device=dev), torch.tensor(counts, device=dev) - 1]

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (B, N) from the layer's outputs (B, D) (row by row on a
        float head, whose kernel changes with the row count: a row's q never depends on the others)."""
        if not self.int4 and g.shape[0] > 1:
            return torch.cat([self.logits(g[i : i + 1]) for i in range(g.shape[0])])
        return self.mm(rms(g, self.net.norm_out, self.net.eps), "head").float()


class Eagle3Prophet(Prophet):
    """The EAGLE-3-style prophet for every row: a row's true slots
    come from the target's fused features, which every target pass (prefill chunks and
    verification) leaves in `Request.fused` for the positions it committed; a row drafts
    once its slots reach its last committed position but one (right after its prompt is
    in), and each draft step is one more slot fed the layer's own output. Its cache length
    is `Request.draft_cached[name]`, true slots only (drafted slots lie past it). q is 0
    outside the draft vocabulary (exact, see feature.py)."""

    def __init__(self, runtime: Eagle3Runtime, vocab_size: int) -> None:
        """runtime: the trained layer with the target's embedding, head and rotary tables; each
        engine drafts through a view of it with caches for its slots (`for_engine`)."""
        self.runtime, self.name, self.vocab_size = runtime, runtime.name, vocab_size
        self.fused_layers = runtime.layers
        self.full_vocab = int(runtime.embed.shape[0])  # the target's vocabulary, where q is placed

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> Eagle3Prophet:
        from specdec.llama import BatchLlama

        if not isinstance(target, BatchLlama):
            raise ValueError(f"prophet '{self.name}' drafts on the batched Llama path only (its rows keep the "
                             "target's fused features); use a plain Llama target such as smollm2")
        other = copy.copy(self)
        other.runtime = self.runtime.view(slots)
        return other

    def free(self, slot: int) -> None:
        self.runtime.free(slot)

    def _catch_up(self, reqs: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Feed each row's pending true slots. Returns the rows that can draft now (their
        slots reach len(context) - 2) and their last outputs (B', D), whose head gives d_1."""
        ready: list[int] = []
        slots, starts, feats, toks = [], [], [], []
        for b, r in enumerate(reqs):
            have = row_cached(r, self.name)
            if not r.fused or r.fused_from != have:
                continue  # no fresh slot to start from (it just joined, or was cut): no draft this step
            pending = torch.cat(r.fused)
            if have + len(pending) != r.length - 1:
                continue
            ready.append(b)
            slots.append(row_slot(r))
            starts.append(have)
            feats.append(pending)
            toks.append(r.context[have + 1 : have + 1 + len(pending)])
        if not ready:
            return ready, None
        g = self.runtime.run(slots, starts, feats, toks, [True] * len(ready))
        for b in ready:
            r = reqs[b]
            set_row_cached(r, self.name, r.length - 1)
            r.fused, r.fused_from = [], r.length - 1
        return ready, g

    @torch.inference_mode()
    def settle(self, reqs: Sequence[Request], leave: int = 0) -> None:
        """Feed each row's pending true slots into its cache but the last `leave` (so that a
        timed round catches up on as many slots as a real one does)."""
        for r in reqs:
            pending = torch.cat(r.fused) if r.fused else None
            have = row_cached(r, self.name)
            if pending is None or r.fused_from != have or len(pending) <= leave:
                continue
            m = len(pending) - leave
            self.runtime.run([row_slot(r)], [have], [pending[:m]], [r.context[have + 1 : have + 1 + m]], [True])
            set_row_cached(r, self.name, have + m)
            r.fused, r.fused_from = [pending[m:]], have + m

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        rt = self.runtime
        tokens: list[list[int]] = [[] for _ in reqs]
        want = [b for b, k in enumerate(ks) if k > 0]
        if not want:
            return BatchDraft(tokens, None)
        got, g = self._catch_up([reqs[b] for b in want])
        rows = [want[i] for i in got]
        if g is None:
            return BatchDraft(tokens, None)
        k_rows = [ks[b] for b in rows]
        keep = keep_drafting_rows(reqs)
        who = f"prophet '{self.name}'"
        sampled = [i for i, b in enumerate(rows) if not reqs[b].params.greedy]
        probs = torch.zeros(len(reqs), max(k_rows), self.full_vocab, device=g.device) if sampled else None
        for j in range(1, max(k_rows) + 1):
            live = [i for i in range(len(rows)) if k_rows[i] >= j]
            if j > 1:  # slot N-2+j-1 of each row still drafting: (its last output, its last draft)
                g_live = rt.run([row_slot(reqs[rows[i]]) for i in live],
                                [reqs[rows[i]].length - 2 + j - 1 for i in live],
                                [g[i][None] for i in live], [[tokens[rows[i]][-1]] for i in live],
                                [False] * len(live))
                g = g.clone()
                g[live] = g_live
            sub = rt.logits(g[live])  # (B', N)
            check_logits(sub, who)
            picked = rt.vocab_ids[sub.argmax(-1)].tolist()
            drawing = [n for n, i in enumerate(live) if i in sampled]
            if drawing:
                q = probs_by_params(sub[drawing][:, None], [reqs[rows[live[n]]] for n in drawing], who)[:, 0]
                for m, n in enumerate(drawing):
                    req = reqs[rows[live[n]]]
                    picked[n] = draw(q[m], req.params, req.generator, req.length + j - 1, rt.vocab_ids,
                                     self.full_vocab)
                    probs[rows[live[n]], j - 1].index_copy_(-1, rt.vocab_ids, q[m].float())  # type: ignore[index]
            for n, i in enumerate(live):
                b = rows[i]
                tokens[b].append(picked[n])
                stop = keep[b]
                if stop is not None and k_rows[i] > j:
                    sure = probs[b, j - 1] if probs is not None and not reqs[b].params.greedy else \
                        torch.zeros(self.full_vocab, device=g.device).index_copy_(
                            -1, rt.vocab_ids, torch.softmax(sub[n].float(), -1))
                    if not stop(sure):
                        k_rows[i] = j
        return BatchDraft(tokens, probs, one_hot=[r.params.greedy for r in reqs])
