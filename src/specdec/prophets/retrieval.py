"""A search engine as the prophet (REST-style retrieval drafting).

The datastore is a token corpus (by default the bundled models' training split of the
stdlib) indexed by a suffix array truncated to its first WIDTH tokens: every position of
the corpus, sorted by the WIDTH tokens that start there. Two packed 64-bit keys per
position (tokens 0-3 and 4-7, 16 bits each) turn a prefix lookup into two `searchsorted`
calls. A draft finds the longest suffix of the context (up to WIDTH tokens) that occurs in
the corpus, then extends it greedily with the most frequent next token among the
occurrences. Deterministic: q is one-hot.

With no datastore (`--draft retrieval:context`), each request's own context is the corpus: a
suffix array over the prompt and what it has generated, built when the prophet is asked and
the context has grown (a sort of a few hundred to a few thousand tokens, well under a
millisecond), its ids renumbered densely so that any vocabulary fits the 16-bit keys. Beside
prompt lookup (`ngram`, the latest occurrence of the last 2-4 tokens, copied), it continues
the longest match of up to WIDTH tokens with the continuation seen most often, token by token,
so that in a token tree the two propose different branches where a context repeats with
variations.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specdec.defaults import cache_dir
from specdec.prophets.base import BatchDraft, Budget, Prophet
from specdec.request import Request

WIDTH = 8  # tokens the suffix array is sorted by; longer matches are not distinguished
HALF = WIDTH // 2
PAD = 0xFFFF  # positions past the end of the corpus sort last


def _packed(tokens: np.ndarray, offset: int) -> np.ndarray:
    """key[i] = tokens[i+offset .. i+offset+3] packed big-endian, 16 bits each. (N,) uint64."""
    n = len(tokens)
    padded = np.concatenate([tokens.astype(np.uint64), np.full(WIDTH, PAD, dtype=np.uint64)])
    key = np.zeros(n, dtype=np.uint64)
    for j in range(HALF):
        key = (key << np.uint64(16)) | padded[offset + j : offset + j + n]
    return key


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Positions sorted by their first WIDTH tokens. tokens (N,) < 65535 -> (N,) int64."""
    if len(tokens) and int(tokens.max()) >= PAD:
        raise ValueError("the retrieval datastore stores token ids below 65535")
    return np.lexsort((_packed(tokens, HALF), _packed(tokens, 0)))


class Datastore:
    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray) -> None:
        self.tokens = tokens.astype(np.int64)
        self.sa = suffix_array
        self.key_hi = _packed(tokens, 0)[suffix_array]
        self.key_lo = _packed(tokens, HALF)[suffix_array]

    @classmethod
    def build(cls, tokens: np.ndarray) -> Datastore:
        return cls(tokens, build_suffix_array(tokens))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, tokens=self.tokens.astype(np.uint16), sa=self.sa.astype(np.int32))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Datastore:
        data = np.load(path)
        return cls(data["tokens"], data["sa"].astype(np.int64))

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """[lo, hi) of suffix-array rows whose first len(pattern) <= WIDTH tokens equal pattern."""
        m = len(pattern)
        hi_pat = list(pattern[:HALF])
        lo_key = hi_key = 0
        for j in range(HALF):
            t = hi_pat[j] if j < len(hi_pat) else None
            lo_key = (lo_key << 16) | (t if t is not None else 0)
            hi_key = (hi_key << 16) | (t if t is not None else 0xFFFF)
        lo = int(np.searchsorted(self.key_hi, np.uint64(lo_key), "left"))
        hi = int(np.searchsorted(self.key_hi, np.uint64(hi_key), "right"))
        if m <= HALF or lo >= hi:
            return lo, hi
        rest = list(pattern[HALF:])
        lo_key = hi_key = 0
        for j in range(HALF):
            t = rest[j] if j < len(rest) else None
            lo_key = (lo_key << 16) | (t if t is not None else 0)
            hi_key = (hi_key << 16) | (t if t is not None else 0xFFFF)
        sub = self.key_lo[lo:hi]
        return lo + int(np.searchsorted(sub, np.uint64(lo_key), "left")), lo + int(
            np.searchsorted(sub, np.uint64(hi_key), "right"))

    def next_tokens(self, lo: int, hi: int, m: int, sample_cap: int = 2048) -> tuple[int, int]:
        """Most frequent token following the m-token match in rows [lo, hi), and its count."""
        rows = self.sa[lo:hi] if hi - lo <= sample_cap else self.sa[np.linspace(lo, hi - 1, sample_cap).astype(int)]
        nxt = rows + m
        nxt = nxt[nxt < len(self.tokens)]
        if not len(nxt):
            return -1, 0
        values, counts = np.unique(self.tokens[nxt], return_counts=True)
        best = int(counts.argmax())
        return int(values[best]), int(counts[best])


