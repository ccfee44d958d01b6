"""The bench's roofline line: the bytes a step reads, counted from the weights as they are
held, and the floor they give at a bandwidth; checked against the tensors themselves."""

import torch

from specdec.bench.roofline import (
    gemv_bandwidth,
    kv_bytes,
    llama_step_bytes,
    prophet_step_bytes,
    roofline,
    roofline_line,
    target_step_bytes,
    weight_bytes,
)


def test_weight_bytes_counts_every_kind_of_weight():
    from specdec.int4 import Int4Weight, quantize_q8_0
    from specdec.llama import Int8Weight

    assert weight_bytes(torch.zeros(3, 5)) == 60 and weight_bytes(torch.zeros(4, dtype=torch.bfloat16)) == 8
    assert weight_bytes(torch.nn.Linear(4, 3, bias=False)) == 48
    assert weight_bytes({"a": torch.zeros(2), "b": [torch.zeros(1), None]}) == 12
    w = torch.randn(64, 128)
    int8 = Int8Weight(w, torch.float32)
    assert weight_bytes(int8) == 64 * 128 + 64 * 4
    int4 = Int4Weight(quantize_q8_0(w))
    assert weight_bytes(int4) == int4.nbytes
    assert 0 < int4.nbytes < weight_bytes(w)  # 4-bit planes read fewer bytes than float32
    assert weight_bytes("not a weight") == 0


def test_a_llama_step_reads_every_layer_the_head_and_one_embedding_row(tiny_pair):
    import specdec

    dec = specdec.load(tiny_pair["target"], draft="none")
    lw = dec.target
    model = lw.model
    params = {id(p): p for p in model.parameters()}  # tied head and embedding once
    table = model.model.embed_tokens.weight
    every = sum(p.numel() * p.element_size() for p in params.values())
    tied = model.lm_head.weight.data_ptr() == table.data_ptr()
    # every parameter once, the embedding table (when untied) as one row; the head in full
    expected = every if tied else every - weight_bytes(table)
    expected += table.shape[1] * table.element_size()
    head_rows_cut = (model.lm_head.weight.shape[0] - lw.vocab_size) * table.shape[1] * 4
    assert llama_step_bytes(lw) == expected - head_rows_cut
    assert kv_bytes(lw, 10) == 2 * lw.n_layers * lw.n_kv * lw.head_dim * 10 * 4
    assert target_step_bytes(dec.target, 10) == llama_step_bytes(lw) + kv_bytes(lw, 10)
    half = specdec.load(tiny_pair["target"], draft="none", kv_dtype="float16").target  # what the cache holds
    assert half.kv_dtype == torch.float16 and kv_bytes(half, 10) == kv_bytes(lw, 10) // 2


def test_prophet_bytes_and_the_report_line(tiny_pair, tiny_eagle):
    import specdec

    dec = specdec.load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}")
    ngram, eagle = dec.prophets
    assert prophet_step_bytes(ngram) is None  # prompt lookup reads no weights
    assert prophet_step_bytes(eagle) == weight_bytes(eagle.head) + weight_bytes(eagle.head_weight) + \
        eagle.embed.shape[1] * eagle.embed.element_size()
    r = roofline(dec, bandwidth=1e9)
    target, prophet = r["parts"]
    assert target["name"] == "target" and prophet["name"] == f"prophet {eagle.name}"
    costs = dec.decision_costs()
    assert abs(target["floor_ms"] - target["megabytes"]) < 1e-9  # 1 GB/s: a megabyte a millisecond
    assert abs(target["measured_ms"] - 1e3 * costs.t_plain) < 1e-9
    assert abs(target["over_floor"] - target["measured_ms"] / target["floor_ms"]) < 1e-9
    line = roofline_line(r)
    assert line.startswith("Roofline: this machine streams 1.0 GB/s") and f"prophet {eagle.name}" in line
    assert r["device"] == "cpu" and f"({r['threads']} threads, 256 MB matrix)" in line
    gpu = roofline_line({**r, "device": "cuda:0"})  # a GPU run says whose bandwidth it measured
    assert gpu.startswith("Roofline: the GPU (cuda:0) streams 1.0 GB/s") and "threads" not in gpu


def test_gemv_bandwidth_is_a_plausible_rate():
    bw = gemv_bandwidth(megabytes=32, repeats=3)
    assert 1e8 < bw < 1e13  # between 0.1 GB/s and 10 TB/s
