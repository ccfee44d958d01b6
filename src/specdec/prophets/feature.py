"""Prophets over the target's own features (its last hidden state, after the final norm).

The verification pass already computes the target's hidden state h_t at every scored
position, and the target's head turns h_t into p(x_{t+1}). A feature prophet reuses it:
- `eagle` (autoregressive over features, after EAGLE): a small network maps
  (h_t, embedding of x_{t+1}) to a guess of h_{t+1}; the target's head turns the guess into
  q(x_{t+2}); the drafted token is fed back with the guessed feature, K times.
- `medusa` (non-autoregressive, after Medusa): head k maps h_t alone to a guess of
  h_{t+k}; all K tokens are drafted at once.
- `kangaroo` (autoregressive over tokens, after Kangaroo's early exit with an adapter): the
  target's own first L layers read each drafted token (through the target's KV cache, as
  in layerskip), and a small adapter maps their output, through the final norm, to a
  guess of the last layer's feature at the same position (specdec.prophets.layerskip).
The networks are residual MLPs; the embedding and the head are the target's own, handed
in at construction (nothing is copied into the prophet's file).

Reduced draft vocabulary: the head is cut to the N token ids most frequent in the
target's answers, and q is 0 everywhere else. That stays exact: the verifier accepts a
drafted token x with probability min(1, p(x)/q(x)) and on rejection samples from
norm(max(0, p - q)), which is p itself outside the N ids; a token q cannot propose is
simply recovered from p. Only the acceptance rate depends on N.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec import qgemm
from specdec.prophets.base import Draft, KeepDrafting, span
from specdec.sampling import SamplingParams, draw, logits_to_probs


class ResidualMLP(nn.Module):
    """x + W2 silu(W1 [x; extra])."""

    def __init__(self, dim: int, extra: int, rank: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim + extra, rank, bias=False)
        self.down = nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.down.weight)  # starts as the identity: a guess of "the same feature"

    # At run time beside a 4-bit target: the two products as Q8_0 blocks on the target's block kernel
    # (`FeatureProphet`), float32 activations; None: the float (or bf16) Linear layers (training)
    products: tuple[Any, Any] | None = None

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        inp = x if extra is None else torch.cat([x, extra], dim=-1)
        if self.products is not None:
            up, down = self.products
            return x + down.mm(torch.nn.functional.silu(up.mm(inp)))
        return x + self.down(torch.nn.functional.silu(self.up(inp)))


KINDS = ("eagle", "medusa", "kangaroo")


class FeatureHead(nn.Module):
    """The trainable part of a feature prophet. kind "eagle": blocks[0] reads (h, e), the
    rest read h; kind "medusa": heads[k] maps h to the feature k+1 steps ahead; kind
    "kangaroo": the blocks map the target's early-exit feature after `layers` layers to
    the last layer's feature."""

    def __init__(self, kind: str, dim: int, rank: int, depth: int = 2, n_heads: int = 4, layers: int = 0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"feature prophet kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "kangaroo" and layers < 1:
            raise ValueError("a kangaroo adapter needs the number of target layers it reads (layers >= 1)")
        self.kind, self.dim, self.rank, self.depth, self.n_heads = kind, dim, rank, depth, n_heads
        self.layers = layers
        if kind == "eagle":
            self.blocks = nn.ModuleList([ResidualMLP(dim, dim if i == 0 else 0, rank) for i in range(depth)])
        elif kind == "medusa":
            self.blocks = nn.ModuleList([ResidualMLP(dim, 0, rank) for _ in range(n_heads)])
        else:
            self.blocks = nn.ModuleList([ResidualMLP(dim, 0, rank) for _ in range(depth)])

    def config(self) -> dict[str, Any]:
        out = {"kind": self.kind, "dim": self.dim, "rank": self.rank, "depth": self.depth, "n_heads": self.n_heads}
        return {**out, "layers": self.layers} if self.kind == "kangaroo" else out

    def step(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """eagle: the next feature from the feature h (..., D) and the next token's embedding e."""
        x = self.blocks[0](h, e)
        for block in self.blocks[1:]:
            x = block(x)
        return x

    def ahead(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """medusa: the feature k >= 1 steps after h."""
        return self.blocks[k - 1](h)

    def adapt(self, early: torch.Tensor) -> torch.Tensor:
        """kangaroo: the last layer's feature guessed from the early-exit one (..., D). With
        zero-initialised blocks this is the identity, i.e. plain early exit (layerskip)."""
        x = early
        for block in self.blocks:
            x = block(x)
        return x


def save_head(head: FeatureHead, vocab_ids: torch.Tensor, out: Path, info: dict[str, Any]) -> None:
    """Weights as int8 with one scale per output row (a quarter of fp32's bytes), the draft
    vocabulary, and the config; loadable with `load_head`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"vocab_ids": vocab_ids.to(torch.int32).contiguous()}
    for name, w in head.state_dict().items():
        w = w.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        tensors[name + ".int8"] = (w / scale).round().clamp(-127, 127).to(torch.int8).contiguous()
        tensors[name + ".scale"] = scale.to(torch.float32).contiguous()
    save_file(tensors, str(out / "prophet.safetensors"))
    (out / "prophet.json").write_text(json.dumps({**head.config(), **info}, indent=2) + "\n")


def load_head(path: Path) -> tuple[FeatureHead, torch.Tensor, dict[str, Any]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "prophet.json").read_text())
    tensors = load_file(str(path / "prophet.safetensors"))
    head = FeatureHead(cfg["kind"], cfg["dim"], cfg["rank"], cfg.get("depth", 2), cfg.get("n_heads", 4),
                       cfg.get("layers", 0))
    state = {name[: -len(".int8")]: tensors[name].float() * tensors[name[: -len(".int8")] + ".scale"]
             for name in tensors if name.endswith(".int8")}
    head.load_state_dict(state)
    return head.eval(), tensors["vocab_ids"].long(), cfg


def full_vocab_logits(sub: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary (..., N) placed in the full vocabulary (..., V), -inf
    (q = 0) at every other id."""
    logits = torch.full((*sub.shape[:-1], vocab_size), float("-inf"), device=sub.device)
    logits[..., vocab_ids] = sub
    return logits


def _fused_step(head: FeatureHead) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """An eagle's `FeatureHead.step` as one call of the extension's layer loop (`residual_mlps`: the same
    ATen calls and block products in the same order, so the same bits), where every block multiplies on
    the block kernels and the C++ loop runs here; else None (the Python blocks)."""
    products = [getattr(b, "products", None) for b in head.blocks]
    if head.kind != "eagle" or any(p is None for p in products):
        return None  # checked before asking for the extension: a float prophet never builds it
    from specdec import layerloop

    module = layerloop.kernels()
    if module is None or layerloop.loop_choice() == "python":
        return None
    ups = [layerloop._product(module, up, "") for up, _ in products]  # type: ignore[misc]
    downs = [layerloop._product(module, down, "") for _, down in products]  # type: ignore[misc]
    if any(p is None for p in ups + downs):
        return None
    return functools.partial(module.residual_mlps, ups, downs)


def is_feature_prophet(path: str) -> bool:
    return (Path(path) / "prophet.json").is_file()


class FeatureProphet:
    """Drafts from the target's last feature. The engine hands it the feature of the
    position before the last committed token after each round (`see_feature`); with no
    fresh feature (the first round, or after text was cut by a stop string) it proposes
    nothing, and that round is a plain target step that yields one."""

    reads_features = True

    def __init__(self, head: FeatureHead, embed: torch.Tensor, lm_head: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, name: str = "feature", dtype: torch.dtype = torch.float32,
                 block_head: Any = None) -> None:
        """block_head: the target's head rows of the draft vocabulary on a 4-bit block kernel
        (`Int4Weight.block_rows`), multiplied instead of the float rows where given (whatever
        `dtype` the prophet's own layers run in: the block kernel takes float32 activations):
        a draft step reads 5 MB of SmolLM2's Q8_0 head rows instead of 19 MB of float32 (9 MB
        of bfloat16), and the float rows are not kept."""
        mlps = [b for b in head.blocks if isinstance(b, ResidualMLP)]
        if block_head is not None and embed.device.type == "cpu" and all(
                b.up.weight.shape[1] % 32 == 0 and b.down.weight.shape[1] % 32 == 0 for b in mlps):
            # its own products as Q8_0 blocks too (the block kernel's activations): SmolLM2's eagle step (two residual
            # MLPs, 0.92M weights) took 205 us in bfloat16 and 149 in float32 through torch, 72 on the blocks
            # (2-core AMD EPYC, avx512_bf16): its weights are read from memory after every target pass
            from specdec.int4 import Int4Weight, quantize_q8_0

            head = copy.deepcopy(head).float()
            for b in head.blocks:  # every block is a ResidualMLP (FeatureHead)
                assert isinstance(b, ResidualMLP)
                b.products = (Int4Weight(quantize_q8_0(b.up.weight.detach())),
                              Int4Weight(quantize_q8_0(b.down.weight.detach())))
            dtype = torch.float32
        self.head = head.to(device=embed.device, dtype=dtype).eval()  # on the target's device
        self._fused = _fused_step(self.head)
        self.name = name
        self.vocab_size: int | None = vocab_size
        self.embed = embed  # (V, D) the target's, shared
        self.vocab_ids = vocab_ids.to(embed.device)  # (N,) the draft vocabulary
        self.block_head = block_head
        # (N, D) the head's rows of the draft vocabulary, in float, unless the block rows are multiplied
        self.sub_head = None if self.block_head is not None else lm_head[vocab_ids].to(dtype).contiguous()
        self.dtype = dtype
        self._feature: torch.Tensor | None = None
        self._position = -1

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's q never depends on the rows drafted beside it: every product on a block
        kernel (rows invariant by construction). torch's float32 and bfloat16 products are not: their
        kernels change with the row count, so a row's q differs in the last bits."""
        return self.block_head is not None and all(getattr(b, "products", None) is not None
                                                   for b in self.head.blocks)

    def fresh(self) -> FeatureProphet:
        """The same heads (shared, read-only) with state of its own, for another request."""
        other = copy.copy(self)
        other.reset()
        return other

    def for_request(self, target: Any) -> FeatureProphet:
        return self.fresh()

    def see_feature(self, position: int, feature: torch.Tensor) -> None:
        """feature (D,): the target's hidden state at context[position] (whose head gave
        the distribution of context[position + 1])."""
        self._position, self._feature = position, feature

    def max_k(self, k: int) -> int:
        """Medusa drafts at most one token per head."""
        return min(k, self.head.n_heads) if self.head.kind == "medusa" else k

    def guess(self, h: torch.Tensor, h0: torch.Tensor, tokens: torch.Tensor | int, step: int) -> torch.Tensor:
        """The feature whose head gives q at draft step `step` (1-based), for features (..., D):
        eagle from the previous guess h and the embedding of the token drafted before it,
        medusa from the starting feature h0 alone."""
        if self.head.kind == "eagle":
            e = self.embed[tokens].to(self.dtype)
            return self._fused(h, e) if self._fused is not None else self.head.step(h, e)
        return self.head.ahead(h0, step)

    def draft_logits(self, guess: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (..., N) from guessed features (..., D)."""
        if self.block_head is not None:
            return self.block_head.mm(guess.float())  # type: ignore[no-any-return]
        assert self.sub_head is not None
        return qgemm.f32_product(guess.to(self.dtype), self.sub_head).float()  # x @ sub_head.T

    @property
    def head_weight(self) -> Any:
        """What a draft step's head multiplies: the block rows (an Int4Weight) or the float rows."""
        return self.block_head if self.block_head is not None else self.sub_head

    def full_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft vocabulary (..., N) placed in the full vocabulary (..., V),
        0 at every other id: the q the verifier reads."""
        out = torch.zeros(*q.shape[:-1], self.vocab_size or 0, device=q.device)
        return out.index_copy_(-1, self.vocab_ids, q.float())

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        draft = Draft([], None, self.name)
        if self._feature is None or self._position != len(context) - 2 or k < 1:
            return draft
        h0 = h = self._feature.to(self.dtype)
        token = context[-1]
        rows = []
        who = f"prophet '{self.name}'"
        for step in range(1, self.max_k(k) + 1):
            t0 = span()
            h = self.guess(h, h0, token, step)
            # q over the draft vocabulary only (it is 0 elsewhere): the same distribution as over
            # all V ids, for less work (SmolLM2's eagle: 0.8 instead of 1.2 ms a greedy step, 0.9
            # instead of 1.3 at temperature 1)
            sub = self.draft_logits(h)
            q = logits_to_probs(sub, params, who=who)
            token = draw(q, params, generator, len(context) + step - 1, self.vocab_ids, self.vocab_size)
            draft.step_spans.append((t0, span()))
            draft.tokens.append(token)
            draft.forward_calls += 1
            if not params.greedy:  # greedy drafts are one-hot: probs None
                rows.append(self.full_probs(q))
            if keep_drafting is not None and not keep_drafting(
                    self.full_probs(torch.softmax(sub.float(), -1)) if params.greedy else rows[-1]):
                break
        draft.probs = torch.stack(rows) if rows else None
        return draft

    def committed(self, context: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        self._feature, self._position = None, -1
