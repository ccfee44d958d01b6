"""Engine behaviour on toy models: errors, stops, accounting."""

import math

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.policy import Policy
from specdec.prophets.model import ModelProphet
from specdec.sampling import InvalidLogitsError
from specdec.toy import MarkovLM


def test_nan_logits_from_the_target_are_a_clear_error():
    table = torch.zeros(4, 4)
    table[2, 1] = math.nan
    dec = SpeculativeDecoder(MarkovLM(table, "broken"), None)
    with pytest.raises(InvalidLogitsError, match="target 'broken' produced NaN"):
        dec.generate([2], max_new_tokens=3)


def test_nan_logits_from_the_prophet_are_a_clear_error():
    target = MarkovLM.random(4, seed=0)
    bad = torch.full((4, 4), math.nan)
    dec = SpeculativeDecoder(target, ModelProphet(MarkovLM(bad, "bad-draft")), policy=Policy(2))
    with pytest.raises(InvalidLogitsError, match="prophet 'bad-draft' produced NaN"):
        dec.generate([1], max_new_tokens=3)


def test_accounting_adds_up():
    target = MarkovLM.random(6, order=2, seed=3)
    draft = target.blend(MarkovLM.random(6, order=2, seed=4), 0.4, "d")
    dec = SpeculativeDecoder(target, ModelProphet(draft), policy=Policy(4))
    out = dec.generate([1, 2], max_new_tokens=200, temperature=1.0, seed=0)
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == 200
    assert s.rounds == s.target_calls == s.recovered + s.bonus
    assert s.accepted <= s.drafted
    # every round commits its accepted tokens plus one, except where max_new_tokens cut the last
    assert sum(len(e.committed) for e in out.events) == 200
    assert all(len(e.committed) == e.accepted + 1 for e in out.events[:-1])
    assert s.tokens_per_round == pytest.approx((s.accepted + s.rounds) / s.rounds)
    # the request ran on rows of the one loop (views of their own, freed at its end):
    # nothing of it lives in the decoder's models
    assert all(v is None for v in draft.views) and all(v is None for v in target.views)


def test_token_id_prompts_are_validated():
    dec = SpeculativeDecoder(MarkovLM.random(4), None)
    with pytest.raises(ValueError, match="token ids must be in"):
        dec.generate([7], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        dec.generate("text", max_new_tokens=2)


def test_alpha_estimates_the_per_position_acceptance():
    """With a prophet identical to the target at temperature 1, every tested position is
    accepted (p = q), so alpha = 1; with a poor prophet alpha sits between 0 and 1 and
    above accepted / drafted (positions after a rejection are never tested)."""
    target = MarkovLM.random(6, order=2, seed=5)
    same = SpeculativeDecoder(target, ModelProphet(MarkovLM(target.table, "same")), policy=Policy(4))
    s = same.generate([1, 2], max_new_tokens=100, temperature=1.0, seed=0).stats
    assert s.alpha == 1.0 and s.recovered == 0
    poor = SpeculativeDecoder(MarkovLM(target.table), ModelProphet(MarkovLM.random(6, order=2, seed=9)),
                              policy=Policy(4))
    s = poor.generate([1, 2], max_new_tokens=200, temperature=1.0, seed=0).stats
    assert 0 < s.alpha < 1 and s.alpha > s.acceptance_rate


def test_a_request_may_keep_to_some_of_the_loaded_prophets(tiny_pair, tiny_eagle):
    from specdec import load

    dec = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", draft_tokens=3)
    prompt = "x = [1, 2, 1, 2, 1, 2, 1,"
    want = dec.plain().generate(prompt, max_new_tokens=16, temperature=0).token_ids
    only = dec.generate(prompt, max_new_tokens=16, temperature=0, prophets=["tiny-eagle"])
    assert only.token_ids == want and {e.prophet for e in only.events} <= {"tiny-eagle", None}
    both = dec.generate(prompt, max_new_tokens=16, temperature=0)
    assert both.token_ids == want and "ngram" in {e.prophet for e in both.events}
    assert all(e.prophet is None for e in dec.generate(prompt, max_new_tokens=8, prophets=[]).events)
    with pytest.raises(ValueError, match="not loaded.*'ngram', 'tiny-eagle'"):
        dec.generate(prompt, max_new_tokens=4, prophets=["medusa"])


def test_a_request_may_use_another_policy_without_touching_the_decoders(tiny_pair):
    from specdec import load
    from specdec.policy import AutoPolicy

    dec = load(tiny_pair["target"], draft=tiny_pair["far"], policy="auto", draft_tokens=3)
    want = dec.plain().generate("def ", max_new_tokens=24, temperature=0).token_ids
    fixed = dec.generate("def ", max_new_tokens=24, temperature=0, policy="fixed")
    assert fixed.token_ids == want and all(e.k == 3 for e in fixed.events[:-3])
    assert isinstance(dec.policy, AutoPolicy) and dec.policy.costs is None  # fixed K needs no costs
    again = dec.generate("def ", max_new_tokens=24, temperature=0)  # the decoder's own auto policy
    assert again.token_ids == want and dec.policy.costs is not None
    other = dec.generate("def ", max_new_tokens=24, temperature=0, policy="optimal")
    assert other.token_ids == want and isinstance(dec.policy, AutoPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        dec.generate("def ", max_new_tokens=4, policy="greedy-ish")
