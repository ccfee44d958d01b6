"""Self-speculation by early exit: the target drafts for itself with only its first L
layers and its own final norm and head. No second model.

The drafter shares the target's KV cache: layers 0..L-1 already hold the committed prefix,
so drafting never re-reads the prompt. Draft entries are appended to those layers while
drafting and cut off again before the target verifies, which keeps the cache invariant.
The layer count is lowered through the model's config inside try/finally, so the model is
whole again whatever happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from specdec.drafters.base import Draft, KeepDrafting, span
from specdec.lm import HFCausalLM, sync
from specdec.sampling import SamplingParams, logits_to_probs, sample


@contextmanager
def early_exit(model: Any, layers: int) -> Any:
    config = model.config
    full = config.num_hidden_layers
    config.num_hidden_layers = layers
    try:
        yield
    finally:
        config.num_hidden_layers = full


class LayerSkipDrafter:
    def __init__(self, target: HFCausalLM, layers: int) -> None:
        full = target.model.config.num_hidden_layers
        if not 1 <= layers < full:
            raise ValueError(f"layerskip:L needs 1 <= L < {full} (the target's layers), got {layers}")
        self.target = target
        self.layers = layers
        self.name = f"layerskip:{layers}"
        self.vocab_size: int | None = target.vocab_size

    @torch.inference_mode()
    def _step(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ids through the first L layers at positions start.. ; logits of the last one (V,)."""
        model = self.target.model
        positions = torch.arange(start, start + len(ids))[None]
        with early_exit(model, self.layers):
            out = model(input_ids=torch.tensor([ids]), position_ids=positions, cache=self.target.cache,
                        use_cache=True, logits_to_keep=1)
        return out.logits[0, -1, : self.vocab_size].float()

    def _cut_draft_entries(self, n: int) -> None:
        layers: list[Any] = list(self.target.cache.layers)[: self.layers]
        for layer in layers:
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        k = min(k, self.target.max_length - len(context) + 1)
        feed = sync(self.target, context)
        base = len(self.target.tokens)
        draft = Draft([], None, self.name)
        rows = []
        pos = base
        try:
            for _ in range(k):
                t0 = span()
                logits = self._step(feed, pos)
                pos += len(feed)
                q = logits_to_probs(logits, params, who=f"drafter '{self.name}'")
                token = int(q.argmax()) if params.greedy else int(sample(q, generator))
                draft.step_spans.append((t0, span()))
                draft.tokens.append(token)
                rows.append(q)
                feed = [token]
                draft.forward_calls += 1
                if keep_drafting is not None and not keep_drafting(torch.softmax(logits, -1) if params.greedy else q):
                    break
        finally:
            self._cut_draft_entries(base)
        draft.probs = torch.stack(rows) if rows else None
        return draft

    def committed(self, context: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass


@torch.inference_mode()
def choose_layers(target: HFCausalLM, calibration_ids: list[int], k: int = 4,
                  verify_slope: float = 0.06) -> tuple[int, list[dict[str, float]]]:
    """Pick L by measurement: one full forward over calibration text gives every layer's
    hidden states; the target's own norm and head turn each into early-exit predictions,
    whose greedy agreement a_L with the full model, at a cost c_L ~ L / layers of a
    target step, gives the expected gain of drafting K tokens. Returns (best L, table)."""
    from specdec.policy import expected_gain

    model = target.model
    n_layers = model.config.num_hidden_layers
    ids = torch.tensor([calibration_ids[: min(len(calibration_ids), target.max_length)]])
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