class RetrievalProphet(Prophet):
    is_lookup = True

    def __init__(self, store: Datastore | None, min_match: int = 2, min_count: int = 1,
                 name: str = "retrieval") -> None:
        self.store, self.min_match, self.min_count, self.name = store, min_match, min_count, name

    def _longest_match(self, store: Datastore, context: Sequence[int]) -> list[int]:
        """The longest suffix of the context (at most WIDTH tokens) with an occurrence in the
        store that a token follows (of two occurrences one at least has one: only the store's
        end has none)."""
        for m in range(min(WIDTH, len(context)), self.min_match - 1, -1):
            pattern = list(context[-m:])
            lo, hi = store.find(pattern)
            if hi - lo > 1 or hi > lo and store.sa[lo] + m < len(store.tokens):
                return pattern
        return []

    def lookup(self, context: Sequence[int], k: int, store: Datastore | None = None) -> list[int]:
        """Up to k tokens continuing the context's longest match in the datastore (or `store`)."""
        store = store if store is not None else self.store
        if store is None:
            return []
        pattern = self._longest_match(store, context)
        tokens: list[int] = []
        while pattern and len(tokens) < k:
            lo, hi = store.find(pattern)
            token, count = store.next_tokens(lo, hi, len(pattern))
            if token < 0 or count < self.min_count:
                break
            tokens.append(token)
            pattern = (pattern + [token])[-WIDTH:]
        return tokens

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], budget: Budget | None = None) -> BatchDraft:
        return BatchDraft([(self.lookup(r.context, k) if self.store is not None else self._own(r, k)) if k else []
                           for r, k in zip(reqs, ks, strict=True)], None)

    def _own(self, req: Request, k: int) -> list[int]:
        """Up to k tokens from the suffix array over the request's own context (no datastore):
        its ids renumbered 0..n-1 in the store, kept in the request and built again when the
        context has grown."""
        n = req.length
        kept = req.lookups.get(self.name)
        if not (isinstance(kept, tuple) and kept[0] == n):
            ids, local = np.unique(np.asarray(req.context, dtype=np.int64), return_inverse=True)
            if len(ids) >= PAD:  # more distinct ids than 16-bit keys hold: nothing to draft
                return []
            kept = req.lookups[self.name] = (n, ids, Datastore.build(local.astype(np.uint16)))
        _, ids, store = kept
        local = store.tokens[-min(WIDTH, n):].tolist()  # the context's end, renumbered as the store is
        return ids[self.lookup(local, k, store)].tolist()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


def default_index_path(tokenizer: Any) -> Path:
    return cache_dir() / f"retrieval-stdlib-{tokenizer_fingerprint(tokenizer)}.npz"


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def build_default_datastore(tokenizer: Any, out: Path, heldout_percent: float = 4,
                            seed: str = "specdec-split-v1", log: Any = None) -> Datastore:
    """Tokenize the training split of the stdlib (never the held-out files) and index it."""
    from rich.console import Console
    from rich.progress import Progress

    from specdec.data.corpus import list_files, read_text

    files = [f for f in list_files(heldout_percent, seed) if not f.heldout]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenizing the corpus", total=len(files))
        for i in range(0, len(files), 64):
            texts = [t for t in (read_text(f.path) for f in files[i : i + 64]) if t]
            for enc in tokenizer(texts, verbose=False)["input_ids"]:
                ids.extend(enc)
                ids.append(eos)
            bar.update(task, advance=len(files[i : i + 64]))
        task2 = bar.add_task(f"sorting {len(ids):,} suffixes", total=1)
        store = Datastore.build(np.asarray(ids, dtype=np.uint16))
        bar.update(task2, advance=1)
    store.save(out)
    (log or _note)(f"retrieval datastore: {len(ids):,} tokens from {len(files)} files -> {out}")
    return store
