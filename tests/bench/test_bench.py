"""`specdec bench --quick` end to end on the tiny pair: the report's structure and its
safety rules (greedy identity before any ratio), not its timings."""

import json

from specdec.cli import main
from specdec.data.prompts import CATEGORIES, build_suite


def test_prompt_suite_is_deterministic_and_labelled():
    a, b = build_suite(2), build_suite(2)
    assert a == b
    assert {p.category for p in a} == set(CATEGORIES)
    held = {p.source.split(":")[0] for p in a}
    split = __import__("specdec.data.corpus", fromlist=["list_files"]).list_files(4, "specdec-split-v1")
    heldout = {f.relpath for f in split if f.heldout}
    assert held <= heldout


def test_quick_bench_writes_a_complete_report(tiny_pair, tmp_path):
    out = tmp_path / "b"
    assert main(["bench", "--quick", "--target", tiny_pair["target"], "--prophet", tiny_pair["close"],
                 "--out", str(out), "--per-category", "1", "--max-new-tokens", "12"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert {"machine", "results", "prompts", "command"} <= set(report)
    assert report["machine"]["other_load_cores"] >= 0  # how busy the rest of the machine was, said in the report
    assert "other processes used" in (out / "bench.md").read_text()
    greedy = report["results"][0]
    rows = {r["config"]: r for r in greedy["rows"]}
    assert {"plain", "plain (again)", "prophet auto (default)", "prophet K=4", "ngram", "hf plain", "hf assisted K=4",
            "hf prompt-lookup"} <= set(rows)
    for name, r in rows.items():
        assert r["identical_to_plain"], name  # greedy outputs identical, so every ratio is reported
        assert r["speedup"] and r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
    d = rows["prophet K=4"]
    assert 0 <= d["acceptance_rate"] <= 1 and d["predicted_speedup"] > 0 and d["acceptance_by_position"]
    assert greedy["costs"]["c"] > 0 and greedy["costs"]["v_4"] > 0
    assert (out / "bench.md").read_text().count("|") > 20
    assert (out / "timeline-greedy.png").exists() and (out / "speedup-greedy.png").exists()
    assert report["results"][1]["mode"] == "sampling"
    assert report["roofline"]["parts"][0]["name"] == "target" and "Roofline: " in (out / "bench.md").read_text()


def test_configs_not_in_the_suite_are_an_error_not_left_out(tiny_pair, tmp_path, capsys):
    out = tmp_path / "b"
    code = main(["bench", "--quick", "--target", tiny_pair["target"], "--prophet", tiny_pair["close"],
                 "--out", str(out), "--configs", "prophet K=4", "eagle K=4"])
    assert code == 2 and not out.exists()  # checked before anything loads or is written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eagle K=4' is not a configuration of the code (the bundled pair) suite" in err[0]
    assert "'prophet K=4'" in err[0].split("its configurations:")[1]  # the names it runs, to choose from
    # a name of the other mode's table only (greedy's "ngram" in --quick) is not an error
    assert main(["bench", "--quick", "--target", tiny_pair["target"], "--prophet", tiny_pair["close"],
                 "--out", str(out), "--per-category", "1", "--max-new-tokens", "6", "--modes", "sampling",
                 "--configs", "ngram"]) == 0


def test_gpu_check_names_configurations_the_code_suite_runs():
    """scripts/gpu-check's bench asks for configurations by name; each must be one the bundled
    pair's quick suite runs (a name it did not know once left the GPU bench measuring plain
    decoding alone). Where there is no CUDA GPU the script says so and exits 0."""
    import shlex
    import subprocess
    from pathlib import Path

    import torch

    from specdec.bench.main import configs_for

    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts" / "gpu-check").read_text()
    words = shlex.split(script[script.index("specdec.cli bench"):].split("\nbench=")[0].replace("\\\n", " "))
    names = words[words.index("--configs") + 1:]
    assert "--target" in words and words[words.index("--target") + 1] == "models/target"
    known = {c.name for greedy in (True, False) for c in configs_for(True, greedy)}
    assert names and set(names) <= known, set(names) - known
    if not torch.cuda.is_available():
        done = subprocess.run([str(root / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "no CUDA GPU" in done.stdout


def test_a_configuration_that_drafted_nothing_is_named_in_the_report():
    """A prophet that proposed no token on the prompts gives plain decoding's figures: the report
    says so under the table, for specdec's configurations with prophets only."""
    from specdec.bench.report import markdown, nothing_drafted

    rows = [{"config": "plain", "kind": "ours", "draft": "none", "drafted": 0},
            {"config": "ngram", "kind": "ours", "draft": "ngram", "drafted": 0},
            {"config": "prophet K=4", "kind": "ours", "draft": "models/prophet", "drafted": 31},
            {"config": "hf prompt-lookup", "kind": "hf-lookup", "draft": "none"}]
    assert nothing_drafted(rows) == ["drafted 0 tokens: 'ngram' (ngram) proposed nothing on these prompts, so its "
                                     "figures are plain decoding's"]
    assert markdown(rows, {}, [], "### greedy").rstrip().endswith(nothing_drafted(rows)[0])


def test_the_benchs_default_prophet_is_the_targets_own(tmp_path, monkeypatch):
    """`specdec bench --target X` drafts its "default" configurations with X's own default prophet
    (the bundled prophet only for the bundled target: another model's vocabulary differs), and runs
    transformers' assisted generation only where that prophet is a model directory."""
    from specdec.bench.main import _draft_spec, bench_prophet, is_model_dir
    from specdec.defaults import DEFAULT_LOOKUP, bundled_prophet
    from tests.gguf_writer import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert bench_prophet("bundled", None) == bundled_prophet() and is_model_dir(bundled_prophet())
    assert bench_prophet(None, None) == bench_prophet("smollm2", None)  # the default target's
    assert bench_prophet("smollm2", None).startswith("ngram+")
    other = str(write_tiny_gguf(tmp_path / "other.gguf"))
    assert bench_prophet(other, None) == DEFAULT_LOOKUP and not is_model_dir(DEFAULT_LOOKUP)
    assert bench_prophet(other, "ngram") == "ngram"
    assert _draft_spec("default+ngram", DEFAULT_LOOKUP) == DEFAULT_LOOKUP  # each part once
    assert _draft_spec("default", "/m/p") == "/m/p" and _draft_spec("ngram", "/m/p") == "ngram"
