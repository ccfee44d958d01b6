"""One growing sequence on any model (`specdec.lm.LM`): `OneSequence` keeps the sequence's tokens
and drives one cache slot, for the callers that read a model one sequence at a time (training's
teacher-forced features, tools, tests). The loop never uses it: it drives rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.lm import LM


class OneSequence:
    """Slot `slot` of `lm` as one sequence: `forward` appends ids and returns logits, `truncate`
    rolls back (the next call writes from there), trees and early exits as the model offers them.
    Several OneSequences over one model need slots of their own (or `lm.view(1)` each)."""

    def __init__(self, lm: LM, slot: int = 0) -> None:
        self.lm, self.slot = lm, slot
        self.tokens: list[int] = []
        self.last_hidden = torch.zeros(0)
        self._tree: list[int] = []  # the tree tokens of the last tree pass
        self._exit = 0  # ids fed past the committed tokens by early exits

    @property
    def name(self) -> str:
        return self.lm.name

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def max_length(self) -> int:
        return self.lm.max_length

    def _pass(self, ids: Sequence[int], n_logits: int, layers: int | None = None, head: bool = True,
              parents: Sequence[int] | None = None, features: bool = True) -> torch.Tensor:
        args = ([self.slot], [len(self.tokens) + self._exit], [list(ids)], [n_logits])
        trees = [parents] if parents is not None else None
        if features:
            logits, hidden = self.lm.forward_features(*args, layers, head, trees=trees)
            self.last_hidden = hidden[0]
        else:
            logits = self.lm.forward(*args, trees=trees)
        if layers is None:
            self.tokens.extend(ids)
            self._exit = 0
        else:
            self._exit += len(ids)
        return logits[0]

    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor:
        """Append new_ids (n,); logits (n_logits, V) for the last n_logits of them."""
        return self._pass(new_ids, n_logits, features=False)

    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `forward`, also the last hidden states (n_logits, D) the head read."""
        logits = self._pass(new_ids, n_logits)
        return logits, self.last_hidden

    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor:
        """Self-speculation: new_ids through the first `layers` layers and the model's own head,
        logits (V,) of the last; their entries stay provisional until `end_early_exit`."""
        return self._pass(new_ids, 1, layers)[0]

    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor:
        """As early_exit, what the head would read instead of logits, (n_last, D)."""
        self._pass(new_ids, n_last, layers, head=False)
        return self.last_hidden

    def end_early_exit(self, committed: int) -> None:
        """Drop the early exits' provisional entries (and any tokens past `committed`)."""
        self._exit = 0
        self.truncate(committed)

    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor:
        """new_ids (a chain) then a token tree in one pass; logits (1 + N, V) after the chain's
        last token and after each node."""
        logits = self._pass(list(new_ids) + list(tree_tokens), len(tree_tokens) + 1, parents=tree_parents,
                            features=False)
        self._tree = list(tree_tokens)
        return logits

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: the accepted path's entries next to the chain's, the rest dropped."""
        base = len(self.tokens) - len(self._tree)
        self.lm.keep_path(self.slot, base, path)
        self.tokens = self.tokens[:base] + [self._tree[node] for node in path]
        self._tree = []

    def truncate(self, n: int) -> None:
        """Keep the first n tokens: the next call writes from position n."""
        del self.tokens[n:]
        self._exit = 0


__all__ = ["OneSequence"]
