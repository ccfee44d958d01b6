"""The wiring module: --draft specs parsed once and built through a registry of prophet
kinds, devices resolved with clear errors."""

import pytest
import torch

from specdec import load
from specdec.prophets.ngram import NgramProphet
from specdec.wiring import ProphetKind, build_prophets, parse_draft, prophet_kinds, register, resolve_device


def test_parse_draft():
    assert parse_draft("none") == [] and parse_draft("") == [] and parse_draft(None) == []
    assert parse_draft(" models/prophet + ngram ") == ["models/prophet", "ngram"]
    for bad, msg in [("ngram+", "empty part"), ("+ngram", "empty part"), ("ngram+ngram", "appear once")]:
        with pytest.raises(ValueError, match=msg):
            parse_draft(bad)


def test_each_part_is_built_by_the_first_kind_that_claims_it(tiny_pair):
    names = [k.name for k in prophet_kinds()]
    assert names[-1] == "model"  # the catch-all comes last
    assert {"ngram", "retrieval", "layerskip", "int8", "feature"} <= set(names)
    decoder = load(tiny_pair["target"], draft="none")
    built = build_prophets("ngram:3", decoder.target, decoder.tokenizer)
    assert isinstance(built[0], NgramProphet) and built[0].n_max == 3


def test_a_new_prophet_kind_registers_without_touching_the_wiring(tiny_pair, monkeypatch):
    import specdec.wiring as wiring

    monkeypatch.setattr(wiring, "_REGISTRY", list(wiring._REGISTRY))
    made = []

    def build(part, w):
        made.append((part, w.target.name))
        return NgramProphet(n_max=2, name=part)

    register(ProphetKind("echo", lambda p: p.startswith("echo:"), build, "an ngram under another name"))
    assert [k.name for k in prophet_kinds()][-2:] == ["echo", "model"]  # ahead of the catch-all
    decoder = load(tiny_pair["target"], draft="echo:a+ngram")
    assert [d.name for d in decoder.prophets] == ["echo:a", "ngram"] and made == [("echo:a", tiny_pair["target"])]
    with pytest.raises(ValueError, match="registered already"):
        register(ProphetKind("echo", lambda p: False, build, ""))


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_everything_lives_on_the_models_device(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], device="cpu")
    assert decoder.target.device == torch.device("cpu") and decoder.prophets[0].lm.device == torch.device("cpu")
    out = decoder.generate("def f(", max_new_tokens=8, temperature=0.8, seed=3)
    again = decoder.generate("def f(", max_new_tokens=8, temperature=0.8, seed=3)
    assert out.token_ids == again.token_ids and len(out.token_ids) == 8


def test_default_prophets():
    from specdec.defaults import bundled_prophet, bundled_target, default_prophet_for, default_target, models_dir

    assert default_prophet_for(bundled_target()) == bundled_prophet() == default_prophet_for("bundled")
    assert default_target() == "smollm2"
    assert default_prophet_for("smollm2") == f"ngram+{models_dir() / 'smollm2-eagle'}"
    assert default_prophet_for("some/other-model") == "ngram+retrieval:context"
    from specdec.defaults import default_multi_for

    assert default_multi_for("ngram+retrieval:context") == "best" and default_multi_for("ngram") == "auto"


def test_draft_dtype_takes_a_dtype_or_its_name_and_refuses_anything_else(tiny_pair, monkeypatch):
    """load(draft_dtype=...): a torch float dtype or "float32" / "bfloat16" / "float16" / "auto" /
    "default"; anything else is a ValueError that lists the choices, raised before a model loads."""
    import specdec.api as api

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_dtype="bfloat16")
    assert decoder.prophets[0].lm.model.dtype == torch.bfloat16
    assert api.resolve_draft_dtype("float32") is torch.float32 and api.resolve_draft_dtype("default") is None
    assert api.resolve_draft_dtype(torch.float16) is torch.float16
    monkeypatch.setattr(api, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    for bad in ("int4", "fp32", torch.int8, 16):
        with pytest.raises(ValueError, match="draft_dtype must be a float torch dtype or one of default"):
            load(tiny_pair["target"], draft_dtype=bad)
