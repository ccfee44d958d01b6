"""Coupled sampling (`sampling="coupled"`): every draw keyed by (seed, position) through the
exponential race (argmax p_i / E_i, the Gumbel-max trick), shared by prophets and target.
What it promises: an exact sample of the target (chi-square against the exact distribution,
alpha 0.001), and a seeded output that is seeded plain coupled sampling's, token for token,
whatever the prophet, K, tree or batch."""

from collections import Counter

import pytest
import torch

from specdec import load
from specdec.api import batch_engine
from specdec.certify import goodness_of_fit
from specdec.decoder import SpeculativeDecoder
from specdec.policy import Policy
from specdec.prophets.model import ModelProphet
from specdec.prophets.ngram import NgramProphet
from specdec.request import Request
from specdec.sampling import SamplingParams, check_sampling, coupled_choice, draw, keyed_exponentials
from specdec.toy import MarkovLM
from tests.helpers import ALPHA, fit_against_exact

V = 12
PROMPT = [1, 2, 3, 1, 2]


def toy_target() -> MarkovLM:
    return MarkovLM.random(V, order=2, seed=31, sharpness=1.5, name="target")


def test_keyed_draws_depend_on_the_seed_and_position_alone():
    a = keyed_exponentials(7, 100, 50)
    assert torch.equal(a, keyed_exponentials(7, 100, 50))
    assert not torch.equal(a, keyed_exponentials(7, 101, 50))
    assert not torch.equal(a, keyed_exponentials(8, 100, 50))
    # a draft vocabulary reads the full vocabulary's numbers: the same E for the same id
    q_sub = torch.tensor([0.2, 0.5, 0.3])
    ids = torch.tensor([3, 9, 40])
    full = torch.zeros(50).index_copy_(0, ids, q_sub)
    for pos in range(30):
        assert draw(q_sub, SamplingParams(1.0, coupled=5), None, pos, ids, 50) == coupled_choice(full, 5, pos)
    with pytest.raises(ValueError, match="sampling must be one of"):
        check_sampling("gumbel")


def test_a_coupled_draw_is_an_exact_sample():
    """Over seeds, one position's coupled draws follow p (chi-square, alpha 0.001); a token
    of probability 0 never wins."""
    p = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.1, 0.05])
    counts = Counter((coupled_choice(p, seed, 3),) for seed in range(3000))
    assert (2,) not in counts
    result = goodness_of_fit(counts, {(i,): float(p[i]) for i in range(len(p))}, alpha=ALPHA)
    assert result.passed, result.verdict


@pytest.mark.parametrize("which", ["model", "ngram", "model+ngram tree"])
@pytest.mark.slow
def test_coupled_speculation_fits_the_exact_distribution(which):
    """The whole loop on a toy target whose distribution is known exactly."""
    target = toy_target()
    model = ModelProphet(target.blend(MarkovLM.random(V, order=2, seed=32), 0.4, "model"))
    prophets = {"model": [model], "ngram": [NgramProphet(2)], "model+ngram tree": [model, NgramProphet(2)]}[which]
    decoder = SpeculativeDecoder(target, prophets, policy=Policy(3), multi="tree")
    result = fit_against_exact(decoder, target, PROMPT, 3, 1500, temperature=0.9, sampling="coupled")
    assert result.passed, result


@pytest.mark.parametrize("which", ["model", "ngram", "model+ngram tree"])
def test_coupled_speculation_is_seeded_plain_sampling_token_for_token(which):
    target = toy_target()
    plain = SpeculativeDecoder(target, None)
    far = ModelProphet(MarkovLM.random(V, order=2, seed=33, name="far"))
    close = ModelProphet(target.blend(MarkovLM.random(V, order=2, seed=32), 0.2, "close"))
    prophets = {"model": [close], "ngram": [NgramProphet(2)], "model+ngram tree": [far, close, NgramProphet(2)]}[which]
    for k in (1, 4):
        decoder = SpeculativeDecoder(target, prophets, policy=Policy(k), multi="tree")
        for seed in range(12):
            settings = dict(max_new_tokens=20, temperature=1.0, seed=seed, sampling="coupled")
            assert decoder.generate(PROMPT, **settings).token_ids == plain.generate(PROMPT, **settings).token_ids


