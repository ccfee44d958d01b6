"""The command line on the tiny pair: generate (text and --json), check, errors."""

import json

import pytest

from specdec.cli import main

STATS_KEYS = {"rounds", "target_calls", "draft_calls", "drafted", "accepted", "recovered", "bonus",
              "acceptance_rate", "tokens_per_round", "wall_s"}


def test_generate_json(tiny_pair, capsys):
    assert main(["generate", "def f(", "--target", tiny_pair["target"], "--draft", tiny_pair["close"],
                 "--max-new-tokens", "12", "--temperature", "0", "--json", "--compare"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert STATS_KEYS <= set(d["stats"])
    assert len(d["token_ids"]) == 12 and isinstance(d["text"], str)
    assert d["plain"]["token_ids"] == d["token_ids"]


def test_generate_plain_and_text_output(tiny_pair, capsys, tmp_path):
    png = tmp_path / "t.png"
    assert main(["generate", "import ", "--target", tiny_pair["target"], "--draft", tiny_pair["close"],
                 "--max-new-tokens", "10", "--timeline", str(png)]) == 0
    assert capsys.readouterr().out.startswith("import ")
    assert png.stat().st_size > 10_000
    assert main(["generate", "import ", "--target", tiny_pair["target"], "--draft", "none", "--json",
                 "--max-new-tokens", "5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stats"]["draft_calls"] == 0 and d["stats"]["rounds"] == 5


def test_check_passes_for_a_correct_pair(tiny_pair, capsys):
    code = main(["check", "--target", tiny_pair["target"], "--draft", tiny_pair["close"], "--samples", "150",
                 "--tokens", "2", "--temperature", "1.0", "--prompt", "def ", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["passed"] and 0 <= d["p_value"] <= 1 and d["drafted"] > 0


def test_a_check_in_which_nothing_was_drafted_is_inconclusive(tiny_pair, capsys):
    """One-token continuations leave no room for a draft: speculation was plain decoding, and
    a certificate of plain against plain says nothing about the prophet."""
    code = main(["check", "--target", tiny_pair["target"], "--draft", tiny_pair["close"], "--samples", "40",
                 "--tokens", "1", "--prompt", "def "])
    out = capsys.readouterr().out
    assert code == 1 and "INCONCLUSIVE: nothing was drafted" in out


@pytest.mark.parametrize("args,msg", [
    (["--target", "/no/such/model"], "no such directory"),
    (["--temperature", "-1"], "temperature"),
    (["--draft-tokens", "0"], "K must be"),
    (["--device", "tpu"], "device must be"),
    (["--device", "cuda:7"] if __import__("torch").cuda.is_available() else ["--device", "cuda"], "cuda"),
    (["--draft", "ngram+"], "empty part"),
    (["--draft", "ngram:x"], "longest match"),
])
def test_errors_are_clear_and_exit_2(tiny_pair, capsys, args, msg):
    argv = ["generate", "x", "--target", tiny_pair["target"], "--draft", tiny_pair["close"]] + args
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv,draft", [
    (["serve", "--target", "smollm2"], "default"),  # its default prophets have a batched path
    (["serve", "--target", "smollm2", "--max-batch", "1"], "default"),
    (["serve", "--target", "smollm2", "--draft", "none"], "none"),
])
def test_serve_keeps_the_requested_prophet(monkeypatch, argv, draft):
    import specdec.cli as cli

    seen = []

    def fake_load(args):
        seen.append(args.draft)
        raise ValueError("stop before loading")

    monkeypatch.setattr(cli, "_load", fake_load)
    assert main(argv) == 2 and seen == [draft]
