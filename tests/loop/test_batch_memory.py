"""The batched cache is bounded by what its requests hold: each slot grows with its own
request and gives its memory back when the request leaves; long prompts are prefilled a
chunk per step, so the rows already running keep getting tokens meanwhile."""

import pytest
import torch

from specdec import load
from specdec.api import batch_engine
from specdec.batch import BatchLlama
from specdec.request import Request
from specdec.sampling import SamplingParams
from tests.loop.test_batch import smollm2_shaped


def test_a_long_request_holds_only_its_own_slot_and_gives_it_back():
    model = smollm2_shaped()
    lm = BatchLlama(model, "b", slots=8)
    assert lm.kv_bytes() == 0
    lm.forward([3], [0], [list(range(1, 97)) + [5] * 20], [1])  # 116 positions in slot 3
    lm.forward([5], [0], [[1, 2, 3]], [1])
    assert [k is None for k in lm.k_slots] == [True, True, True, False, True, False, True, True]
    assert lm.kv_bytes() == lm.position_bytes() * (lm.k_slots[3].shape[2] + lm.k_slots[5].shape[2])
    lm.free(3)
    assert lm.k_slots[3] is None and lm.kv_bytes() == lm.position_bytes() * lm.k_slots[5].shape[2]


def test_freed_caches_go_back_to_the_system_when_large_or_when_the_last_slot_leaves(monkeypatch):
    """A large freed cache is trimmed at once; small ones stay for the next requests while any
    slot runs, and are handed back (once TRIM_BYTES were freed) when the last one leaves."""
    import specdec.llama as llama

    lm = BatchLlama(smollm2_shaped(), "b", slots=4)
    for slot in range(4):
        lm.forward([slot], [0], [[1, 2, 3]], [1])
    slot_bytes = lm.position_bytes() * lm.k_slots[0].shape[2]
    monkeypatch.setattr(llama, "TRIM_BYTES", int(2.5 * slot_bytes))
    due = []
    for slot in range(3):  # 3 slots' bytes freed, one still running: kept for reuse
        lm.free(slot)
        due.append(lm.trim_due())
    lm.free(3)
    assert due == [False] * 3 and lm.trim_due() and lm.freed_bytes == 0 and not lm.trim_due()
    lm.forward([0], [0], [[1, 2, 3]], [1])
    lm.free(0)  # the last slot again, but less than TRIM_BYTES freed since
    assert not lm.trim_due()
    monkeypatch.setattr(llama, "TRIM_BYTES", slot_bytes)
    lm.forward([1], [0], [[1, 2, 3]], [1])
    lm.forward([2], [0], [[1, 2, 3]], [1])
    lm.free(1)  # as large as TRIM_BYTES: at once, though a slot runs
    assert lm.trim_due()


def test_the_engine_trims_once_a_requests_whole_state_is_dropped(tiny_pair, monkeypatch):
    """The engine asks after freeing the target's slot, the prophets' state and the request's
    features, so that what they held goes back with the slot."""
    import specdec.llama as llama
    import specdec.slots as slots

    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(llama, "TRIM_BYTES", 1)
    monkeypatch.setattr(slots, "trim_heap", lambda: seen.append((engine.target.kv_bytes() == 0,
                                                                   engine.prophet.draft_lm.kv_bytes() == 0)))
    engine.generate([[1, 2, 3]], max_new_tokens=4, temperature=0)
    assert seen == [(True, True)]


def test_the_engine_frees_a_slot_s_memory_when_its_request_ends(tiny_pair):
    engine = batch_engine(tiny_pair["target"], tiny_pair["close"], slots=4, draft_dtype=torch.float32)
    engine.generate([list(range(1, 200)), [1, 2, 3]], max_new_tokens=6, temperature=0)
    assert engine.target.kv_bytes() == 0 and engine.prophet.draft_lm.kv_bytes() == 0
    req = Request([1, 2, 3, 4], 50, SamplingParams(0.0), 2)
    engine.step([req])
    assert engine.target.kv_bytes() > 0
    engine.release(req)  # a cancelled request
    assert engine.target.kv_bytes() == 0 and engine.prophet.draft_lm.kv_bytes() == 0


