"""The model protocol (`specdec.lm.LM`) for models without a batched pass: a cache of their own
per slot, rows scored in turn.

A backend that scores one sequence at a time (transformers' forward in `specdec.hf`, the toy
tables of `specdec.toy`) gives `RowsLM` a `RowState`: one sequence's cache and tokens. Each cache
slot gets its own state (`fresh()`, the same weights), made when the slot is first used, and a
step's rows run through their states one after another: the same drafting, verification,
policies, finishing and events as on the lean batched path; only the speed-up of scoring many
rows in one product is missing.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from specdec.lm import LM
from specdec.request import Request, keep_fused, row_cached, row_slot, set_row_cached


class RowState(Protocol):
    """One sequence of a `RowsLM`: the ids whose keys and values its cache holds (`tokens`),
    appended to by each call, rolled back by `truncate`."""

    name: str
    vocab_size: int
    max_length: int
    tokens: list[int]
    offers_hidden: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def n_layers(self) -> int: ...

    def fresh(self) -> RowState: ...  # another state over the same weights, its cache empty

    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor: ...  # (n_logits, V)

    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, also the hidden states (n_logits, D) the head read."""
        ...

    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor: ...  # (1 + N, V)

    def keep_tree_path(self, n_new: int, path: Sequence[int], tree_tokens: Sequence[int]) -> None: ...

    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor: ...  # (V,)

    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor: ...

    def end_early_exit(self, committed: int) -> None: ...

    def truncate(self, n: int) -> None: ...

    def embeddings(self) -> Any: ...

    def head(self) -> torch.Tensor: ...


