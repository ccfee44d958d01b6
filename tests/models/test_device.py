"""The whole loop on a device: SPECDEC_TEST_DEVICE (default cpu; `scripts/gpu-check` sets
cuda). Models, caches, drafts, generators and the verifier's draws all live there; the
same exact statistical test (chi-square at ALPHA = 0.001 against the toy target's known
distribution) and greedy equality with plain decoding must hold."""

import os
import warnings

import pytest
import torch

from specdec import load
from specdec.decoder import SpeculativeDecoder
from specdec.policy import AutoPolicy, Policy
from specdec.prophets.model import ModelProphet
from specdec.toy import MarkovLM
from tests.helpers import fit_against_exact

DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"SPECDEC_TEST_DEVICE={DEVICE} but there is no CUDA GPU", allow_module_level=True)

V, PROMPT, LENGTH, N = 5, [1, 2], 3, 2000


@pytest.mark.parametrize("multi,policy", [("tree", Policy(3)), ("first", AutoPolicy(3))], ids=["tree", "first-auto"])
def test_exact_distribution_on_the_device(multi, policy):
    target = MarkovLM.random(V, order=2, seed=11, sharpness=1.5, name="target").to(DEVICE)
    good = target.blend(MarkovLM.random(V, order=2, seed=12), 0.35, "good")
    bad = MarkovLM.random(V, order=2, seed=13, sharpness=2.5, name="bad").to(DEVICE)
    decoder = SpeculativeDecoder(target, [ModelProphet(good), ModelProphet(bad)], policy=policy, multi=multi)
    out = decoder.generate(PROMPT, max_new_tokens=LENGTH, temperature=1.0, seed=0)
    assert out.stats.drafted > 0
    result = fit_against_exact(decoder, target, PROMPT, LENGTH, N, temperature=0.9, top_p=0.95)
    assert result.passed, result


def test_greedy_equals_plain_decoding_on_the_device(tiny_pair):
    decoder = load(tiny_pair["target"], draft=f"{tiny_pair['close']}+ngram", device=DEVICE, draft_tokens=3)
    assert decoder.target.device.type == torch.device(DEVICE).type
    plain = decoder.plain()
    for prompt in ["def f(", "import os\nimport sys\n", "class A:\n    def"]:
        out = decoder.generate(prompt, max_new_tokens=16, temperature=0.0)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=16, temperature=0.0).token_ids
        assert out.stats.drafted > 0


@pytest.mark.parametrize("which", ["model", "lookup then feature prophet"])
def test_batched_rows_on_the_device(tiny_pair, tiny_eagle, which):
    draft = tiny_pair["close"] if which == "model" else f"ngram+{tiny_eagle}"
    decoder = load(tiny_pair["target"], draft=draft, device=DEVICE)
    prompts = ["def f(", "import os\n", "x = [1, 2, 3]\nfor i in x:\n    "]
    many = decoder.generate_many(prompts, temperature=0.0, max_new_tokens=12)
    assert [g.token_ids for g in many] == [decoder.generate(p, temperature=0.0, max_new_tokens=12).token_ids
                                           for p in prompts]
    sampled = decoder.generate_many([{"prompt": p, "seed": 5, "temperature": 1.0} for p in prompts],
                                    max_new_tokens=8)
    again = decoder.generate_many([{"prompt": p, "seed": 5, "temperature": 1.0} for p in prompts],
                                  max_new_tokens=8)
    assert [g.token_ids for g in sampled] == [g.token_ids for g in again]  # a seed fixes a row's output


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="cuDNN's attention is a CUDA backend")
def test_the_loop_builds_no_cudnn_attention_plans(tiny_pair):
    """cuDNN's attention builds a plan per new key length (tens of ms on the host), and rounds meet
    a new length each time: the loop attends on flash / memory-efficient / plain attention only
    (specdec.lm.attention_backends). The prophet runs in bfloat16 on a GPU, where PyTorch would
    otherwise choose cuDNN."""
    from torch.profiler import ProfilerActivity, profile

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], device=DEVICE, draft_tokens=3)
    decoder.generate("def f(", max_new_tokens=4, temperature=0.0)
    with warnings.catch_warnings():  # the profiler's notes, not the loop's
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = decoder.generate("import os\nimport sys\n", max_new_tokens=16, temperature=0.0)
        names = [e.key for e in prof.key_averages()]
    assert out.stats.drafted > 0
    assert any("attention" in n for n in names), names  # the profile saw the attention calls
    assert not [n for n in names if "cudnn" in n.lower() and "attention" in n.lower()], names