@pytest.mark.parametrize("draft", ["none", "ngram", "close"])
def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_running_rows_decode(tiny_pair, draft):
    engine = batch_engine(tiny_pair["target"], tiny_pair.get(draft, draft) if draft != "none" else None, slots=4,
                          draft_dtype=torch.float32)
    engine.slots.set_prefill_chunk(8)
    plain = load(tiny_pair["target"], draft="none")
    running = [Request([1, 2, 3, 4, 5], 40, SamplingParams(0.0), 3), Request([7, 8, 9], 40, SamplingParams(0.0), 3)]
    for _ in range(3):
        engine.step(running)
    long = Request([(7 * i) % 150 + 3 for i in range(90)], 6, SamplingParams(0.0), 3)
    steps_until_joined = 0
    while not long.generated:
        events = engine.step([*running, long])
        rows = {id(e.request) for e in events}
        assert all(id(r) in rows for r in running if not r.done)  # the running rows went on every step
        steps_until_joined += 1
    assert steps_until_joined == 90 // 8 + 1  # 89 prompt tokens, 8 a step; the last one decoded with its row
    while not all(r.done for r in [*running, long]):
        engine.step([*running, long])
    for r in [*running, long]:  # greedy: each row is plain decoding of its prompt alone
        want = plain.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=0)
        assert r.generated == want.token_ids


def test_the_server_admits_by_kv_memory_and_refuses_what_can_never_fit(tiny_pair):
    import threading

    import httpx

    from specdec.server import ServerConfig, create_app
    from specdec.server.metrics import ServerMetrics
    from specdec.server.scheduler import Job, Scheduler
    from tests.server_fixtures import serve_in_thread

    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    probe = Scheduler(decoder, ServerMetrics(), max_batch=4)
    one = probe.kv_need(Job(ids=[1] * 10, max_tokens=40))
    assert one > 0
    small = ServerConfig(max_batch=4, kv_memory=one - 1, warm_up=False)
    with serve_in_thread(create_app(decoder, "tiny", small)) as url, httpx.Client(base_url=url, timeout=60) as c:
        too_big = c.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": 40})
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "kv_memory_exceeded"
        assert "--kv-memory" in too_big.json()["error"]["message"]
    config = ServerConfig(max_batch=4, kv_memory=one + one // 2, warm_up=False)  # room for one such request
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=60) as c:
        answers = {}

        def ask(i):
            body = {"prompt": [1 + i] * 10, "max_tokens": 40, "temperature": 0}
            answers[i] = c.post("/v1/completions", json=body).json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        plain = decoder.plain()
        for i in range(3):  # each waited its turn and ran to its answer
            assert answers[i] == plain.generate([1 + i] * 10, max_new_tokens=40, temperature=0).text


def test_one_heap_is_set_unless_per_thread_is_asked_and_a_bad_value_is_an_error(monkeypatch):
    """`specdec serve` (and each replica) calls one_heap before loading; glibc takes M_ARENA_MAX 1."""
    import ctypes.util

    from specdec.heap import one_heap

    monkeypatch.setenv("SPECDEC_HEAPS", "per-thread")
    assert one_heap() is False
    monkeypatch.setenv("SPECDEC_HEAPS", "several")
    with pytest.raises(ValueError, match="SPECDEC_HEAPS must be one of auto, one, per-thread"):
        one_heap()
    monkeypatch.delenv("SPECDEC_HEAPS")
    assert one_heap() is bool(ctypes.util.find_library("c"))


def test_serve_sets_one_heap_before_it_loads(monkeypatch):
    """The order matters: the model's threads are made while loading."""
    import specdec.api
    import specdec.heap
    from specdec.cli import main

    calls: list[str] = []
    monkeypatch.setattr(specdec.heap, "one_heap", lambda: calls.append("one_heap") or True)

    def load(*args, **kwargs):
        calls.append("load")
        raise SystemExit(0)

    monkeypatch.setattr(specdec.api, "load", load)
    with pytest.raises(SystemExit):
        main(["serve", "--port", "0"])
    assert calls == ["one_heap", "load"]
