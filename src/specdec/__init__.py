"""specdec: lossless speculative decoding."""
