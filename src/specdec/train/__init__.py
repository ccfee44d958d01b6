"""Reproducible pipeline for the bundled demo pair: corpus, tokenizer, target, prophets."""
