"""Where the shipped models live (models/ in the repository, or $SPECDEC_MODELS), and which
prophet each target gets by default."""

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


def default_drafter_for(target: str) -> str:
    """The measured best prophet for a target: the bundled drafter for the bundled target;
    prompt lookup (ngram) for smollm2, which beat its trained feature prophets on the chat
    benchmark (1.73x against 0.95x greedy with the float32 target, see the README); none
    (plain decoding) for anything else."""
    from specdec.gguf import is_alias

    if Path(target).resolve() == Path(default_target()).resolve():
        return default_drafter()
    if is_alias(target):
        return "ngram"
    return "none"
