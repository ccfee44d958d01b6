"""Table-based language models whose exact output distribution is computable.

A `MarkovLM` is a random Markov chain of order `order` over a small vocabulary, behind
the same model protocol as a real model (`specdec.lm.LM`: slots, rows, trees, early exits),
one `MarkovSequence` per slot.
`sequence_distribution` enumerates every continuation of a given length with its exact
probability under given sampling settings: the ground truth for the statistical tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from specdec.rows import RowsLM
from specdec.sampling import SamplingParams, logits_to_probs


class MarkovSequence:
    """One sequence of a Markov chain (a `specdec.rows.RowState`): its tokens are its cache."""

    offers_hidden = True
    FEATURE_DIM = 8
    n_layers = 2  # for self-speculation on toy models: "layer 1" of 2 is a pseudo-random feature

    def __init__(self, table: torch.Tensor, name: str = "markov", max_length: int = 1 << 20) -> None:
        """table (V,)*order + (V,): logits of the next token given the last `order` tokens."""
        self.table = table.float()
        self.device = self.table.device  # logits, features, embeddings and head all come from here
        self.order = table.dim() - 1
        self.vocab_size = table.shape[-1]
        self.name = name
        self.max_length = max_length
        self.tokens: list[int] = []
        self.forward_calls = 0

    def logits_after(self, context: Sequence[int]) -> torch.Tensor:
        """(V,) logits of the next token; missing history is padded with token 0."""
        hist = [0] * max(0, self.order - len(context)) + list(context[-self.order :])
        return self.table[tuple(hist)]

    def forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor:
        start = len(self.tokens)
        self.tokens.extend(new_ids)
        self.forward_calls += 1
        rows = [self.logits_after(self.tokens[: i + 1]) for i in range(start, len(self.tokens))]
        return torch.stack(rows[-n_logits:])

    def feature_after(self, context: Sequence[int]) -> torch.Tensor:
        """(FEATURE_DIM,) a fixed pseudo-random feature of the last `order` tokens, so that
        feature prophets can run on toy models (their q is arbitrary; exactness is not)."""
        hist = [0] * max(0, self.order - len(context)) + list(context[-self.order :])
        g = torch.Generator().manual_seed(1 + sum(t * (self.vocab_size + 1) ** i for i, t in enumerate(hist)))
        return torch.randn(self.FEATURE_DIM, generator=g).to(self.device)

    def embeddings(self) -> torch.Tensor:
        """(V, FEATURE_DIM) fixed pseudo-random embeddings (for feature prophets on toy models)."""
        return self._fixed(7)

    def head(self) -> torch.Tensor:
        return self._fixed(8)

    def _fixed(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.vocab_size, self.FEATURE_DIM, generator=g).to(self.device)

    def forward_features(self, new_ids: Sequence[int], n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = len(self.tokens)
        logits = self.forward(new_ids, n_logits)
        rows = [self.feature_after(self.tokens[: i + 1]) for i in range(start, len(self.tokens))]
        return logits, torch.stack(rows[-n_logits:])

    def forward_tree(self, new_ids: Sequence[int], tree_tokens: Sequence[int],
                     tree_parents: Sequence[int]) -> torch.Tensor:
        first = self.forward(new_ids, 1)
        self.forward_calls -= 1
        base = list(self.tokens)
        rows = [first[0]]
        for i in range(len(tree_tokens)):
            path = []
            node = i
            while node >= 0:
                path.append(tree_tokens[node])
                node = tree_parents[node]
            rows.append(self.logits_after(base + path[::-1]))
        self.tokens.extend(tree_tokens)
        self.forward_calls += 1
        return torch.stack(rows)

    def keep_tree_path(self, n_new: int, path: Sequence[int], tree_tokens: Sequence[int]) -> None:
        base = len(self.tokens) - len(tree_tokens)
        self.tokens = self.tokens[:base] + [tree_tokens[node] for node in path]

    def early_exit_features(self, new_ids: Sequence[int], layers: int, n_last: int = 1) -> torch.Tensor:
        """Early exit on a toy model: a fixed pseudo-random feature of the context (another
        seed than feature_after's), (n_last, FEATURE_DIM); the ids are appended until
        end_early_exit, as on a real model."""
        start = len(self.tokens)
        self.tokens.extend(new_ids)
        self.forward_calls += 1
        rows = [self.feature_after([*self.tokens[: i + 1], layers]) for i in range(start, len(self.tokens))]
        return torch.stack(rows[-n_last:])

    def early_exit(self, new_ids: Sequence[int], layers: int) -> torch.Tensor:
        return self.early_exit_features(new_ids, layers)[0] @ self.head().T

    def end_early_exit(self, committed: int) -> None:
        self.truncate(committed)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def fresh(self) -> MarkovSequence:
        return MarkovSequence(self.table, self.name, self.max_length)

    def reset(self) -> None:
        self.tokens = []
        self.forward_calls = 0


class MarkovLM(RowsLM):
    """A Markov chain as an `LM`: `slots` sequences of its own, rows scored in turn."""

    FEATURE_DIM = MarkovSequence.FEATURE_DIM

    def __init__(self, table: torch.Tensor, name: str = "markov", max_length: int = 1 << 20, slots: int = 1) -> None:
        """table (V,)*order + (V,): logits of the next token given the last `order` tokens."""
        self.chain = MarkovSequence(table, name, max_length)
        super().__init__(self.chain, slots)
        self.table, self.order = self.chain.table, self.chain.order

    @classmethod
    def random(cls, vocab_size: int, order: int = 1, seed: int = 0, sharpness: float = 2.0,
               name: str = "markov") -> MarkovLM:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn((vocab_size,) * (order + 1), generator=g) * sharpness, name)

    def to(self, device: str | torch.device) -> MarkovLM:
        """The same model with its table on `device` (for the device checks)."""
        return MarkovLM(self.table.to(device), self.name, self.max_length, self.slots)

    def blend(self, other: MarkovLM, weight: float, name: str) -> MarkovLM:
        """A prophet close to this model: logits mixed with other's (weight 0 = identical)."""
        return MarkovLM((1 - weight) * self.table + weight * other.table.to(self.device), name, self.max_length)

    def logits_after(self, context: Sequence[int]) -> torch.Tensor:
        """(V,) logits of the next token after `context`."""
        return self.chain.logits_after(context)

    def feature_after(self, context: Sequence[int]) -> torch.Tensor:
        return self.chain.feature_after(context)


def sequence_distribution(lm: MarkovLM, prompt: Sequence[int], length: int,
                          params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` tokens under `params`."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(lm.vocab_size), repeat=length):
        prob = 1.0
        ctx = list(prompt)
        for tok in seq:
            prob *= float(logits_to_probs(lm.logits_after(ctx), params)[tok])
            if prob == 0.0:
                break
            ctx.append(tok)
        if prob > 0:
            out[seq] = prob
    return out
