"""The training corpus: the running interpreter's standard library, split by file.

The split is a salted hash of each file's path relative to the stdlib root, so it is the
same on every machine with the same Python and never depends on file order or mtime.
Held-out files are never trained on; evaluation text and benchmark prompts come from them.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    path: Path
    heldout: bool


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, percent: float, seed: str) -> bool:
    digest = hashlib.sha256(f"{seed}:{relpath}".encode()).digest()
    bucket = int.from_bytes(digest[:4], "big") % 10_000
    return bucket < percent * 100


def list_files(heldout_percent: float, seed: str, root: Path | None = None) -> list[CorpusFile]:
    """Every .py file of the stdlib (site-packages excluded), sorted, with its split."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relpath = path.relative_to(root).as_posix()
        if relpath.startswith("site-packages/") or "/site-packages/" in relpath:
            continue
        files.append(CorpusFile(relpath, path, is_heldout(relpath, heldout_percent, seed)))
    return files


def read_text(path: Path) -> str | None:
    """The file's text, or None for the few stdlib files that are not valid UTF-8 on purpose."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def write_split(files: list[CorpusFile], out: Path) -> None:
    split = {
        "root": str(files[0].path.parent) if files else "",
        "train": [f.relpath for f in files if not f.heldout],
        "heldout": [f.relpath for f in files if f.heldout],
    }
    out.write_text(json.dumps(split, indent=1))
