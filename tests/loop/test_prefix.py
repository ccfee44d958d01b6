"""Prompt prefix caching (specdec.prefix): the cache itself, then the promise it makes: a
request that starts from a cached prefix gets the tokens it would have got reading its whole
prompt (greedy and seeded sampling, alone, in batches, chunked, through the server), on the
tiny lean-path pair and on SmolLM2's 4-bit C++ path."""

from __future__ import annotations

import httpx
import pytest
import torch

from specdec import load
from specdec.prefix import PrefixCache
from specdec.server import ServerConfig, create_app
from tests.server_fixtures import serve_in_thread

BLOCK = 4


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, n, 3, generator=g), torch.randn(2, 1, n, 3, generator=g)


def block_bytes() -> int:
    return 2 * 2 * 1 * BLOCK * 3 * 4


def test_a_prefix_is_found_by_its_tokens_in_whole_blocks_leaving_the_last_token():
    cache = PrefixCache(BLOCK, 1 << 20)
    tokens = list(range(100, 113))  # 13 tokens: usable 12 (3 blocks), the last token stays to be read
    k, v = kv(13)
    assert cache.store(tokens, k, v) == 3
    n, blocks = cache.lookup(tokens + [7, 8])
    assert n == 12 and len(blocks) == 3
    assert torch.equal(torch.cat([b[0] for b in blocks], 2), k[:, :, :12])
    assert torch.equal(torch.cat([b[1] for b in blocks], 2), v[:, :, :12])
    assert cache.lookup(tokens[:12])[0] == 8  # a 12-token prompt reads its last token: 2 blocks
    assert cache.lookup(tokens[:5] + [0] + tokens[6:])[0] == 4  # parts at token 5: the first block only
    assert cache.lookup([1] + tokens[1:])[0] == 0  # the same later blocks under another first block: no
    assert cache.store(tokens, k, v) == 0  # already here
    assert cache.stats.hits == 3 and cache.stats.hit_tokens == 12 + 8 + 4


def test_within_the_first_chunk_blocks_are_fine_so_a_shared_system_turn_is_kept():
    """With the targets' attention chunk (64), blocks end at multiples of 8 within the first 64
    positions (where prompts attend in blocks of 8: `defaults.attention_block_end`), then at
    multiples of 64: two chat prompts that share a 24-token system turn share 24 positions."""
    from specdec.defaults import FINE_BLOCK, PREFILL_CHUNK

    cache = PrefixCache(PREFILL_CHUNK, 1 << 24)
    assert cache.spans(150) == [(a, a + FINE_BLOCK) for a in range(0, 64, FINE_BLOCK)] + [(64, 128)]
    system = list(range(100, 124))
    first = system + list(range(500, 515))  # 39 tokens: 4 blocks of 8 usable (32 < 38)
    assert cache.store(first, *kv(39)) == 4
    assert cache.lookup(system + [7] * 10)[0] == 24  # another question after the same system turn
    assert cache.lookup(system[:20] + [7] * 30)[0] == 16
    assert cache.usable(64) == 56 and cache.usable(65) == 64 and cache.usable(129) == 128


def test_only_what_a_prompt_pass_computed_is_stored():
    cache = PrefixCache(BLOCK, 1 << 20)
    k, v = kv(6)  # six positions computed of a 20-token prompt
    assert cache.store(list(range(20)), k, v) == 1
    assert cache.lookup(list(range(20)))[0] == 4


def test_the_cache_stays_within_its_bytes_dropping_the_least_recently_used_children_first():
    cache = PrefixCache(BLOCK, 5 * block_bytes())
    shared = list(range(8))  # two blocks every prompt shares
    for i in range(6):
        tokens = shared + [1000 + i] * 8 + [0]
        cache.store(tokens, *kv(16, i))
        assert cache.nbytes <= cache.max_bytes
        assert cache.lookup(shared + [1]) == (8, cache.lookup(shared + [1])[1])  # the parents outlive children
    assert cache.stats.evicted_blocks > 0
    assert cache.lookup(shared + [1005] * 8 + [0])[0] == 16  # the latest whole prefix is here
    too_big = PrefixCache(BLOCK, block_bytes() - 1)
    assert too_big.store(list(range(9)), *kv(9)) == 0 and too_big.nbytes == 0


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="block"):
        PrefixCache(0, 10)
    with pytest.raises(ValueError, match="size"):
        PrefixCache(4, -1)
    for bad in (-1, float("inf"), float("nan"), True, "64"):
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            load("bundled", draft="none", prefix_cache_mb=bad)


# ----------------------------------------------------------------- the promise, end to end

