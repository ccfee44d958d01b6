"""Broad self-distillation data: the task templates and the batched generator that answers
prompts for the prophets' training (specdec.train.magpie)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.batch import BatchLlama
from specdec.data.tasks import over_passage, passage_requests, task_prompts
from specdec.train.magpie import continue_rows, good_question


def test_task_prompts_are_distinct_and_cover_the_kinds_people_ask():
    prompts = task_prompts(400, seed=3)
    assert len(prompts) == 400 and len({t for _, t in prompts}) == 400
    kinds = {k for k, _ in prompts}
    assert {"writing", "roleplay", "reasoning", "math", "code", "stem", "humanities", "translation",
            "extraction"} <= kinds
    assert task_prompts(50, seed=3) == prompts[:50]  # a seed fixes them
    made = over_passage(["A long passage about bees and their hives."] * 20, seed=1)
    assert all("bees" in t for _, t in made) and {k for k, _ in made} <= {"summary", "qa", "extraction"}
    assert all(r.startswith("Write ") for r in passage_requests(5))


def test_good_question_filters_noise():
    assert good_question("How do I plan a small vegetable garden on a balcony?")
    assert not good_question("Hi")  # too short
    assert not good_question("the the the the the the the the the the")  # a repetition loop
    assert not good_question("Visit https://example.com for more about SmolLM")


def test_continue_rows_matches_one_row_greedy_decoding_and_keeps_every_hidden_state(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float32).eval()
    lm = BatchLlama(model, "tiny", 1)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    gen = torch.Generator().manual_seed(0)
    rows = continue_rows(lm, prompts, 12, {0}, 0.0, 1.0, gen, True)
    for p, (toks, hidden) in zip(prompts, rows, strict=True):
        assert 1 <= len(toks) <= 12
        assert hidden.shape == (len(p) + len(toks) - 1, lm.embed.shape[1])
        # the exact one-row path: the same greedy tokens, nearly the same features
        seq, ref, feats = list(p), [], []
        logits, h = lm.forward_features([0], [0], [seq], [len(seq)])
        feats.append(h[0])
        for _ in range(len(toks)):
            t = int(logits[0, -1].argmax())
            ref.append(t)
            if t == 0:
                break
            logits, h = lm.forward_features([0], [len(seq)], [[t]], [1])
            seq.append(t)
            feats.append(h[0])
        lm.free(0)
        assert ref == toks
        exact = torch.cat(feats)[: hidden.shape[0]]
        torch.testing.assert_close(hidden.float(), exact.float(), atol=0.05, rtol=0.02)


def test_generate_writes_shards_the_prophets_training_reads_and_resumes(tmp_path):
    """End to end on SmolLM2 (the only target with the chat template Magpie feeds): the
    target writes questions and passages, answers every prompt into shards, a rerun answers
    nothing again, and specdec.train.features reads the shards."""
    from specdec.train.features import load_shards
    from specdec.train.magpie import generate

    out = tmp_path / "broad"
    torch.manual_seed(0)
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=6, seed=1, log=lambda *a: None)
    prompts = torch.load(out / "prompts.pt", weights_only=False)
    kinds = {p["category"] for p in prompts}
    assert "magpie" in kinds and any(k.startswith("own-") for k in kinds) and len(prompts) >= 8
    shards = sorted(out.glob("shard-*.pt"))
    assert len(shards) == -(-len(prompts) // 4)
    first = torch.load(shards[0], weights_only=True)
    for ids, hidden, p_len in zip(first["ids"], first["hidden"], first["prompt_len"], strict=True):
        assert p_len < len(ids) <= p_len + 6 and hidden.shape == (len(ids) - 1, 576)
    stamps = [s.stat().st_mtime_ns for s in shards]
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=6, seed=1, log=lambda *a: None)
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # resumed: nothing answered twice
    data = load_shards(out, 1)
    assert data.n_answer_tokens == sum(len(i) - p for s in shards
                                       for i, p in zip(torch.load(s, weights_only=True)["ids"],
                                                       torch.load(s, weights_only=True)["prompt_len"], strict=True))


def test_exported_ids_rebuild_the_same_shards_features_included(tmp_path):
    """The shards' ids go into one small file (the repository keeps it); the features are
    rebuilt from it by one teacher-forced pass: the same sequences, metadata and held-out
    split, and features as the generating pass computed them (bf16, up to rounding)."""
    import numpy as np

    from specdec.train.magpie import export_ids, features_from_ids, generate, read_ids

    out = tmp_path / "broad"
    torch.manual_seed(0)
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=6, seed=1, log=lambda *a: None)
    info = export_ids(out, tmp_path / "ids.npz")
    seqs = read_ids(tmp_path / "ids.npz")
    assert info["sequences"] == len(seqs) and info["tokens"] == sum(len(s["ids"]) for s in seqs)
    assert np.load(tmp_path / "ids.npz")["tokens"].dtype == np.uint16
    rebuilt = features_from_ids(tmp_path / "ids.npz", tmp_path / "again", rows=3, log=lambda *a: None)
    assert torch.load(rebuilt / "prompts.pt", weights_only=False) == torch.load(out / "prompts.pt", weights_only=False)
    shards = sorted(out.glob("shard-*.pt"))
    assert [s.name for s in shards] == [s.name for s in sorted(rebuilt.glob("shard-*.pt"))]
    for path in shards:
        a, b = torch.load(path, weights_only=False), torch.load(rebuilt / path.name, weights_only=False)
        assert a["ids"] == b["ids"] and a["prompt_len"] == b["prompt_len"] and a["category"] == b["category"]
        assert a["temperature"] == b["temperature"] and tuple(a["fused_layers"]) == tuple(b["fused_layers"])
        for key in ("hidden", "fused"):
            for x, y in zip(a[key], b[key], strict=True):
                # bf16 passes of other shapes (the prompt's the same): each answer position within 5% of its
                # norm, 2% on average (measured on SmolLM2: up to 3.2%, the prompt's positions 0)
                assert x.shape == y.shape
                err = (x.float() - y.float()).norm(dim=-1) / x.float().norm(dim=-1)
                assert float(err.max()) < 0.05 and float(err.mean()) < 0.02, (key, float(err.max()))


def test_more_grows_the_prompt_list_and_answers_only_the_new_prompts(tmp_path):
    """generate(more=True) with a new seed appends prompts not already in the list (compared
    without case and punctuation), each marked with its seed, leaves the old prompts and their
    shards as they were, answers the new batches, and changes nothing when rerun; the seeds
    survive an export and an ids-only rebuild, so a rebuilt folder can grow again."""
    from specdec.train.magpie import export_ids, features_from_ids, generate, prompt_key

    out = tmp_path / "broad"
    torch.manual_seed(0)
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=4, seed=1, log=lambda *a: None)
    old = torch.load(out / "prompts.pt", weights_only=False)
    shards = sorted(out.glob("shard-*.pt"))
    stamps = [s.stat().st_mtime_ns for s in shards]
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=4, seed=2, log=lambda *a: None,
             more=True)
    grown = torch.load(out / "prompts.pt", weights_only=False)
    assert grown[: len(old)] == old and len(grown) > len(old)
    fresh = grown[len(old):]
    assert all(q["seed"] == 2 for q in fresh)
    assert not {prompt_key(q["text"]) for q in fresh} & {prompt_key(q["text"]) for q in old}
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # the old batches are not answered again
    now = sorted(out.glob("shard-*.pt"))
    assert len(now) == -(-len(grown) // 4) and now[: len(shards)] == shards
    stamps = [s.stat().st_mtime_ns for s in now]
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=4, seed=2, log=lambda *a: None,
             more=True)
    assert torch.load(out / "prompts.pt", weights_only=False) == grown
    assert [s.stat().st_mtime_ns for s in now] == stamps
    export_ids(out, tmp_path / "ids.npz")
    again = features_from_ids(tmp_path / "ids.npz", tmp_path / "again", log=lambda *a: None, features=False)
    assert torch.load(again / "prompts.pt", weights_only=False) == grown
    assert all("hidden" not in torch.load(s, weights_only=False) for s in again.glob("shard-*.pt"))


def test_the_int4_engine_answers_ids_only_and_the_features_come_after(tmp_path):
    """engine="int4": the decoder users run answers (token ids, the EOS kept, as generate gives
    them alone for the same seed), then `add_features` gives every shard the features the
    prophets' training reads, rewriting each shard once."""
    import specdec
    from specdec.train.eagle3 import load_sequences
    from specdec.train.magpie import add_features, generate

    out = tmp_path / "broad"
    torch.manual_seed(0)
    generate("smollm2", out, n_magpie=2, n_tasks=8, batch_size=4, max_new=6, seed=1, log=lambda *a: None,
             engine="int4")
    shards = sorted(out.glob("shard-*.pt"))
    first = torch.load(shards[0], weights_only=False)
    assert "hidden" not in first and len(first["ids"]) == 4
    decoder = specdec.load("smollm2", draft="none")
    p_len, seq = first["prompt_len"][0], first["ids"][0]
    if first["temperature"] == 0:
        alone = decoder.generate(seq[:p_len], max_new_tokens=6, temperature=0, stop=[])
        assert seq[p_len:] == list(alone.token_ids)
    add_features(out, rows=3, log=lambda *a: None)
    for path in shards:
        shard = torch.load(path, weights_only=False)
        for ids, hidden, fused in zip(shard["ids"], shard["hidden"], shard["fused"], strict=True):
            assert hidden.shape == (len(ids) - 1, 576) and fused.shape == (len(ids) - 1, 3 * 576)
    train, held, layers = load_sequences(out, 768, heldout_every=2)
    assert len(train) + len(held) > 0 and len(layers) == 3
    stamps = [s.stat().st_mtime_ns for s in shards]
    add_features(out, log=lambda *a: None)
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # nothing computed twice


