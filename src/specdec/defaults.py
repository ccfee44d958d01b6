"""Where the bundled demo pair lives (models/ in the repository, or $SPECDEC_MODELS)."""

from __future__ import annotations

import os
from pathlib import Path


def models_dir() -> Path:
    env = os.environ.get("SPECDEC_MODELS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "models"


def default_target() -> str:
    return str(models_dir() / "target")


def default_drafter() -> str:
    return str(models_dir() / "drafter")