def turns(vocab: int, seed: int = 0) -> list[list[int]]:
    """Three prompts, each the previous one and more (a conversation re-sent each turn)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (240,), generator=g).tolist()  # the tiny target's context: 256
    return [ids[:100], ids[:170], ids[:240]]


def run_turns(decoder, prompts, **settings):
    return [decoder.generate(p, max_new_tokens=12, **settings).token_ids for p in prompts]


@pytest.mark.parametrize("prophet", ["none", "close", "ngram", "eagle", "layerskip:1", "close+ngram"])
def test_a_cached_prefix_gives_the_tokens_of_the_whole_prompt(tiny_pair, tiny_eagle, prophet):
    draft = {"close": tiny_pair["close"], "eagle": tiny_eagle,
             "close+ngram": tiny_pair["close"] + "+ngram"}.get(prophet, prophet)  # the last: a token tree
    plain = load(tiny_pair["target"], draft=draft, policy="fixed")
    cached = load(tiny_pair["target"], draft=draft, policy="fixed", prefix_cache_mb=16)
    prompts = turns(plain.target.vocab_size)
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        assert run_turns(cached, prompts, **settings) == run_turns(plain, prompts, **settings), settings
    stats = cached._one_loop().slots.prefix_cache.stats
    # greedy: the later turns start at 64 and 128; sampled, every turn finds what greedy left
    assert stats.hits == 5 and stats.hit_tokens == 64 + 128 + 64 + 128 + 192, stats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cached_prefix_gives_the_same_tokens_in_half_precision(tiny_pair, dtype):
    plain = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", dtype=dtype)
    cached = load(tiny_pair["target"], draft=tiny_pair["close"], policy="fixed", dtype=dtype, prefix_cache_mb=16)
    prompts = turns(plain.target.vocab_size, 2)
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        assert run_turns(cached, prompts, **settings) == run_turns(plain, prompts, **settings), settings
    assert cached._one_loop().slots.prefix_cache.stats.hit_tokens == 64 + 128 + 64 + 128 + 192


def test_batched_rows_and_chunked_prefill_take_cached_prefixes_exactly(tiny_pair):
    plain = load(tiny_pair["target"], draft="ngram", policy="fixed")
    cached = load(tiny_pair["target"], draft="ngram", policy="fixed", prefix_cache_mb=16)
    shared = turns(plain.target.vocab_size, 3)[1][:160]  # a document every prompt starts with
    prompts = [shared + [5 + i] * (3 + i) for i in range(6)]
    want = plain.generate_many(prompts, max_batch=2, max_new_tokens=10, temperature=0)
    got = cached.generate_many(prompts, max_batch=2, max_new_tokens=10, temperature=0)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    from specdec.wiring import engine_for

    engine = engine_for(cached, 2)
    # every row but the first starts at 128: the second waited for its turn to prefill, the first
    # read the document meanwhile
    assert engine.slots.prefix_cache.stats.hit_tokens == 5 * 128
    engine.slots.set_prefill_chunk(32)  # chunked prefill in blocks of 32: a cache of 32-position blocks
    assert engine.slots.prefix_cache.block == 32 and len(engine.slots.prefix_cache) == 0
    got = cached.generate_many(prompts, max_batch=2, max_new_tokens=10, temperature=0)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.slots.prefix_cache.stats.hit_tokens == 5 * 160
    # all six rows at once (one step admits them all): the first reads the document, the rest wait
    # their turn to prefill and start past it
    wide = load(tiny_pair["target"], draft="ngram", policy="fixed", prefix_cache_mb=16)
    got = wide.generate_many(prompts, max_batch=8, max_new_tokens=10, temperature=0)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine_for(wide, 8).slots.prefix_cache.stats.hit_tokens == 5 * 128


@pytest.mark.parametrize("prophet", ["none", "ngram", "close"])
def test_prompts_that_share_a_short_opening_take_it_from_the_cache_exactly(tiny_pair, prophet):
    """Prompts sharing their first 21 tokens (less than a chunk, as a chat template's system turn):
    each later one starts at 16 (two blocks of 8) with the tokens of reading its whole prompt,
    alone and in batches, greedy and seeded sampling."""
    draft = tiny_pair["close"] if prophet == "close" else prophet
    plain = load(tiny_pair["target"], draft=draft, policy="fixed")
    cached = load(tiny_pair["target"], draft=draft, policy="fixed", prefix_cache_mb=16)
    opening = turns(plain.target.vocab_size, 5)[0][:21]
    prompts = [opening + [7 + i] * (5 + 3 * i) for i in range(4)]
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        assert run_turns(cached, prompts, **settings) == run_turns(plain, prompts, **settings), settings
    # greedy: the later three start at 16; sampled, each finds its own prompt's whole blocks (the
    # last one's 32 tokens of 35, the others' 24)
    assert cached._one_loop().slots.prefix_cache.stats.hit_tokens == 3 * 16 + 3 * 24 + 32
    want = plain.generate_many(prompts, max_batch=4, max_new_tokens=10, temperature=0)
    got = cached.generate_many(prompts, max_batch=4, max_new_tokens=10, temperature=0)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_an_engine_that_reads_every_prompt_feature_keeps_no_prefixes(tiny_pair):
    engine = load(tiny_pair["target"], draft="none")._one_loop()
    engine.slots.fused_layers = (0, 1, 2)  # as with an eagle3 prophet, which drafts from every position's features
    assert engine.slots.enable_prefix_cache(1 << 20) is None and engine.slots.prefix_cache is None


def test_the_server_answers_a_conversation_from_its_prefix_cache_as_without(tiny_pair):
    prompts = turns(load(tiny_pair["target"], draft="none").target.vocab_size, 5)
    plain = load(tiny_pair["target"], draft="ngram", policy="fixed")
    want = [plain.generate(p, max_new_tokens=12, temperature=0).text for p in prompts]
    decoder = load(tiny_pair["target"], draft="ngram", policy="fixed")
    config = ServerConfig(warm_up=False, prefix_cache_mb=8, prefill_chunk=64)
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=60) as c:
        got = []
        for p in prompts:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            got.append(r.json())
        metrics = c.get("/metrics").text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("specdec_prefix_cache_hit_tokens_total"))
    assert hits == 64 + 128
    assert [g["choices"][0]["text"] for g in got] == want
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, 64, 128]  # OpenAI's field


@pytest.mark.parametrize("draft", ["none", "ngram"])
@pytest.mark.slow
def test_smollm2_continues_a_chat_from_its_prefix_cache_token_for_token(draft):
    messages = [{"role": "system", "content": "You answer briefly and exactly. " * 10},
                {"role": "user", "content": "Name three rivers in Europe."}]
    plain = load("smollm2", draft=draft)
    cached = load("smollm2", draft=draft, prefix_cache_mb=32)
    first = plain.generate(messages=messages, max_new_tokens=8, temperature=0)
    assert cached.generate(messages=messages, max_new_tokens=8, temperature=0).token_ids == first.token_ids
    more = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And in Asia?"}]
    assert cached.generate(messages=more, max_new_tokens=8, temperature=0).token_ids == \
        plain.generate(messages=more, max_new_tokens=8, temperature=0).token_ids
    assert cached._one_loop().slots.prefix_cache.stats.hit_tokens >= 64
    # another question after SmolLM2's default system turn (24 tokens) starts past it
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    before = cached._one_loop().slots.prefix_cache.stats.hit_tokens
    for question in ("Why is the sky blue?", "Write a haiku about autumn."):
        ask = [{"role": "user", "content": question}]
        assert cached.generate(messages=ask, max_new_tokens=8, temperature=0).token_ids == \
            plain.generate(messages=ask, max_new_tokens=8, temperature=0).token_ids
    assert cached._one_loop().slots.prefix_cache.stats.hit_tokens - before == 24


def test_a_decoders_engines_share_one_prefix_cache(tiny_pair):
    from specdec.wiring import engine_for

    cached = load(tiny_pair["target"], draft="none", prefix_cache_mb=16)
    prompt = turns(cached.target.vocab_size, 7)[1]  # 170 tokens: two whole blocks
    alone = cached.generate(prompt, max_new_tokens=4, temperature=0)
    engine = engine_for(cached, 4)
    assert engine.slots.prefix_cache is cached._one_loop().slots.prefix_cache
    [again] = cached.generate_many([prompt], max_batch=4, max_new_tokens=4, temperature=0)
    assert again.token_ids == alone.token_ids and engine.slots.prefix_cache.stats.hit_tokens == 128


def test_concurrent_requests_under_a_small_cache_get_their_own_answers(tiny_pair):
    """Load: 12 concurrent requests, three documents shared four times each, a cache that holds
    only a few blocks (so blocks are evicted while rows take them): every answer is the plain
    decoder's, the cache never exceeds its budget, and blocks were both reused and evicted."""
    import threading

    plain = load(tiny_pair["target"], draft="ngram", policy="fixed")
    docs = [turns(plain.target.vocab_size, 20 + d)[1][:160] for d in range(3)]
    prompts = [docs[i % 3] + [9 + i] * (2 + i % 5) for i in range(12)]
    want = [plain.generate(p, max_new_tokens=8, temperature=0).text for p in prompts]
    decoder = load(tiny_pair["target"], draft="ngram", policy="fixed")
    block_mib = 64 * decoder.target.position_bytes() / 2**20
    config = ServerConfig(warm_up=False, prefix_cache_mb=5 * block_mib, max_batch=4)
    answers: dict[int, httpx.Response] = {}
    with serve_in_thread(create_app(decoder, "tiny", config)) as url, httpx.Client(base_url=url, timeout=120) as c:
        def ask(i: int) -> None:
            answers[i] = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        metrics = c.get("/metrics").text
    assert sorted(answers) == list(range(12))
    assert [answers[i].json()["choices"][0]["text"] for i in range(12)] == want
    from specdec.wiring import engine_for

    cache = engine_for(decoder, 4).slots.prefix_cache
    assert cache.nbytes <= cache.max_bytes and cache.stats.evicted_blocks > 0 and cache.stats.hit_tokens > 0
    assert sum(answers[i].json()["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(12)) == \
        cache.stats.hit_tokens
    assert f"specdec_prefix_cache_bytes {float(cache.nbytes)}" in metrics
