"""The one model protocol: a language model as the loop sees it (`LM`).

A model has `slots` independent KV caches written by position. `forward(slots, starts, new_ids,
n_logits)` puts row b's new ids into cache slot slots[b] at positions starts[b].., seeing that
slot's first starts[b] entries (what lies past them, a rejected draft, is overwritten or dropped:
rolling back is writing by position), and returns logits for the last n_logits[b] of them.
Token trees, hidden states for feature prophets and early exits are arguments of the same two
calls. `view(slots)` gives the same weights with caches of its own.

A model family or backend is one file implementing it: `specdec.llama.BatchLlama` (the lean
path: Llama and the families of `specdec.families`, every row of a step in one batched pass),
`specdec.hf.HFLM` (any other transformers model, rows in turn), `specdec.toy.MarkovLM` (tables
whose exact distributions are known, for the statistical tests). `specdec.sequence.OneSequence`
drives any of them as one growing sequence (training, tools, tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Where the loop's attention may run while it steps on `device`. On CUDA, PyTorch would take
    cuDNN's attention for bfloat16 on recent GPUs, and cuDNN builds an execution plan for every
    new key length (tens of ms each on the host): speculation meets a new length every round
    and a prophet at every draft step, so drafts took 35 ms a call on an H200 (the same call
    1.5 ms where every length had been met before). Flash, memory-efficient and plain attention
    need no plan. Elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class LM(Protocol):
    """A model with `slots` independent caches, written by position (see the module doc)."""

    name: str
    vocab_size: int  # token ids scored (the vocabulary shared with the tokenizer)
    max_length: int  # context limit in tokens
    slots: int
    offers_hidden: bool  # whether forward_features' hidden states are the head's input (feature prophets)
    forward_calls: int  # passes run (a statistic)

    @property
    def device(self) -> torch.device: ...  # where its weights and caches live; logits come back there

    @property
    def n_layers(self) -> int: ...

    def view(self, slots: int) -> LM:
        """The same weights (nothing loaded, fused or quantized again), `slots` empty caches of its own."""
        ...

    def free(self, slot: int) -> None:
        """Return a slot's cache memory: its request has left."""
        ...

    def forward(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                n_logits: Sequence[int], trees: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
        """Row b: new_ids[b] into cache slot slots[b] at positions starts[b].., seeing that
        slot's first starts[b] entries. Returns logits (B, max(n_logits), V): entry j of row b
        is after its new token len(new_ids[b]) - n_logits[b] + j; entries past n_logits[b] are padding.
        trees[b]: the parents of a token tree ending row b's new ids (`tree_layout`): logits
        after the chain's last token and after each node."""
        ...

    def forward_features(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                         n_logits: Sequence[int], layers: int | None = None, head: bool = True,
                         trees: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, also returning the hidden states (B, max(n_logits), D) the head read;
        layers: the first ones only (an early exit: entries of the first `layers` layers only,
        provisional until the slot is next written from a committed position; head=False:
        features only)."""
        ...

    def keep_path(self, slot: int, base: int, path: Sequence[int]) -> None:
        """After a tree pass: the accepted nodes' entries moved to base, base + 1, ..."""
        ...

    def embeddings(self) -> Any: ...  # (V, D) input embedding table (indexed by ids)

    def head(self) -> torch.Tensor: ...  # (V, D) float output head; logits = hidden @ head.T


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def tree_depths(tree_parents: Sequence[int]) -> list[int]:
    """Each node's depth in a token tree (a root's child: 1); parents come before children."""
    depth: list[int] = []
    for par in tree_parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def tree_layout(start: int, n_new: int, tree_parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention for scoring a chain of n_new tokens then a token tree after
    `start` cached tokens. A node sits at (chain end + its depth) and sees the cache, the
    chain, itself and its ancestors, never its siblings.
    Returns positions (n_new + N,) int64 and allowed (n_new + N, start + n_new + N) bool."""
    n_tree, depth = len(tree_parents), tree_depths(tree_parents)
    positions = torch.tensor(list(range(start, start + n_new)) + [start + n_new - 1 + d for d in depth])
    allowed = torch.zeros(n_new + n_tree, start + n_new + n_tree, dtype=torch.bool)
    allowed[:, : start + n_new] = True
    allowed[:n_new, start : start + n_new] = torch.ones(n_new, n_new, dtype=torch.bool).tril()
    for i in range(n_tree):
        node = i
        while node >= 0:
            allowed[n_new + i, start + n_new + node] = True
            node = tree_parents[node]
    return positions, allowed
