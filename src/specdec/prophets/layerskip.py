"""Self-speculation by early exit: the target drafts for itself with only its first L
layers and its own final norm and head. No second model.

The prophet shares the target's KV cache: layers 0..L-1 already hold the committed prefix,
so drafting never re-reads the prompt. The target's `early_exit` writes the draft's entries
past the committed tokens and `end_early_exit` drops them before the target verifies,
which keeps the cache invariant (see lm.py and llama.py for the two cache kinds).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from specdec.lm import sync
from specdec.prophets.base import Draft, FeatureBlind, KeepDrafting, draft_autoregressively
from specdec.prophets.feature import FeatureHead, full_vocab_logits
from specdec.sampling import SamplingParams


class LayerSkipProphet(FeatureBlind):
    def __init__(self, target: Any, layers: int) -> None:
        full = target.n_layers
        if not 1 <= layers < full:
            raise ValueError(f"layerskip:L needs 1 <= L < {full} (the target's layers), got {layers}")
        self.target = target  # HFCausalLM or FastLlamaLM: both implement early_exit
        self.layers = layers
        self.name = f"layerskip:{layers}"
        self.vocab_size: int | None = target.vocab_size

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        k = min(k, self.target.max_length - len(context) + 1)
        feed = sync(self.target, context)
        base = len(self.target.tokens)
        calls0 = self.target.forward_calls
        try:
            draft = draft_autoregressively(self._step, feed, k, self.name, params, generator, keep_drafting,
                                           len(context))
        finally:
            self.target.end_early_exit(base)
        draft.forward_calls = self.target.forward_calls - calls0
        self.target.forward_calls = calls0  # drafting passes are not target calls
        return draft

    def _step(self, ids: list[int]) -> torch.Tensor:
        """ids through the first L layers; logits (V,) of the last."""
        return self.target.early_exit(ids, self.layers)

    def committed(self, context: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def for_request(self, target: Any) -> LayerSkipProphet:
        """Early exit through the request's own view of the target (its cache)."""
        other = copy.copy(self)
        other.target = target
        return other


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

    def _step(self, ids: list[int]) -> torch.Tensor:
        feature = self.target.early_exit_features(ids, self.layers)[0]
        sub = (self.adapter.adapt(feature.to(self.dtype)) @ self.sub_head.T).float()
        return full_vocab_logits(sub, self.vocab_ids, self.vocab_size or 0)


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
