"""What a new user is promised: `--json` prints one JSON document on stdout and nothing
else (first-run conversions and datastore builds included), and with a seed the output is
a function of (decoder settings, prompt, seed) for every policy, across fresh loads."""

import json

import pytest

import specdec.data.corpus as corpus
from specdec import load
from specdec.cli import main
from specdec.policy import POLICIES
from tests.gguf_writer import write_tiny_gguf


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run_json(argv, capfd):
    code = main(argv)
    out, err = capfd.readouterr()
    assert code in (0, 1), err
    assert out.endswith("\n") and out.count("\n") == 1, out[:500]  # one line: one document
    return json.loads(out), err


def test_every_json_command_prints_one_json_document_and_nothing_else(tiny_pair, tmp_path, cache, monkeypatch,
                                                                      capfd):
    every = corpus.list_files
    monkeypatch.setattr(corpus, "list_files", lambda *a, **k: every(*a, **k)[:40])  # a small first-run build
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    # first run: the GGUF file is converted and the retrieval datastore built, both with progress
    doc, err = run_json(["generate", "abc", "--target", str(gguf), "--draft", "retrieval", "--max-new-tokens", "6",
                         "--temperature", "0", "--json"], capfd)
    assert len(doc["token_ids"]) == 6
    assert "retrieval datastore" in err and (cache / "gguf").is_dir()
    tiny = ["--target", tiny_pair["target"], "--draft", tiny_pair["close"]]
    doc, _ = run_json(["generate", "def f(", *tiny, "--max-new-tokens", "8", "--temperature", "0", "--compare",
                       "--json"], capfd)
    assert doc["plain"]["token_ids"] == doc["token_ids"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(\nimport os\n")
    doc, _ = run_json(["generate", "--prompts-file", str(prompts), *tiny, "--max-new-tokens", "5", "--json"], capfd)
    assert len(doc) == 2 and all(len(d["token_ids"]) == 5 for d in doc)
    doc, _ = run_json(["check", *tiny, "--samples", "20", "--json"], capfd)
    assert "p_value" in json.dumps(doc)
    # an error is one line on stderr, exit code 2, and nothing on stdout
    assert main(["generate", "x", *tiny, "--max-new-tokens", "0", "--json"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("specdec: error:")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_seed_fixes_the_output_of_every_policy_across_fresh_loads(tiny_pair, cache, policy):
    outs = []
    for _ in range(3):  # three freshly loaded decoders, as three runs of the CLI would be
        decoder = load(tiny_pair["target"], draft=tiny_pair["close"], policy=policy, draft_tokens=4)
        outs.append([decoder.generate("def f(", max_new_tokens=24, temperature=1.0, seed=seed).token_ids
                     for seed in (1, 2, 3)])
        assert decoder.generate("def f(", max_new_tokens=24, temperature=1.0, seed=1).token_ids == outs[-1][0]
    assert outs[0] == outs[1] == outs[2]


def test_policies_that_need_costs_read_them_stored_not_measured_again(tiny_pair, cache):
    first = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto")
    first.generate("def f(", max_new_tokens=4, seed=0)
    stored = list((cache / "costs").glob("*.json"))
    assert len(stored) == 1
    second = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto")

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    second.calibrate = no_measuring
    second.generate("def f(", max_new_tokens=4, seed=0)
    assert second.policy.costs == first.policy.costs
    # other settings are other costs: K is part of the key
    third = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto", draft_tokens=6)
    third.generate("def f(", max_new_tokens=4, seed=0)
    assert len(list((cache / "costs").glob("*.json"))) == 2


def test_costs_measured_while_other_processes_ran_are_stored_with_the_load_and_read_after(tiny_pair, cache,
                                                                                         monkeypatch):
    """A restart never measures again (a busy machine once paid 380 s of measuring at every start):
    costs measured under load are stored with how busy the machine was and how noisy the timings
    were, and every later load decides from them."""
    from specdec import costmodel

    monkeypatch.setattr(costmodel.OtherLoad, "cores", lambda self: 1.0)
    first = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto")
    first.generate("def f(", max_new_tokens=4, seed=0)
    assert first.policy.costs is not None and first.policy.costs.t_plain > 0
    [path] = list((cache / "costs").glob("*.json"))
    record = json.loads(path.read_text())
    assert record["measured"]["other_cores"] == 1.0 and record["measured"]["spread"] >= 0.0
    assert record["measured"]["seconds"] > 0 and record["costs"]["spread"] == pytest.approx(
        record["measured"]["spread"], abs=1e-3)
    second = load(tiny_pair["target"], draft=tiny_pair["close"], policy="auto")
    second.calibrate = lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured again"))
    second.generate("def f(", max_new_tokens=4, seed=0)
    assert second.policy.costs == first.policy.costs


def test_a_measurement_stops_repeating_once_its_budget_is_spent():
    import time

    from specdec.costmodel import interleaved_times

    calls = []
    times = interleaved_times({"slow": lambda: (calls.append(1), time.sleep(0.02))}, 50, budget_s=0.05)
    assert 2 <= len(times["slow"]) < 10 and len(calls) == len(times["slow"]) + 1  # the warm-up is not timed
    assert len(interleaved_times({"fast": lambda: None}, 7)["fast"]) == 7  # no budget: every repeat


def test_other_load_counts_other_processes_and_not_this_one():
    """Measured in CPU seconds, not against the wall clock: on a busy machine this process and its
    child get what the scheduler gives them, and every other process's time is others' time too."""
    import os
    import subprocess
    import sys
    import time

    from specdec.costmodel import OtherLoad, _cpu_seconds

    before = _cpu_seconds()
    start, deadline = time.process_time(), time.monotonic() + 120
    while time.process_time() - start < 0.5 and time.monotonic() < deadline:  # this process spins 0.5 CPU s
        pass
    after = _cpu_seconds()
    assert before is not None and after is not None
    own, busy = after[1] - before[1], after[0] - before[0]
    assert own > 0.45 and busy > own - 0.1  # the machine's busy time holds this process's own
    load = OtherLoad()
    children = os.times()
    # this process waits while the child spins until it has had 1 CPU second
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 1.0: pass"], check=True,
                   timeout=300)
    done = os.times()
    child = done.children_user + done.children_system - children.children_user - children.children_system
    assert load.start is not None
    others = load.cores() * (time.perf_counter() - load.start[2])  # others' CPU seconds over the child's run
    assert child >= 0.9 and others > 0.8 * child


def test_the_cli_gives_one_text_per_seed_for_the_optimal_policy(tiny_pair, cache, capfd):
    texts = []
    for _ in range(3):
        doc, _ = run_json(["generate", "def f(", "--target", tiny_pair["target"], "--draft", tiny_pair["close"],
                           "--policy", "optimal", "--temperature", "1", "--seed", "42", "--max-new-tokens", "24",
                           "--json"], capfd)
        texts.append(doc["token_ids"])
    assert texts[0] == texts[1] == texts[2]


def test_help_states_the_one_rule_for_sampling_defaults(capsys):
    from specdec.decoder import SpeculativeDecoder
    from specdec.defaults import SAMPLING_RULE, TEMPERATURE

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(SAMPLING_RULE.split()) in text
    import inspect

    params = inspect.signature(SpeculativeDecoder.generate).parameters
    # max_new_tokens None: MAX_NEW_TOKENS, or the room the prompt leaves in the context if that is less
    assert params["temperature"].default == TEMPERATURE and params["max_new_tokens"].default is None


def test_the_server_follows_the_same_defaults(tiny_pair):
    """No max_tokens: the rule's 128 (within the context); temperature and top_p absent or null:
    the rule's 1.0, so a seeded answer equals the API's seeded sample with the defaults."""
    import httpx

    from specdec.defaults import MAX_NEW_TOKENS
    from specdec.server import ServerConfig, create_app
    from tests.server_fixtures import serve_in_thread

    decoder = load(tiny_pair["target"], draft="none")
    want = decoder.generate("def f(", seed=7)  # the API's defaults: 128 tokens at most, temperature 1
    assert len(want.token_ids) <= MAX_NEW_TOKENS
    with serve_in_thread(create_app(decoder, "tiny", ServerConfig(max_tokens=4096))) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        for body in ({"prompt": "def f(", "seed": 7}, {"prompt": "def f(", "seed": 7, "temperature": None,
                                                         "top_p": None, "max_tokens": None}):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
            assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)


def test_specdec_calibrate_shows_the_stored_costs_and_measures_again_only_when_asked(tiny_pair, cache, capfd):
    tiny = ["--target", tiny_pair["target"], "--draft", tiny_pair["close"], "--policy", "auto"]
    doc, _ = run_json(["calibrate", *tiny, "--json"], capfd)
    assert doc["costs"]["t_plain"] > 0 and doc["key"]["prophets"] and "spread" in doc["costs"]
    [path] = list((cache / "costs").glob("*.json"))
    again, _ = run_json(["calibrate", *tiny, "--json"], capfd)
    assert again["costs"] == doc["costs"]  # read back, not measured again
    assert main(["calibrate", *tiny, "--again"]) == 0  # measured anew and stored in the same place
    assert "plain step" in capfd.readouterr().out and list((cache / "costs").glob("*.json")) == [path]
    assert main(["calibrate", "--target", tiny_pair["target"], "--draft", "none"]) == 2  # nothing to measure
    assert capfd.readouterr().err.startswith("specdec: error: nothing to measure")
