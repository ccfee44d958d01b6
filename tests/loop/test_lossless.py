"""Layer 3 of the losslessness tests: the whole loop (prophet + verify + rollback + bonus
+ stops) against toy models whose exact distribution over continuations is known.

Each case samples continuations of 3 tokens and runs Pearson's chi-square test against
the exact distribution at significance ALPHA = 0.001 (fixed seeds: the outcome is
reproducible). The negative controls replace the verifier by plausible wrong ones and
must be caught by the same test, which proves the test has power.
"""

import pytest
import torch

import specdec.batch as batch_mod
import specdec.ragged as ragged_mod
from specdec.decoder import SpeculativeDecoder
from specdec.policy import AdaptivePolicy, ConfidencePolicy, OptimalPolicy, Policy
from specdec.prophets.model import ModelProphet
from specdec.sampling import sample
from specdec.toy import MarkovLM
from specdec.verify import Verdict
from tests.helpers import fit_against_exact

V, PROMPT, LENGTH, N = 5, [1, 2], 3, 3000


def models():
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target")
    good = target.blend(MarkovLM.random(V, order=2, seed=12), 0.35, "good")
    bad = MarkovLM.random(V, order=2, seed=13, sharpness=2.5, name="bad")
    return target, good, bad


CASES = [
    # (prophet, K, settings)
    ("good", 1, dict(temperature=1.0)),
    ("good", 3, dict(temperature=1.0)),
    ("bad", 3, dict(temperature=1.0)),
    ("good", 5, dict(temperature=0.6)),
    ("bad", 2, dict(temperature=1.7)),
    ("good", 3, dict(temperature=1.0, top_k=3)),
    ("bad", 4, dict(temperature=0.8, top_p=0.7)),
    ("good", 2, dict(temperature=1.2, top_k=4, top_p=0.9)),
]


@pytest.mark.parametrize("prophet,k,settings", CASES)
def test_speculative_sampling_matches_the_exact_distribution(prophet, k, settings):
    target, good, bad = models()
    decoder = SpeculativeDecoder(target, ModelProphet(good if prophet == "good" else bad), policy=Policy(k))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, **settings)
    assert result.passed, result


@pytest.mark.parametrize("policy", [AdaptivePolicy(2), ConfidencePolicy(6, 0.5), OptimalPolicy(3)],
                         ids=["adaptive", "confidence", "optimal"])
def test_policies_are_lossless(policy):
    target, good, _ = models()
    decoder = SpeculativeDecoder(target, ModelProphet(good), policy=policy)
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0)
    assert result.passed, result


@pytest.mark.parametrize("multi", ["tree", "best", "first"])
def test_several_prophets_are_lossless(multi):
    target, good, bad = models()
    decoder = SpeculativeDecoder(target, [ModelProphet(good), ModelProphet(bad)], policy=Policy(3), multi=multi)
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=0.9, top_k=4)
    assert result.passed, result


class UnknownProphet:
    """A prophet of a kind the library does not ship (as one registered by a user): it drafts on
    the one loop through the prophet protocol alone (here by handing the rows to a model prophet)."""

    reads_features, fused_layers, is_lookup, model_steps, combine = False, (), False, False, None

    def __init__(self, inner):
        self.inner, self.name, self.vocab_size = inner, "unknown", inner.vocab_size

    @property
    def draft_lm(self):
        return self.inner.draft_lm

    @property
    def parts(self):
        return [self]

    def for_engine(self, target, slots, branches=1):
        return UnknownProphet(self.inner.for_engine(target, slots, branches))

    def room(self, req):
        return self.inner.room(req)

    def prefill(self, reqs):
        self.inner.prefill(reqs)

    def propose(self, reqs, ks, budget=None):
        return self.inner.propose(reqs, ks)

    def free(self, slot):
        self.inner.free(slot)

    def settle(self, reqs, leave=0):
        self.inner.settle(reqs, leave)


@pytest.mark.parametrize("multi", ["first", "tree"])
def test_a_prophet_of_an_unknown_kind_is_lossless_on_the_one_loop(multi):
    from specdec.wiring import engine_for

    target, good, bad = models()
    prophets = [UnknownProphet(ModelProphet(good))] + ([ModelProphet(bad)] if multi == "tree" else [])
    decoder = SpeculativeDecoder(target, prophets, policy=Policy(3), multi=multi)
    engine = engine_for(decoder, 2)
    assert isinstance(engine.prophet.parts[0], UnknownProphet)
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0)
    assert result.passed, result
    assert decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=1).stats.drafted > 0


def test_plain_decoding_matches_the_exact_distribution():
    target, _, _ = models()
    result = fit_against_exact(SpeculativeDecoder(target), target, PROMPT, LENGTH, N, temperature=1.0)
    assert result.passed, result


def argmax_matching_verifier(draft_tokens, draft_probs, target_probs, generator):
    """Wrong on purpose: accept while the draft equals the target's argmax (the greedy
    rule) even at temperature 1, then sample from p."""
    n = 0
    while n < len(draft_tokens) and int(draft_tokens[n]) == int(target_probs[n].argmax()):
        n += 1
    kind = "bonus" if n == len(draft_tokens) else "recovered"
    return Verdict(n, int(sample(target_probs[n], generator)), kind)


def resample_from_p_verifier(draft_tokens, draft_probs, target_probs, generator):
    """Wrong on purpose: the right acceptance test, but the replacement token is drawn
    from p instead of the residual norm(max(0, p - q)) (a classic bug)."""
    k = len(draft_tokens)
    for i in range(k):
        x = int(draft_tokens[i])
        if float(torch.rand((), generator=generator)) * float(draft_probs[i, x]) >= float(target_probs[i, x]):
            return Verdict(i, int(sample(target_probs[i], generator)), "recovered")
    return Verdict(k, int(sample(target_probs[k], generator)), "bonus")


@pytest.mark.parametrize("wrong", [argmax_matching_verifier, resample_from_p_verifier])
def test_negative_control_biased_verifier_is_caught(monkeypatch, wrong):
    target, good, _ = models()
    monkeypatch.setattr(batch_mod, "verify_chain", wrong)  # the one loop's verifier of a sampled row alone
    monkeypatch.setattr(ragged_mod, "verify_chain", wrong)  # and of each row in `verify_rows_reference`
    decoder = SpeculativeDecoder(target, ModelProphet(good), policy=Policy(3))
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=1.0)
    assert not result.passed, result
