"""Small real Llama models on disk, for tests that need `from_pretrained` and a real cache."""

from pathlib import Path

import torch

from specdec.data.corpus import list_files, read_text
from specdec.train.tokenizer import train_tokenizer


def tiny_texts(n_files: int = 30) -> list[str]:
    files = [f for f in list_files(4, "specdec-split-v1") if not f.heldout][:400:13][:n_files]
    return [t for t in (read_text(f.path) for f in files) if t]


def make_model(vocab: int, seed: int, hidden: int = 64, layers: int = 2, max_len: int = 256, eos: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                      initializer_range=0.3, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def build_tiny_pair(root: Path) -> dict[str, str]:
    from transformers import AutoTokenizer

    train_tokenizer(iter(tiny_texts()), 512, 2, root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    out = {}
    target = make_model(len(tok), 0, hidden=64, layers=3)
    close = make_model(len(tok), 0, hidden=64, layers=3)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    far = make_model(len(tok), 1, hidden=32, layers=1)
    padded = make_model(len(tok) + 40, 2, hidden=64, layers=2)
    for name, model in [("target", target), ("close", close), ("far", far), ("padded", padded)]:
        model.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
        out[name] = str(root / name)
    # a prophet whose tokenizer differs from the target's
    train_tokenizer(iter(tiny_texts(12)), 400, 2, root / "other-tok")
    other = make_model(400, 3, hidden=32, layers=1)
    other.save_pretrained(str(root / "other"))
    AutoTokenizer.from_pretrained(str(root / "other-tok")).save_pretrained(str(root / "other"))
    out["other"] = str(root / "other")
    return out
