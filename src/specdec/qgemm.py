"""Matrix products of float32 activations with GGUF 4-bit and 8-bit block weights, on the CPU
(and, `f32_product`, of a few float32 rows with float32 weights: kernels/f32mm.cpp).

`q4_1_mm(x, blocks)` and `q8_0_mm(x, blocks)` compute x @ W.T for a weight matrix W (N, K) held as
the blocks of a GGUF file, byte for byte (llama.cpp's layouts, 32 weights a block):

- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes qs; w[j] = d * (qs[j] & 15) + m, w[j+16] = d * (qs[j] >> 4) + m
  (one fused multiply-add: the exact value rounded once to float32);
- Q8_0, 34 bytes: fp16 d, 32 int8 q; w[j] = d * q[j] (rounded to float32).

The blocks tensor is uint8 (N, K/32, 20) or (N, K/32, 34). The weights are de-quantized in float32 and
the products accumulated in float32. Each weight block is unpacked once per tile of up to 6 activation
rows and applied to all of them, so a product of M rows costs far less than M one-row products; what is
left is the float32 multiply-adds themselves (2 a block and row), which bound the cost of M > 1 rows on
a CPU whose vector units do one 512-bit FMA a cycle (AMD Zen 4: M = 5 costs ~2.5x one row in cache).
With AVX2, products of 16 rows or more (a prompt's chunks, large batches) run a register-blocked kernel
(16 weight rows de-quantized into a transposed panel, tiles of 6 activation rows, 12 accumulators) that
computes the same partial sums in the same order: 1.6x faster prompt reading on a 2-core AMD EPYC.

Row invariance: every output element is computed by one fixed sequence of float operations (see the
C++ source), so row r of a product is bit-for-bit the same whatever the number of rows, the other rows,
the thread count or the instruction set the kernel was built for (scalar, AVX2, AVX-512).

The kernel is a PyTorch C++ extension (src/specdec/kernels/qgemm.cpp), compiled for this machine
(-O3 -march=native) on first use and cached under $SPECDEC_CACHE/kernels (default
~/.cache/specdec/kernels), keyed by a hash of its source, the torch version and the CPU's flags.
It runs on torch's own thread pool (at::parallel_for) and splits work over N only. `available()` says
whether it could be built here (x86-64 Linux with a C++ compiler and ninja); `why_unavailable()` why not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from specdec import sampling
from specdec.defaults import cache_dir

QK = 32  # weights a block
Q4_1_BYTES = 20
Q8_0_BYTES = 34
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
SOURCE = KERNELS_DIR / "qgemm.cpp"
# one extension: the products (float32, int8 and bfloat16 activations), the layer loop, lookups
SOURCES = (SOURCE, KERNELS_DIR / "qgemm8.cpp", KERNELS_DIR / "qgemm16.cpp", KERNELS_DIR / "step.cpp",
           KERNELS_DIR / "lookup.cpp", KERNELS_DIR / "f32mm.cpp")
HEADERS = (KERNELS_DIR / "qgemm_common.h", KERNELS_DIR / "step_ops.h", KERNELS_DIR / "step_product.h")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-Wall")
LDFLAGS = ("-fopenmp",)
_IMPLS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
_IMPLS8 = {"auto": 0, "scalar": 1, "avx2": 2, "avx512vnni": 3}

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _cpu_flags() -> str:
    """The CPU's model name and feature flags (the first processor's), for the build's key."""
    model = flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    return f"{model}|{flags}"


@functools.cache
def build_name() -> str:
    """The extension's name: a hash of its source, the build flags, torch's version and this CPU
    (fixed for the process: computed once)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    for part in (" ".join(CFLAGS), " ".join(LDFLAGS), torch.__version__, sys.version, _cpu_flags()):
        h.update(b"\0" + part.encode())
    return f"specdec_qgemm_{h.hexdigest()[:16]}"


def build_dir() -> Path:
    """Where the extension is built and cached ($SPECDEC_CACHE/kernels/NAME, default ~/.cache/specdec/...)."""
    return cache_dir() / "kernels" / build_name()


def _find_ninja() -> str | None:
    """Make `ninja` callable for torch's builder (the `ninja` package's binary if none is on PATH)."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    bin_dir = str(getattr(ninja, "BIN_DIR", ""))
    if not bin_dir or not (Path(bin_dir) / "ninja").exists():
        return "the ninja package has no ninja binary"
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings or log lines from torch's builder (its errors still raise, with the compiler's output)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _build() -> ModuleType:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"needs x86-64 Linux, this is {sys.platform} on {platform.machine()}")
    problem = _find_ninja()
    if problem:
        raise RuntimeError(problem)
    from torch.utils import cpp_extension

    name = build_name()
    directory = cache_dir() / "kernels" / name
    directory.mkdir(parents=True, exist_ok=True)
    with _quiet(), _building(directory):
        module = cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), build_directory=str(directory), verbose=False)
    return module  # type: ignore[no-any-return]


