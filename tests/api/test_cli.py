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


@pytest.mark.slow
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
    (["--branches", "0"], "branches must be an integer from 1"),
    (["--branches", "4"], "has none: add one"),  # a draft model: no eagle to grow trees from
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


@pytest.mark.slow
def test_chat_keeps_the_conversation_and_reads_each_turn_from_the_prefix_cache(monkeypatch, capsys):
    """`specdec chat` on SmolLM2: a line per message, /reset, end of input ends; each answer is
    what the library answers to the same conversation, and later turns start from the cache."""
    import io

    from specdec import load

    system = "You are a terse assistant. Answer in a few words. " * 8
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n\n/reset\nName a color.\nAnd a fruit?\n"))
    assert main(["chat", "--draft", "none", "--temperature", "0", "--max-new-tokens", "8", "--system", system]) == 0
    out, err = capsys.readouterr()
    answers = out.splitlines()
    assert len(answers) == 3 and answers[0] == answers[1] and all(answers)
    turns = [line for line in err.splitlines() if "from the prefix cache]" in line]
    assert len(turns) == 3 and "(conversation reset)" in err
    cached = [int(line.split(", ")[-1].split()[0]) for line in turns]
    assert cached[0] == 0 and cached[1] >= 64 and cached[2] >= 64, turns  # the system message, then the turns
    plain = load("smollm2", draft="none")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": answers[1]}, {"role": "user", "content": "And a fruit?"}]
    assert plain.generate(messages=messages, max_new_tokens=8, temperature=0).text == answers[2]


def test_chat_refuses_bad_input_in_one_line(tiny_pair, capsys):
    assert main(["chat", "--prefix-cache", "-1"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert main(["chat", "--target", tiny_pair["target"], "--draft", "none"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_a_bad_argument_is_one_line_on_stderr_and_exit_code_2(capsys):
    """argparse's errors (an unknown choice, a value of the wrong type, an unknown command) are one
    line naming what is wrong, with no usage block, and exit code 2."""
    for argv in (["generate", "hi", "--kv-dtype", "half"], ["generate", "--max-new-tokens", "x", "hi"], ["bogus"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "error:" in err and "usage" not in err, (argv, err)
