"""Prompt prefix caching: the target's keys and values of prompt prefixes that earlier
requests read, kept by blocks and copied into a new request's cache slot instead of read
again (multi-turn chat re-sends the whole conversation; many requests share a system prompt
or a document).

Exactness. A prompt's leading positions attend in blocks whose ends
`defaults.attention_block_end` gives (multiples of the target's attention chunk, and of
`FINE_BLOCK` within the first chunk: `attention.exact_attention`), and every product computes
each row alone (the same bits at any row count), so the keys and values at positions [0, L)
depend on tokens [0, L) only, whenever L is such an end. The cache keeps exactly such
prefixes: blocks between consecutive ends (8 positions within the first chunk, so that a
chat template's system turn is kept, then chunks), each keyed by its own
tokens and its parent block (so a key is the whole prefix, compared token for token, never by
a hash alone), taken only from positions a prompt pass computed (never from generated tokens,
which one-token steps compute). A request that finds its first L positions here starts at L
and reads the rest as it would have: the same keys and values, the same logits, the same
tokens (tested against the same requests with no cache).

Memory: at most `max_bytes` (least recently used blocks go first; a lookup refreshes the
blocks it uses, deepest first, so a prefix's parents are never dropped before its children)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.defaults import attention_block_end, attention_block_floor

_Key = tuple[int, tuple[int, ...]]  # (parent block's id, 0 for none; this block's tokens)


@dataclass
class _Block:
    id: int
    keys: torch.Tensor  # (layers, kv heads, block, head dim)
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class PrefixStats:
    lookups: int = 0  # looks (a row waiting to read its prompt looks again each step)
    hits: int = 0  # looks that found at least one block (a row that finds some stops looking)
    hit_tokens: int = 0  # prompt positions not read again
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of prompt keys and values by prefix, within `max_bytes` (see the module)."""

    def __init__(self, block: int, max_bytes: int) -> None:
        """block: the target's attention chunk (the blocks end where its prompt blocks do)."""
        if block < 1:
            raise ValueError("the prefix cache's block must be >= 1 position")
        if max_bytes < 0:
            raise ValueError("the prefix cache's size must be >= 0 bytes")
        self.block, self.max_bytes = block, max_bytes
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()  # least recently used first
        self._next_id = 1
        self.nbytes = 0
        self.stats = PrefixStats()
        self._lock = threading.Lock()  # engines of one decoder share a cache, each stepping in its own thread

    def __len__(self) -> int:
        return len(self._blocks)

    def spans(self, limit: int) -> list[tuple[int, int]]:
        """The blocks [a, b) of positions [0, limit), whole ones only."""
        out, a = [], 0
        while (b := attention_block_end(a, self.block)) <= limit:
            out.append((a, b))
            a = b
        return out

    def usable(self, prompt_len: int) -> int:
        """The longest prefix a prompt of this length may take from here or give to it: whole
        blocks, leaving at least its last token to be read (its logits start the answer)."""
        return attention_block_floor(max(prompt_len - 1, 0), self.block)

    def _refresh(self, path: Sequence[_Key]) -> None:
        for key in reversed(path):  # deepest first: a parent ends up more recent than its children
            self._blocks.move_to_end(key)

    def lookup(self, tokens: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The longest cached prefix of `tokens` that `usable` allows: its length and its
        blocks' (keys, values), in order."""
        with self._lock:
            return self._lookup(tokens)

    def _lookup(self, tokens: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        self.stats.lookups += 1
        path: list[_Key] = []
        parent = 0
        end = 0
        for a, b in self.spans(len(tokens) - 1):
            key = (parent, tuple(tokens[a:b]))
            found = self._blocks.get(key)
            if found is None:
                break
            path.append(key)
            parent, end = found.id, b
        self._refresh(path)
        if path:
            self.stats.hits += 1
            self.stats.hit_tokens += end
        return end, [(self._blocks[k].keys, self._blocks[k].values) for k in path]

    def store_rows(self, target: Any, reqs: Sequence[Any]) -> None:
        """Rows (`Request`s holding a slot of `target`) whose prompt a prompt pass has read (all
        but its last token, at least to the last whole block) give its blocks to the cache, once."""
        for r in reqs:
            if r.slot is None or r.prefix_stored or r.target_cached < self.usable(len(r.prompt)):
                continue
            r.prefix_stored = True
            kv = target.slot_kv(r.slot)
            if kv is not None and self.usable(len(r.prompt)) > r.prefix_hit:
                end = self.usable(len(r.prompt))
                self.store(r.prompt, kv[0][:, :, :end], kv[1][:, :, :end])

    def take_rows(self, target: Any, reqs: Sequence[Any]) -> None:
        """Rows that hold a slot of `target` but have read nothing of their prompt yet start from
        the longest prefix kept for it: at admission, and again each step while they wait for
        their turn to prefill (a row sharing a document with the row being prefilled starts past it)."""
        for r in reqs:
            if r.slot is not None and r.target_cached == 0 and self.usable(len(r.prompt)) > 0:
                n, blocks = self.lookup(r.prompt)
                if n:
                    r.target_cached = r.prefix_hit = target.load_prefix(r.slot, blocks)

    def store(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> int:
        """Keep the whole blocks of prompt `tokens` that a prompt pass computed into keys and
        values ((layers, kv heads, >= positions, head dim): positions [0, keys.shape[2])) and
        that are not here yet, within `max_bytes`. Returns the blocks added."""
        with self._lock:
            return self._store(tokens, keys, values)

    def _store(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> int:
        path: list[_Key] = []
        kept, added, parent = 0, 0, 0
        for a, b in self.spans(min(len(tokens) - 1, keys.shape[2])):
            key = (parent, tuple(tokens[a:b]))
            found = self._blocks.get(key)
            if found is None:
                nbytes = 2 * keys[:, :, a:b].numel() * keys.element_size()
                if kept + nbytes > self.max_bytes:
                    break  # the prefix itself would not fit
                found = _Block(self._next_id, keys[:, :, a:b].clone(), values[:, :, a:b].clone())
                self._next_id += 1
                self._blocks[key] = found
                self.nbytes += found.nbytes
                self.stats.stored_blocks += 1
                added += 1
            path.append(key)
            kept += found.nbytes
            parent = found.id
        self._refresh(path)
        self._evict(set(path))
        return added

    def _evict(self, keep: set[_Key]) -> None:
        """Least recently used blocks out until the cache fits (never one of `keep`)."""
        for key in [k for k in self._blocks if k not in keep]:
            if self.nbytes <= self.max_bytes:
                break
            block = self._blocks.pop(key)
            self.nbytes -= block.nbytes
            self.stats.evicted_blocks += 1

    def resize(self, max_bytes: int) -> None:
        """A new size; blocks beyond it go, least recently used first."""
        with self._lock:
            self.max_bytes = max_bytes
            self._evict(set())

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0


__all__ = ["PrefixCache", "PrefixStats"]
