"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex, a Lark grammar)
as a request's own state, on the grammar engine llguidance (chosen by measurement over
xgrammar, docs/structured.md).

The distribution reproduced is the target's under the constraint: at each position its logits
with every token the grammar disallows set to -inf, then temperature, top-k and top-p over
what is left (as serving engines order it). Nothing here samples or verifies; the loop asks:

- `Constraint.inside(draft)`: how many drafted tokens to score. A draft is cut after its first
  token outside the grammar: that token is still scored (masked p has 0 there, so it is
  rejected with certainty and the residual of masked p and the prophet's q is drawn, which is
  exact for any q), and what follows it could never be reached.
- `Constraint.masks_along(draft)` / `masks_tree(tokens, parents)`: the allowed tokens at each
  scored position of a row (the state after the committed output and the draft before it),
  applied to the pass's logits by `mask_logits` before any distribution is built.
- `Constraint.forced(limit)`: the tokens the grammar leaves no choice about (exactly one token
  allowed), committed at the start of a round with no pass: masked p is one-hot there at any
  temperature, so they are the target's own tokens with certainty (the grammar as a prophet
  whose q = p = 1; counted apart from accepted tokens, `RoundEvent.forced`).
- `Constraint.commit(tokens)`: the round's committed tokens advance the matcher. Drafts are
  checked by advancing it and rolling back (`_sync`), so the matcher always ends a step at
  the committed output, as the caches do.
- `mask_draft(logits, reqs, prefixes)`: a prophet's q masked along its own draft (the state
  after the committed output and what it drafted so far), so that its guesses stay inside.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


# JSON on one line, ", " and ": " between items and keys (a schema's "x-guidance" may say
# otherwise): a small model's output cannot run into whitespace that never ends, and keys
# and separators are forced tokens (no pass)
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response format, regex or grammar that cannot constrain a request."""


@dataclass(frozen=True)
class Grammar:
    """A request's output constraint as given: its kind (GRAMMAR_KINDS) and source (a JSON
    schema's text, a regex, a Lark grammar; "" for any JSON object)."""

    kind: str
    source: str = ""

    def engine_grammar(self) -> str:
        """The grammar in llguidance's form."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT))
        if self.kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT))
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.source))
        return str(LLMatcher.grammar_from_lark(self.source))


def json_schema_grammar(schema: Any) -> Grammar:
    """A JSON schema (a dict, or its JSON text) as a Grammar, its shape checked."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON ({e}): pass a JSON object") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return Grammar("json_schema", json.dumps(schema))


