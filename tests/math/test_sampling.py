import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import InvalidLogitsError, SamplingParams, logits_to_probs


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 5.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_temperature_matches_softmax():
    logits = torch.randn(3, 11)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(probs, torch.softmax(logits / 0.7, -1), atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.floats(0.05, 1.0), st.integers(0, 10_000))
def test_top_k_top_p_masks_are_respected(k, top_p, seed):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(seed)) * 3
    probs = logits_to_probs(logits, SamplingParams(1.0, top_k=k, top_p=top_p))
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    kept = probs > 0
    assert int(kept.sum()) <= k
    # everything kept is at least as likely as everything dropped
    if (~kept).any():
        assert logits[kept].min() >= logits[~kept].max()
    # the kept set is the smallest prefix (after top-k) reaching top_p
    full = torch.softmax(logits.masked_fill(logits < torch.topk(logits, k).values[-1], -math.inf), -1)
    ordered = torch.sort(full, descending=True).values
    n_needed = int(((torch.cumsum(ordered, 0) - ordered < top_p) & (ordered > 0)).sum())
    assert int(kept.sum()) == n_needed


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(top_k=1.5)])
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_nan_logits_are_a_clear_error():
    with pytest.raises(InvalidLogitsError, match="target 'x' produced NaN"):
        logits_to_probs(torch.tensor([0.0, float("nan")]), SamplingParams(), who="target 'x'")
    with pytest.raises(InvalidLogitsError, match="-inf for every token"):
        logits_to_probs(torch.full((3,), -math.inf), SamplingParams())


def test_a_row_with_one_possible_token_needs_no_draw():
    from specdec.sampling import sample

    g = torch.Generator().manual_seed(1)
    before = g.get_state()
    assert int(sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), g)) == 2
    assert torch.equal(g.get_state(), before)  # nothing drawn: greedy rows leave the generator alone
    almost = torch.tensor([1.0, 1e-30, 0.0])  # two possible tokens, however unlikely the second
    sample(almost, g)
    assert not torch.equal(g.get_state(), before)


