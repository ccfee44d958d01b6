"""Tiny random-weight models of the families people run, built from each family's transformers
config (no download), for the transformers path's tests. Sliding windows are small (WINDOW
positions) so that a test of a few dozen tokens crosses them; the weights are drawn wide
(initializer_range 0.3) so that greedy choices are clear, not near-ties."""

from pathlib import Path

import torch

from specdec.defaults import bundled_target

WINDOW = 8  # the sliding window of the sliding families: tests run 3-6x past it
VOCAB = 8192  # the bundled tokenizer's (models/target), which the saved models ship with
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, initializer_range=0.3, bos_token_id=0, eos_token_id=0,
             pad_token_id=0)


def _config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **SHAPE)
    if family == "mistral":  # every layer slides
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SHAPE)
    if family == "qwen2":  # q/k/v biases; the layers past max_window_layers slide, the first is full
        return tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              tie_word_embeddings=False, **SHAPE)
    if family == "qwen3":  # q/k norms, full attention
        return tf.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **SHAPE)
    if family == "gemma2":  # sliding and full layers alternating, logit soft-capping, GeGLU, tied head
        return tf.Gemma2Config(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                               attn_implementation="eager", **SHAPE)
    if family == "gemma3":  # five sliding layers then a full one; q/k norms
        return tf.Gemma3TextConfig(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16, **SHAPE)
    if family == "phi3":  # fused qkv and gate-up projections, a sliding window on every layer
        return tf.Phi3Config(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False,
                             **{k: v for k, v in SHAPE.items() if k != "head_dim"})
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


def make_family_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(family)).eval()


def save_family_model(family: str, root: Path, seed: int = 0, cache_implementation: str | None = None) -> str:
    """The model saved as a local directory that `specdec.load` reads, with the bundled tokenizer."""
    from transformers import AutoTokenizer

    model = make_family_model(family, seed)
    if cache_implementation is not None:  # what transformers' generate would build; specdec keeps its own cache
        model.generation_config.cache_implementation = cache_implementation
    out = root / (family if cache_implementation is None else f"{family}-{cache_implementation}")
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(bundled_target()).save_pretrained(str(out))
    return str(out)
