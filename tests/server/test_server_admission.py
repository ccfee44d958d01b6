"""A default server (SmolLM2, int4) with a small --kv-memory budget: many long prompts sent at
once wait for admission (none refused, none failing), each step runs only the rows whose
reserved caches fit the budget, every answer is the one the prompt gets alone, and the
server's memory stays bounded."""

import re
import threading
from pathlib import Path

import httpx

from specdec.llama import BatchLlama, grown_capacity
from tests.server_fixtures import ServerProcess

PROMPT_TOKENS, MAX_TOKENS, REQUESTS = 200, 8, 6
# SmolLM2-135M's cache per position: keys and values, 30 layers, 3 KV heads of 64, float16 (a 4-bit target's)
POSITION_BYTES = 2 * 30 * 3 * 64 * 2
NEED = POSITION_BYTES * grown_capacity(PROMPT_TOKENS + MAX_TOKENS + 1, BatchLlama.INITIAL_CAPACITY, 8192)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def prompt(which: int) -> list[int]:
    return [((7919 if which == 0 else 7717) * i + which) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def step_rows(metrics: str) -> dict[str, float]:
    """specdec_step_batch_size's cumulative buckets (le -> steps), with "count"."""
    out = {m.group(1): float(m.group(2)) for m in
           re.finditer(r'^specdec_step_batch_size_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', metrics, re.M)}
    out["count"] = float(re.search(r"^specdec_step_batch_size_count ([0-9.e+]+)$", metrics, re.M).group(1))
    return out


def test_long_prompts_sent_at_once_wait_for_the_kv_budget_and_are_all_answered(tmp_path):
    budget_mib = 2.5 * NEED / 2**20  # room for two such requests at once, not three
    server = ServerProcess(["--draft", "none", "--kv-memory", f"{budget_mib:.2f}"], tmp_path / "server.log",
                           env={"OMP_NUM_THREADS": "2"}, timeout=300)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            body = {"max_tokens": MAX_TOKENS, "temperature": 0}
            alone = [c.post("/v1/completions", json={**body, "prompt": prompt(w)}).json()["choices"][0]["text"]
                     for w in (0, 1)]  # each prompt alone (and the server warm)
            before = step_rows(c.get("/metrics").text)
            idle = rss_mib(server.proc.pid)
            Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")  # VmHWM := RSS now
            answers: dict[int, httpx.Response] = {}

            def ask(i: int) -> None:
                answers[i] = c.post("/v1/completions", json={**body, "prompt": prompt(i % 2)})

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(REQUESTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(150)
            peak = max(rss_mib(server.proc.pid, "VmHWM"), rss_mib(server.proc.pid))
            after = step_rows(c.get("/metrics").text)
        assert server.proc.poll() is None, server.log()[-3000:]
        assert sorted(answers) == list(range(REQUESTS))
        for i, r in answers.items():  # all waited their turn, none was refused or failed
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS
            assert r.json()["choices"][0]["text"] == alone[i % 2], i  # greedy: as the prompt alone
        steps = {le: after[le] - before[le] for le in after}
        assert steps["2.0"] == steps["count"], steps  # never more rows in a step than the budget holds
        assert steps["1.0"] < steps["count"], steps  # but two at once while the others waited
        assert peak - idle < 512, (idle, peak)
    finally:
        server.stop()