def response_format_grammar(response_format: Any) -> Grammar | None:
    """OpenAI's `response_format` as a Grammar: {"type": "text"} (None), {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise GrammarError('response_format must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        return json_schema_grammar(spec["schema"])
    raise GrammarError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')


def grammar_of(response_format: Any = None, regex: str | None = None, grammar: str | None = None) -> Grammar | None:
    """The one constraint a request asks for (None: unconstrained); at most one of the three."""
    given = [name for name, v in (("response_format", response_format), ("regex", regex), ("grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise GrammarError(f"pass one of response_format, regex and grammar, not {' and '.join(given)}")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError("regex must be a non-empty string")
        return Grammar("regex", regex)
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("grammar must be a non-empty Lark grammar (a 'start' rule)")
        return Grammar("lark", grammar)
    return response_format_grammar(response_format)


class _ByteTokenizer:
    """A tokenizer over given byte strings (a toy model's vocabulary), in the form llguidance's
    TokenizerWrapper reads: greedy longest-match encoding."""

    def __init__(self, tokens: Sequence[bytes], eos: int) -> None:
        self.tokens = list(tokens)
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, i = [], 0
        by_len = sorted((t for t in range(len(self.tokens)) if t != self.eos_token_id and self.tokens[t]),
                        key=lambda t: -len(self.tokens[t]))
        while i < len(data):
            t = next((t for t in by_len if data.startswith(self.tokens[t], i)), None)
            if t is not None:
                ids.append(t)
            i += len(self.tokens[t]) if t is not None else 1  # a byte with no token of its own: left out
        return ids


class Vocabulary:
    """A model's tokens as the grammar engine reads them (built once per decoder, ~0.5 s for
    SmolLM2's 49,152 tokens): `vocab_size` ids, the ids past the tokenizer's never allowed."""

    def __init__(self, engine_tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = engine_tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Vocabulary:
        """From a Hugging Face (fast) tokenizer; eos_ids: the tokens that end an answer (the
        grammar allows them where it may end)."""
        import llguidance.hf

        if tokenizer is None:
            raise GrammarError("constrained decoding needs the model's tokenizer")
        eos = sorted(eos_ids) or None
        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos), vocab_size)

    @classmethod
    def of_tokens(cls, tokens: Sequence[bytes], eos: int) -> Vocabulary:
        """From byte strings, one per id (a toy model's; `eos` ends an answer)."""
        from llguidance import LLTokenizer, TokenizerWrapper

        return cls(LLTokenizer(TokenizerWrapper(_ByteTokenizer(tokens, eos)), slices=[]), len(tokens))

    def compile(self, grammar: Grammar) -> Constraint:
        """A fresh constraint (its own matcher, at the start) for one request; GrammarError
        with the engine's message where the grammar is invalid or unsupported."""
        from llguidance import LLMatcher

        text = check_grammar(grammar, self.tokenizer)
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_one_line(grammar, matcher.get_error()))
        return Constraint(matcher, self.vocab_size, grammar, self.tokenizer.eos_tokens)


def _one_line(grammar: Grammar, error: str) -> str:
    """The engine's message on one line (its source excerpt and caret lines left out)."""
    lines = [line.strip() for line in str(error).splitlines()]
    kept = [line for line in lines if line and not re.match(r"^(\^|\d+\s*\|)", line)]
    return f"invalid {grammar.kind.replace('_', ' ')}: {' '.join(kept)}"


def check_grammar(grammar: Grammar, tokenizer: Any = None) -> str:
    """The grammar in the engine's form, checked (with no tokenizer: its syntax and the
    features it uses); GrammarError where it is invalid or unsupported."""
    from llguidance import LLMatcher

    try:
        text = grammar.engine_grammar()
    except ValueError as e:
        raise GrammarError(_one_line(grammar, str(e))) from None
    error = LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise GrammarError(_one_line(grammar, error))
    return text


class Constraint:
    """One request's grammar state: a matcher advanced over the request's committed output
    (see the module's docstring). `jump`: commit forced tokens (`forced`); False leaves them
    to the target's passes (the same tokens, for measuring what forcing saves)."""

    def __init__(self, matcher: Any, vocab_size: int, grammar: Grammar, eos_ids: Sequence[int] = (),
                 jump: bool = True) -> None:
        self.matcher = matcher
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size = vocab_size
        self.grammar = grammar
        self.jump = jump
        self.mask_s = 0.0  # seconds spent computing masks (`specdec bench --suite structured` reports it)
        self._scratch: list[int] = []  # tokens consumed past the committed output (a draft being read)
        self._end_read = False  # the last of _scratch is an end token (read, not consumed)

    def _sync(self, prefix: Sequence[int]) -> int:
        """Bring the matcher to the committed output + prefix (rolling back what it read of
        another draft); returns how many of prefix it could read (the rest leaves the grammar).
        An end token is read where the grammar may end, without the matcher consuming it
        (nothing follows it, and the engine's rollback does not undo an end)."""
        common = 0
        while common < min(len(prefix), len(self._scratch)) and prefix[common] == self._scratch[common]:
            common += 1
        if len(self._scratch) > common:
            drop = len(self._scratch) - common - self._end_read  # the end token was never consumed
            self._end_read = False
            if drop:
                self.matcher.rollback(drop)
            del self._scratch[common:]
        rest = list(prefix[common:])
        if rest and not self._end_read:
            rest = rest[: next((i for i, t in enumerate(rest) if not 0 <= t < self.vocab_size), len(rest))]
            n = self.matcher.try_consume_tokens(rest)
            self._scratch.extend(rest[:n])
            if n < len(rest) and rest[n] in self.eos_ids and self.matcher.is_accepting():
                self._scratch.append(rest[n])
                self._end_read = True
        return len(self._scratch)

    def plan(self, draft: Sequence[int]) -> tuple[list[int] | None, bool]:
        """What the engine reads to fill a chain's masks in one call (`masks_for`): the
        draft's tokens inside the grammar that the matcher consumes (None: the committed
        output has ended, nothing is read), and whether an end token follows them (read,
        never consumed: the position after it allows only an end token). The matcher is
        left at the committed output, as the engine needs it."""
        n = self._sync(draft)
        end = self._end_read
        self._sync(())
        if self._end_read:
            return None, True
        return list(draft[: n - end]), end

    def mask(self, prefix: Sequence[int] = ()) -> torch.Tensor | None:
        """(V,) bool: the tokens allowed after the committed output and prefix; None where
        prefix leaves the grammar."""
        if self._sync(prefix) < len(prefix):
            return None
        if self._end_read:  # after an end token the output has ended: a position never reached
            after = torch.zeros(self.vocab_size, dtype=torch.bool)
            after[sorted(self.eos_ids)] = True
            return after
        t0 = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, len(bits))
        out[:n] = bits[:n]
        self.mask_s += time.perf_counter() - t0
        return torch.from_numpy(out)

    def inside(self, draft: Sequence[int]) -> int:
        """How many of a draft's tokens to score: all of them, or up to and including the
        first one outside the grammar."""
        n = self._sync(draft)
        return min(n + 1, len(draft))

    def masks_along(self, draft: Sequence[int]) -> torch.Tensor:
        """(n + 1, V) bool: the allowed tokens at each scored position of a chain (after
        draft[:j], j = 0..n), where n = `inside(draft)` - 1 if a token leaves the grammar, else
        len(draft)."""
        rows = []
        for j in range(len(draft) + 1):
            m = self.mask(draft[:j])
            if m is None:
                break
            rows.append(m)
        return torch.stack(rows)

    def masks_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """(N + 1, V) bool: row 0 the root's allowed tokens, row i + 1 those after node i's path
        (all tokens where that path leaves the grammar: it is never reached, its node being
        rejected with certainty)."""
        paths: list[list[int]] = []
        rows = [self.mask(())]
        for i, parent in enumerate(parents):
            paths.append((paths[parent] if parent >= 0 else []) + [tokens[i]])
            rows.append(self.mask(paths[i]))
        every = torch.ones(self.vocab_size, dtype=torch.bool)
        return torch.stack([every if m is None else m for m in rows])

    def commit(self, tokens: Sequence[int]) -> None:
        """The round's committed tokens: the matcher moves past them for good."""
        n = self._sync(tokens)
        if n < len(tokens):
            raise RuntimeError(f"a committed token ({tokens[n]}) is outside the request's grammar")
        self._scratch = []  # an end token read stays read: nothing may follow it

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar leaves no choice about (one token allowed each), at most
        `limit`, committed here. Nothing when `jump` is off."""
        out: list[int] = []
        while self.jump and len(out) < limit:
            m = self.mask(())
            if m is None:
                break
            allowed = torch.nonzero(m)
            if len(allowed) != 1:
                break
            token = int(allowed[0, 0])
            self.commit([token])
            out.append(token)
            if token in self.eos_ids:
                break
        return out

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end token may follow."""
        return bool(self.matcher.is_stopped())


