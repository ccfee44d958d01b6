"""One sequence on the fast path as a `specdec.lm.CausalLM`: `FastLlamaLM`, slot 0 of a
one-slot `BatchLlama` with the sequence's tokens kept here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.llama import BatchLlama


class FastLlamaLM:
    """One sequence as a `specdec.lm.CausalLM`, on the one Llama path there is: slot 0 of a
    one-slot `BatchLlama`, with the sequence's tokens kept here. Draft models run row by
    row through it where a prophet has no batched path, training reads features through it,
    and the decoder holds its target as one; every product, attention and exactness rule
    (`exact_rows`: in bf16 and int4 the scored rows attend as one-token steps) is
    BatchLlama's. Every attribute of the weights (`model`, `layers`, `int4`, ...) reads
    through to it."""

    INITIAL_CAPACITY = 256  # KV positions allocated up front (grows by doubling)
    offers_hidden = True  # forward_features: logits and the last hidden states

    def __init__(self, model: Any, name: str, vocab_size: int | None = None, int8: bool = False,
                 act_dtype: torch.dtype = torch.float32, rows: BatchLlama | None = None,
                 kv_dtype: str | torch.dtype | None = None) -> None:
        """int8: the same weights quantized to int8 per output row (weight-only; activations in
        act_dtype), a compressed copy of the model to draft with (`--draft TARGET:int8`), made
        from the float weights (never from a model's 4-bit ones). rows: a one-slot view of
        weights already read (`fresh`)."""
        self.rows = rows if rows is not None else BatchLlama(model, name, 1, vocab_size, int8=int8,
                                                             act_dtype=act_dtype, kv_dtype=kv_dtype)
        # The KV buffer grows with the request (doubling, up to the context), instead of being
        # sized to every position the config allows (8,192 for SmolLM2: ~377 MB in fp32).
        self.rows.reserve(0, min(self.INITIAL_CAPACITY, self.rows.max_length))
        self.tokens: list[int] = []
        self.last_hidden = torch.zeros(0)

    def __getattr__(self, attr: str) -> Any:
        if attr == "rows":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.rows, attr)

    @property
    def capacity(self) -> int:
        """KV positions currently allocated."""
        k = self.rows.k_slots[0]
        return 0 if k is None else int(k.shape[2])

    @property
    def forward_calls(self) -> int:
        return self.rows.forward_calls

    @forward_calls.setter
    def forward_calls(self, n: int) -> None:
        self.rows.forward_calls = n

    def _pass(self, ids: Sequence[int], n_logits: int, layers: int | None = None, head: bool = True,
              parents: Sequence[int] | None = None) -> torch.Tensor:
        logits, hidden = self.rows.forward_features([0], [len(self.tokens)], [list(ids)], [n_logits], layers, head,
                                                    trees=[parents] if parents is not None else None)
        self.tokens.extend(ids)
        self.last_hidden = hidden[0]
        return logits[0]

    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor:
        """Append new_ids (n,); logits (n_logits, V) for the last n_logits of them."""
        return self._pass(new_ids, n_logits)

    def embeddings(self) -> torch.Tensor:
        return self.rows.embed

    def head(self) -> torch.Tensor:
        """The head's float weights (V, D) (with dtype int4, those transformers de-quantized)."""
        if isinstance(self.rows.lm_head, torch.Tensor):
            return self.rows.lm_head
        return self.rows.model.lm_head.weight[: self.rows.vocab_size]

    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `forward`, also returning the last hidden states (n_logits, D), after the final norm."""
        logits = self._pass(new_ids, n_logits)
        return logits, self.last_hidden

    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor:
        """Self-speculation: new_ids through the first `layers` layers and the model's own head,
        logits (V,) of the last. Their cache entries (layers < L only) sit past the committed
        tokens, where the next full pass overwrites them: end_early_exit truncates back."""
        return self._pass(new_ids, 1, layers)[0]

    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor:
        """As early_exit, but what the head would read instead of logits: the final norm of
        the first `layers` layers' output, (n_last, D) for the last n_last new ids."""
        self._pass(new_ids, n_last, layers, head=False)
        return self.last_hidden

    def end_early_exit(self, committed: int) -> None:
        self.truncate(committed)

    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor:
        """new_ids (a chain) then a token tree in one pass; logits (1 + N, V) after the chain's
        last token and after each node. Nodes sit at position (chain end + depth) and see
        only their ancestors."""
        return self._pass(list(new_ids) + list(tree_tokens), len(tree_tokens) + 1, parents=tree_parents)

    def keep_tree_path(self, n_new: int, path: Sequence[int], tree_tokens: Sequence[int]) -> None:
        """Move the accepted path's cache entries next to the committed ones, drop the rest."""
        base = len(self.tokens) - len(tree_tokens)
        self.rows.keep_path(0, base, path)
        self.tokens = self.tokens[:base] + [tree_tokens[node] for node in path]

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def fresh(self) -> FastLlamaLM:
        """Another view of the same (fused, possibly quantized) weights with an empty cache of
        its own: nothing is fused or quantized again."""
        return FastLlamaLM(self.rows.model, self.rows.name, rows=self.rows.view(1))

