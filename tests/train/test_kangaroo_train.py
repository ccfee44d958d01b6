"""The kangaroo adapter's training path (`specdec distill --only kangaroo`), on the tiny
Llama: early-exit features computed from stored ids match the lean path's, and training
lowers the distillation loss from where plain early exit starts."""

import torch

from specdec.prophets.feature import FeatureHead
from specdec.train.features import _loss, _unroll, early_features, load_shards, train_head
from specdec.wiring import load_pretrained
from tests.helpers import lean


def test_kangaroo_trains_from_early_exit_features(tiny_pair, tmp_path):
    model, _ = load_pretrained(tiny_pair["target"], torch.float32)
    lm = lean(model, "tiny")
    g = torch.Generator().manual_seed(0)
    shard = {"ids": [], "hidden": [], "prompt_len": []}
    for _ in range(24):  # self-distillation shards as selfdistill writes them: ids, last hidden state
        ids = torch.randint(1, lm.vocab_size, (40,), generator=g).tolist()
        lm.truncate(0)
        _, hidden = lm.forward_features(ids[:-1], len(ids) - 1)
        shard["ids"].append(ids), shard["hidden"].append(hidden.to(torch.bfloat16)), shard["prompt_len"].append(8)
    torch.save(shard, tmp_path / "shard-00000.pt")

    early = early_features(tiny_pair["target"], tmp_path, 1, log=lambda *a: None)
    lm.truncate(0)
    want = lm.early_exit_features(shard["ids"][0][:39], 1, n_last=39)
    assert early.shape == (24 * 39, lm.lm.embed.shape[1])
    assert torch.allclose(early[:39].float(), want, atol=0.05)  # stored in bf16
    assert (tmp_path / "early-1.pt").exists()

    data = load_shards(tmp_path, 1, heldout_every=6, vocab_size=lm.vocab_size)
    data.early = early
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    vocab = torch.arange(lm.vocab_size)
    data.add_targets(lm_head)
    position_of = torch.arange(lm.vocab_size)
    idx = data.starts_train[:128]

    def loss(head):
        with torch.no_grad():
            return float(_loss(_unroll(head, data, idx, embed, 1), data, idx, lm_head.to(torch.bfloat16),
                               position_of, 0.1)[0])

    start = FeatureHead("kangaroo", embed.shape[1], 16, depth=1, layers=1)  # zero blocks: plain early exit
    cfg = {"rank": 16, "depth": 1, "unroll": 1, "layers": 1, "lr": 1e-2, "batch_size": 64, "eval_every": 10}
    head, info = train_head("kangaroo", data, embed, lm_head, vocab, cfg, tmp_path / "k.ckpt", minutes=5,
                            max_steps=60, log=lambda *a: None)
    assert info["steps"] == 60 and len(info["heldout_agreement"]) == 1
    assert loss(head) < loss(start)
