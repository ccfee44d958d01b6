"""The training pipeline (`specdec train`, `specdec distill`) for a few steps on a tiny corpus."""

import json
import shutil

from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import load
from specdec.cli import main
from specdec.data.corpus import list_files, stdlib_root

LOOP = """seq_len = 64
batch_size = 2
lr = 1e-3
min_lr = 1e-4
warmup_steps = 2
weight_decay = 0.1
seed = 0
num_hidden_layers = {layers}
num_attention_heads = 2
num_key_value_heads = 2
max_position_embeddings = 128
tie_word_embeddings = true
"""

CONFIG = f"""
[corpus]
heldout_percent = 40
seed = "test"
[tokenizer]
vocab_size = 300
min_frequency = 2
[target]
hidden_size = 32
intermediate_size = 64
minutes = 1
{LOOP.format(layers=2)}
[prophet]
hidden_size = 16
intermediate_size = 32
data_minutes = 1
distill_minutes = 1
distill_temperature = 1.0
{LOOP.format(layers=1)}
"""


def test_split_is_deterministic_and_holds_files_out():
    a = list_files(4, "specdec-split-v1")
    b = list_files(4, "specdec-split-v1")
    assert [(f.relpath, f.heldout) for f in a] == [(f.relpath, f.heldout) for f in b]
    held = sum(f.heldout for f in a)
    assert 0.02 * len(a) < held < 0.07 * len(a)
    assert not any("site-packages" in f.relpath for f in a)


def test_train_and_distill_a_few_steps(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ["abc.py", "bisect.py", "colorsys.py", "keyword.py", "this.py", "fnmatch.py", "glob.py",
                 "shlex.py", "textwrap.py", "numbers.py"]:
        shutil.copy(stdlib_root() / name, corpus / name)
    (tmp_path / "cfg.toml").write_text(CONFIG)
    work, target, prophet, data = (tmp_path / n for n in ["work", "target", "prophet", "data"])
    assert main(["train", "--config", str(tmp_path / "cfg.toml"), "--work-dir", str(work), "--out", str(target),
                 "--corpus-root", str(corpus), "--max-steps", "3"]) == 0
    meta = json.loads((target / "training.json").read_text())
    assert meta["steps"] == 3 and meta["heldout_loss"] > 0
    assert json.loads((work / "split.json").read_text())["heldout"]
    assert main(["distill", "--config", str(tmp_path / "cfg.toml"), "--work-dir", str(work), "--target", str(target),
                 "--out", str(prophet), "--data-out", str(data), "--max-steps", "2"]) == 0
    meta = json.loads((prophet / "training.json").read_text())
    assert meta["kind"] == "prophet-distilled" and meta["distill_steps"] == 4
    # the results load with from_pretrained and decode together
    assert AutoModelForCausalLM.from_pretrained(str(prophet)).config.hidden_size == 16
    assert len(AutoTokenizer.from_pretrained(str(target))) == 300
    out = load(str(target), draft=str(prophet)).generate("def f(", max_new_tokens=8, temperature=0)
    assert len(out.token_ids) == 8
    # a second run resumes from the checkpoint instead of starting over
    assert main(["train", "--config", str(tmp_path / "cfg.toml"), "--work-dir", str(work), "--out", str(target),
                 "--corpus-root", str(corpus), "--max-steps", "4"]) == 0
    assert json.loads((target / "training.json").read_text())["steps"] == 4
