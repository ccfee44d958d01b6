"""Logits -> the distribution actually sampled from (temperature, top-k, top-p).

Pure functions. The same `SamplingParams` are applied to the target's logits (p) and to
a prophet's logits (q), so that the verifier compares the two distributions that are
really sampled from. Temperature 0 means greedy: the distribution is one-hot on the
argmax (ties broken toward the lowest id, as `torch.argmax` does).

Coupled sampling (`SamplingParams.coupled`, `sampling="coupled"`): the token at absolute
position t is argmax_i p_i / E_i, with E_i exponentials keyed by (seed, t) alone (the
exponential race, the Gumbel-max trick without logarithms): an exact sample of p, whose
random numbers depend on nothing but the seed and the position. The target's choice so made
is a one-hot p for the verifier; a prophet drafting at the same position with the same keyed
numbers proposes the target's own choice whenever q is close to p. The output is then the
seeded plain decoder's, token for token, whatever the prophet, K or batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

_kernels: ModuleType | None = None  # specdec's compiled kernels (`specdec.qgemm`), where loaded


def use_kernels(module: ModuleType | None) -> None:
    """Run `sample`'s scan in these compiled kernels (`kernels/lookup.cpp`; the kernel module calls
    this when it loads them); None: in torch and NumPy (the same operations in the same order)."""
    global _kernels
    _kernels = module


# Called after each drafted token with that step's q (V,): returning False stops drafting
# early (the confidence policy).
KeepDrafting = Callable[[torch.Tensor], bool]


class InvalidLogitsError(ValueError):
    """A model produced NaN or +inf logits, or logits that leave no token to sample."""


SAMPLING_MODES = ("rejection", "coupled")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None  # keep the k most probable tokens; None or 0 = all
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = all
    coupled: int | None = None  # the seed of keyed draws (coupled sampling); None: the request's generator draws

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer (0 or None = off), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.coupled is not None and (not isinstance(self.coupled, int) or isinstance(self.coupled, bool)):
            raise ValueError(f"the coupling seed must be an integer, got {self.coupled!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_logits(logits: torch.Tensor, who: str = "model") -> None:
    """Raise a clear error for logits that cannot define a distribution. logits (..., V)."""
    if math.isfinite(float(logits.detach().float().sum())):  # the usual case, in one cheap pass: no NaN or inf anywhere
        return
    if torch.isnan(logits).any():
        raise InvalidLogitsError(f"{who} produced NaN logits")
    if torch.isposinf(logits).any():
        raise InvalidLogitsError(f"{who} produced +inf logits")
    if torch.isneginf(logits).all(dim=-1).any():
        raise InvalidLogitsError(f"{who} produced logits that are -inf for every token")


def _mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are all kept). (..., V)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def _mask_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches top_p. (..., V)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # A token is kept when the mass strictly before it is below top_p: the first token is always kept.
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, who: str = "model") -> torch.Tensor:
    """The sampling distribution for each row of logits. (..., V) -> (..., V) float32."""
    check_logits(logits, who)
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = _mask_top_k(logits if params.temperature == 1.0 else logits / params.temperature, params.top_k or 0)
    probs = torch.softmax(logits, dim=-1)
    return _mask_top_p(probs, params.top_p)


SAMPLE_BLOCK = 256  # ids per block of the two-level inversion in `sample`
SMALL_ARGMAX = 1 << 20  # `argmax`: elements up to which one thread's NumPy scan beats PyTorch's reduction


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first of equal maxima, as `torch.argmax`): for a small float32 CPU
    tensor (a row alone's logits) by NumPy's one-thread scan, 3 us over SmolLM2's 49,152 ids
    on a 2-core CPU against 43 us for PyTorch's reduction, which wakes its thread pool for
    one row (SMALL_ARGMAX); PyTorch's otherwise. Call after `check_logits` (NaN is not a max)."""
    return torch.from_numpy(_numpy_picks(x)[0]) if _small(x) else x.argmax(-1)


