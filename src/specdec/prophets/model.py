"""A small language model as the prophet: drafts autoregressively with its own KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.lm import CausalLM, sync
from specdec.prophets.base import Draft, FeatureBlind, KeepDrafting, draft_autoregressively
from specdec.sampling import SamplingParams


class ModelProphet(FeatureBlind):
    def __init__(self, lm: CausalLM, name: str | None = None) -> None:
        self.lm = lm
        self.name = name or lm.name
        self.vocab_size: int | None = lm.vocab_size

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        # Room in the prophet's own context: it scores positions up to len(context) + k - 2.
        k = min(k, self.lm.max_length - len(context) + 1)
        # The first step feeds every committed token the cache lacks (one, or two after a
        # bonus token), so the cache catches up without re-running what it has seen.
        feed = sync(self.lm, context)
        calls0 = self.lm.forward_calls
        draft = draft_autoregressively(lambda ids: self.lm.forward(ids, 1)[0], feed, k, self.name, params,
                                       generator, keep_drafting, len(context))
        draft.forward_calls = self.lm.forward_calls - calls0
        return draft

    def committed(self, context: Sequence[int]) -> None:
        sync(self.lm, context)

    def for_request(self, target: Any) -> ModelProphet:
        return ModelProphet(self.lm.fresh(), self.name)  # its own cache over the same weights

    def reset(self) -> None:
        self.lm.truncate(0)
