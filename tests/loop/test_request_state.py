"""A request owns the state it runs on: interleaved streams on one decoder, or requests from
two threads, each give what they give alone."""

import threading

import pytest

from specdec import load

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range("]


@pytest.mark.parametrize("draft", ["close", "layerskip:1", "ngram"])
def test_two_interleaved_streams_on_one_decoder_each_give_their_own_answer(tiny_pair, draft):
    spec = tiny_pair.get(draft, draft)
    decoder = load(tiny_pair["target"], draft=spec, draft_tokens=3)
    want = [decoder.generate(p, max_new_tokens=24, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS[:2])]
    a = decoder.stream(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=0)
    b = decoder.stream(PROMPTS[1], max_new_tokens=24, temperature=0.8, seed=1)
    got: list[list[int]] = [[], []]
    live = {0: a, 1: b}
    while live:  # one round of each in turn
        for i, s in list(live.items()):
            event = next(s, None)
            if event is None:
                del live[i]
            else:
                got[i].extend(event.committed)
    assert got == [w.token_ids for w in want]
    # and the decoder is free again: its own state serves the next request
    assert decoder.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=0).token_ids == want[0].token_ids


def test_requests_from_two_threads_each_give_their_own_answer(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    want = {p: decoder.generate(p, max_new_tokens=32, temperature=1.0, seed=7).token_ids for p in PROMPTS}
    got: dict[str, list[list[int]]] = {p: [] for p in PROMPTS}

    def work(prompts):
        for _ in range(3):
            for p in prompts:
                got[p].append(decoder.generate(p, max_new_tokens=32, temperature=1.0, seed=7).token_ids)

    threads = [threading.Thread(target=work, args=(PROMPTS[:2],)), threading.Thread(target=work, args=(PROMPTS[2:],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(runs == [want[p]] * 3 for p, runs in got.items())


def test_a_stream_dropped_early_frees_the_decoder(tiny_pair):
    decoder = load(tiny_pair["target"], draft=tiny_pair["close"], draft_tokens=3)
    s = decoder.stream(PROMPTS[0], max_new_tokens=30, temperature=0)
    next(s)
    s.close()
    engine = decoder._one_loop()
    assert len(engine.slots.free) == engine.target.slots  # its row (cache slot) went back at once
