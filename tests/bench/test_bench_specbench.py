"""`specdec bench --suite spec-bench` end to end on the bundled pair: the per-task report
(tokens per target pass, acceptance, greedy identity with plain decoding) and its bad
input, never its timings."""

import itertools
import json

import pytest

from specdec.bench.main import specbench_questions
from specdec.cli import main

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short note about the weather.", "Shorter."]},
    {"question_id": 121, "category": "coding", "turns": ["def parse(path):\n    \"\"\"Read the file at path"]},
    {"question_id": 201, "category": "translation", "turns": ["Translate into German: the cat sleeps."]},
]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def specbench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("specbench")
    questions = _write(tmp / "q.jsonl", QUESTIONS)
    out = tmp / "out"
    rc = main(["bench", "--suite", "spec-bench", "--questions", str(questions), "--target", "bundled",
               "--max-new-tokens", "8", "--modes", "greedy,sampling", "--out", str(out)])
    return rc, out


@pytest.mark.slow
def test_specbench_reports_every_task_and_overall(specbench_run):
    rc, out = specbench_run
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["suite"] == "spec-bench" and report["machine"]["cpu"] is not None
    assert report["machine"]["other_load_cores"] >= 0
    assert [p["task"] for p in report["prompts"]] == ["mt_bench", "mt_bench", "translation"]
    assert {r["method"]: r["tokens_per_pass"] for r in report["leaderboard_tokens_per_pass"]}["EAGLE-2"] == 4.35
    greedy, sampling = report["results"]
    assert (greedy["mode"], sampling["mode"]) == ("greedy", "sampling")
    assert sampling["settings"]["temperature"] == 1.0 and greedy["settings"]["temperature"] == 0.0
    for res in (greedy, sampling):
        rows = {(r["config"], r["task"]): r for r in res["tasks"]}
        spec = next(r["config"] for r in res["tasks"] if r["config"].startswith("default"))
        assert set(rows) == {(c, t) for c in ("plain (again)", spec) for t in ("mt_bench", "translation", "overall")}
        assert rows[(spec, "overall")]["questions"] == 3 and rows[(spec, "mt_bench")]["questions"] == 2
        for r in res["tasks"]:
            assert r["tokens_per_pass"] >= 1.0, r
            assert r["speedup"] is not None and r["speedup"] > 0
        for task in ("mt_bench", "translation", "overall"):
            assert rows[("plain (again)", task)]["tokens_per_pass"] == 1.0
            assert rows[("plain (again)", task)]["acceptance_rate"] is None
            assert 0.0 <= rows[(spec, task)]["acceptance_rate"] <= 1.0
        # the bench's usual per-configuration rows, in the same format
        assert {r["config"] for r in res["rows"]} == {"plain", "plain (again)", spec}
    for r in greedy["tasks"]:  # greedy speculative decoding gives plain decoding's tokens exactly
        assert r["identical"] == r["questions"] and r["identical_to_plain"] and not r["mismatches"], r
    assert all(r["identical"] is None for r in sampling["tasks"])
    assert {r["config"] for r in greedy["runs"]} == {"plain", "plain (again)", spec}
    assert len(greedy["runs"]) == 3 * 3
    for res in (greedy, sampling):  # every run of ours knows when its first token was out
        assert all(0 < r["first_token_s"] <= r["wall_s"] for r in res["runs"]), res["runs"]
        assert all(r["decode_speedup"] is None or r["decode_speedup"] > 0 for r in res["tasks"])


@pytest.mark.slow
def test_specbench_markdown_has_the_per_task_rows(specbench_run):
    _, out = specbench_run
    md = (out / "bench.md").read_text()
    assert "Machine: " in md and "Spec-Bench: 3 questions (mt_bench 2, translation 1)" in md
    assert "EAGLE-3 (Vicuna-13B) 5.71" in md and "prompt lookup (PLD) 1.73" in md
    assert md.count("### ") == 2 and "tokens per target pass" in md
    lines = [line for line in md.splitlines() if line.startswith("| default")]
    assert any("| mt_bench |" in line for line in lines) and any("| translation |" in line for line in lines)
    assert any("| **overall** |" in line and "| 3/3 |" in line for line in lines)
    assert "MISMATCH" not in md


def test_specbench_question_selection(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]}
            for i, c in enumerate(["writing"] * 3 + ["coding"] * 3 + ["qa"] * 3 + ["rag"])]
    path = _write(tmp_path / "q.jsonl", rows)
    two = specbench_questions(str(path), 2)
    # MT-bench's categories taken in turn; tasks in Spec-Bench's order
    assert [(p.category, p.text) for p in two] == [("mt_bench", "q0"), ("mt_bench", "q3"), ("qa", "q6"),
                                                   ("qa", "q7"), ("rag", "q9")]
    assert len(specbench_questions(str(path), 0)) == 10


@pytest.mark.parametrize("case", ["missing", "unreadable", "directory", "malformed", "no-turns", "empty",
                                  "not-spec-bench", "negative", "branches-zero", "branches-word"])
