"""The benchmark prompt suite, drawn from held-out stdlib files (never trained on), in
labelled categories, so the report shows where speculation helps and where it does not."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from specdec.data.corpus import list_files, read_text

DEFAULT_SPLIT = (4, "specdec-split-v1")  # configs/bundled.toml [corpus]
CATEGORIES = ("code", "prose", "grounded", "symbols")


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    source: str  # file:line it came from
    text: str


def _code(lines: list[str], i: int) -> str | None:
    """Code completion: the lines before a def, the def line and the next line."""
    if not re.match(r"\s*def \w+\(", lines[i]) or i + 2 >= len(lines):
        return None
    return "\n".join(lines[max(0, i - 12) : i + 2]) + "\n"


def _prose(lines: list[str], i: int) -> str | None:
    """Docstring / prose continuation: stop a few words into a multi-line docstring."""
    m = re.match(r'(\s*)"""(\w.{20,})$', lines[i])
    if not m or i + 3 >= len(lines) or '"""' in m.group(2) or not lines[i + 1].strip():
        return None
    words = lines[i + 1].split()
    if len(words) < 4:
        return None
    head = "\n".join(lines[max(0, i - 6) : i + 1])
    return head + "\n" + lines[i + 1][: len(lines[i + 1]) - len(" ".join(words[len(words) // 2 :]))]


def _grounded(lines: list[str], i: int) -> str | None:
    """Input-grounded rewriting: a function, then the same function started again; the
    answer copies much of the prompt."""
    if not re.match(r"def \w+\(", lines[i]):
        return None
    j = i + 1
    while j < len(lines) and (not lines[j] or lines[j].startswith((" ", "\t"))):
        j += 1
    body = lines[i:j]
    while body and not body[-1].strip():
        body.pop()
    if not 6 <= len(body) <= 30:
        return None
    return "\n".join(body) + "\n\n\n# The same function, copied unchanged:\n" + "\n".join(body[:2]) + "\n"


def _symbols(lines: list[str], i: int) -> str | None:
    """Symbol- or arithmetic-heavy text: a run of lines dense in digits and operators."""
    window = lines[i : i + 6]
    if len(window) < 6 or any(not w.strip() for w in window):
        return None
    text = "".join(window)
    dense = sum(c.isdigit() or c in "+-*/%=<>()[]{},.:^&|~0x" for c in text) / max(1, len(text))
    if dense < 0.35 or sum(c.isdigit() for c in text) < 12:
        return None
    return "\n".join(window) + "\n"


BUILDERS = {"code": _code, "prose": _prose, "grounded": _grounded, "symbols": _symbols}


def build_suite(per_category: int = 6, seed: int = 0, max_chars: int = 1200) -> list[BenchPrompt]:
    files = [f for f in list_files(*DEFAULT_SPLIT) if f.heldout]
    candidates: dict[str, list[BenchPrompt]] = {c: [] for c in CATEGORIES}
    for f in files:
        text = read_text(f.path)
        if not text:
            continue
        lines = text.splitlines()
        for i in range(len(lines)):
            for cat, build in BUILDERS.items():
                prompt = build(lines, i)
                if prompt and 40 <= len(prompt) <= max_chars:
                    candidates[cat].append(BenchPrompt(cat, f"{f.relpath}:{i + 1}", prompt))
    rng = random.Random(seed)
    suite: list[BenchPrompt] = []
    for cat in CATEGORIES:
        pool = candidates[cat]
        # one prompt per file at most, so a single file cannot dominate a category
        by_file: dict[str, BenchPrompt] = {}
        for p in rng.sample(pool, len(pool)):
            by_file.setdefault(p.source.split(":")[0], p)
        picks = sorted(by_file.values(), key=lambda p: p.source)
        suite.extend(rng.sample(picks, min(per_category, len(picks))))
    return suite
