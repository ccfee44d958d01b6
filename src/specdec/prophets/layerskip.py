"""Self-speculation by early exit: the target drafts for its own rows with only its first L
layers and its own final norm and head (layerskip), or through a trained adapter after them
(kangaroo, `AdaptedExitProphet`). No second model, no cache of its own.

It reads and writes the rows' own target slots: those layers' entries for the drafted
positions sit past each row's committed tokens, where the verification pass overwrites
them; the row's cached length never moves while drafting.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from specdec.lm import LM
from specdec.prophets.feature import FeatureHead, full_vocab_logits
from specdec.prophets.model import ModelSteps
from specdec.request import Request


class LayerSkipProphet(ModelSteps):
    def __init__(self, target: Any, layers: int) -> None:
        full = target.n_layers
        if not 1 <= layers < full:
            raise ValueError(f"layerskip:L needs 1 <= L < {full} (the target's layers), got {layers}")
        self.target = target  # the decoder's target (an LM)
        self.layers = layers
        self.name = f"layerskip:{layers}"
        self.vocab_size: int | None = target.vocab_size
        self.target_rows: LM | None = None  # an engine's view of the target (for_engine)

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> LayerSkipProphet:
        other = copy.copy(self)
        other.target_rows = target
        return other

    @property
    def rows(self) -> LM:
        assert self.target_rows is not None, "a decoder's prophet drafts through its engine's view (for_engine)"
        return self.target_rows

    def prefill(self, reqs: Sequence[Request]) -> None:
        pass  # the rows' target slots are its cache

    def _cached(self, req: Request) -> int:
        return req.target_cached

    def _fed(self, req: Request, n: int) -> None:
        pass  # provisional entries: the target's cached length stays at the committed tokens

    @torch.inference_mode()
    def _logits(self, slots: list[int], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        return self.rows.forward_features(slots, starts, feeds, [1] * len(slots), layers=self.layers)[0][:, 0]


class AdaptedExitProphet(LayerSkipProphet):
    """Early exit with a trained adapter (after Kangaroo): the target's first L layers read
    each drafted token, a small network (FeatureHead kind "kangaroo", trained by
    `specdec distill` on the target's own answers) maps their output through the final
    norm to a guess of the last layer's feature, and the target's head cut to the draft
    vocabulary turns it into q (0 outside that vocabulary, which stays exact: see
    specdec.prophets.feature). Only the adapter and the vocabulary are shipped."""

    def __init__(self, target: Any, adapter: FeatureHead, vocab_ids: torch.Tensor, name: str,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(target, adapter.layers)
        self.name = name
        self.adapter = adapter.to(device=target.device, dtype=dtype).eval().requires_grad_(False)
        self.vocab_ids = vocab_ids.to(target.device)
        self.sub_head = target.head()[vocab_ids].detach().to(dtype).contiguous()  # (N, D)
        self.dtype = dtype

    @torch.inference_mode()
    def _logits(self, slots: list[int], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        _, feature = self.rows.forward_features(slots, starts, feeds, [1] * len(slots), layers=self.layers,
                                                head=False)
        sub = (self.adapter.adapt(feature[:, 0].to(self.dtype)) @ self.sub_head.T).float()  # (B', N)
        return full_vocab_logits(sub, self.vocab_ids, self.vocab_size or 0)  # (B', V)


@torch.inference_mode()
def choose_layers(target: Any, calibration_ids: list[int], k: int = 4,
                  verify_slope: float = 0.06) -> tuple[int, list[dict[str, float]]]:
    """Pick L by measurement: one full forward over calibration text gives every layer's
    hidden states; the target's own norm and head turn each into early-exit predictions,
    whose greedy agreement a_L with the full model, at a cost c_L ~ L / layers of a
    target step, gives the expected gain of drafting K tokens. Returns (best L, table)."""
    from specdec.costmodel import expected_gain

    model = target.model
    n_layers = target.n_layers
    ids = torch.tensor([calibration_ids[: min(len(calibration_ids), target.max_length)]])
    ids = ids.to(target.device)
    out = model(input_ids=ids, output_hidden_states=True)
    final = out.logits[0, :, : target.vocab_size].argmax(-1)
    table = []
    for layer in range(1, n_layers):
        hidden = model.model.norm(out.hidden_states[layer][0])
        early = model.lm_head(hidden)[:, : target.vocab_size].argmax(-1)
        a = float((early == final).float().mean())
        c = (layer + 0.5) / (n_layers + 0.5)  # the head costs about half a layer here
        table.append({"layers": layer, "agreement": a, "c": c,
                      "expected_gain": expected_gain(a, k, c, 1 + verify_slope * k)})
    best = max(table, key=lambda row: row["expected_gain"])
    return int(best["layers"]), table
