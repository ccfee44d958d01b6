"""Prophets. Every prophet implements `specdec.prophets.base.Prophet` (drafting for rows of
the one loop), one class per kind; `specdec.prophets.combine` joins several. Each is handed
the models it needs; `specdec.wiring` turns a `--draft` spec into prophets (a registry of
prophet kinds); nothing here loads a model."""

from __future__ import annotations

from specdec.prophets.base import BatchDraft, Prophet
from specdec.prophets.combine import FirstProphet, TreeProphet
from specdec.prophets.feature import FeatureProphet
from specdec.prophets.layerskip import AdaptedExitProphet, LayerSkipProphet
from specdec.prophets.model import ModelProphet
from specdec.prophets.ngram import NgramProphet
from specdec.prophets.retrieval import RetrievalProphet

__all__ = ["AdaptedExitProphet", "BatchDraft", "FeatureProphet", "FirstProphet", "LayerSkipProphet", "ModelProphet",
           "NgramProphet", "Prophet", "RetrievalProphet", "TreeProphet"]
