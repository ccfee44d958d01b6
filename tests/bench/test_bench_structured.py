"""`specdec bench --suite structured --peers llama.cpp`: llama.cpp's own JSON-schema
constrained decoding beside specdec's constrained configurations: its bad input refused in
one line before any model loads, the suite's rows with a peer (items it cannot take counted
invalid and left out of its seconds), and, where llama-cpp-python imports, a real run of two
schemas through it that checks validity. Never the timings."""

import json
import sys

import pytest

from specdec.bench import peers, structured
from specdec.cli import main


@pytest.mark.parametrize("case", ["unknown", "missing-package", "not-gguf"])
def test_bad_structured_peers_exit_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    if case == "missing-package":
        monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp fails as if not installed
    else:
        monkeypatch.setitem(peers.REQUIRES, "llama.cpp", lambda: None)
    out = tmp_path / "out"
    args = ["bench", "--suite", "structured", "--target", "bundled" if case == "not-gguf" else "smollm2",
            "--peers", "vllm" if case == "unknown" else "llama.cpp", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error: --peers"), err
    assert ('pip install -e ".[llamacpp]"' in err[0]) == (case != "not-gguf"), err
    assert ("known: llama.cpp" in err[0]) == (case == "unknown"), err
    assert not out.exists()  # refused before any model loaded


def _run(config, item, wall, tokens, valid=True, not_run=None):
    return {"config": config, "item": item, "wall_s": wall, "new_tokens": tokens, "target_calls": tokens,
            "rounds": tokens, "forced": 0, "accepted": 0, "valid": valid, "not_run": not_run,
            "mask_s": None if config.startswith("llama") else 0.001}


def test_a_peers_items_not_run_are_invalid_and_left_out_of_its_seconds():
    runs = [_run("plain constrained", "a", 1.0, 10), _run("plain constrained", "b", 3.0, 30),
            _run("llama.cpp constrained", "a", 2.0, 12), _run("llama.cpp constrained", "b", 0.0, 0, False, "refused")]
    rows = {r["config"]: r for r in structured.summarize_runs(runs, ("plain constrained", "llama.cpp constrained"))}
    peer = rows["llama.cpp constrained"]
    assert (peer["items"], peer["not_run"], peer["valid"]) == (2, 1, 1)
    assert peer["speedup_vs_plain_constrained"] == pytest.approx(0.5)  # against plain's item "a" alone
    assert peer["tokens_per_s"] == pytest.approx(6.0) and peer["mask_ms_per_round"] is None
    assert rows["plain constrained"]["speedup_vs_plain_constrained"] == pytest.approx(1.0)
    report = {"command": "c", "machine": "m", "target": "t", "prophets": [], "schemas": 2, "tool_calls": 0,
              "max_new_tokens": 8, "rows": list(rows.values()), "greedy_mismatches": [],
              "peers": {"llama.cpp constrained": {"package": "llama-cpp-python 0", "file": "x.gguf", "threads": 1}},
              "runs": runs}
    md = structured.report_markdown(report)
    assert "| llama.cpp constrained | 1/2 |" in md and "| - | - |" in md  # its mask time is not told apart
    assert "1 item(s) not run, counted invalid (refused" in md and "the same GGUF file x.gguf" in md


def test_the_suite_runs_a_peer_interleaved(tmp_path, monkeypatch):
    """The structured suite with --peers on two items (a schema, a tool call): a fake peer
    in the rotation, fed the chat template's token ids and the item's grammar."""
    suite = structured.load_suite()
    small = {"schemas": suite["schemas"][:1], "tools": suite["tools"], "tool_calls": suite["tool_calls"][-1:]}
    monkeypatch.setattr(structured, "load_suite", lambda: small)
    monkeypatch.setitem(peers.REQUIRES, "llama.cpp", lambda: None)
    monkeypatch.setattr(structured, "peer_gbnf", lambda item: f"root ::= {item['kind']!r}")
    seen = []

    class FakePeer:
        info = {"package": "fake 1", "file": "fake.gguf", "threads": 1}

        def grammar_error(self, gbnf):
            return "refused" if "tool" in gbnf else None

        def generate(self, prompt_ids, seed, settings):
            seen.append((len(prompt_ids), settings["gbnf"], settings["temperature"]))
            return [2], 0.01, {"target_calls": 2, "drafted": 0, "accepted": 0}  # an empty answer: invalid

    monkeypatch.setattr(structured, "load_peer", lambda cfg, path, n_ctx, threads, eos: FakePeer())
    out = tmp_path / "out"
    assert main(["bench", "--suite", "structured", "--peers", "llama.cpp", "--max-new-tokens", "12",
                 "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {*structured.CONFIGS, "llama.cpp constrained"}
    peer = rows["llama.cpp constrained"]
    assert (peer["items"], peer["not_run"], peer["valid"]) == (2, 1, 0)
    assert seen and all(n > 20 and g == "root ::= 'schema'" and t == 0.0 for n, g, t in seen)
    assert all(r["items"] == 2 for r in rows.values())
    assert report["peers"]["llama.cpp constrained"]["file"] == "fake.gguf"
    assert {r["config"] for r in report["runs"]} == set(rows)  # every configuration on every item
    assert "| llama.cpp constrained | 0/2 |" in (out / "bench.md").read_text()


def test_llama_cpp_constrained_answers_two_schemas_validly():
    pytest.importorskip("llama_cpp")
    import specdec

    decoder = specdec.load("smollm2", draft="none")
    work = [w for w in structured.items(structured.load_suite(), None, 0) if w["name"] in ("person", "phone")]
    table = peers.STRUCTURED_PEER_CONFIGS["llama.cpp"]
    loaded = structured.load_peers(table, "smollm2", decoder, work, 60)
    (name, peer), = loaded.items()
    person, phone = work
    assert person["peer_errors"] == {name: None}
    # llama-cpp-python's converter writes "\d" into GBNF literals, which llama.cpp refuses: checked, not crashed
    assert phone["peer_errors"][name] == "llama.cpp does not parse the grammar"
    assert peer.grammar_error('root ::= "a" | "b"') is None
    for item, schema in ((person, person["schema"]), ({**person, "schema": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"]}}, None)):
        if schema is None:
            item["gbnf"] = structured.peer_gbnf(item)
        run = structured.run_peer(decoder, peer, name, item, 60)
        assert run["valid"] and run["finish_reason"] == "stop" and run["wall_s"] > 0, run
        assert run["target_calls"] == run["new_tokens"]  # one pass a token, the prompt's among them
    assert structured.run_peer(decoder, peer, name, phone, 60)["not_run"]