def test_specbench_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    good = _write(tmp_path / "good.jsonl", QUESTIONS)
    args = ["bench", "--suite", "spec-bench", "--target", "bundled", "--out", str(tmp_path / "out")]
    if case == "unreadable":
        args += ["--questions", str(tmp_path / "no-such-file.jsonl")]
    elif case == "directory":
        args += ["--questions", str(tmp_path)]
    elif case == "malformed":
        args += ["--questions", str(_write(tmp_path / "bad.jsonl", [QUESTIONS[0], '{"question_id": 2, "categ']))]
    elif case == "no-turns":
        args += ["--questions", str(_write(tmp_path / "bad.jsonl", [{"question_id": 1, "category": "qa"}]))]
    elif case == "empty":
        args += ["--questions", str(_write(tmp_path / "bad.jsonl", [""]))]
    elif case == "not-spec-bench":
        args = ["bench", "--suite", "code", "--questions", str(good), "--out", str(tmp_path / "out")]
    elif case == "negative":
        args += ["--questions", str(good), "--per-task", "-1"]
    elif case.startswith("branches"):
        args += ["--questions", str(good), "--branches", "1,0" if case == "branches-zero" else "1,x"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error: "), err
    if case == "malformed":
        assert "line 2" in err[0]
    assert not (tmp_path / "out").exists()  # refused before anything was loaded or written


def test_a_greedy_mismatch_is_reported_loudly_and_withholds_the_speedup():
    from specdec.bench.report import by_task, specbench_markdown
    from specdec.bench.runner import Config, Run

    configs = [Config("plain", "ours"), Config("spec", "ours", "ngram")]
    stats = {"target_calls": 2, "drafted": 4, "accepted": 2}
    runs = [Run("plain", 0, "qa", [1, 2, 3], 1.0, {"target_calls": 3}), Run("spec", 0, "qa", [1, 2, 3], 0.5, stats),
            Run("plain", 1, "rag", [4, 5], 1.0, {"target_calls": 2}), Run("spec", 1, "rag", [4, 6], 0.5, stats)]
    rows = {r["task"]: r for r in by_task(runs, configs, "plain", True, ["qa", "rag"], ["qa:1", "rag:2"])}
    assert rows["qa"]["speedup"] == pytest.approx(2.0) and rows["qa"]["identical"] == 1
    assert rows["rag"]["speedup"] is None and rows["rag"]["mismatches"] == ["rag:2"]
    assert rows["overall"]["speedup"] is None and rows["overall"]["identical"] == 1
    assert rows["overall"]["tokens_per_pass"] == pytest.approx(5 / 4)
    assert rows["overall"]["acceptance_rate"] == pytest.approx(0.5)
    md = specbench_markdown(list(rows.values()), "### greedy")
    assert "1/2 **MISMATCH**" in md and "MISMATCH: greedy speculative output differs" in md and "rag:2" in md


@pytest.mark.slow
def test_specbench_report_has_the_roofline(specbench_run):
    _, out = specbench_run
    report = json.loads((out / "bench.json").read_text())
    parts = {p["name"]: p for p in report["roofline"]["parts"]}
    assert parts["target"]["megabytes"] > 0 and parts["target"]["measured_ms"] > 0
    assert report["roofline"]["bandwidth_gb_s"] > 0
    assert "Roofline: this machine streams" in (out / "bench.md").read_text()


@pytest.mark.slow
def test_specbench_report_has_the_cost_curve(specbench_run):
    """The machine's measured cost curve (tokens scored in one pass -> one-token steps) beside the
    figures it explains: one token costs one step, the curve never falls, and the report says so."""
    _, out = specbench_run
    curve = json.loads((out / "bench.json").read_text())["cost_curve"]
    for label in ("greedy", "temperature 1"):
        steps = {int(n): v for n, v in curve["curves"][label]["steps"].items()}
        assert steps[1] == pytest.approx(1.0) and len(steps) >= 2
        assert all(steps[a] <= steps[b] for a, b in itertools.pairwise(sorted(steps)))
        assert curve["curves"][label]["step_ms"] > 0
    assert "Cost curve, tokens scored in one pass -> one-token steps" in (out / "bench.md").read_text()


def test_decoding_speedup_leaves_out_the_prompt_reading():
    """Sampled runs end at different lengths: the decoding speedup compares tokens after the first
    over the seconds after the first token, so a short answer's prompt reading does not count
    against it, while Spec-Bench's throughput ratio is kept as it is."""
    from specdec.bench.report import by_task, specbench_markdown
    from specdec.bench.runner import Config, Run

    configs = [Config("plain", "ours"), Config("spec", "ours", "ngram")]
    # plain: 1 s to its first token, then 100 tokens at 0.01 s; spec: the same prompt reading, then
    # 20 tokens twice as fast, ending early
    runs = [Run("plain", 0, "qa", list(range(101)), 2.0, {"target_calls": 101, "first_token_s": 1.0}),
            Run("spec", 0, "qa", list(range(21)), 1.1, {"target_calls": 11, "first_token_s": 1.0})]
    rows = {r["task"]: r for r in by_task(runs, configs, "plain", False, ["qa"], ["qa:1"])}
    assert rows["qa"]["speedup"] == pytest.approx((21 / 1.1) / (101 / 2.0))  # < 1: most of its time read the prompt
    assert rows["qa"]["decode_speedup"] == pytest.approx((20 / 0.1) / (100 / 1.0))  # 2.0
    assert "decoding speedup" in specbench_markdown(list(rows.values()), "### sampling")
    peerless = [Run("plain", 0, "qa", [1, 2], 1.0, {}), Run("spec", 0, "qa", [1, 2], 1.0, {"first_token_s": 0.5})]
    assert by_task(peerless, configs, "plain", False, ["qa"], ["qa:1"])[0]["decode_speedup"] is None


def test_specbench_runs_each_draft_once_per_branches_value():
    from specdec.bench.main import parse_branches, specbench_configs

    assert parse_branches(None) == [1] and parse_branches("1,4") == [1, 4]
    configs = specbench_configs("smollm2", ["default", "ngram"], [1, 4])
    assert [(c.name, c.branches) for c in configs[2:]] == [
        ("default (ngram+models/smollm2-eagle)", 1), ("default (ngram+models/smollm2-eagle), branches 4", 4),
        ("ngram", 1), ("ngram, branches 4", 4)]
    assert [c.branches for c in configs[:2]] == [1, 1]  # plain twice
