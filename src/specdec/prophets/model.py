"""A small language model as the prophet: drafts autoregressively for every row at once, each
row up to its own K, in cache slots of its own (a row's length there is
`Request.draft_cached[name]`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.grammar import mask_draft
from specdec.lm import LM
from specdec.prophets.base import BatchDraft, Budget, Prophet, probs_by_params
from specdec.request import Request, keep_drafting_rows, row_cached, row_slot
from specdec.rows import prefill_rows
from specdec.sampling import draw


class ModelSteps(Prophet):
    """Drafting token by token with a model for every row at once, each row up to its own K:
    each step is one pass of `rows` over every row still drafting, in the rows' own slots of
    its cache (their lengths in `Request.draft_cached[name]`)."""

    model_steps = True
    name: str

    @property
    def rows(self) -> LM:
        """The model the rows draft with."""
        raise NotImplementedError

    def room(self, req: Request) -> int:
        return self.rows.max_length - req.length + 1  # it scores positions up to len + k - 2

    def prefill(self, reqs: Sequence[Request]) -> None:
        prefill_rows(self.rows, reqs, self.name)

    def _cached(self, req: Request) -> int:
        """Positions of the row's context already in the prophet's cache (drafting starts there)."""
        return row_cached(req, self.name)

    def _fed(self, req: Request, n: int) -> None:
        req.draft_cached[self.name] = self._cached(req) + n  # its own cache keeps what it read

    def _logits(self, slots: list[int], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """One drafting step for these rows: logits (B', V) after each row's feed."""
        return self.rows.forward(slots, starts, feeds, [1] * len(slots))[:, 0]

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs = torch.zeros(len(reqs), max(ks), self.rows.vocab_size, device=self.rows.device)  # (B, K, V)
        at = {b: self._cached(reqs[b]) for b, k in enumerate(ks) if k > 0}
        feeds = {b: reqs[b].context[at[b]:] for b in at}
        keep = keep_drafting_rows(reqs)
        ks = list(ks)
        for j in range(max(ks)):
            live = [b for b in feeds if ks[b] > j]
            if not live:
                break
            logits = self._logits([row_slot(reqs[b]) for b in live], [at[b] for b in live],
                                  [feeds[b] for b in live])  # (B_live, V)
            if any(reqs[b].constraint is not None for b in live):  # q under each row's grammar, along its draft
                logits = mask_draft(logits, [reqs[b] for b in live], [tokens[b] for b in live])
            q = probs_by_params(logits[:, None], [reqs[b] for b in live], f"prophet '{self.name}'")[:, 0]
            probs[live, j] = q
            greedy = q.argmax(-1).tolist()  # (B_live,) the token of a greedy row, whose q is one-hot
            for i, b in enumerate(live):
                req = reqs[b]
                at[b] += len(feeds[b])
                self._fed(req, len(feeds[b]))
                token = greedy[i] if req.params.greedy else draw(q[i], req.params, req.generator,
                                                                    req.length + j)
                feeds[b] = [token]
                tokens[b].append(token)
                stop = keep[b]
                if stop is not None and not stop(torch.softmax(logits[i], -1) if req.params.greedy else q[i]):
                    ks[b] = j + 1  # the confidence policy's early stop: this row drafts no further
        return BatchDraft(tokens, probs)


class ModelProphet(ModelSteps):
    """lm: the model; its view with an engine's slots (`draft_lm`, the same weights) is made by
    `for_engine`."""

    def __init__(self, lm: LM, name: str | None = None, rows: LM | None = None) -> None:
        self.lm = lm
        self.name = name or lm.name
        self.vocab_size: int | None = lm.vocab_size
        self.draft_lm = rows

    def for_engine(self, target: LM, slots: int, branches: int = 1) -> ModelProphet:
        return ModelProphet(self.lm, self.name, self.lm.view(slots))

    @property
    def rows(self) -> LM:
        assert self.draft_lm is not None, "a decoder's prophet drafts through its engine's view (for_engine)"
        return self.draft_lm
