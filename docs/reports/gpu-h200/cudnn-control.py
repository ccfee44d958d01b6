"""Negative control: the loop with attention_backends turned into a no-op must show cuDNN
attention on CUDA (so the device test can fail), then the same with the real one must not."""
import contextlib
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import specdec.batch
from specdec import load

real = specdec.batch.attention_backends
dec = load("models/target", draft="models/prophet", device="cuda", policy="fixed", draft_tokens=4)
for label, fn in (("no-op (as before)", lambda d: contextlib.nullcontext()), ("attention_backends", real)):
    specdec.batch.attention_backends = fn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            dec.generate("class Stack:\n    def push(self, x):\n        ", max_new_tokens=24, temperature=0)
    cud = [e for e in prof.key_averages() if "cudnn" in e.key.lower() and "attention" in e.key.lower()]
    # fresh prompt lengths each time: new key lengths, as a user's requests meet
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = dec.generate("x = 1\n" * (7 if fn is real else 9) + "def g(y):\n    ", max_new_tokens=64, temperature=0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    calls = sum(e.draft_calls for e in out.events)
    dr = sum(sum(b - a for a, b in e.draft_spans) for e in out.events)
    print(f"{label}: cuDNN attention calls {sum(e.count for e in cud)}; 64 tokens {wall*1e3:.0f} ms, "
          f"draft {dr / max(1, calls) * 1e3:.2f} ms a call ({calls} calls)", flush=True)
