"""`specdec bench --peers llama.cpp`: other engines decoding the same prompts beside specdec.

llama.cpp (through llama-cpp-python) loads the very GGUF file that specdec loads for its
target, is fed the same prompt token ids (the chat template already applied by specdec)
and the same settings, and runs interleaved per prompt with specdec's own configurations:
plainly, and with llama-cpp-python's own speculative mode, its prompt lookup decoding
(`LlamaPromptLookupDecoding`, 10 tokens drafted from a 2-gram match in the context, every
one scored in one batch). In `--suite structured` the peer decodes under llama.cpp's own
grammar sampler instead (`STRUCTURED_PEER_CONFIGS`; a GBNF grammar in the settings,
from llama-cpp-python's JSON-schema converter). Its rows are reported beside specdec's, with tokens/s and the
speedup against specdec's plain decoding, and in greedy mode how often its tokens equal
specdec plain's: a fact, never a check (different kernels, so near-ties can break the
other way; llama.cpp's CPU kernels round the activations to 8 bits for 4-bit products).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specdec.bench.report import fmt
from specdec.bench.runner import Config, Run, Runner
from specdec.errors import SpecdecError

INSTALL = 'pip install -e ".[llamacpp]"'
LOOKUP_TOKENS = 10  # llama-cpp-python's own default for LlamaPromptLookupDecoding
PEER_CONFIGS = {"llama.cpp": [Config("llama.cpp plain", "peer", "llama.cpp", k=0),
                              Config(f"llama.cpp prompt lookup K={LOOKUP_TOKENS}", "peer", "llama.cpp+lookup",
                                     k=LOOKUP_TOKENS)]}
# `--suite structured`: llama.cpp's JSON-schema constrained decoding (settings["gbnf"], its grammar sampler)
STRUCTURED_PEER_CONFIGS = {"llama.cpp": [Config("llama.cpp constrained", "peer", "llama.cpp", k=0)]}


class Peer(Protocol):
    def generate(self, prompt_ids: list[int], seed: int,
                 settings: dict[str, Any]) -> tuple[list[int], float, dict[str, Any]]: ...


def _require_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        raise SpecdecError(f"--peers llama.cpp needs the llama-cpp-python package, which does not import here: "
                           f"{INSTALL} (it compiles llama.cpp, several minutes)") from None


REQUIRES = {"llama.cpp": _require_llama_cpp}


def peer_model_path(target: str) -> Path:
    """The GGUF file that specdec loads for `target`: llama.cpp's model."""
    from specdec.defaults import display_name, is_alias
    from specdec.gguf import smollm2_gguf

    if is_alias(target):
        return smollm2_gguf()
    if target.lower().endswith(".gguf"):
        return Path(target).expanduser()
    raise SpecdecError(f"--peers llama.cpp decodes the target's own GGUF file, and the target "
                       f"{display_name(target)} is none (smollm2 or a .gguf path)")


def check_peers(text: str | None, target: str,
                table: dict[str, list[Config]] | None = None) -> list[Config]:
    """The configurations of `--peers` (a comma list) in `table` (default PEER_CONFIGS),
    checked before any model loads: an unknown name, a missing package or a target without
    a GGUF file is a SpecdecError."""
    table = PEER_CONFIGS if table is None else table
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for name in names:
        if name not in table:
            raise SpecdecError(f"--peers: unknown peer {name!r} (known: {', '.join(table)}; "
                               f"llama.cpp needs {INSTALL})")
    for name in dict.fromkeys(names):
        REQUIRES[name]()
    if names:
        peer_model_path(target)
    return [cfg for name in dict.fromkeys(names) for cfg in table[name]]


@contextmanager
def _quiet_output() -> Iterator[None]:
    """The process's stdout and stderr to /dev/null meanwhile (what a C library prints)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
    finally:
        for fd, copy in ((1, saved[0]), (2, saved[1])):
            os.dup2(copy, fd)
            os.close(copy)


class _CountedDraft:
    """A llama-cpp-python draft model that counts the tokens it proposes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.drafted = inner, 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        out = self.inner(input_ids, **kwargs)
        self.drafted += len(out)
        return out