def test_coupled_drafts_are_the_targets_own_choice_when_q_is_p():
    """A prophet equal to the target proposes, with the same keyed numbers, what the target
    picks: every drafted token is accepted (rejection sampling also accepts all when q = p;
    coupling keeps that while making the output independent of the prophet)."""
    target = toy_target()
    decoder = SpeculativeDecoder(target, ModelProphet(MarkovLM(target.table, "same")), policy=Policy(4))
    g = decoder.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=3, sampling="coupled")
    assert all(e.accepted == len(e.drafted) for e in g.events)


@pytest.mark.parametrize("prophet", ["close", "far", "ngram", "eagle", "layerskip:1"])
def test_every_prophet_kind_on_a_real_llama_gives_seeded_plain_coupled_tokens(tiny_pair, tiny_eagle, prophet):
    draft = {"close": tiny_pair["close"], "far": tiny_pair["far"], "ngram": "ngram", "eagle": tiny_eagle,
             "layerskip:1": "layerskip:1"}[prophet]
    decoder = load(tiny_pair["target"], draft=draft, policy="fixed", draft_tokens=3, draft_dtype=torch.float32)
    plain = decoder.plain()
    for seed in range(3):
        settings = dict(max_new_tokens=24, temperature=1.0, seed=seed, sampling="coupled")
        want = plain.generate("def main():", **settings).token_ids
        assert decoder.generate("def main():", **settings).token_ids == want


@pytest.mark.parametrize("draft", [None, "close", "ngram", "eagle"])
def test_a_coupled_row_gives_the_same_tokens_alone_and_in_a_batch(tiny_pair, tiny_eagle, draft):
    """Batched rows (other rows beside it, some rejection-sampled) give a coupled row the
    tokens of seeded plain coupled decoding of that prompt alone."""
    spec = {None: None, "close": tiny_pair["close"], "ngram": "ngram", "eagle": tiny_eagle}[draft]
    engine = batch_engine(tiny_pair["target"], spec, slots=4, draft_dtype=torch.float32)
    plain = load(tiny_pair["target"], draft="none").plain()
    prompts = [plain.prompt_ids(p) for p in ("def main():", "import os\n", "class A:", "x = [")]
    rows = [Request(p, 20, SamplingParams(1.0), 3, seed=10 + i, sampling="coupled" if i % 2 == 0 else "rejection")
            for i, p in enumerate(prompts)]
    from specdec.request import batch_free

    # a coupled row's tokens never depend on K: its K may follow the batch; a seeded rejection-sampled row's may not
    assert [batch_free(r) for r in rows] == [True, False, True, False]
    engine.generate(rows)
    for i, r in enumerate(rows):
        if i % 2 == 0:
            want = plain.generate(r.prompt, max_new_tokens=20, temperature=1.0, seed=10 + i, sampling="coupled")
            assert r.generated == want.token_ids
    many = load(tiny_pair["target"], draft=spec or "none").generate_many(
        [{"prompt": p, "seed": 10 + i} for i, p in enumerate(prompts)], max_new_tokens=20, temperature=1.0,
        sampling="coupled")
    for i, g in enumerate(many):
        want = plain.generate(prompts[i], max_new_tokens=20, temperature=1.0, seed=10 + i, sampling="coupled")
        assert g.token_ids == want.token_ids


def test_bad_sampling_modes_are_refused(tiny_pair):
    decoder = load(tiny_pair["target"], draft="ngram")
    with pytest.raises(ValueError, match="sampling must be one of"):
        decoder.generate("x", max_new_tokens=2, sampling="gumbel")
    with pytest.raises(ValueError, match="sampling must be one of"):
        Request([1, 2], 2, sampling="")
