"""Prophets. Every prophet implements `specdec.prophets.base.Prophet`; each is handed the
models it needs. `specdec.wiring` turns a `--draft` spec into prophets (a registry of
prophet kinds); nothing here loads a model."""

from __future__ import annotations

from specdec.prophets.base import Draft, Prophet
from specdec.prophets.feature import FeatureProphet
from specdec.prophets.layerskip import LayerSkipProphet
from specdec.prophets.model import ModelProphet
from specdec.prophets.ngram import NgramProphet
from specdec.prophets.retrieval import RetrievalProphet

__all__ = ["Draft", "Prophet", "FeatureProphet", "ModelProphet", "NgramProphet", "RetrievalProphet", "LayerSkipProphet"]
