"""Layer 1 of the losslessness tests: the verifier alone, with forced and exact cases."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.certify import goodness_of_fit
from specdec.verify import DraftTree, residual, verify_chain, verify_greedy_tree, verify_tree

BIG = 30.0


def one_hotish(token, v=5):
    logits = torch.full((v,), -BIG)
    logits[token] = BIG
    return torch.softmax(logits, -1)


def test_forced_accept_accept_reject():
    # the target agrees on positions 1 and 2 and puts no mass on the third draft token
    draft = torch.tensor([1, 2, 3])
    q = torch.stack([one_hotish(1), one_hotish(2), one_hotish(3)])
    p = torch.stack([one_hotish(1), one_hotish(2), one_hotish(4), one_hotish(0)])
    for seed in range(20):
        v = verify_chain(draft, q, p, torch.Generator().manual_seed(seed))
        assert (v.n_accepted, v.next_token, v.next_kind) == (2, 4, "recovered")


def test_forced_all_accepted_gives_bonus():
    draft = torch.tensor([1, 2])
    p = torch.stack([one_hotish(1), one_hotish(2), one_hotish(3)])
    v = verify_chain(draft, None, p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.next_token, v.next_kind) == (2, 3, "bonus")


def test_forced_first_rejection_deterministic_prophet():
    p = torch.stack([one_hotish(4), one_hotish(0)])
    v = verify_chain(torch.tensor([2]), None, p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.next_token, v.next_kind) == (0, 4, "recovered")


def test_residual_exact():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    assert torch.allclose(residual(p, q, 1), torch.tensor([0.4, 0.0, 0.1, 0.0]) / 0.5)
    assert torch.allclose(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4, 0.0]))


def exact_one_step(p, q):
    """P(output token = y) for K=1 speculative sampling: should equal p exactly."""
    accept = torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-30)) * (q > 0)
    accepted_mass = q * accept  # P(draft x and accepted)
    reject_mass = 1 - accepted_mass.sum()
    return accepted_mass + reject_mass * residual(p, q, 0)


def test_one_step_output_distribution_is_p_exactly():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(7, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(7, generator=g) * 2, -1)
        assert torch.allclose(exact_one_step(p, q), p, atol=1e-6)


def test_recovered_tokens_follow_the_residual_statistically():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    q = torch.tensor([0.6, 0.1, 0.1, 0.2])
    counts: Counter = Counter()
    while sum(counts.values()) < 20_000:
        x = int(torch.multinomial(q, 1, generator=g))
        v = verify_chain(torch.tensor([x]), q[None], torch.stack([p, p]), g)
        if v.next_kind == "recovered":
            counts[v.next_token] += 1
    expected = residual(p, q, 0)
    result = goodness_of_fit(counts, {i: float(expected[i]) for i in range(4)})
    assert result.passed, result
    assert counts[0] == 0  # no residual mass where q exceeds p


def test_tree_with_one_chain_matches_chain_on_forced_paths():
    tree = DraftTree()
    tree.add_chain([1, 2, 3], None, "a")
    p = torch.stack([one_hotish(1), one_hotish(2), one_hotish(4), one_hotish(0)])
    v = verify_tree(tree, p, torch.Generator().manual_seed(0))
    assert (v.path, v.next_token, v.next_kind) == ([0, 1], 4, "recovered")


def test_tree_second_child_accepted_after_first_rejected():
    tree = DraftTree()
    tree.add_chain([1, 2], None, "a")
    tree.add_chain([3, 4], None, "b")
    # p puts all mass on 3 then 4: a's branch is rejected, b's accepted to its leaf
    p = torch.stack([one_hotish(3), one_hotish(2), one_hotish(0), one_hotish(4), one_hotish(2)])
    v = verify_tree(tree, p, torch.Generator().manual_seed(0))
    assert [tree.tokens[n] for n in v.path] == [3, 4]
    assert (v.next_token, v.next_kind, v.accepted_by) == (2, "bonus", ["b", "b"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=17, max_size=17))
def test_a_greedy_tree_verdict_is_verify_trees_on_one_hot_rows(chains, picks):
    """verify_greedy_tree (following the target's choices) gives verify_tree's verdict on one-hot
    p, for any tree of up to 4 chains (shared nodes, repeated proposals) and any choices."""
    tree = DraftTree()
    for i, chain in enumerate(chains):
        tree.add_chain(chain, None, f"p{i}")
    choices = picks[: len(tree.tokens) + 1]
    want = verify_tree(tree, torch.stack([one_hotish(c) for c in choices]), torch.Generator().manual_seed(0))
    got = verify_greedy_tree(tree, choices)
    assert (got.path, got.next_token, got.next_kind, got.accepted_by) == \
        (want.path, want.next_token, want.next_kind, want.accepted_by)


def test_tree_shares_nodes_but_keeps_both_proposals():
    tree = DraftTree()
    tree.add_chain([1, 2], None, "a")
    tree.add_chain([1, 3], None, "b")
    assert tree.tokens == [1, 2, 3] and tree.parents == [-1, 0, 0]
    assert len(tree.proposals) == 4


@pytest.mark.parametrize("identical_prophets", [False, True])
def test_multi_draft_first_token_distribution_is_p_exactly(identical_prophets):
    """Two prophets draw independently at the root (often the same token, which then
    shares a node but keeps both proposals): the exact distribution of the round's first
    output token, by enumeration over both draws, equals p."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, generator=g), -1)
    q1 = torch.softmax(torch.randn(5, generator=g), -1)
    q2 = q1 if identical_prophets else torch.softmax(torch.randn(5, generator=g), -1)
    total = torch.zeros(5)
    for x1 in range(5):
        for x2 in range(5):
            a1 = min(1.0, float(p[x1] / q1[x1]))
            r1 = residual(p, q1, x1)
            a2 = min(1.0, float(r1[x2] / q2[x2]))
            r2 = residual(r1, q2, x2)
            out = torch.zeros(5)
            out[x1] += a1
            out[x2] += (1 - a1) * a2
            out += (1 - a1) * (1 - a2) * r2
            total += q1[x1] * q2[x2] * out
    assert torch.allclose(total, p, atol=1e-6)
