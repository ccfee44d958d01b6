"""The bundled demo pair in models/: loads by default, decodes losslessly, fits its budget."""

from pathlib import Path

import pytest

from specdec import load
from specdec.check import certify
from specdec.data.prompts import build_suite
from specdec.defaults import default_drafter, default_target

MODELS = Path(default_target()).parent


@pytest.fixture(scope="module")
def bundled():
    return load()


def test_weights_fit_the_budget_and_have_a_card():
    size = sum(f.stat().st_size for f in MODELS.rglob("*.safetensors"))
    assert 0 < size <= 48_000_000  # the budget, in MB (10^6 bytes)
    assert "PSF" in (MODELS / "README.md").read_text()


def test_default_decoder_is_the_bundled_pair(bundled):
    assert bundled.target.name == default_target()
    assert [d.name for d in bundled.drafters] == [Path(default_drafter()).name]


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
