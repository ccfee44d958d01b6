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

`HFCausalLM` adapts any Hugging Face causal LM with a croppable cache (loaded by
`specdec.wiring`); `specdec.toy`
has table-based models behind the same interface, whose exact distributions are known.
"""

from __future__ import annotations

import contextlib
import copy
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


class HFCausalLM:
    """A Hugging Face causal LM with a `DynamicCache`, batch size 1."""

    offers_hidden = True  # its .model.model is the decoder stack, its lm_head the head

    def __init__(self, model: Any, name: str, vocab_size: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model.eval()
        self.name = name
        self.vocab_size = vocab_size or model.config.vocab_size
        self.max_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._cache_cls = DynamicCache
        self.device = next(model.parameters()).device
        self.n_layers = int(model.config.num_hidden_layers)  # early exit may stop after any of them
        self._stacks: dict[int, Any] = {}  # early exit: the decoder stack cut to L layers, by L
        self.reset()

    def _stack(self, layers: int) -> Any:
        """The decoder stack running only its first `layers` layers: a shallow copy of the
        model's stack (the same layer modules and weights) with a config copy of its own, so
        early exit never edits the model's shared config."""
        if layers not in self._stacks:
            stack = copy.copy(self.model.model)  # a new __dict__: the same submodules and weights
            stack.config = copy.copy(self.model.config)
            stack.config.num_hidden_layers = layers
            self._stacks[layers] = stack
        return self._stacks[layers]

    def fresh(self) -> HFCausalLM:
        """Another view of the same weights with its own, empty cache."""
        return HFCausalLM(self.model, self.name, self.vocab_size)

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)
        self.tokens: list[int] = []
        self.forward_calls = 0

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor:
        """Append new_ids (n,) to the cache; logits (n_logits, V) for the last n_logits of them."""
        start = len(self.tokens)
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(new_ids), device=self.device)[None]
        out = self.model(input_ids=input_ids, position_ids=positions, cache=self.cache, use_cache=True,
                         logits_to_keep=n_logits)
        self.tokens.extend(new_ids)
        self.forward_calls += 1
        return out.logits[0, -n_logits:, : self.vocab_size].float()

    def embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()

    def head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()[: self.vocab_size]

    @torch.inference_mode()
    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, also returning the last hidden states (n_logits, D), after the final norm."""
        start = len(self.tokens)
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(new_ids), device=self.device)[None]
        out = self.model.model(input_ids=input_ids, position_ids=positions, cache=self.cache, use_cache=True)
        hidden = out.last_hidden_state[0, -n_logits:]
        logits = self.model.lm_head(hidden)
        self.tokens.extend(new_ids)
        self.forward_calls += 1
        return logits[:, : self.vocab_size].float(), hidden.float()

    @torch.inference_mode()
    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor:
        """Append new_ids (a chain) then a token tree, in one call, with a tree attention mask.

        Returns logits (1 + N, V): after the last of new_ids, then after each tree node.
        The tree's cache entries stay until `keep_tree_path` keeps the accepted path.
        """
        positions, allowed = tree_layout(len(self.tokens), len(new_ids), tree_parents)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        input_ids = torch.tensor([list(new_ids) + list(tree_tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, position_ids=positions[None].to(self.device),
                         attention_mask=mask[None, None].to(self.device), cache=self.cache, use_cache=True)
        self.tokens.extend(list(new_ids) + list(tree_tokens))
        self.forward_calls += 1
        return out.logits[0, len(new_ids) - 1 :, : self.vocab_size].float()

    def keep_tree_path(self, n_new: int, path: Sequence[int], tree_tokens: Sequence[int]) -> None:
        """After forward_tree: keep the chain and the accepted path's entries, drop the rest."""
        base = len(self.tokens) - len(tree_tokens)
        keep = torch.tensor(list(range(base)) + [base + node for node in path], device=self.device)
        layers: list[Any] = list(self.cache.layers)
        for layer in layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        self.tokens = self.tokens[:base] + [tree_tokens[node] for node in path]

    @torch.inference_mode()
    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor:
        """Self-speculation: new_ids through the first `layers` layers and the model's own
        head; logits (V,) of the last. Entries go to the first L cache layers only, past
        the committed tokens, until `end_early_exit` cuts them off."""
        feature = self.early_exit_features(new_ids, layers)
        return self.model.lm_head(feature.to(self.model.lm_head.weight.dtype))[0, : self.vocab_size].float()

    @torch.inference_mode()
    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor:
        """What the head would read after the first `layers` layers (their output through the
        final norm), (n_last, D) for the last n_last new ids."""
        start = self.cache.get_seq_length()  # layer 0 holds committed + earlier draft entries
        positions = torch.arange(start, start + len(new_ids), device=self.device)[None]
        out = self._stack(layers)(input_ids=torch.tensor([list(new_ids)], device=self.device),
                                  position_ids=positions, cache=self.cache, use_cache=True)
        self.forward_calls += 1
        return out.last_hidden_state[0, -n_last:].float()

    def end_early_exit(self, committed: int) -> None:
        layers: list[Any] = list(self.cache.layers)
        for layer in layers:
            extra = layer.get_seq_length() - committed
            if extra > 0:
                layer.crop(-extra)

    def truncate(self, n: int) -> None:
        drop = len(self.tokens) - n
        if drop > 0:
            self.cache.crop(-drop)
            del self.tokens[n:]
