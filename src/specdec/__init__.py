"""specdec: lossless speculative decoding for Hugging Face language models."""

from specdec.api import load
from specdec.decoder import Generation, SpeculativeDecoder
from specdec.events import RoundEvent
from specdec.policy import AdaptivePolicy, ConfidencePolicy, OptimalPolicy, Policy
from specdec.sampling import SamplingParams
from specdec.stats import Stats

__all__ = ["load", "Generation", "SpeculativeDecoder", "RoundEvent", "Policy", "AdaptivePolicy",
           "ConfidencePolicy", "OptimalPolicy", "SamplingParams", "Stats"]
