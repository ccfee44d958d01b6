"""Prophets. Every drafter implements `specdec.drafters.base.Drafter`; each is handed the
models it needs. `specdec.wiring` turns a `--draft` spec into drafters (a registry of
prophet kinds); nothing here loads a model."""

from __future__ import annotations

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.feature import FeatureDrafter
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.retrieval import RetrievalDrafter

__all__ = ["Draft", "Drafter", "FeatureDrafter", "ModelDrafter", "NgramDrafter", "RetrievalDrafter", "LayerSkipDrafter"]
