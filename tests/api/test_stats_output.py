"""Stats count only tokens that reached the output: a round that EOS, a stop string or the
length ends inside its accepted run counts the tokens it kept, never those it threw away."""

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.policy import Policy
from specdec.prophets.model import ModelProphet
from specdec.stats import summarize
from specdec.toy import MarkovLM

V = 12


def chain() -> MarkovLM:
    """Token i is always followed by i + 1 (mod V): a prophet equal to it is always accepted."""
    table = torch.full((V, V), -30.0)
    for i in range(V):
        table[i, (i + 1) % V] = 30.0
    return MarkovLM(table, "chain")


class Letters:
    """A tokenizer for the toy vocabulary: token i is the letter chr(97 + i)."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


def decoder(eos=(), k=4) -> SpeculativeDecoder:
    target = chain()
    return SpeculativeDecoder(target, ModelProphet(chain()), Letters(), Policy(k), eos_token_ids=eos)


def check_invariants(out) -> None:
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == sum(len(e.committed) for e in out.events)
    assert s.accepted + s.rounds == s.new_tokens
    assert s.accepted + s.recovered + s.bonus + s.cut == s.new_tokens
    assert s.tokens_per_round == pytest.approx(s.new_tokens / s.rounds)
    assert s.accepted <= s.drafted
    assert all(0 <= a <= 1 for a in s.acceptance_by_position)


def test_eos_as_the_first_drafted_token_counts_one_token_in_one_round():
    out = decoder(eos={1}, k=8).generate([0], max_new_tokens=20, temperature=0)
    assert out.token_ids == [1] and out.finish_reason == "eos"
    e = out.events[0]
    assert e.accepted == 8 and e.next_kind == "bonus"  # what the verifier said ...
    s = out.stats  # ... and what reached the output
    assert (s.rounds, s.new_tokens, s.accepted, s.bonus, s.recovered, s.cut) == (1, 1, 0, 0, 0, 1)
    assert s.tokens_per_round == 1.0 and s.acceptance_by_position == []
    check_invariants(out)


def test_eos_inside_the_accepted_run():
    out = decoder(eos={3}, k=4).generate([0], max_new_tokens=20, temperature=0)
    assert out.token_ids == [1, 2, 3] and out.finish_reason == "eos"
    s = out.stats
    assert (s.accepted, s.bonus, s.cut, s.tokens_per_round) == (2, 0, 1, 3.0)
    assert s.acceptance_by_position == [1.0, 1.0]  # positions 3 and 4 never reached the output
    assert s.per_prophet["chain"]["accepted"] == 2
    check_invariants(out)


def test_stop_string_inside_the_accepted_run():
    out = decoder(k=6).generate([0], max_new_tokens=30, temperature=0, stop="cd")
    assert out.finish_reason == "stop" and out.text == "b"
    assert out.token_ids == [1, 2, 3]  # the fewest tokens whose text reaches the stop string's end
    s = out.stats
    assert (s.new_tokens, s.accepted, s.cut, s.bonus) == (3, 2, 1, 0)
    check_invariants(out)


@pytest.mark.parametrize("n", [1, 2, 5, 9, 13])
def test_length_ends_a_run_without_counting_beyond_it(n):
    out = decoder(k=4).generate([0], max_new_tokens=n, temperature=0)
    assert len(out.token_ids) == n and out.finish_reason == "length"
    check_invariants(out)


def test_full_rounds_count_every_accepted_token_and_the_bonus():
    out = decoder(k=4).generate([0], max_new_tokens=10, temperature=0)
    s = out.stats
    assert s.bonus == s.rounds and s.cut == 0 and s.accepted == 10 - s.rounds
    check_invariants(out)


def test_sampled_rounds_with_rejections_keep_the_invariants():
    target = MarkovLM.random(8, order=2, seed=3)
    draft = target.blend(MarkovLM.random(8, order=2, seed=4), 0.5, "d")
    dec = SpeculativeDecoder(target, ModelProphet(draft), policy=Policy(4), eos_token_ids={5})
    for seed in range(20):
        out = dec.generate([1, 2], max_new_tokens=40, temperature=1.0, seed=seed)
        check_invariants(out)
        assert summarize(out.events) == out.stats
