"""The bundled small pair in models/: loads as "bundled", decodes losslessly, fits its budget."""

from pathlib import Path

import pytest

from specdec import load
from specdec.check import certify
from specdec.data.prompts import build_suite
from specdec.defaults import bundled_prophet, bundled_target

MODELS = Path(bundled_target()).parent


@pytest.fixture(scope="module")
def bundled():
    return load("bundled")


def test_weights_fit_the_budget_and_have_a_card():
    size = sum(f.stat().st_size for f in MODELS.rglob("*.safetensors"))
    assert 0 < size <= 48_000_000  # the budget, in MB (10^6 bytes)
    assert "PSF" in (MODELS / "README.md").read_text()


def test_bundled_decoder_is_the_small_pair_with_its_prophet(bundled):
    assert bundled.target.name == "bundled"
    assert [d.name for d in bundled.prophets] == [Path(bundled_prophet()).name]


def test_the_default_target_is_the_real_chat_model():
    import inspect

    from specdec.api import load as api_load
    from specdec.cli import build_parser
    from specdec.defaults import default_prophet_for, default_target

    assert default_target() == "smollm2"
    assert inspect.signature(api_load).parameters["target"].default is None  # None -> default_target()
    for command in (["generate", "hi"], ["serve"], ["check"], ["bench"]):
        args = build_parser().parse_args(command)
        assert args.target is None  # each command loads default_target() when none is named
    assert default_prophet_for("bundled") == bundled_prophet()


@pytest.mark.parametrize("k", [2, 5])
def test_bundled_greedy_equals_plain(bundled, k):
    plain = bundled.plain()
    for p in build_suite(1):
        want = plain.generate(p.text, max_new_tokens=24, temperature=0).token_ids
        assert bundled.generate(p.text, max_new_tokens=24, temperature=0, draft_tokens=k).token_ids == want


def test_bundled_pair_passes_check(bundled):
    report = certify(bundled, bundled.plain(), "def __init__(self", tokens=2, samples=150, temperature=1.0)
    assert report.result.passed, report.result
    assert report.acceptance_rate > 0.2