def row_constraint(req: Any) -> Constraint | None:
    return getattr(req, "constraint", None)


def inside_rows(reqs: Sequence[Any], drafts: Sequence[Sequence[int]]) -> list[int]:
    """How many of each row's drafted tokens to score (`Constraint.inside`; all of an unconstrained row's)."""
    return [len(d) if (c := row_constraint(r)) is None else c.inside(d) for r, d in zip(reqs, drafts, strict=True)]


_ENGINE: dict[str, Any] = {}  # llguidance's LLExecutor and the thread a step's masks are filled on, made once


def _engine() -> Any:
    """llguidance's executor: it fills many matchers' masks in one call, on its own threads,
    with the GIL released."""
    if "executor" not in _ENGINE:
        from llguidance import LLExecutor

        _ENGINE["executor"] = LLExecutor()
    return _ENGINE["executor"]


def _worker() -> ThreadPoolExecutor:
    if "worker" not in _ENGINE:
        _ENGINE["worker"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-masks")
    return cast(ThreadPoolExecutor, _ENGINE["worker"])


def _fill(jobs: Sequence[tuple[Any, int, list[int]]], rows: int, vocab_size: int) -> np.ndarray:
    """(rows, V) bool: each job's matcher's allowed tokens at its row (`(matcher, row, [])`),
    or at its row and one row after each of its tokens (`(matcher, row, tokens)`: the engine
    advances the matcher over them and rolls it back); rows no job writes allow every token.
    At most two calls of the engine, whatever the number of matchers."""
    from llguidance.numpy import (
        allocate_token_bitmask,
        fill_next_token_bitmask_par,
        fill_next_token_bitmask_par_with_draft_tokens,
    )

    words = allocate_token_bitmask(rows, vocab_size)  # (rows, ceil(V / 32)) int32, every bit set
    here = [(m, i) for m, i, tokens in jobs if not tokens]
    along = [(m, i, list(tokens)) for m, i, tokens in jobs if tokens]
    if here:
        fill_next_token_bitmask_par(_engine(), here, words)
    if along:
        fill_next_token_bitmask_par_with_draft_tokens(_engine(), along, words)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # token 32 w + j: bit j of word w
    return bits[:, :vocab_size].view(np.bool_)  # 0 / 1 bytes read as bools, no copy


class StepMasks:
    """The allowed tokens at every scored position of a step's rows (`masks_for`), filled now
    or on a worker thread while the caller runs the target's pass. Until `wait` returns, the
    rows' matchers belong to the fill: nothing else may read or advance them."""

    def __init__(self, shape: tuple[int, int, int], work: Callable[[], torch.Tensor] | None,
                 background: bool) -> None:
        self.shape = shape  # (B, n, V)
        self._result: torch.Tensor | None = None
        self._future: Future[torch.Tensor] | None = None
        if work is not None and background:
            self._future = _worker().submit(work)
        elif work is not None:
            self._result = work()

    def wait(self) -> torch.Tensor | None:
        """(B, n, V) bool: row b's allowed tokens after its committed output and each prefix
        of its draft (positions never reached, and unconstrained rows, allow every token);
        None where no row is constrained."""
        if self._future is not None:
            self._result, self._future = self._future.result(), None
        return self._result

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The pass's logits (B, >= n, V) with the disallowed tokens at -inf; a new tensor (a
        pass's logits may be inference tensors)."""
        allowed = self.wait()  # (B, n, V)
        if allowed is None:
            return logits
        if allowed.shape != logits.shape:  # positions past the longest draft: every token
            full = torch.ones(logits.shape, dtype=torch.bool)  # (B, n_logits, V)
            n = min(allowed.shape[1], logits.shape[1])
            full[:, :n] = allowed[:, :n]
            allowed = full
        # where, not masked_fill: the same values, about half the time over a step's (B, n, V)
        return torch.where(allowed.to(logits.device), logits, -float("inf"))


def masks_for(reqs: Sequence[Any], drafts: Sequence[Sequence[int]], trees: Sequence[Sequence[int]] | None = None,
              background: bool = False) -> StepMasks:
    """The masks of a step's scored positions for every row at once: a chain row's after
    its draft's prefixes (bit for bit `Constraint.masks_along`), all chain rows in one call
    of the engine; a tree row's (trees[b]: its nodes' parents) by `masks_tree`. Each
    matcher ends back at its committed output. `background`: filled on a worker thread
    (the engine releases the GIL), for a caller that starts it before the target's pass
    and calls `wait` after it."""
    constrained = [(b, c) for b, r in enumerate(reqs) if (c := row_constraint(r)) is not None]
    n = max(len(d) for d in drafts) + 1
    vocab = constrained[0][1].vocab_size if constrained else 0
    shape = (len(reqs), n, vocab)
    if not constrained:
        return StepMasks(shape, None, background)
    jobs: list[tuple[Any, int, list[int]]] = []
    placed: list[tuple[int, int, int, bool]] = []  # (row b, first buffer row, rows from the engine, end row)
    tree_rows: list[tuple[int, Constraint, Sequence[int]]] = []  # (row b, its constraint, its nodes' parents)
    for b, c in constrained:
        if trees is not None and trees[b]:
            tree_rows.append((b, c, trees[b]))
            continue
        tokens, end = c.plan(drafts[b])
        first = sum(k for _, _, k, _ in placed)
        if tokens is not None:
            jobs.append((c.matcher, first, tokens))
        placed.append((b, first, 0 if tokens is None else len(tokens) + 1, end))
    rows = sum(k for _, _, k, _ in placed)

    def work() -> torch.Tensor:
        allowed = torch.ones(shape, dtype=torch.bool)  # (B, n, V)
        if jobs:
            t0 = time.perf_counter()
            bits = torch.from_numpy(_fill(jobs, rows, vocab))  # (rows, V)
            share = (time.perf_counter() - t0) / len(jobs)
            for b, first, k, _ in placed:
                allowed[b, :k] = bits[first: first + k]
                constrained_by[b].mask_s += share if k else 0.0
        for b, _, k, end in placed:
            if end:  # after an end token the output has ended: only an end token (a position never reached)
                allowed[b, k] = False
                allowed[b, k, sorted(constrained_by[b].eos_ids)] = True
        for b, c, parents in tree_rows:
            masks = c.masks_tree(drafts[b], parents)
            c.mask(())  # the matcher back at the committed output
            allowed[b, : masks.shape[0]] = masks
        return allowed

    constrained_by = dict(constrained)
    return StepMasks(shape, work, background)


def mask_logits(logits: torch.Tensor, reqs: Sequence[Any], drafts: Sequence[Sequence[int]],
                trees: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """A pass's logits (B, n, V) with each constrained row's disallowed tokens at -inf: row
    b's scored positions after its draft's prefixes (a chain, `masks_along`) or its tree's
    paths (trees[b]: its nodes' parents; [] for a chain), every row's masks from `masks_for`
    (one call of the engine for the chains). A new tensor (a pass's logits may be inference
    tensors)."""
    return masks_for(reqs, drafts, trees).apply(logits)


def mask_draft(logits: torch.Tensor, reqs: Sequence[Any], prefixes: Sequence[Sequence[int]],
               ids: torch.Tensor | None = None) -> torch.Tensor:
    """A prophet's logits for one drafting step (B, V), or over its draft vocabulary `ids`
    (B, N), with each constrained row's disallowed tokens at -inf (after the committed output
    and prefixes[b], what the row drafted so far; every row's mask in one call of the engine,
    bit for bit `Constraint.mask`); a row whose prefix left the grammar, or whose mask leaves
    none of `ids`, keeps its logits. A new tensor."""
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # (B, V) or (B, N)
    rows: list[tuple[int, Constraint]] = []
    ended: list[tuple[int, Constraint]] = []
    for b, r in enumerate(reqs):
        c = row_constraint(r)
        if c is None or c._sync(prefixes[b]) < len(prefixes[b]):
            continue
        (ended if c._end_read else rows).append((b, c))
    masks: dict[int, torch.Tensor] = {}
    if rows:
        t0 = time.perf_counter()
        bits = torch.from_numpy(_fill([(c.matcher, i, []) for i, (_, c) in enumerate(rows)], len(rows),
                                      rows[0][1].vocab_size))  # (rows, V)
        share = (time.perf_counter() - t0) / len(rows)
        for i, (b, c) in enumerate(rows):
            c.mask_s += share
            masks[b] = bits[i]
    for b, c in ended:
        masks[b] = cast(torch.Tensor, c.mask(prefixes[b]))  # only an end token
    for b, m in masks.items():
        if ids is not None:
            m = m[ids.cpu()]
        if bool(m.any()):
            allowed[b] = m
    return logits.masked_fill(~allowed.to(logits.device), -float("inf"))


__all__ = ["GRAMMAR_KINDS", "JSON_LAYOUT", "Constraint", "Grammar", "GrammarError", "StepMasks", "Vocabulary",
           "check_grammar", "grammar_of", "inside_rows", "json_schema_grammar", "mask_draft", "mask_logits",
           "masks_for", "response_format_grammar"]