def test_sample_draws_each_row_from_its_distribution():
    """The inverse-CDF sampler: chi-square (alpha as in the suite) per row over many draws,
    rows unnormalized and with zeros, which are never drawn (also over 49,152 ids)."""
    from collections import Counter

    from specdec.certify import goodness_of_fit
    from specdec.sampling import sample
    from tests.helpers import ALPHA

    g = torch.Generator().manual_seed(7)
    rows = torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0],
                         [3.0, 1.0, 0.0, 0.0, 4.0],  # unnormalized
                         [0.0, 0.0, 0.0, 1e-3, 0.999]])
    draws = torch.stack([sample(rows, g) for _ in range(20_000)])  # (n, 3)
    for r in range(len(rows)):
        probs = rows[r] / rows[r].sum()
        counts = Counter(draws[:, r].tolist())
        assert all(probs[t] > 0 for t in counts)
        result = goodness_of_fit(counts, {t: float(p) for t, p in enumerate(probs)}, alpha=ALPHA)
        assert result.passed, (r, result)
    big = torch.softmax(torch.randn(49_152, generator=g), -1)  # a real vocabulary's size
    big[::2] = 0.0
    assert all(int(sample(big, g)) % 2 == 1 for _ in range(200))


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The specification of `sample`'s draw: the first id whose float64 cumulative mass exceeds
    u times the total (one sequential sum over every id)."""
    cdf = probs.double().cumsum(-1)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])


@pytest.mark.parametrize("size", [3, 255, 256, 257, 8191, 49_152])
def test_sample_is_the_first_id_past_u_times_the_total(size):
    """The two-level sampler (block totals, then within one block) draws what one float64
    cumulative sum over every id draws, from the same uniform: 300 distributions a size,
    unnormalized, with zeros, peaked and flat, their mass in the last (partial) block."""
    from specdec.sampling import sample

    g = torch.Generator().manual_seed(size)
    for case in range(300):
        probs = torch.softmax(torch.randn(size, generator=g) * float(torch.rand((), generator=g) * 10), -1)
        if case % 3 == 1:
            probs = probs * (torch.rand(size, generator=g) < 0.5) * 7.0  # zeros, unnormalized
        if case % 3 == 2:
            probs[: max(1, size - 5)] = 0.0  # only the last ids have mass
        if int((probs > 0).sum()) < 2:
            probs[-1] = probs[-2] = 0.5
        state = g.get_state()
        u = float(torch.rand(1, generator=g, dtype=torch.float64)[0])
        g.set_state(state)
        token = int(sample(probs, g))
        assert token == _inverse_cdf(probs, u), (size, case)
        assert probs[token] > 0
        if case % 50 == 0:  # float64 rows are summed as they are
            g.set_state(state)
            assert int(sample(probs.double(), g)) == _inverse_cdf(probs.double(), u)


@pytest.mark.parametrize("size", [1, 3, 255, 256, 257, 2047, 8191, 49_152])
def test_the_extensions_scan_and_numpys_draw_the_same_id(size, monkeypatch):
    """`sample` scans in the extension where it is loaded, else in torch and NumPy: the same block totals,
    the same one-token rows and the same ids from the same uniforms, bit for bit (float32 and
    float64 rows, zeros, a uniform just below 1), and the same draws through `sample` itself."""
    from specdec import qgemm, sampling

    if not qgemm.available():
        pytest.skip(f"qgemm unavailable: {qgemm.why_unavailable()}")
    ext = qgemm.module()
    g = torch.Generator().manual_seed(size)
    for case in range(60):
        probs = torch.softmax(torch.randn(3, size, generator=g) * float(torch.rand((), generator=g) * 10), -1)
        if case % 3 == 1:
            probs = probs * (torch.rand(3, size, generator=g) < 0.5) * 7.0  # zeros, unnormalized
        if case % 4 == 2:
            probs = probs.double()
        totals, single = ext.sample_totals(probs)
        totals_py, single_py = sampling._sample_totals(probs)
        assert torch.equal(totals, totals_py) and torch.equal(single, single_py), case
        if (single == -2).any():
            continue
        u = torch.rand(3, generator=g, dtype=torch.float64)
        u[case % 3] = 1 - 2.0 ** -53 if case % 5 == 0 else u[case % 3]
        picked = ext.sample_pick(probs, totals, u)
        assert torch.equal(picked, sampling._sample_pick(probs, totals_py, u)), case
        assert all(probs[r, int(i)] > 0 for r, i in enumerate(picked))
    row = torch.softmax(torch.randn(size, generator=g), -1)
    state = g.get_state()
    with_ext = [int(sampling.sample(row, g)) for _ in range(20)]
    g.set_state(state)
    monkeypatch.setattr(sampling, "_kernels", None)  # as in a process that never loaded the kernels
    assert [int(sampling.sample(row, g)) for _ in range(20)] == with_ext


def test_checked_argmax_is_argmax_and_raises_what_check_logits_raises():
    from specdec.sampling import SMALL_ARGMAX, checked_argmax

    picks = checked_argmax

    g = torch.Generator().manual_seed(3)
    for shape in [(1, 49_152), (3, 2, 1000), (SMALL_ARGMAX // 1000 + 1, 1000)]:  # NumPy's path, then PyTorch's
        x = torch.randn(*shape, generator=g)
        x[..., 7] = x.max()  # ties: the first of equal maxima
        assert torch.equal(picks(x), x.argmax(-1))
        for value, message in [(float("nan"), "produced NaN"), (math.inf, r"produced \+inf")]:
            bad = x.clone()
            bad.view(-1)[bad.numel() // 2] = value  # not the row's maximum before it was put there
            with pytest.raises(InvalidLogitsError, match=message):
                picks(bad, "m")
        row = x.clone()
        row[0] = -math.inf
        with pytest.raises(InvalidLogitsError, match="-inf for every token"):
            picks(row, "m")
        some = x.clone()
        some[..., :5] = -math.inf  # -inf in places is no error
        assert torch.equal(picks(some), some.argmax(-1))