@contextlib.contextmanager
def _building(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads the extension in `directory`, under a lock the system
    lets go of when its holder dies. Torch's builder marks a build with a file `lock` and waits, with
    no end, while one is there; a build that was killed (Ctrl-C during the first run's compile) left
    it behind and every later process hung. Holding this lock, no other process is building, so a
    `lock` file found is such a leftover and goes."""
    import fcntl

    with open(directory / "specdec.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load() -> ModuleType | None:
    """The extension, built (or loaded from the cache) on first call; None if it cannot be."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
                sampling.use_kernels(_module)
            except Exception as e:  # a failed build: unavailable, never an error at import or in callers
                _error = f"{type(e).__name__}: {e}".strip()
    return _module


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it already, else None (never builds it)."""
    return _module


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine. Builds it on first call."""
    return _load() is not None


def why_unavailable() -> str | None:
    """Why the kernel is unavailable (the build's error), None if it is available."""
    _load()
    return _error


def impls() -> list[str]:
    """The implementations compiled into this machine's build, e.g. ['scalar', 'avx2', 'avx512']."""
    return list(_require().impls())


def module() -> ModuleType:
    """The built extension (for `specdec.layerloop`); raises where it is unavailable."""
    return _require()


def _require() -> ModuleType:
    module = _load()
    if module is None:
        raise RuntimeError(f"the qgemm kernel is unavailable: {_error}")
    return module


def f32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ weight.T. Float32 on the CPU where the extension builds: products of up to
    `f32_rows()` rows (64: decoding steps, verification passes, token trees, batches) on specdec's own
    kernel (kernels/f32mm.cpp), whose every row has the same bits whatever the row count, the
    thread count or the instruction set, at the memory's speed (2-core AMD EPYC Zen 4, SmolLM2's
    49,152 x 576 head: 4.7 ms for 1 row and 4.6 for 2, against ATen's 10.5 and 24.7; its
    3,072 x 576 product 0.27 ms for 1 to 4 rows against 0.61-1.33; 64 rows of the head 25 ms against
    33); more rows (a prompt) on ATen's matmul; the extension's `f32_product` decides (dtype,
    device, rows). Other devices never load the extension for it."""
    if x.device.type == "cpu":
        module = _module if _module is not None else _load()
        if module is not None:
            return module.f32_product(x, weight)  # type: ignore[no-any-return]
    return x @ weight.T


def f32_rows() -> int:
    """The most rows `f32_product` multiplies on specdec's float32 kernel; 0 where the extension is
    unavailable (every float32 product then runs on ATen's matmul)."""
    module = _load()
    return 0 if module is None else int(module.f32_rows())


def f32_tile() -> str:
    """The tile specdec's float32 kernel multiplies in on this machine (weight rows x activation
    rows, e.g. "6x4" with AVX-512); "" where the extension is unavailable."""
    module = _load()
    return "" if module is None else str(module.f32_tile())


def _mm(x: torch.Tensor, blocks: torch.Tensor, fmt: int, impl: str, int8: bool = False) -> torch.Tensor:
    module = _module if _module is not None else _require()
    entry = module.qmm8 if int8 else module.qmm
    if impl == "auto":
        return _on_rows(entry, x, blocks, fmt, 0)
    impls = _IMPLS8 if int8 else _IMPLS
    if impl not in impls:
        raise ValueError(f"impl must be one of {sorted(impls)}, got {impl!r}")
    return _on_rows(entry, x, blocks, fmt, impls[impl])


def _on_rows(entry: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """entry(x2, *args) for x (..., K) taken as float32 contiguous rows x2 (M, K), the (M, N) result
    shaped back to (..., N)."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return entry(x, *args)  # type: ignore[no-any-return]  # the common case, no copies
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., K)")
    out: torch.Tensor = entry(x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous(), *args)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def q4_1_mm(x: torch.Tensor, blocks: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) float32, W given as Q4_1 blocks uint8 (N, K/32, 20).

    x is cast to float32 and made contiguous if needed. `impl` picks an implementation (tests):
    "auto" (the best compiled), "scalar", "avx2" or "avx512"; all give the same bits."""
    return _mm(x, blocks, 0, impl)


def q8_0_mm(x: torch.Tensor, blocks: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) float32, W given as Q8_0 blocks uint8 (N, K/32, 34). See `q4_1_mm`."""
    return _mm(x, blocks, 1, impl)


def q4_1_mm8(x: torch.Tensor, blocks: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """As `q4_1_mm`, with x quantized to int8 blocks first (llama.cpp's scheme, see qgemm8.cpp):
    per block of 32, dx = max|x| / 127, codes round(x / dx), integer dot products with the weights'
    codes. impl: "auto", "scalar", "avx2" or "avx512vnni"; all give the same bits."""
    return _mm(x, blocks, 0, impl, int8=True)


def q8_0_mm8(x: torch.Tensor, blocks: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """As `q8_0_mm`, with x quantized to int8 blocks first (see `q4_1_mm8`)."""
    return _mm(x, blocks, 1, impl, int8=True)


def q4_1_mm16(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) float32 on the bfloat16 kernel, W given as Q4_1 panels
    (N/16, K/32, 320) (`panel_q4_1`). x is rounded to bfloat16 (round to nearest even); the
    weights are exact (w = d q + m: the codes' dot products with x by AVX-512 BF16 instructions,
    accumulating in float32, then d and m applied per block); rows invariant by construction
    (see qgemm16.cpp). Only where `has_bf16_kernel()`."""
    return _on_rows((_module if _module is not None else _require()).qmm16, x, panels, 0)


def q8_0_mm16(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) float32 on the bfloat16 kernel, W given as Q8_0 panels
    (N/16, K/32, 544) (`panel_q8_0`). As `q4_1_mm16`: x rounded to bfloat16, the weights exact
    (w = d q, every int8 code exact in bfloat16), d applied per block; rows invariant by construction."""
    return _on_rows((_module if _module is not None else _require()).qmm16, x, panels, 1)


AMX_UNIT = 2  # added to a panels' format (0 Q4_1, 1 Q8_0): their dot products on the AMX tile unit (qgemm16.cpp)


def q4_1_mm_amx(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """As `q4_1_mm16` (the same panels, x rounded to bfloat16, the weights exact, d and m per
    block), each block's dot products on the CPU's AMX tile unit, which adds in its own order:
    rows invariant, but not the bits of `q4_1_mm16`. Only where `has_amx_kernel()`."""
    return _on_rows((_module if _module is not None else _require()).qmm16, x, panels, 0 + AMX_UNIT)


def q8_0_mm_amx(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """As `q8_0_mm16`, each block's dot products on the AMX tile unit (see `q4_1_mm_amx`)."""
    return _on_rows((_module if _module is not None else _require()).qmm16, x, panels, 1 + AMX_UNIT)


PANEL_ROWS = 16  # weight rows a panel of the bfloat16 kernel
PANEL_BLOCK = 320  # bytes of a panel's block: 16 d, 16 m (fp16), then 8 groups of 4 positions x 16 rows of codes


def _by_panel(blocks: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Blocks (N, K/32, nbytes) checked and grouped by panel: (N/16, K/32, 16 rows, nbytes), rows of
    zeros added to make N a multiple of 16."""
    _check_blocks(blocks, nbytes)
    if blocks.shape[0] % PANEL_ROWS:
        pad = blocks.new_zeros(PANEL_ROWS - blocks.shape[0] % PANEL_ROWS, *blocks.shape[1:])
        blocks = torch.cat([blocks, pad])
    n, kb, _ = blocks.shape
    return blocks.reshape(n // PANEL_ROWS, PANEL_ROWS, kb, nbytes).transpose(1, 2)


def panel_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (N, K/32, 20) -> the bfloat16 kernel's panels (N/16, K/32, 320), the same bytes
    regrouped by 16 weight rows: per block the 16 rows' d, their m, then for each group of four
    positions 4k..4k+3 two bytes a row, q[4k] | q[4k+2] << 4 and q[4k+1] | q[4k+3] << 4 (one
    load widening them to words holds two pairs of positions, see qgemm16.cpp). Rows of zeros
    (d = m = 0) make N a multiple of 16: the product's columns past N are zeros."""
    b = _by_panel(blocks, Q4_1_BYTES)  # (P, KB, 16 rows, 20)
    d = b[..., 0:2].reshape(*b.shape[:2], 32)
    m = b[..., 2:4].reshape(*b.shape[:2], 32)
    q = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=-1)  # (P, KB, 16 rows, 32 positions)
    g = q.reshape(*q.shape[:3], 8, 4)  # (P, KB, 16 rows, 8 groups, 4 positions)
    codes = torch.stack([g[..., 0] | (g[..., 2] << 4), g[..., 1] | (g[..., 3] << 4)], dim=-1)
    codes = codes.transpose(2, 3)  # (P, KB, 8 groups, 16 rows, 2 bytes)
    return torch.cat([d, m, codes.reshape(*b.shape[:2], 256)], dim=-1).contiguous()


def unpanel_q4_1(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of `panel_q4_1`: panels (N/16, K/32, 320) -> Q4_1 blocks (N, K/32, 20)."""
    if panels.dtype != torch.uint8 or panels.dim() != 3 or panels.shape[2] != PANEL_BLOCK:
        raise ValueError(f"panels must be uint8 (N/16, K/32, {PANEL_BLOCK}), got {panels.dtype} {tuple(panels.shape)}")
    p, kb, _ = panels.shape
    d = panels[..., 0:32].reshape(p, kb, PANEL_ROWS, 2)
    m = panels[..., 32:64].reshape(p, kb, PANEL_ROWS, 2)
    codes = panels[..., 64:].reshape(p, kb, 8, PANEL_ROWS, 2).transpose(2, 3)  # (P, KB, 16 rows, 8 groups, 2)
    q = torch.stack([codes[..., 0] & 15, codes[..., 1] & 15, codes[..., 0] >> 4, codes[..., 1] >> 4], dim=-1)
    q = q.reshape(p, kb, PANEL_ROWS, QK)
    b = torch.cat([d, m, q[..., :16] | (q[..., 16:] << 4)], dim=-1)  # (P, KB, 16 rows, 20)
    return b.transpose(1, 2).reshape(p * PANEL_ROWS, kb, Q4_1_BYTES).contiguous()


PANEL_BLOCK8 = 544  # bytes of a Q8_0 panel's block: 16 d (fp16), then 16 pairs of positions x 16 rows of 2 codes


def panel_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (N, K/32, 34) -> the bfloat16 kernel's panels (N/16, K/32, 544), the same bytes
    regrouped by 16 weight rows: per block the 16 rows' d, then for each pair of positions
    (2i, 2i+1) two bytes a row, q[2i] and q[2i+1] (see qgemm16.cpp). Rows of zeros (d = 0) make
    N a multiple of 16: the product's columns past N are zeros."""
    b = _by_panel(blocks, Q8_0_BYTES)  # (P, KB, 16 rows, 34)
    d = b[..., 0:2].reshape(*b.shape[:2], 32)
    codes = b[..., 2:].reshape(*b.shape[:3], 16, 2).transpose(2, 3)  # (P, KB, 16 pairs, 16 rows, 2)
    return torch.cat([d, codes.reshape(*b.shape[:2], 512)], dim=-1).contiguous()


def unpanel_q8_0(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of `panel_q8_0`: panels (N/16, K/32, 544) -> Q8_0 blocks (N, K/32, 34)."""
    if panels.dtype != torch.uint8 or panels.dim() != 3 or panels.shape[2] != PANEL_BLOCK8:
        raise ValueError(f"panels must be uint8 (N/16, K/32, {PANEL_BLOCK8}), got {panels.dtype} {tuple(panels.shape)}")
    p, kb, _ = panels.shape
    d = panels[..., 0:32].reshape(p, kb, PANEL_ROWS, 2)
    codes = panels[..., 32:].reshape(p, kb, 16, PANEL_ROWS, 2).transpose(2, 3).reshape(p, kb, PANEL_ROWS, QK)
    b = torch.cat([d, codes], dim=-1)  # (P, KB, 16 rows, 34)
    return b.transpose(1, 2).reshape(p * PANEL_ROWS, kb, Q8_0_BYTES).contiguous()


def has_bf16_kernel() -> bool:
    """Whether the extension builds here with its bfloat16 kernel (a CPU with avx512_bf16)."""
    return available() and bool(_require().impls16())


def has_amx_kernel() -> bool:
    """Whether the bfloat16 kernel can run its dot products on the AMX tile unit here (a CPU with
    amx_bf16, and a system that gives this process the tile state)."""
    return available() and "amx" in _require().impls16()


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x float32 -> bfloat16, rounded as the bfloat16 kernel rounds its activations."""
    return _require().round_bf16(x.to(torch.float32).contiguous())  # type: ignore[no-any-return]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 (M, K) -> (codes int8 (M, K), dx float32 (M, K/32), sx float32 (M, K/32)): the int8
    kernel's quantization of its activations (sx = dx * the sum of a block's codes)."""
    return _require().quantize_rows(x)  # type: ignore[no-any-return]


def impls8() -> list[str]:
    """The int8 kernel's implementations compiled in this machine's build, e.g. ['scalar', 'avx2', 'avx512vnni']."""
    return list(_require().impls8())


# ------------------------------------------------------------------------------------------- packing

def _check_scale(name: str, t: torch.Tensor, n: int, kb: int) -> None:
    if t.dtype != torch.float16 or tuple(t.shape) != (n, kb):
        raise ValueError(f"{name} must be float16 of shape ({n}, {kb}), got {t.dtype} {tuple(t.shape)}")


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float16 (N, KB) -> its little-endian bytes, uint8 (N, KB, 2)."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape, 2)


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (N, K/32, 20) uint8 from scales d and minimums m (float16 (N, K/32)) and codes q
    (uint8 (N, K), values 0..15): w = d * q + m per block of 32 along K."""
    if q.dim() != 2 or q.dtype != torch.uint8 or q.shape[1] % QK:
        raise ValueError(f"q must be uint8 (N, K) with K a multiple of {QK}, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    kb = k // QK
    _check_scale("d", d, n, kb)
    _check_scale("m", m, n, kb)
    if q.numel() and int(q.max()) > 15:
        raise ValueError("q4_1 codes must be in 0..15")
    qb = q.reshape(n, kb, QK)
    qs = qb[..., :16] | (qb[..., 16:] << 4)
    return torch.cat([_half_bytes(d), _half_bytes(m), qs], dim=-1).contiguous()


def pack_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (N, K/32, 34) uint8 from scales d (float16 (N, K/32)) and codes q (int8 (N, K)): w = d * q."""
    if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] % QK:
        raise ValueError(f"q must be int8 (N, K) with K a multiple of {QK}, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    kb = k // QK
    _check_scale("d", d, n, kb)
    qb = q.reshape(n, kb, QK).view(torch.uint8)
    return torch.cat([_half_bytes(d), qb], dim=-1).contiguous()


def _check_blocks(blocks: torch.Tensor, nbytes: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != nbytes:
        raise ValueError(f"blocks must be uint8 (N, K/32, {nbytes}), got {blocks.dtype} {tuple(blocks.shape)}")


def _halves(b: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 2) little-endian -> float64 (...) of the float16 they hold."""
    return b.contiguous().view(torch.float16).squeeze(-1).double()


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 (N, K) weights of Q4_1 blocks (N, K/32, 20), exactly as the kernel uses them
    (d * q + m computed exactly, rounded once to float32). Pure torch, for tests."""
    _check_blocks(blocks, Q4_1_BYTES)
    n, kb, _ = blocks.shape
    d = _halves(blocks[..., 0:2]).unsqueeze(-1)
    m = _halves(blocks[..., 2:4]).unsqueeze(-1)
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).double()
    return (d * q + m).float().reshape(n, kb * QK)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 (N, K) weights of Q8_0 blocks (N, K/32, 34), exactly as the kernel uses them
    (d * q rounded to float32). Pure torch, for tests."""
    _check_blocks(blocks, Q8_0_BYTES)
    n, kb, _ = blocks.shape
    d = _halves(blocks[..., 0:2]).unsqueeze(-1)
    q = blocks[..., 2:].contiguous().view(torch.int8).double()
    return (d * q).float().reshape(n, kb * QK)
