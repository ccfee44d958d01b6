"""Where a step's time goes on a device: plain vs fixed-K speculation on the bundled pair,
per-round draft/verify spans from RoundEvents, then a torch.profiler table of one generation."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specdec import load

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
prompt = "import os\nimport sys\n\n\ndef main(argv):\n    "
for draft in ("models/prophet", "ngram"):
    dec = load("models/target", draft=draft, device=dev, policy="fixed", draft_tokens=4)
    plain = dec.plain()
    for d in (plain, dec, plain, dec):
        d.generate(prompt, max_new_tokens=16, temperature=0)
    for name, d in (("plain", plain), (f"{draft} K=4", dec)) * 2:
        sync()
        t = time.perf_counter()
        out = d.generate(prompt, max_new_tokens=64, temperature=0)
        sync()
        wall = time.perf_counter() - t
        ev = out.events
        dr = sum(sum(b - a for a, b in e.draft_spans) for e in ev)
        ver = sum(e.target_span[1] - e.target_span[0] for e in ev)
        calls = sum(e.draft_calls for e in ev)
        print(f"{name:>22}: {len(out.token_ids)} tokens {wall*1e3:7.1f} ms, {len(ev)} rounds, "
              f"verify {ver/len(ev)*1e3:.2f} ms/round, draft {dr/max(1,calls)*1e3:.2f} ms/call ({calls} calls), "
              f"other {(wall-dr-ver)/len(ev)*1e3:.2f} ms/round")
dec = load("models/target", draft="models/prophet", device=dev, policy="fixed", draft_tokens=4)
dec.generate(prompt, max_new_tokens=16, temperature=0)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
with profile(activities=acts) as prof:
    dec.generate(prompt, max_new_tokens=32, temperature=0)
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48))
if dev.startswith("cuda"):
    print(ka.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=48))