def checked_argmax(logits: torch.Tensor, who: str = "model") -> torch.Tensor:
    """argmax(logits) (..., V) -> (...), with `check_logits`'s errors from the same pass: an
    argmax is the first NaN where there is one, else +inf where there is one, and -inf only
    where every logit of its row is, so a finite maximum everywhere is all that check asks
    (logits fresh from a target's head come from memory, ~30 us a read of SmolLM2's 49,152)."""
    if _small(logits):  # by NumPy, whose calls cost less than PyTorch's right after a step
        picks, tops = _numpy_picks(logits)
        if not np.isfinite(tops).all():
            check_logits(logits, who)
        return torch.from_numpy(picks)
    ids = logits.argmax(-1)
    if not bool(torch.isfinite(logits.gather(-1, ids[..., None])).all()):
        check_logits(logits, who)
    return ids


def _small(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() <= SMALL_ARGMAX and not x.requires_grad


def _numpy_picks(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The argmax of each row of x (..., V) and the values there, by NumPy."""
    a = x.detach().contiguous().numpy()
    picks = a.argmax(-1)
    return picks, np.take_along_axis(a, picks[..., None], -1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row. probs (..., V) -> (...) int64, not necessarily normalized. A
    single row with only one possible token (greedy: one-hot) is that token, without a draw
    from the generator.

    By inversion: one uniform u per row (float64, from the row's generator), and the first id
    whose cumulative mass exceeds u times the row's total, the mass summed in float64 in two
    levels: the totals of blocks of SAMPLE_BLOCK ids (each summed in id order), then within
    the one block where u falls, from the cumulative total before it. A token of probability
    0 is never drawn (its cumulative mass equals its predecessor's). The scan runs in the
    extension (`kernels/lookup.cpp`) where specdec's kernels are loaded, else in torch and NumPy
    (`_sample_totals`, `_sample_pick`): the same operations in the same order, so the same id
    from the same uniform. `torch.multinomial` draws V exponentials for one sample (0.9 ms
    over SmolLM2's 49,152 ids on a 2-core CPU); a draw here ~25 us with the extension, ~215 us
    without it (measured alone, 2-core AMD EPYC Zen 4; the float64 sums added in order cost
    that path ~130 us more than the unordered sums it used before, for the same bits in both)."""
    device = probs.device
    rows = probs.detach().reshape(-1, probs.shape[-1])
    if rows.dtype not in (torch.float32, torch.float64) or device.type != "cpu":  # float64 kept: no mass lost
        rows = (rows if rows.dtype == torch.float64 else rows.float()).cpu()
    rows = rows.contiguous()
    n_rows = rows.shape[0]
    ext = _kernels  # specdec's compiled kernels once a model's loading built them (`use_kernels`)
    totals, single = ext.sample_totals(rows) if ext is not None else _sample_totals(rows)
    one = single.tolist()
    if n_rows == 1 and one[0] >= 0:  # one possible token: no draw
        return torch.tensor(one[0], device=device).reshape(probs.shape[:-1])
    if -2 in one:
        raise ValueError("cannot sample from a row whose probabilities are all 0")
    u = torch.rand(n_rows, generator=generator, dtype=torch.float64, device=device).cpu()
    ids = ext.sample_pick(rows, totals, u) if ext is not None else _sample_pick(rows, totals, u)
    out = ids.reshape(probs.shape[:-1])
    return out if device.type == "cpu" else out.to(device)


def _sample_totals(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s first level without the extension, as it computes it: each row's cumulative
    block totals (R, blocks) float64 (torch's float64 `cumsum` adds in order, as the extension
    does) and its one id with mass (-1: several, -2: none)."""
    n_rows, size = rows.shape
    blocks = -(-size // SAMPLE_BLOCK)
    padded = rows if blocks * SAMPLE_BLOCK == size else torch.nn.functional.pad(rows, (0, blocks * SAMPLE_BLOCK - size))
    sums = torch.cumsum(padded.reshape(n_rows, blocks, SAMPLE_BLOCK), dim=2, dtype=torch.float64)[:, :, -1]
    positive = rows > 0
    count = positive.sum(-1)
    single = torch.where(count == 1, positive.to(torch.uint8).argmax(-1), torch.where(count == 0, -2, -1))
    return torch.cumsum(sums, dim=1), single


def _sample_pick(rows: torch.Tensor, totals: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample`'s second level without the extension, as it computes it: each row's id where
    u times its total falls (the first id whose cumulative mass, added in order from the
    total before its block, exceeds it)."""
    mass, cum, uu = rows.numpy(), totals.numpy(), u.numpy()
    n_rows, blocks = cum.shape
    ids = np.empty(n_rows, dtype=np.int64)
    for r in range(n_rows):
        x = uu[r] * cum[r, -1]
        j = min(int(np.searchsorted(cum[r], x, side="right")), blocks - 1)  # u * total rounded up: the last block
        lo = j * SAMPLE_BLOCK
        block = mass[r, lo: lo + SAMPLE_BLOCK].astype(np.float64)
        within = np.cumsum(np.concatenate(([cum[r, j - 1] if j else 0.0], block)))[1:]
        i = int(np.searchsorted(within, x, side="right"))
        if i >= len(block):  # x at or past the block's summed end (rounding): the last id with mass
            i = int(np.flatnonzero(mass[r, : lo + len(block)] > 0)[-1]) - lo
        ids[r] = lo + i
    return torch.from_numpy(ids)


# ----------------------------------------------------------------- coupled sampling
def check_sampling(mode: object) -> str:
    """A request's sampling mode: "rejection" (the verifier's own draws, the default) or
    "coupled" (draws keyed by seed and position; see the module's docstring)."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {mode!r}")
    return str(mode)


def keyed_exponentials(seed: int, position: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """n standard exponentials (float64) that depend on (seed, position) alone: one per token
    id of the vocabulary, the same for the target and every prophet, in every batch."""
    key = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 63)
    gen = torch.Generator(device=device)
    gen.manual_seed(key)
    return torch.empty(n, dtype=torch.float64, device=device).exponential_(generator=gen)


def coupled_choice(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token of a coupled draw at `position` from probs (V,): argmax p_i / E_i with the
    keyed exponentials. A token of probability 0 never wins."""
    return int(torch.argmax(probs.double() / keyed_exponentials(seed, position, probs.shape[-1], probs.device)))


def draw(q: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, position: int,
         ids: torch.Tensor | None = None, vocab_size: int | None = None) -> int:
    """A drafted token at absolute `position` from q (V,), or from q over the draft vocabulary
    `ids`: the argmax when greedy, the coupled draw when the request is coupled, else a draw
    from the request's generator. Returns a token id of the full vocabulary."""
    if params.greedy:
        i = int(q.argmax())
    elif params.coupled is not None:
        if ids is None:
            return coupled_choice(q, params.coupled, position)
        e = keyed_exponentials(params.coupled, position, vocab_size or int(ids.max()) + 1, q.device)[ids]
        i = int(torch.argmax(q.double() / e))
    else:
        i = int(sample(q, generator))
    return int(ids[i]) if ids is not None else i


def couple(probs: torch.Tensor, params: SamplingParams, start: int,
           positions: Sequence[int] | None = None) -> torch.Tensor:
    """The target's distributions (R, V) for a coupled request: each row one-hot on its
    coupled draw at position start + row (or positions[row]); unchanged otherwise. The
    verifier then accepts a drafted token exactly when it is that draw."""
    if params.coupled is None or params.greedy:
        return probs
    rows = positions if positions is not None else range(start, start + probs.shape[0])
    picks = [coupled_choice(probs[r], params.coupled, t) for r, t in enumerate(rows)]
    return torch.nn.functional.one_hot(torch.tensor(picks, device=probs.device), probs.shape[-1]).to(probs.dtype)
