"""Batched speculative decoding: the ragged verifier against its per-row specification,
the batched Llama path against the unbatched one, greedy equality per row with unbatched
plain decoding, and the exact statistical test per row of a batch with mixed settings."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.ragged import verify_rows, verify_rows_reference

# ----------------------------------------------------------------- the ragged verifier


@st.composite
def ragged_batches(draw):
    n_rows = draw(st.integers(1, 5))
    k_max = draw(st.integers(0, 4))
    vocab = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    lens = [draw(st.integers(0, k_max)) for _ in range(n_rows)]
    one_hot = torch.tensor([draw(st.booleans()) for _ in range(n_rows)])
    sharp = draw(st.sampled_from([0.5, 3.0, 30.0]))  # 30: near one-hot p and q (forced paths)
    target_probs = torch.softmax(torch.randn(n_rows, k_max + 1, vocab, generator=g) * sharp, -1)
    draft_probs = torch.softmax(torch.randn(n_rows, k_max, vocab, generator=g) * sharp, -1)
    if draw(st.booleans()):  # some rows whose q equals p exactly: everything accepted
        draft_probs[0] = target_probs[0, :k_max]
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(n_rows, k_max)
    for b, k in enumerate(lens):
        tokens[b, k:] = -1  # padding must never be read
    all_one_hot = draw(st.booleans())
    return tokens, lens, None if all_one_hot else draft_probs, None if all_one_hot else one_hot, target_probs, seed


@settings(max_examples=200, deadline=None)
@given(ragged_batches())
def test_vectorised_ragged_verifier_equals_the_per_row_reference(batch):
    tokens, lens, draft_probs, one_hot, target_probs, seed = batch
    gens_a = [torch.Generator().manual_seed(seed + b) for b in range(len(lens))]
    gens_b = [torch.Generator().manual_seed(seed + b) for b in range(len(lens))]
    expected = verify_rows_reference(tokens, lens, draft_probs, one_hot, target_probs, gens_a)
    got = verify_rows(tokens, lens, draft_probs, one_hot, target_probs, gens_b)
    assert got.rows() == expected
    # and both left every generator in the same state
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_a, gens_b, strict=True))
    assert all(v.n_accepted <= k for v, k in zip(expected, lens, strict=True))


def test_ragged_verifier_forced_paths():
    """Extreme p: row 0 accepts all 3 and takes a bonus, row 1 rejects at 1, row 2 drafts nothing."""
    v = 4
    p = torch.zeros(3, 4, v)
    p[0, :, 2] = 1.0  # the target wants token 2 everywhere
    p[1, 0, 1], p[1, 1:, 3] = 1.0, 1.0
    p[2, :, 0] = 1.0
    tokens = torch.tensor([[2, 2, 2], [1, 2, -1], [-1, -1, -1]])
    gens = [torch.Generator().manual_seed(b) for b in range(3)]
    out = verify_rows(tokens, [3, 2, 0], None, None, p, gens).rows()
    assert [(r.n_accepted, r.next_token, r.next_kind) for r in out] == [
        (3, 2, "bonus"), (1, 3, "recovered"), (0, 0, "bonus")]
