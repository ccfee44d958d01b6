"""`specdec bench`: side-by-side speed of speculative decoding against plain decoding,
Hugging Face assisted generation and the theoretical limit (see shared BENCHMARKS.md)."""
