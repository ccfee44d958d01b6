"""Chat prompts made from local text (the standard library's docstrings and code).

Four categories, as an instruct model's users ask: `instruct` (explain something),
`code` (write a function from its description), `summary` (summarise a given text) and
`copy` (repeat or lightly rework a given text, where prompt lookup shines). Prompts for
training prophets come from the training split of the stdlib; benchmark prompts from
held-out files only, so a prophet is never measured on what it was trained on.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass

from specdec.data.corpus import list_files, read_text

CHAT_CATEGORIES = ("instruct", "code", "summary", "copy")
SPLIT = (4, "specdec-split-v1")  # the bundled corpus split (configs/bundled.toml [corpus])


@dataclass(frozen=True)
class ChatPrompt:
    category: str
    source: str  # module:name it came from
    text: str  # the user's message

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class _Doc:
    module: str
    name: str
    signature: str
    doc: str
    code: str


def _docs(source: str, module: str) -> list[_Doc]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 60 or not doc[0].isalpha():
            continue
        sig = ""
        if isinstance(node, ast.FunctionDef):
            args = [a.arg for a in node.args.args]
            sig = f"({', '.join(args)})"
        code = "\n".join(lines[node.lineno - 1 : (node.end_lineno or node.lineno)])
        out.append(_Doc(module, node.name, sig, doc, code))
    return out


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n")[0].split())
    end = para.find(". ")
    return (para if end < 0 else para[: end + 1]).rstrip(".")


def _paragraphs(doc: str, limit: int = 900) -> str:
    text = ""
    for para in doc.split("\n\n"):
        para = " ".join(para.split())
        if len(text) + len(para) > limit:
            break
        text += ("\n\n" if text else "") + para
    return text


def _make(doc: _Doc, category: str, rng: random.Random) -> str | None:
    first = _first_sentence(doc.doc)
    if category == "instruct":
        forms = [f"What does `{doc.name}` in Python's `{doc.module}` module do? Answer briefly.",
                 f"Explain to a beginner, in a few sentences: {first}.",
                 f"I am reading about `{doc.module}.{doc.name}`. Its documentation says: \"{first}.\" "
                 "What is it useful for?"]
        return rng.choice(forms)
    if category == "code":
        if not doc.signature:
            return None
        what = first[0].lower() + first[1:]
        return f"Write a Python function `{doc.name}{doc.signature}` that does the following: {what}."
    if category == "summary":
        text = _paragraphs(doc.doc)
        if len(text) < 200:
            return None
        return f"Summarize the following text in one or two sentences.\n\n{text}"
    if category == "copy":
        if rng.random() < 0.5 and 120 <= len(doc.code) <= 900:
            return ("Add a one-line comment above each statement of this Python code and return the whole "
                    f"code:\n\n```python\n{textwrap.dedent(doc.code)}\n```")
        text = _paragraphs(doc.doc, 600)
        if len(text) < 120:
            return None
        return f"Repeat the following text exactly as it is written:\n\n{text}"
    raise ValueError(f"unknown chat prompt category {category!r}")


def chat_prompts(n_per_category: int, heldout: bool, seed: int = 0) -> list[ChatPrompt]:
    """n prompts of each category, from held-out files (benchmarks) or training files (prophets)."""
    percent, salt = SPLIT
    files = [f for f in list_files(percent, salt) if f.heldout == heldout]
    rng = random.Random(seed)
    rng.shuffle(files)
    docs: list[_Doc] = []
    need = 4 * n_per_category * len(CHAT_CATEGORIES)
    for f in files:
        text = read_text(f.path)
        if text:
            module = f.relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            docs.extend(_docs(text, module))
        if len(docs) >= need:
            break
    rng.shuffle(docs)
    out: list[ChatPrompt] = []
    for ci, category in enumerate(CHAT_CATEGORIES):
        made = 0
        start = ci * len(docs) // len(CHAT_CATEGORIES)  # each category starts on other documents
        for doc in docs[start:] + docs[:start]:
            if made == n_per_category:
                break
            text = _make(doc, category, rng)
            if text is not None:
                out.append(ChatPrompt(category, f"{doc.module}:{doc.name}", text))
                made += 1
    return out
