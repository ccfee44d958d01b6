"""Broad self-distillation data: the task templates and the batched generator that answers
prompts for the prophets' training (specdec.train.magpie)."""

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
