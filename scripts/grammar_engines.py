"""Time grammar engines' mask computation on SmolLM2's tokenizer."""
import json, time, statistics, sys
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/root/.cache/specdec/gguf/smollm2-2f78640916036c4d")
V = 49152
SCHEMAS = [
 ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["name", "age", "email"], "additionalProperties": False},
  {"name": "Alice Smith", "age": 34, "email": "alice@example.com"}),
 ({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
  {"items": [{"sku": "A-100", "qty": 2, "price": 9.99}, {"sku": "B-7", "qty": 1, "price": 120.5}]}),
 ({"type": "object", "properties": {"status": {"enum": ["active", "inactive", "banned"]}, "meta": {"type": "object", "properties": {"created": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["created", "tags"], "additionalProperties": False}}, "required": ["status", "meta"], "additionalProperties": False},
  {"status": "active", "meta": {"created": "2024-01-02", "tags": ["a", "bb", "ccc"]}}),
]
def texts():
    for s, inst in SCHEMAS:
        yield s, json.dumps(inst)

def bench_llg():
    import llguidance, llguidance.hf, llguidance.torch as lt
    t0 = time.perf_counter(); lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V); t_tok = time.perf_counter() - t0
    out = []
    for s, text in texts():
        ids = tok(text)["input_ids"]
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)))
        t_comp = time.perf_counter() - t0
        bm = lt.allocate_token_bitmask(1, V)
        times = []; ff = 0
        for t in ids:
            t0 = time.perf_counter(); lt.fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter() - t0)
            ff += len(m.compute_ff_tokens())
            assert m.consume_token(t), (m.get_error(), t)
        t0 = time.perf_counter(); lt.fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter() - t0)
        out.append((t_comp, statistics.median(times), max(times), len(ids), m.is_accepting()))
    return t_tok, out

def bench_xgr():
    import xgrammar as xgr
    t0 = time.perf_counter(); ti = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); comp = xgr.GrammarCompiler(ti, max_threads=1, cache_enabled=False); t_tok = time.perf_counter() - t0
    out = []
    for s, text in texts():
        ids = tok(text)["input_ids"]
        t0 = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(s), any_whitespace=False); t_comp = time.perf_counter() - t0
        m = xgr.GrammarMatcher(cg)
        bm = xgr.allocate_token_bitmask(1, V)
        times = []
        for t in ids:
            t0 = time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter() - t0)
            assert m.accept_token(t), t
        t0 = time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter() - t0)
        out.append((t_comp, statistics.median(times), max(times), len(ids), m.is_terminated()))
    return t_tok, out

for name, f in (("llguidance", bench_llg), ("xgrammar", bench_xgr)):
    t_tok, rows = f()
    print(f"{name}: tokenizer setup {t_tok*1e3:.0f} ms")
    for c, med, mx, n, acc in rows:
        print(f"  compile {c*1e3:7.1f} ms  mask median {med*1e6:7.1f} us  max {mx*1e6:8.1f} us  steps {n+1} accepting_at_end={acc}")
