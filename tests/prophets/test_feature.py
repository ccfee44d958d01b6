"""Feature prophets (eagle, medusa) with a reduced draft vocabulary: exact on toy models
whose distribution is known, greedy-equal on the real target with the shipped prophets."""

import pytest
import torch

from specdec import load
from specdec.decoder import SpeculativeDecoder
from specdec.policy import AutoPolicy, Policy
from specdec.prophets.feature import FeatureHead, FeatureProphet, load_head, save_head
from specdec.prophets.ngram import NgramProphet
from specdec.sampling import SamplingParams
from specdec.toy import MarkovLM
from tests.helpers import fit_against_exact

V, PROMPT, LENGTH, N = 5, [1, 2], 4, 4000


def toy_prophet(target: MarkovLM, kind: str, vocab_ids=(0, 1, 3), seed: int = 0) -> FeatureProphet:
    torch.manual_seed(seed)
    head = FeatureHead(kind, MarkovLM.FEATURE_DIM, rank=8, depth=2, n_heads=4)
    for p in head.parameters():  # not the identity it starts as: an arbitrary, imperfect prophet
        torch.nn.init.normal_(p, std=0.5)
    return FeatureProphet(head, target.embeddings(), target.head(), torch.tensor(vocab_ids), V, name=kind)


@pytest.mark.parametrize("kind,k,settings", [
    ("eagle", 3, dict(temperature=1.0)),
    ("eagle", 2, dict(temperature=0.7, top_k=3)),
    ("medusa", 3, dict(temperature=1.0)),
    ("medusa", 4, dict(temperature=1.3, top_p=0.9)),
])
@pytest.mark.slow
def test_feature_prophets_with_a_reduced_vocabulary_are_exact(kind, k, settings):
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    decoder = SpeculativeDecoder(target, toy_prophet(target, kind), policy=Policy(k))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, **settings)
    assert result.passed, result
    out = decoder.generate(PROMPT, max_new_tokens=LENGTH, seed=0, **settings)
    assert out.stats.drafted > 0  # the prophet really drafted (after the first, plain round)


def test_auto_policy_with_a_feature_prophet_is_exact():
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    decoder = SpeculativeDecoder(target, toy_prophet(target, "eagle", (0, 1, 2, 3, 4)), policy=AutoPolicy(3))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0)
    assert result.passed, result


@pytest.mark.parametrize("policy", [Policy(3), AutoPolicy(3)], ids=["fixed", "auto"])
def test_prompt_lookup_first_then_a_feature_prophet_is_exact(policy):
    """multi="first": ngram drafts where the context repeats, the feature prophet elsewhere;
    the choice depends on the committed context only, so the loop stays exact."""
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    prophets = [NgramProphet(n_max=2, n_min=1), toy_prophet(target, "eagle", (0, 1, 2, 3, 4))]
    decoder = SpeculativeDecoder(target, prophets, policy=policy, multi="first")
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0)
    assert result.passed, result
    who = {e.prophet for seed in range(30) for e in decoder.generate(PROMPT, max_new_tokens=LENGTH, seed=seed).events}
    assert {"ngram", "eagle"} <= who  # both really drafted


def test_a_draft_never_proposes_outside_its_vocabulary(tmp_path):
    target = MarkovLM.random(V, order=2, seed=11, name="target")
    prophet = toy_prophet(target, "eagle", (1, 3))
    decoder = SpeculativeDecoder(target, prophet, policy=Policy(3))
    for seed in range(20):
        out = decoder.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=seed)
        assert all(t in (1, 3) for e in out.events for t in e.drafted)
    save_head(prophet.head, prophet.vocab_ids, tmp_path / "p", {"vocab_size": V})
    head, vocab, cfg = load_head(tmp_path / "p")
    assert vocab.tolist() == [1, 3] and cfg["kind"] == "eagle"
    for a, b in zip(head.state_dict().values(), prophet.head.state_dict().values(), strict=True):
        assert torch.allclose(a, b.float(), atol=b.abs().max().item() / 100)  # int8 storage, per-row scales


def test_feature_prophets_need_a_target_with_features():
    target = MarkovLM.random(V, order=2, seed=11, name="target")
    target.offers_hidden = False
    with pytest.raises(ValueError, match="hidden states"):
        SpeculativeDecoder(target, toy_prophet(target, "eagle"), policy=Policy(3))