class RowsLM:
    """An `LM` over one-sequence states: one per slot, rows scored in turn."""

    def __init__(self, state: RowState, slots: int = 1) -> None:
        """state: a sequence of the model (its cache empty or not: it is only a prototype; each
        slot gets a `fresh()` one)."""
        self.state, self.slots = state, slots
        self.name, self.vocab_size, self.max_length = state.name, state.vocab_size, state.max_length
        self.offers_hidden = state.offers_hidden
        self.views: list[RowState | None] = [None] * slots  # per slot, made when the slot is first used
        self._trees: dict[int, list[int]] = {}  # per slot: the tree tokens of its last tree pass
        self.forward_calls = 0

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def n_layers(self) -> int:
        return self.state.n_layers

    def view(self, slots: int) -> RowsLM:
        """The same weights, `slots` empty caches of its own (a subclass keeps its class)."""
        other = copy.copy(self)
        RowsLM.__init__(other, self.state, slots)
        return other

    def embeddings(self) -> Any:
        return self.state.embeddings()

    def head(self) -> torch.Tensor:
        return self.state.head()

    def free(self, slot: int) -> None:
        self.views[slot] = None
        self._trees.pop(slot, None)

    def _view(self, slot: int, start: int) -> RowState:
        """The slot's view, holding exactly its first `start` entries: entries past them (a
        rejected draft, the provisional entries of an early exit) are dropped. A start past
        the view's tokens continues an early exit, whose entries the view keeps itself."""
        view = self.views[slot]
        if view is None:
            view = self.views[slot] = self.state.fresh()
        if start <= len(view.tokens):
            view.truncate(start)
            view.end_early_exit(start)
        return view

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                n_logits: Sequence[int], trees: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
        """See `specdec.lm.LM.forward`."""
        return self._rows(slots, starts, new_ids, n_logits, None, True, trees, features=False)[0]

    @torch.inference_mode()
    def forward_features(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                         n_logits: Sequence[int], layers: int | None = None, head: bool = True,
                         trees: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See `specdec.lm.LM.forward_features` (an early exit: one logit row per row)."""
        return self._rows(slots, starts, new_ids, n_logits, layers, head, trees, features=True)

    def _rows(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
              n_logits: Sequence[int], layers: int | None, head: bool, trees: Sequence[Sequence[int] | None] | None,
              features: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = max(n_logits)
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor | None] = []  # per row: the features the head read, where asked for
        for b, (slot, start, ids, n) in enumerate(zip(slots, starts, new_ids, n_logits, strict=True)):
            if start + len(ids) > self.max_length:
                raise ValueError(f"'{self.name}' has a context of {self.max_length} tokens")
            view = self._view(int(slot), start)
            parents = trees[b] if trees is not None else None
            h = None
            if parents and features:
                raise ValueError(f"'{self.name}' scores a token tree without its features: a feature prophet in "
                                 "a tree (--multi tree) needs a plain Llama target on the lean path")
            if parents:  # a chain then a token tree: logits after the chain's last token and each node
                chain = len(ids) - len(parents)
                tree_tokens = list(ids[chain:])
                out = view.forward_tree(list(ids[:chain]), tree_tokens, list(parents))
                self._trees[int(slot)] = tree_tokens
            elif layers is not None:  # an early exit (its last token): the view keeps its provisional entries
                if head:
                    out = view.early_exit(list(ids), layers)[None]
                else:
                    h = view.early_exit_features(list(ids), layers, 1)
                    out = h.new_zeros(1, 0)
            elif features:
                out, h = view.forward_features(list(ids), max(n, 1))
            else:
                out = view.forward(list(ids), max(n, 1))
            logits.append(out[:n])
            hidden.append(None if h is None else h[:n])
        self.forward_calls += 1
        width = self.vocab_size if head else 0
        out_logits = torch.zeros(len(slots), m, width, device=self.device)
        for b, row in enumerate(logits):
            out_logits[b, : row.shape[0]] = row.float()
        dims = {h.shape[-1] for h in hidden if h is not None}
        out_hidden = torch.zeros(len(slots), m, dims.pop() if dims else 0, device=self.device)
        for b, h in enumerate(hidden):
            if h is not None:
                out_hidden[b, : h.shape[0]] = h.float()
        return out_logits, out_hidden

    def keep_path(self, slot: int, base: int, path: Sequence[int]) -> None:
        """After a tree pass: the view keeps the accepted path's entries after its chain."""
        view, tree_tokens = self.views[slot], self._trees.pop(slot, None)
        if view is not None and tree_tokens is not None:
            view.keep_tree_path(0, list(path), tree_tokens)



def prefill_rows(lm: LM, reqs: Sequence[Request], cache: str, budget: int | None = None,
                 capture: tuple[int, ...] = ()) -> None:
    """Feed rows' prompts but their last token (later steps then feed few tokens per row):
    with a budget, one chunk per row, from where the row is (its length in `cache`) to
    the next multiple of `budget` positions, for rows in order while the chunks fit `budget`
    tokens in all (at least one row); without, every row's whole prompt. capture: target
    layers whose outputs each row keeps for an eagle3 prophet (`Request.fused`)."""
    feeds: list[tuple[Request, int, int]] = []
    used = 0
    for r in reqs:
        done, end = row_cached(r, cache), len(r.prompt) - 1
        if done >= end:
            continue
        stop = end if budget is None else min(end, (done // budget + 1) * budget)
        if feeds and budget is not None and used + stop - done > budget:
            break
        feeds.append((r, done, stop))
        used += stop - done
    args = ([row_slot(r) for r, _, _ in feeds], [a for _, a, _ in feeds], [r.prompt[a:b] for r, a, b in feeds],
            [0] * len(feeds))
    if feeds and capture:
        fused = lm.forward_fused(*args, capture=capture)[2]  # type: ignore[attr-defined]
        for i, (r, a, b) in enumerate(feeds):
            keep_fused(r, a, fused[i, : b - a])
    elif feeds:
        lm.forward(*args)
    for r, _, b in feeds:
        set_row_cached(r, cache, b)


__all__ = ["RowState", "RowsLM", "prefill_rows"]
