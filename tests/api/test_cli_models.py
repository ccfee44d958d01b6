"""Every command that loads a model, on models it cannot run and paths that hold none: one line
on stderr naming what is wrong and what to pass instead, exit code 2, never a traceback. And a
model it can run (a tiny Gemma 3, sliding-window layers) from a local directory, end to end."""

import io
import json
import shutil

import pytest

from specdec.cli import main
from tests.families import save_family_model
from tests.gguf_writer import write_tiny_gguf

COMMANDS = {
    "generate": ["generate", "x y", "--max-new-tokens", "4"],
    "chat": ["chat", "--draft", "none"],
    "check": ["check", "--draft", "ngram", "--samples", "5"],
    "calibrate": ["calibrate", "--draft", "ngram"],
    "bench": ["bench", "--quick", "--per-category", "1", "--max-new-tokens", "4"],
    "serve": ["serve", "--port", "0"],
    "distill": ["distill", "--max-steps", "1"],
    "index": ["index"],
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Paths that hold no model specdec can run, by name: what each must be refused for."""
    import transformers as tf

    from specdec.defaults import bundled_target

    root = tmp_path_factory.mktemp("bad")
    good = save_family_model("llama", root)
    (root / "empty").mkdir()
    for name in ("corrupt", "unknown", "no-tokenizer"):
        shutil.copytree(good, root / name)
    (root / "corrupt" / "model.safetensors").write_bytes(b"not safetensors")
    config = json.loads((root / "unknown" / "config.json").read_text())
    (root / "unknown" / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    for f in (root / "no-tokenizer").glob("tokenizer*"):
        f.unlink()
    (root / "garbage.gguf").write_text("not a GGUF file")
    write_tiny_gguf(root / "rwkv.gguf", arch="rwkv6")
    mamba = tf.AutoModelForCausalLM.from_config(tf.MambaConfig(vocab_size=8192, hidden_size=16, num_hidden_layers=1,
                                                               state_size=4))
    mamba.save_pretrained(str(root / "mamba"))
    tf.AutoTokenizer.from_pretrained(bundled_target()).save_pretrained(str(root / "mamba"))
    return {
        "missing": (str(root / "nope"), "no such directory"),
        "empty": (str(root / "empty"), "has no config.json"),
        "corrupt": (str(root / "corrupt"), "could not load target"),
        "unknown": (str(root / "unknown"), "frobnicator"),
        "no-tokenizer": (str(root / "no-tokenizer"), "has no tokenizer files"),
        "garbage.gguf": (str(root / "garbage.gguf"), "not a readable GGUF file"),
        "rwkv.gguf": (str(root / "rwkv.gguf"), "holds a 'rwkv6' model"),
        "mamba": (str(root / "mamba"), "cannot roll back"),
    }


TOKENIZER_FAULTS = {"missing", "empty", "no-tokenizer", "garbage.gguf", "rwkv.gguf"}  # what `index` reads


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", ["missing", "empty", "corrupt", "unknown", "no-tokenizer", "garbage.gguf",
                                  "rwkv.gguf", "mamba"])
def test_a_model_specdec_cannot_run_is_one_line_and_exit_code_2(bad, capsys, monkeypatch, tmp_path, command, case):
    if command == "index" and case not in TOKENIZER_FAULTS:
        pytest.skip("index reads the tokenizer only, which this case has")
    if command == "distill" and case in ("corrupt", "unknown", "mamba"):
        pytest.skip("distill reads the target after the corpus, which is missing first (tested below)")
    path, says = bad[case]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    where = {"index": ["--tokenizer", path, "--out", str(tmp_path / "ix.npz")],
             "distill": ["--target", path, "--work-dir", str(tmp_path)],
             "bench": ["--target", path, "--out", str(tmp_path)]}.get(command, ["--target", path])
    assert main(COMMANDS[command] + where) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and err.count("\n") == 1, err
    assert says in err or command == "distill" and "local model directory" in err, err


def test_distill_without_a_prepared_corpus_says_to_train_first(bad, capsys, tmp_path):
    good = bad["corrupt"][0]  # a directory with a config and a tokenizer
    assert main(["distill", "--target", good, "--work-dir", str(tmp_path), "--max-steps", "1"]) == 2
    assert "run `specdec train --work-dir" in capsys.readouterr().err


def test_a_fault_of_specdec_itself_is_one_line_too(monkeypatch, capsys):
    """Not bad input but a bug: one line saying how to see the traceback, exit code 1; with
    SPECDEC_TRACEBACK=1 the traceback itself."""
    import specdec.cli as cli

    def broken(args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(cli, "_load", broken)
    assert main(["generate", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: something broke" in err and "SPECDEC_TRACEBACK=1" in err
    monkeypatch.setenv("SPECDEC_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["generate", "x"])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return save_family_model("gemma3", tmp_path_factory.mktemp("gemma3"))


def test_a_local_directory_of_another_family_generates_and_compares(gemma3, capsys):
    """A tiny Gemma 3 (sliding-window layers, 8 positions) saved with save_pretrained: its
    default prophets (prompt lookup and the suffix index over the context) draft, the greedy
    tokens are plain decoding's, and --compare says so."""
    prompt = "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\na = 1\n"
    assert main(["generate", prompt, "--target", gemma3, "--temperature", "0", "--max-new-tokens", "24",
                 "--compare"]) == 0
    err = capsys.readouterr().err
    assert "ngram, retrieval:context" in err and "(identical tokens)" in err and "drafted 0 tokens" not in err


@pytest.mark.parametrize("draft,says", [("default", "proposed nothing for this prompt"), ("none", "no prophet")])
def test_compare_says_when_nothing_was_drafted(gemma3, capsys, draft, says):
    """One new token is one round, with nothing before it to look up: --compare would compare plain
    decoding with itself, and says so."""
    assert main(["generate", "Tell", "--target", gemma3, "--draft", draft, "--temperature", "0",
                 "--max-new-tokens", "1", "--compare"]) == 0
    err = capsys.readouterr().err
    assert "drafted 0 tokens: " in err and says in err