def test_a_feature_prophet_serves_interleaved_requests():
    """Requests are rows of the one loop: two interleaved streams share the heads but not
    their state (each row's feature), and each decodes as it does alone."""
    from itertools import zip_longest

    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    decoder = SpeculativeDecoder(target, toy_prophet(target, "eagle", (0, 1, 2, 3, 4)), policy=Policy(3))
    alone = [decoder.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=s) for s in (4, 5)]
    assert all(g.stats.drafted > 0 for g in alone)
    got: list[list[int]] = [[], []]
    streams = [decoder.stream(PROMPT, max_new_tokens=12, temperature=1.0, seed=s) for s in (4, 5)]
    for pair in zip_longest(*streams):
        for i, e in enumerate(pair):
            if e is not None:
                got[i] += e.committed
    assert got == [g.token_ids for g in alone]


# ---------------------------------------------------------------- kangaroo: early exit + adapter


def toy_adapter(dim: int, layers: int = 1, seed: int = 0, identity: bool = False) -> FeatureHead:
    torch.manual_seed(seed)
    head = FeatureHead("kangaroo", dim, rank=8, depth=1, layers=layers)
    if not identity:
        for p in head.parameters():  # an arbitrary, imperfect adapter
            torch.nn.init.normal_(p, std=0.5)
    return head


@pytest.mark.parametrize("k,settings", [(3, dict(temperature=1.0)), (2, dict(temperature=0.7, top_k=3))])
def test_an_early_exit_adapter_with_a_reduced_vocabulary_is_exact(k, settings):
    from specdec.prophets.layerskip import AdaptedExitProphet

    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    prophet = AdaptedExitProphet(target, toy_adapter(MarkovLM.FEATURE_DIM), torch.tensor([0, 1, 3]), "kangaroo")
    decoder = SpeculativeDecoder(target, prophet, policy=Policy(k))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, **settings)
    assert result.passed, result
    out = decoder.generate(PROMPT, max_new_tokens=LENGTH, seed=0, **settings)
    assert out.stats.drafted > 0 and all(t in (0, 1, 3) for e in out.events for t in e.drafted)


def test_an_identity_adapter_is_plain_early_exit(tiny_pair):
    """Zero-initialised, the adapter is the identity, and over the full vocabulary the
    prophet's q is the one the target's own early-exit logits give (layerskip)."""
    from specdec.prophets.layerskip import AdaptedExitProphet, LayerSkipProphet
    from specdec.request import Request

    dec = load(tiny_pair["target"], draft="layerskip:1")
    target = dec.target
    full = torch.arange(target.vocab_size)
    adapted = AdaptedExitProphet(target, toy_adapter(target.head().shape[1], identity=True), full, "kangaroo")
    plain_exit = LayerSkipProphet(target, 1)
    rows = target.view(1)  # an engine's view of the target, one slot
    rows.forward([0], [0], [[1, 5, 9]], [1])

    def q(prophet):  # the prophet's q for the token after [1, 5, 9, 4], the row's first 3 in the slot
        req = Request([1, 5, 9, 4], 4, SamplingParams(1.0), 1, seed=0)
        req.slot, req.target_cached = 0, 3
        return prophet.for_engine(rows, 1).propose([req], [1]).probs[0, 0]

    assert torch.allclose(q(adapted), q(plain_exit), atol=1e-4)


def test_a_shipped_adapter_loads_by_path_and_is_greedy_exact(tiny_pair, tmp_path):
    plain = load(tiny_pair["target"], draft="none")
    dim = plain.target.head().shape[1]
    vocab = torch.arange(0, plain.target.vocab_size, 2)
    save_head(toy_adapter(dim, layers=1, seed=3), vocab, tmp_path / "k", {"vocab_size": plain.target.vocab_size})
    dec = load(tiny_pair["target"], draft=str(tmp_path / "k"), draft_tokens=3)
    for prompt in ["def ", "import os\nimport"]:
        want = plain.generate(prompt, max_new_tokens=24, temperature=0).token_ids
        out = dec.generate(prompt, max_new_tokens=24, temperature=0)
        assert out.token_ids == want and out.stats.drafted > 0
        assert all(t % 2 == 0 for e in out.events for t in e.drafted)
    save_head(toy_adapter(dim, layers=9), vocab, tmp_path / "deep", {"vocab_size": plain.target.vocab_size})
    with pytest.raises(ValueError, match="layers"):
        load(tiny_pair["target"], draft=str(tmp_path / "deep"))