@pytest.mark.slow
def test_features_of_the_int4_model_from_several_id_files(tmp_path):
    """features_from_ids reads a file and a folder of grow's seed files as one data set (shards
    numbered on), and engine="int4" gives each position the feature the int4 model users run
    computes there (what an eagle reads when it serves: within bf16 rounding of the engine's own
    forward_features), not the float model's (negative control); fused=False keeps no fused layers."""
    import shutil

    import specdec
    from specdec.train.magpie import export_ids, features_from_ids, generate, read_ids

    out = tmp_path / "broad"
    torch.manual_seed(0)
    generate("smollm2", out, n_magpie=2, n_tasks=6, batch_size=4, max_new=5, seed=1, log=lambda *a: None,
             engine="int4")
    export_ids(out, tmp_path / "one.npz")
    (tmp_path / "grown").mkdir()
    shutil.copy(tmp_path / "one.npz", tmp_path / "grown" / "seed-1000.npz")
    n_shards = len(sorted(out.glob("shard-*.pt")))
    both = features_from_ids([tmp_path / "one.npz", tmp_path / "grown"], tmp_path / "int4", rows=3,
                             log=lambda *a: None, engine="int4", fused=False)
    shards = sorted(both.glob("shard-*.pt"))
    assert len(shards) == 2 * n_shards and not (both / "prompts.pt").exists()
    seqs = read_ids(tmp_path / "one.npz")
    first = torch.load(shards[0], weights_only=False)
    again = torch.load(shards[n_shards], weights_only=False)
    assert first["ids"] == again["ids"] and "fused" not in first and first["features"] == "int4"
    lm = specdec.load("smollm2", draft="none").target.view(1)
    floats = features_from_ids(tmp_path / "one.npz", tmp_path / "bf16", rows=3, log=lambda *a: None, fused=False)
    float_first = torch.load(sorted(floats.glob("shard-*.pt"))[0], weights_only=False)
    for ids, hidden, other in zip(first["ids"], first["hidden"], float_first["hidden"], strict=True):
        _, own = lm.forward_features([0], [0], [ids[:-1]], [len(ids) - 1])
        lm.free(0)
        own = own[0].float()
        # a teacher-forced batch (bf16 storage, its own attention order) against the engine's exact rows:
        # measured 0.4-0.7% of a position's norm, at most 1.4-1.9% (the first positions); the float model's
        # features 1.1-3.1%, about 3x as far
        err = (hidden.float() - own).norm(dim=-1) / own.norm(dim=-1)
        assert float(err.mean()) < 0.01 and float(err.max()) < 0.03, (float(err.mean()), float(err.max()))
        control = (other.float() - own).norm(dim=-1) / own.norm(dim=-1)
        assert float(control.mean()) > 2 * float(err.mean()), (float(control.mean()), float(err.mean()))
    assert len(seqs) == sum(len(torch.load(s, weights_only=False)["ids"]) for s in shards[:n_shards])
