"""Reduced-precision products whose rows never depend on how many rows share them: the
condition for greedy speculative output (K+1 rows scored at once) to be plain decoding's
(one row at a time), bit for bit. Checked on the kernels of three kinds of CPU through
oneDNN's ISA cap: AVX2, AVX-512 without bf16 (emulated), and this machine's own (native
bf16 where it has it)."""

import json
import subprocess
import sys

import pytest
import torch

from specdec.rowpolicy import ROW_POLICIES, padded_rows, probe_row_policy, row_bucket, row_product

# SmolLM2-135M's product shapes: qkv, o, gate_up, down, and a slice of the head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]

CHILD = """
import json, torch
import torch.nn.functional as F
from specdec.rowpolicy import padded_rows, probe_row_policy, row_product
torch.manual_seed(1)
weights = [(torch.randn(o, i) * 0.05).to(torch.bfloat16) for o, i in %s]
policy = probe_row_policy(weights)
broken = {}
with torch.inference_mode():
    for w in weights:
        x = (torch.randn(80, w.shape[1]) * 3).to(torch.bfloat16)  # other rows than the probe's
        one = torch.stack([row_product(x[i:i + 1], w, policy)[0] for i in range(80)])
        for m in range(1, 41):
            got = torch.cat([row_product(x[s:s + m], w, policy) for s in range(0, 80 - 80 %% m, m)])
            if not torch.equal(got, one[:len(got)]):
                broken.setdefault(str(tuple(w.shape)), []).append(m)
print(json.dumps({"policy": policy, "broken": broken}))
"""


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE", "ALL"])
def test_every_row_count_rounds_each_row_as_a_one_row_product(isa):
    env = {"ONEDNN_MAX_CPU_ISA": isa, "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHILD % SHAPES], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["policy"] in ROW_POLICIES
    assert result["broken"] == {}, result


def test_row_policies_pad_as_documented():
    assert [padded_rows(m, "none") for m in (1, 2, 17)] == [1, 2, row_bucket(17)]
    assert [padded_rows(m, "min2") for m in (1, 2, 17)] == [2, 2, row_bucket(17)]
    assert [padded_rows(m, "tile16") for m in (1, 15, 16, 17, 33)] == [16, 16, 16, 32, 48]
    assert [padded_rows(m, "chunk16") for m in (1, 17, 33)] == [16, 32, 48]
    assert all(padded_rows(m, p) >= m for m in range(1, 300) for p in ROW_POLICIES)


def test_the_probe_falls_back_to_whole_tiles_when_rows_vary():
    """A product whose bits change with the row count under every cheap policy (simulated:
    a weight that is not what the kernel multiplies) is run in whole 16-row tiles."""
    calls = []
    real = torch.Tensor.__matmul__

    def flaky(self, other):
        calls.append(self.shape[0])
        out = real(self, other)
        return out + (self.shape[0] % 16 != 0) * 1e-2  # rows differ unless the product is whole tiles

    w = torch.randn(64, 32).to(torch.bfloat16)
    torch.Tensor.__matmul__ = flaky
    try:
        policy = probe_row_policy([w])
    finally:
        torch.Tensor.__matmul__ = real
    assert policy == "tile16" and calls


def test_the_probe_falls_back_to_separate_tiles_when_large_tiles_vary():
    """Where a 32- or 48-row product rounds rows unlike a 16-row one (AMX kernels do), every
    product runs as separate 16-row tiles."""
    real = torch.Tensor.__matmul__

    def flaky(self, other):
        return real(self, other) + (self.shape[0] != 16) * 1e-2

    w = torch.randn(64, 32).to(torch.bfloat16)
    torch.Tensor.__matmul__ = flaky
    try:
        policy = probe_row_policy([w])
        x = torch.randn(40, 32).to(torch.bfloat16)
        got = row_product(x, w, policy)
        one = torch.cat([row_product(x[i:i + 1], w, policy) for i in range(40)])
    finally:
        torch.Tensor.__matmul__ = real
    assert policy == "chunk16" and torch.equal(got, one)
