"""Any transformers causal LM as a `specdec.lm.LM` (`HFLM`): transformers' own forward, a cache
specdec can roll back, one per slot (`HFSequence`), rows scored in turn (`specdec.rows.RowsLM`).

Speculation writes a draft's keys and values, then drops the rejected ones (`truncate`), keeps a
token tree's accepted path (`keep_tree_path`) and cuts an early exit's provisional entries
(`end_early_exit`); the step-cost calibration does the same on its timed passes. Of the cache
layers transformers builds, only a full-length `DynamicLayer` gives back exactly the entries
before any position, at any length:
- a sliding-window layer (`DynamicSlidingWindowLayer`: Mistral, Qwen2 with use_sliding_window,
  Gemma 2/3, Phi-3 with sliding_window) evicts what falls out of its window, so once a context
  is past the window a crop cannot restore it ("Call `activate_past_recording` before `crop`");
  recording the past keeps the evicted entries only until the next crop, not across rounds;
- a static layer (`cache_implementation="static"` or "hybrid") is sized in advance, and its
  sliding variant is a ring that cannot be cropped once it has wrapped;
- a quantized layer (`cache_implementation="quantized"`) re-quantizes its residual block as it
  fills, so a crop cannot give back the values it held (transformers: `is_croppable = False`).
So `HFSequence` keeps a `DynamicCache` of full-length layers of its own, whatever the model's
generation config asks `generate` to build, and a sliding layer sees only its window through
the attention mask: transformers builds the sliding-window mask from absolute positions for a
full-length layer, and a token tree's mask is built here, windowed the same way
(`tree_masks`). The price: a sliding layer keeps every position, as a full layer does (memory
linear in the context, as the full layers' already is), and attends over them masked.

Layers that keep some other state (linear attention, state-space and convolution layers,
chunked attention, layers reading another layer's cache) cannot be rolled back this way;
`attention_layout` refuses such a model when it loads, in one line.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from specdec.errors import ModelLoadError
from specdec.lm import tree_layout
from specdec.rows import RowsLM

ROLLBACK_LAYERS = ("full_attention", "sliding_attention")  # layer kinds whose keys/values a full-length cache holds


def attention_layout(config: Any, name: str = "model") -> tuple[list[str], int | None, bool]:
    """What the decoder's attention looks like, as transformers reads its config: each layer's
    kind ("full_attention" or "sliding_attention"), the sliding window (None: no layer slides)
    and whether the model reads one attention mask per layer kind (a config with `layer_types`:
    Qwen2/3, Gemma 2/3) or one for every layer (Llama, Mistral, Phi-3). A layer of any other
    kind is a `ModelLoadError` naming it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    declared = getattr(text, "layer_types", None)
    try:
        kinds = list(get_layer_types_and_kwargs(text)[0])
    except (AttributeError, KeyError, TypeError, ValueError):  # a config transformers' caches do not read
        kinds = list(declared) if declared is not None else ["full_attention"]
    other = sorted(set(kinds) - set(ROLLBACK_LAYERS))
    if other:
        raise ModelLoadError(
            f"'{name}' ({getattr(text, 'model_type', '?')}) has {', '.join(other)} layers, whose state specdec cannot "
            f"roll back after a rejected draft; it runs models whose layers are full or sliding-window attention")
    window = getattr(text, "sliding_window", None) if "sliding_attention" in kinds else None
    return kinds, (int(window) if window else None), declared is not None


class HFSequence:
    """One sequence of a transformers causal LM: a full-length `DynamicCache` of its own, batch
    size 1 (a `specdec.rows.RowState`)."""

    offers_hidden = True  # its output embeddings are the head; forward_features reads what they read

    def __init__(self, model: Any, name: str, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.name = name
        self.vocab_size = vocab_size or model.config.vocab_size
        text = model.config.get_text_config(decoder=True)
        self.max_length = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
        self.layer_kinds, self.window, self.mask_per_kind = attention_layout(model.config, name)
        self.device = next(model.parameters()).device
        self.n_layers = int(text.num_hidden_layers)  # early exit may stop after any of them
        self._stacks: dict[int, Any] = {}  # early exit: the decoder stack cut to L layers, by L
        self.reset()

    def _stack(self, layers: int) -> Any:
        """The decoder stack running only its first `layers` layers: a shallow copy of the
        model's stack (the same layer modules and weights) with a config copy of its own, so
        early exit never edits the model's shared config."""
        if layers not in self._stacks:
            stack = copy.copy(self.model.get_decoder())  # a new __dict__: the same submodules and weights
            stack.config = copy.copy(stack.config)
            stack.config.num_hidden_layers = layers
            self._stacks[layers] = stack
        return self._stacks[layers]

    def fresh(self) -> HFSequence:
        """Another view of the same weights with its own, empty cache."""
        return HFSequence(self.model, self.name, self.vocab_size)

    def reset(self) -> None:
        from transformers import DynamicCache

        # no config: every layer a full-length DynamicLayer (see the module's docstring)
        self.cache = DynamicCache()
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
        """As forward, also returning the hidden states (n_logits, D) the head read (after the
        final norm). The logits are the model's own, with whatever follows its head (Gemma's
        soft-capping)."""
        read: list[torch.Tensor] = []
        hook = self.model.get_output_embeddings().register_forward_hook(lambda mod, args, out: read.append(args[0]))
        try:
            logits = self.forward(new_ids, n_logits)
        finally:
            hook.remove()
        return logits, read[-1][0, -n_logits:].float()

    def tree_masks(self, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive attention masks (1, 1, n, L) for a tree pass from `tree_layout`'s positions
        (n,) and allowed (n, L): as it is for full layers, and for sliding layers also within
        the window counted from positions, as transformers' own mask counts it (a key at
        position k is seen from position q when q - k < window); a node's ancestors sit at
        their own positions, so a node sees what it would see at the end of a chain. One mask,
        or one per layer kind for a model that reads them so."""
        dtype = self.model.dtype

        def additive(ok: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)
            return mask[None, None].to(self.device)

        if self.window is None:
            return additive(allowed)
        cached = allowed.shape[1] - len(positions)
        keys = torch.cat([torch.arange(cached), positions])  # (L,) each key's position: the cache's, then the pass's
        near = allowed & (positions[:, None] - keys[None, :] < self.window)
        if not self.mask_per_kind:
            return additive(near)
        return {"full_attention": additive(allowed), "sliding_attention": additive(near)}

    @torch.inference_mode()
    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor:
        """Append new_ids (a chain) then a token tree, in one call, with a tree attention mask.

        Returns logits (1 + N, V): after the last of new_ids, then after each tree node.
        The tree's cache entries stay until `keep_tree_path` keeps the accepted path.
        """
        positions, allowed = tree_layout(len(self.tokens), len(new_ids), tree_parents)
        input_ids = torch.tensor([list(new_ids) + list(tree_tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, position_ids=positions[None].to(self.device),
                         attention_mask=self.tree_masks(positions, allowed), cache=self.cache, use_cache=True)
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
        head = self.model.get_output_embeddings()
        return head(feature.to(head.weight.dtype))[0, : self.vocab_size].float()

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


class HFLM(RowsLM):
    """A transformers causal LM as an `LM`: `slots` sequences of its own (`HFSequence`), rows
    scored one after another through transformers' forward."""

    def __init__(self, model: Any, name: str, vocab_size: int | None = None, slots: int = 1) -> None:
        super().__init__(HFSequence(model, name, vocab_size), slots)
        self.model = model


__all__ = ["HFLM", "HFSequence", "attention_layout"]
