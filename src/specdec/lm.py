"""Language models as the engine sees them: score tokens, own a KV cache, roll it back.

The engine never touches a model directly; it talks to a `CausalLM`:
- `tokens` are the ids whose keys/values are cached (a prefix of the context);
- `forward(new_ids, n_logits)` appends `new_ids` and returns logits for the last
  `n_logits` of them (teacher forcing: K drafted tokens are scored in one call);
- `forward_tree(...)` scores a token tree in one call (several prophets);
- `truncate(n)` rolls the cache back to its first n tokens (rejected tokens are dropped).

`sync(context)` keeps the invariant used by the engine: after it, the cache holds the
longest common prefix of its tokens and the context, but never the whole context, so
the next forward always has at least one token to produce the next distribution from.

`specdec.hf.HFCausalLM` adapts any transformers causal LM (loaded by `specdec.wiring`);
`specdec.llama.FastLlamaLM` is the lean Llama path; `specdec.toy` has table-based models behind
the same interface, whose exact distributions are known.
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


class CausalLM(Protocol):
    name: str
    vocab_size: int  # number of token ids scored (the shared vocabulary)
    max_length: int  # context limit in tokens
    tokens: list[int]  # ids whose keys/values are in the cache
    forward_calls: int
    @property
    def device(self) -> torch.device: ...  # where its weights and caches live; logits come back there


    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor: ...  # (n_logits, V)

    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor: ...  # (1 + N, V)

    def truncate(self, n: int) -> None: ...

    def fresh(self) -> CausalLM: ...  # another view of the same weights with its own, empty cache

    offers_hidden: bool  # whether forward_features, embeddings and head are available (feature prophets)

    def embeddings(self) -> torch.Tensor: ...  # (V, D) input embedding matrix

    def head(self) -> torch.Tensor: ...  # (V, D) output head; logits = hidden @ head.T

    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, also returning the last hidden states (n_logits, D), after the final norm."""
        ...

    def keep_tree_path(self, n_new: int, path: Sequence[int], tree_tokens: Sequence[int]) -> None: ...

    @property
    def n_layers(self) -> int: ...

    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor:
        """Self-speculation: logits (V,) after the first `layers` layers and the final norm
        and head; cache entries past the committed tokens until end_early_exit."""
        ...

    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor:
        """As early_exit, the (n_last, D) features the head would read instead of logits."""
        ...

    def end_early_exit(self, committed: int) -> None: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def sync(lm: CausalLM, context: Sequence[int]) -> list[int]:
    """Roll lm's cache back to what context shares with it; return the ids still to feed."""
    keep = min(common_prefix(lm.tokens, context), len(context) - 1)
    if keep < len(lm.tokens):
        lm.truncate(keep)
    return list(context[keep:])


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
