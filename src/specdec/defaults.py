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
    for smollm2 prompt lookup where the context repeats and its EAGLE-style feature prophet
    elsewhere ("ngram+models/smollm2-eagle", multi="first": 1.94x greedy on its chat
    benchmark against 1.59x for prompt lookup alone, and batched 1.29-1.33x at 8 rows against
    1.11x, see the README); none (plain decoding) for anything else."""
    from specdec.gguf import is_alias

    if Path(target).resolve() == Path(default_target()).resolve():
        return default_drafter()
    if is_alias(target):
        eagle = models_dir() / "smollm2-eagle"
        return f"ngram+{eagle}" if (eagle / "prophet.json").is_file() else "ngram"
    return "none"


def default_draft_tokens_for(target: str, draft: str) -> int:
    """K for a target's default prophets: 8 where prompt lookup leads them on smollm2 (long
    drafts pay where the context repeats: 1.94x against 1.75x greedy with K <= 4 on its
    chat benchmark, the same at temperature 1), else 4."""
    from specdec.gguf import is_alias

    return 8 if is_alias(target) and draft.startswith("ngram") else 4
