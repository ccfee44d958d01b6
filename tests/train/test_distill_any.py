"""`specdec distill --target X --minutes N` on tiny random-weight models of two families (no download):
a Qwen3 with a chat template (Magpie questions and task prompts) and a Gemma 3 base model with
sliding windows (continuations of its own text). The whole command at a tiny scale writes the
prophet under the hash of the weights, `default_prophet_for` names it, decoding with it drafts and
is token-identical to plain decoding; a rerun after an interruption redoes no finished stage; bad
targets get one line and exit code 2; the trainer reads the very embeddings, head and soft-capped
distribution the serving prophet and the target use."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec import load
from specdec.cli import main
from specdec.defaults import bundled_target, default_prophet_for, weights_files, weights_key
from specdec.train import anytarget

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TINY = ["--minutes", "1", "--prompts", "8", "--batch-size", "4", "--max-new-tokens", "24", "--max-steps", "8"]


def tiny_model(family: str, root: Path, template: str | None = None) -> str:
    """A tiny random model of a family saved with the bundled tokenizer (and a chat template with its
    turn tokens where given): qwen3 (q/k norms), gemma2 (soft-capping, scaled embeddings), gemma3
    (sliding windows of 8), gpt2 (no lean family)."""
    import transformers as T
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_target())
    if template is not None:
        turns = ["<|im_start|>", "<|im_end|>"] if template == CHATML else ["<start_of_turn>", "<end_of_turn>"]
        tok.add_special_tokens({"additional_special_tokens": turns})
        tok.chat_template = template
    eos = [0, len(tok) - 1] if template is not None else 0  # the end of a turn ends an answer
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3,
                  bos_token_id=0, eos_token_id=eos, pad_token_id=0)
    cfg = {"qwen3": lambda: T.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **common),
           "gemma2": lambda: T.Gemma2Config(num_hidden_layers=2, query_pre_attn_scalar=16, **common),
           "gemma3": lambda: T.Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
                                                layer_types=["sliding_attention", "full_attention"] * 2, **common),
           "gpt2": lambda: T.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128)}[family]()
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    out = root / family
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill-any")
    return {"qwen3": tiny_model("qwen3", root, CHATML), "gemma3": tiny_model("gemma3", root),
            "gpt2": tiny_model("gpt2", root)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def distill(target: str, *extra: str) -> int:
    return main(["distill", "--target", target, *TINY, *extra])


def test_a_chat_model_end_to_end_the_prophet_load_finds_drafts_and_decodes_as_plain(models, cache, capsys, tmp_path):
    target = models["qwen3"]
    assert distill(target, "--check-samples", "60") == 0
    out = capsys.readouterr()
    key = weights_key(weights_files(target))
    prophet = cache / "prophets" / key / "eagle"
    assert f"prophet: {prophet}" in out.out
    assert "held-out greedy agreement by draft step: 1: " in out.out and "PASS" in out.out
    assert "min in all: data" in out.err and "stage 3 of 3, training" in out.err  # the split, said on stderr
    report = json.loads((prophet.parent / "eagle-evaluation.json").read_text())
    assert len(report["training"]["heldout_agreement"]) == anytarget.UNROLL and report["weights_key"] == key
    prompts = json.loads((cache / "distill" / key / "prompts.json").read_text())
    assert {p["category"] for p in prompts} - {"magpie"}  # task prompts, in the chat template
    assert all(p["ids"][:2] == prompts[0]["ids"][:2] for p in prompts)  # <|im_start|>user ...

    assert default_prophet_for(target) == f"ngram+{prophet}"
    moved = tmp_path / "elsewhere"  # the same weights at another path: the same prophet (a hash, not the path)
    shutil.copytree(target, moved)
    assert default_prophet_for(str(moved)) == f"ngram+{prophet}"

    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    plain = load(target, draft="none").generate(messages=chat, max_new_tokens=40, temperature=0)
    spec = load(target)  # the default: prompt lookup, then the trained eagle
    assert [p.name for p in spec.prophets][-1] == "eagle"
    eagle = load(target, draft=str(prophet))
    for decoder in (spec, eagle):
        out_spec = decoder.generate(messages=chat, max_new_tokens=40, temperature=0)
        assert out_spec.token_ids == plain.token_ids
    assert eagle.generate(messages=chat, max_new_tokens=40, temperature=0).stats.drafted > 0


def test_a_rerun_after_an_interruption_redoes_no_finished_stage(models, cache, monkeypatch, capsys):
    target = models["gemma3"]  # a base model: continuations of its own text
    real_features = anytarget.add_features

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(anytarget, "add_features", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(target, "--check-samples", "0")
    work = cache / "distill" / weights_key(weights_files(target))
    state = json.loads((work / "state.json").read_text())
    assert state["done"] == ["data"] and "ratio" in state  # measured on the first batch
    shards = {p.name: p.stat().st_mtime_ns for p in sorted(work.glob("shard-*.pt"))}
    assert len(shards) == 2
    prompts = json.loads((work / "prompts.json").read_text())
    assert {p["category"] for p in prompts} == {"own-text"} and all(p["ids"][0] == 0 for p in prompts)

    def redone(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(anytarget, "add_features", real_features)
    monkeypatch.setattr(anytarget, "answer", redone)
    monkeypatch.setattr(anytarget, "build_prompts", redone)
    assert distill(target, "--check-samples", "0") == 0
    first = torch.load(work / "shard-00000.pt", weights_only=False)  # its features were read in stage 1
    assert (work / "shard-00000.pt").stat().st_mtime_ns == shards["shard-00000.pt"]
    assert len(first["hidden"][0]) == len(first["ids"][0]) - 1
    assert json.loads((work / "state.json").read_text())["done"] == ["data", "features", "train"]

    monkeypatch.setattr(anytarget, "add_features", redone)
    monkeypatch.setattr(anytarget, "train", redone)
    capsys.readouterr()
    assert distill(target, "--check-samples", "0") == 0
    assert "already trained for these weights" in capsys.readouterr().err

    prompt = [0, *first["ids"][0][1:6]]  # an opening of its own text, past its sliding window of 8 below
    plain = load(target, draft="none").generate(prompt, max_new_tokens=30, temperature=0)
    for draft in ("default", str(work.parent.parent / "prophets" / work.name / "eagle")):
        out = load(target, draft=draft).generate(prompt, max_new_tokens=30, temperature=0)
        assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


@pytest.mark.parametrize("case", ["missing", "transformers-path", "no-target", "config", "zero-minutes"])
def test_bad_targets_and_settings_get_one_line_and_exit_code_2(models, cache, capsys, tmp_path, case):
    argv = {"missing": ["--target", str(tmp_path / "nothing-here")],
            "transformers-path": ["--target", models["gpt2"]],
            "no-target": [],
            "config": ["--target", models["qwen3"], "--config", "configs/bundled.toml"],
            "zero-minutes": ["--target", models["qwen3"], "--minutes", "0"]}[case]
    assert main(["distill", "--minutes", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error: ") and len(err.splitlines()) == 1, err
    if case == "transformers-path":
        assert "lean path" in err


@pytest.mark.parametrize("template,turn", [(CHATML, "<|im_start|>user\n"), (GEMMA, "<start_of_turn>user\n")])
def test_magpie_questions_start_where_the_users_text_would(template, turn):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_target())
    end = "<|im_end|>" if template == CHATML else "<end_of_turn>"
    tok.add_special_tokens({"additional_special_tokens": [turn.split("user")[0], end]})
    tok.chat_template = template
    prefix, ends, _ = anytarget.magpie_template(tok)
    assert tok.decode(prefix).endswith(turn) and "user" in tok.decode(prefix)
    assert ends == {tok.convert_tokens_to_ids(end)}


def test_training_reads_what_the_serving_prophet_and_the_target_read(tmp_path):
    """Gemma 2: scaled embeddings (the engine scales after its lookup) and a final soft-cap."""
    from specdec.prophets.feature import FeatureHead, save_head

    target = tiny_model("gemma2", tmp_path)
    decoder = load(target, draft="none")
    embed, head, softcap = anytarget.training_tensors(decoder)
    assert softcap == decoder.target.arch.final_softcap == 30.0
    path = tmp_path / "eagle"
    vocab = torch.arange(0, 4000)
    save_head(FeatureHead("eagle", head.shape[1], 32), vocab, path, {})
    prophet = load(target, draft=str(path), draft_dtype="float32").prophets[0]
    assert torch.equal(prophet.embed, embed) and torch.equal(prophet.head_weight, head[vocab])

    ids = decoder.prompt_ids("The sea and the sky")
    logits, hidden = decoder.target.view(1).forward_features([0], [0], [ids], [len(ids)])
    from specdec.train.features import FeatureData

    def Stored(h):  # noqa: N802 (features as the trainer holds them; only `hidden` is read here)
        empty = torch.zeros(0, dtype=torch.long)
        return FeatureData(h.to(torch.bfloat16), empty, empty, empty, empty, 0)

    stored = Stored(hidden[0])
    stored.targets_from_cache(tmp_path / "targets.pt", head, softcap)
    p = torch.softmax(logits[0], -1)  # the target's own distribution, soft-cap included
    assert torch.equal(stored.p_ids[:, 0].long(), p.argmax(-1))
    assert torch.allclose(stored.p_probs[:, 0], p.max(-1).values, atol=0.02)  # the features stored in bf16
    uncapped = Stored(hidden[0])
    uncapped.targets_from_cache(tmp_path / "uncapped.pt", head, None)
    assert not torch.allclose(uncapped.p_probs[:, 0], p.max(-1).values, atol=0.02)  # the soft-cap matters here


def test_the_weights_key_is_the_contents_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    a.write_bytes(b"weights" * 1000)
    b.write_bytes(b"weights" * 1000)
    c.write_bytes(b"weights" * 999 + b"Weight")
    assert weights_files(str(a)) == [a] and weights_files(str(tmp_path / "none.gguf")) == []
    assert weights_key([a]) == weights_key([b]) != weights_key([c])
    memo = json.loads((tmp_path / "cache" / "prophets" / "digests.json").read_text())
    assert set(memo) == {str(p.resolve()) for p in (a, b, c)}
    assert default_prophet_for(str(a)) == "ngram+retrieval:context"  # nothing trained for it
