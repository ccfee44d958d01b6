"""A small language model as the prophet: drafts autoregressively with its own KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters.base import Draft, KeepDrafting, span
from specdec.lm import CausalLM, sync
from specdec.sampling import SamplingParams, logits_to_probs, sample


class ModelDrafter:
    def __init__(self, lm: CausalLM, name: str | None = None) -> None:
        self.lm = lm
        self.name = name or lm.name
        self.vocab_size: int | None = lm.vocab_size

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, keep_drafting: KeepDrafting | None = None) -> Draft:
        # Room in the drafter's own context: it scores positions up to len(context) + k - 2.
        k = min(k, self.lm.max_length - len(context) + 1)
        draft = Draft([], None, self.name)
        rows: list[torch.Tensor] = []
        # The first step feeds every committed token the cache lacks (one, or two after a
        # bonus token), so the cache catches up without re-running what it has seen.
        feed = sync(self.lm, context)
        calls0 = self.lm.forward_calls
        for _ in range(k):
            t0 = span()
            logits = self.lm.forward(feed, 1)[0]  # (V,)
            q = logits_to_probs(logits, params, who=f"drafter '{self.name}'")
            token = int(q.argmax()) if params.greedy else int(sample(q, generator))
            draft.step_spans.append((t0, span()))
            draft.tokens.append(token)
            rows.append(q)
            feed = [token]
            # In greedy mode q is one-hot, so confidence is read from the plain softmax.
            if keep_drafting is not None and not keep_drafting(torch.softmax(logits, -1) if params.greedy else q):
                break
        draft.probs = torch.stack(rows) if rows else None
        draft.forward_calls = self.lm.forward_calls - calls0
        return draft

    def committed(self, context: Sequence[int]) -> None:
        sync(self.lm, context)

    def reset(self) -> None:
        self.lm.truncate(0)
