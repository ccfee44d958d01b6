"""Incremental detokenisation equals decoding whole, on the shipped tokenizers and
SmolLM2's, for text with multi-byte characters and for arbitrary ids."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specdec.defaults import models_dir
from specdec.text import IncrementalText

ALPHABET = st.sampled_from(list("abc xyz_().:=\n\t") + ["é", "ß", "中文", "🙂", "👍🏽", "  ", "ℝ", "\u0301"])


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def tokenizer(request):
    if request.param == "bundled":
        return AutoTokenizer.from_pretrained(str(models_dir() / "target"))
    from specdec.gguf import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def grow(tokenizer, ids, chunks):
    """Feed ids in growing prefixes of the given chunk sizes; every text must equal the whole decode."""
    text = IncrementalText(tokenizer)
    end = 0
    for size in [*chunks, len(ids)]:
        end = min(len(ids), end + max(1, size))
        want = tokenizer.decode(ids[:end], skip_special_tokens=True)
        assert text(ids[:end]) == want, (ids[:end], end)
        if end == len(ids):
            break
    return text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(ALPHABET, min_size=1, max_size=40), chunks=st.lists(st.integers(1, 4), max_size=30))
def test_text_with_multibyte_characters(tokenizer, parts, chunks):
    ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
    grow(tokenizer, ids, chunks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunks=st.lists(st.integers(1, 3), max_size=30))
def test_arbitrary_ids_including_partial_bytes_and_special_tokens(tokenizer, data, chunks):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=40))
    grow(tokenizer, ids, chunks)


def test_ids_that_are_cut_start_over(tokenizer):
    ids = tokenizer("def f(x):\n    return x + 1  # 🙂 done", add_special_tokens=False)["input_ids"]
    text = grow(tokenizer, ids, [2, 2, 2])
    assert text(ids[:3]) == tokenizer.decode(ids[:3], skip_special_tokens=True)
    other = tokenizer("print('hello')", add_special_tokens=False)["input_ids"]
    assert text(other) == tokenizer.decode(other, skip_special_tokens=True)


def test_only_a_window_is_decoded(tokenizer):
    """Growing a long answer token by token decodes O(n) ids in all, not O(n^2)."""
    ids = tokenizer(" ".join(f"word{i} é中🙂" for i in range(120)), add_special_tokens=False)["input_ids"]
    decoded = []

    class Counting:
        def decode(self, some, **kw):
            decoded.append(len(some))
            return tokenizer.decode(some, **kw)

    text = IncrementalText(Counting())
    for end in range(1, len(ids) + 1):
        assert text(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    assert len(ids) > 400 and sum(decoded) < 12 * len(ids), (sum(decoded), len(ids))
    calls = len(decoded)
    assert text(ids) == tokenizer.decode(ids, skip_special_tokens=True) and len(decoded) == calls  # asked again


def test_timeline_draws_tokens_that_look_like_mathtext(tmp_path):
    """Token labels are plain text: a drafted "$$" or "$x^" once made matplotlib's mathtext
    parser fail a whole bench run."""
    from specdec.events import RoundEvent
    from specdec.viz.timeline import plot_timeline

    class Tok:
        def decode(self, ids):
            return {1: "$$", 2: "$x^", 3: "\\frac{"}[ids[0]]

    events = [RoundEvent(0, "ngram", 2, [1, 2], 1, 3, "recovered", [1, 3], 1, 1, 0.0, 0.01,
                         draft_spans=[(0.0, 0.001)], target_span=(0.001, 0.01))]
    out = tmp_path / "t.png"
    plot_timeline(events, out, tokenizer=Tok())
    assert out.stat().st_size > 1000