class LlamaCppPeer:
    """llama.cpp on a GGUF file: `generate` decodes prompt token ids from a fresh context
    (no prefix kept from the previous prompt), stops at EOS (kept, as specdec does) or
    max_new_tokens, and returns the new ids, the wall time and its passes (eval calls,
    the prompt's included, as specdec counts target calls), drafted and accepted tokens.
    settings["gbnf"] (optional): a GBNF grammar the answer is held to by llama.cpp's own
    grammar sampler (its time is within the wall time)."""

    def __init__(self, path: Path, n_ctx: int, threads: int, eos: set[int], lookup: int = 0,
                 n_batch: int = 512) -> None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.draft = _CountedDraft(LlamaPromptLookupDecoding(num_pred_tokens=lookup)) if lookup else None
        # with a draft model every position's logits are kept; logits_all must say so too, or llama-cpp-python
        # sizes its logits buffer for one batch and a prompt longer than a batch overflows it
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=n_batch, n_gpu_layers=0, verbose=False, logits_all=bool(lookup),
                         draft_model=self.draft)  # type: ignore[arg-type]
        self.eos, self.evals = set(eos), 0
        self.info = {"package": f"llama-cpp-python {llama_cpp.__version__}", "file": path.name, "n_ctx": n_ctx,
                     "threads": threads, "draft": f"LlamaPromptLookupDecoding(num_pred_tokens={lookup})"
                     if lookup else None}
        inner = self.llm.eval

        def counted(tokens: Any) -> None:
            self.evals += 1
            inner(tokens)

        setattr(self.llm, "eval", counted)  # noqa: B010 (the generate loop calls self.eval)

    def grammar_error(self, gbnf: str) -> str | None:
        """Why llama.cpp cannot take a GBNF grammar (None: it can). Checked before decoding:
        llama-cpp-python adds a grammar that does not parse as a null sampler, which crashes."""
        import llama_cpp

        with _quiet_output():  # its parser prints the whole grammar on an error
            sampler = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, gbnf.encode(), b"root")
        if not sampler:
            return "llama.cpp does not parse the grammar"
        llama_cpp.llama_sampler_free(sampler)
        return None

    def generate(self, prompt_ids: list[int], seed: int,
                 settings: dict[str, Any]) -> tuple[list[int], float, dict[str, Any]]:
        t = settings["temperature"]
        if t > 0:  # every filter off but those asked for: the model's own distribution at temperature t
            kw: dict[str, Any] = dict(temp=t, top_k=settings.get("top_k") or 0, top_p=settings.get("top_p") or 1.0,
                                      min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        else:
            kw = dict(temp=0.0, repeat_penalty=1.0)
        n = settings["max_new_tokens"]
        if settings.get("gbnf"):
            from llama_cpp import LlamaGrammar

            kw["grammar"] = LlamaGrammar.from_string(settings["gbnf"], verbose=False)  # a fresh grammar state
        self.llm.set_seed(seed)
        self.evals = 0
        if self.draft is not None:
            self.draft.drafted = 0
        out: list[int] = []
        t0 = time.perf_counter()
        self.llm.reset()  # no KV prefix reuse across prompts: specdec starts each prompt afresh too
        gen = self.llm.generate(prompt_ids, reset=True, **kw)
        for tok in gen:
            out.append(int(tok))
            if tok in self.eos or len(out) >= n:
                break
        gen.close()
        wall = time.perf_counter() - t0
        drafted = self.draft.drafted if self.draft is not None else 0
        # each eval yields its accepted drafts and one token more
        return out, wall, {"target_calls": self.evals, "drafted": drafted, "accepted": len(out) - self.evals}


def load_peer(cfg: Config, path: Path, n_ctx: int, threads: int, eos: set[int]) -> Peer:
    if cfg.draft.startswith("llama.cpp"):
        return LlamaCppPeer(path, n_ctx, threads, eos, lookup=cfg.k if cfg.draft.endswith("+lookup") else 0)
    raise SpecdecError(f"no peer {cfg.draft!r}")


@dataclass
class PeerRunner(Runner):
    """The bench's Runner that also runs the peers' configurations (kind "peer")."""

    peers: dict[str, Peer] = field(default_factory=dict)

    def run(self, cfg: Config, prompt_ids: list[int], seed: int) -> tuple[list[int], float, dict[str, Any]]:
        if cfg.kind != "peer":
            return super().run(cfg, prompt_ids, seed)
        return self.peers[cfg.name].generate(prompt_ids, seed, self.settings)


def attach_peers(runner: Runner, configs: list[Config], target: str, prompt_ids: list[list[int]],
                 max_new_tokens: int, eos: set[int]) -> Runner:
    """`runner` with the peers of `configs` loaded (the target's GGUF file, a context just
    large enough for the longest prompt and its continuation, torch's thread count)."""
    peers = [c for c in configs if c.kind == "peer"]
    if not peers:
        return runner
    path = peer_model_path(target)
    need = max(map(len, prompt_ids)) + max_new_tokens + 1
    n_ctx = -(-need // 256) * 256
    out = PeerRunner(runner.settings, runner.decoders, runner.hf)
    for cfg in peers:
        out.peers[cfg.name] = load_peer(cfg, path, n_ctx, torch.get_num_threads(), eos)
    return out


def peer_info(runner: Runner) -> dict[str, Any]:
    return {name: getattr(p, "info", {}) for name, p in getattr(runner, "peers", {}).items()}


def _agreement(runs: list[Run], name: str, baseline: str) -> dict[str, Any]:
    """How often `name`'s tokens equal the baseline's, question by question, and the share
    of the baseline's tokens before the first difference."""
    base: dict[int, list[Run]] = {}
    for r in runs:
        if r.config == baseline:
            base.setdefault(r.prompt, []).append(r)
    seen: dict[int, int] = {}
    equal = total = 0
    same_tokens = base_tokens = 0
    for r in runs:
        if r.config != name:
            continue
        rep = seen[r.prompt] = seen.get(r.prompt, -1) + 1
        b = base[r.prompt][rep].tokens
        prefix = next((i for i, (x, y) in enumerate(zip(r.tokens, b, strict=False)) if x != y), min(len(r.tokens),
                                                                                                     len(b)))
        total += 1
        equal += r.tokens == b
        same_tokens += prefix
        base_tokens += len(b)
    return {"config": name, "runs": total, "equal": equal,
            "prefix_share": same_tokens / base_tokens if base_tokens else None}


def peer_summary(runs: list[Run], configs: list[Config], rows: list[dict[str, Any]], greedy: bool,
                 info: dict[str, Any], baseline: str = "plain") -> dict[str, Any]:
    """Every configuration's tokens/s beside specdec plain's and the first peer's (summed new
    tokens / summed seconds), and, greedy, each peer's agreement with specdec plain."""
    tps = {r["config"]: r["tokens_per_s"] for r in rows}
    peers = [c.name for c in configs if c.kind == "peer"]
    ref = peers[0] if peers else None
    side = [{"config": r["config"], "peer": r["config"] in peers, "tokens_per_s": r["tokens_per_s"],
             "vs_specdec_plain": r["tokens_per_s"] / tps[baseline] if tps.get(baseline) else None,
             "vs_reference_peer": r["tokens_per_s"] / tps[ref] if ref and tps.get(ref) else None} for r in rows]
    return {"info": info, "reference_peer": ref, "side_by_side": side,
            "agreement_with_plain": [_agreement(runs, p, baseline) for p in peers] if greedy else []}


def peers_markdown(block: dict[str, Any], weights: str) -> str:
    ref = block["reference_peer"]
    info: dict[str, Any] = next(iter(block["info"].values()), {})
    lines = [f"Beside {ref} ({info.get('package', '?')}, the same GGUF file {info.get('file', '?')}, "
             f"{info.get('threads', '?')} thread(s), on the CPU), interleaved per prompt with specdec's "
             f"configurations (specdec's target weights: {weights}); tokens/s = summed new tokens / summed seconds:",
             "", f"| config | tok/s | x specdec plain | x {ref} |", "|---|---|---|---|"]
    for r in block["side_by_side"]:
        name = f"{r['config']} (peer)" if r["peer"] else r["config"]
        lines.append(f"| {name} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['vs_specdec_plain'])} | "
                     f"{fmt(r['vs_reference_peer'])} |")
    best = max(block["side_by_side"], key=lambda r: r["tokens_per_s"])
    lines += ["", f"Fastest here: {best['config']}" + (" (a peer)." if best["peer"] else " (specdec).")]
    for a in block["agreement_with_plain"]:
        lines.append(f"Greedy: {a['config']}'s tokens equal specdec plain's on {a['equal']}/{a['runs']} questions "
                     f"({fmt(a['prefix_share'], '.1%')} of plain's tokens before the first difference); a fact, "
                     "not a check: other kernels, so near-ties can break the other way.")
    return "\n".join(lines) + "\n"
