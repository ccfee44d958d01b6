"""The decoder: a target, its prophets, a tokenizer and a K policy, and the API over them
(`generate`, `stream`, `generate_many`, `calibrate`).

Every request runs on the one round loop, `specdec.batch.BatchEngine` (built by
`specdec.wiring.engine_for`): `generate` and `stream` step one request alone, as a batch of
one; `generate_many` and the server step many. One round (MISSION.md):
  1. the prophet(s) propose up to K tokens per row, recording q for each;
  2. the target scores each row's pending tokens plus its draft in ONE forward pass, giving
     p_1..p_{K+1} (with several prophets and multi="tree": a token tree with a tree mask);
  3. verification accepts a prefix and samples one recovered or bonus token per row;
  4. the output is extended and finished (`specdec.finish`: EOS, length, stop strings,
     text); each cache keeps only the committed length (written by position).
Plain decoding is the same loop with no prophet: every round is one target step. The
request owns its row (cache slot, generator, policy); nothing of it lives here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from specdec import coststore
from specdec.batch import BatchEngine
from specdec.costmodel import Costs
from specdec.coststore import ONE_LOOP_SLOTS
from specdec.defaults import MAX_NEW_TOKENS, TEMPERATURE, TOP_P
from specdec.driver import Row, run_rows
from specdec.errors import ContextLengthError
from specdec.events import RoundEvent
from specdec.finish import Finish, check_stops
from specdec.generation import Generation
from specdec.grammar import Constraint, Vocabulary, grammar_of
from specdec.lm import LM
from specdec.policy import Policy, make_policy
from specdec.prophets.base import Prophet
from specdec.request import Request
from specdec.sampling import SamplingParams, check_sampling
from specdec.stats import summarize


def check_prophets(prophets: Sequence[str] | None, loaded: Sequence[str]) -> frozenset[str] | None:
    """A request's choice among the loaded prophets (by name), checked; None: all of them."""
    if prophets is None:
        return None
    if isinstance(prophets, str) or not all(isinstance(p, str) for p in prophets):
        raise ValueError("prophets must be a list of prophet names")
    unknown = [p for p in prophets if p not in loaded]
    if unknown:
        raise ValueError(f"prophet(s) {', '.join(map(repr, unknown))} not loaded; this decoder has "
                         f"{', '.join(map(repr, loaded)) or 'none'}")
    return frozenset(prophets)


def _check_text(text: str, what: str) -> None:
    """Text a tokenizer can encode: no lone UTF-16 surrogates (they have no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not valid Unicode text: fix the encoding of the input") from None


def _check_ids(prompt: Any) -> list[int]:
    """A flat sequence of integer token ids: a list, or a 1-D integer tensor or array."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("a prompt is text or a sequence of token ids, not bytes")
    shape = getattr(prompt, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {tuple(shape)}: pass one prompt's ids")
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a {prompt.dtype} tensor")
        return [int(t) for t in prompt.tolist()]
    dtype = getattr(prompt, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", "i") not in "iu":
        raise ValueError(f"token ids must be integers, got an array of {dtype}")
    ids: list[int] = []
    for t in prompt:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token ids must be integers, got {type(t).__name__} {t!r}")
        ids.append(int(t.__index__()))
    return ids


class SpeculativeDecoder:
    """Speculative decoding of `target` with zero, one or several prophets.

    With several prophets, `multi="tree"` merges their drafts into one token tree verified
    exactly in one target pass; `multi="best"` asks them in the order of their recent
    tokens per round in this request (one not yet tried first; `policy.best_first`) and
    verifies the first non-empty draft; `multi="first"` asks them in
    order and verifies the first non-empty draft (e.g. "ngram+eagle": prompt lookup where it
    finds a match, the trained prophet elsewhere). Which prophet drafts depends only on the
    committed context, so every mode stays exact.
    """

    def __init__(self, target: LM, prophets: Prophet | Sequence[Prophet] | None = None,
                 tokenizer: Any = None, policy: Policy | None = None, multi: str = "tree",
                 eos_token_ids: Iterable[int] = ()) -> None:
        if prophets is None:
            prophets = []
        elif not isinstance(prophets, Sequence):
            prophets = [prophets]
        if multi not in ("tree", "best", "first"):
            raise ValueError(f"multi must be 'tree', 'best' or 'first', got {multi!r}")
        for d in prophets:
            if d.vocab_size is not None and d.vocab_size != target.vocab_size:
                raise ValueError(f"prophet '{d.name}' scores {d.vocab_size} ids, the target {target.vocab_size}")
        self.target = target
        self.prophets = list(prophets)
        self.tokenizer = tokenizer
        self.policy = policy or Policy(5)
        self._costs: Costs | None = None  # measured once (calibrate) for whichever policy needs costs
        self.multi = multi
        # MiB of prompt prefixes' keys and values its engines keep for later requests (0: none; specdec.prefix)
        self.prefix_cache_mb = 0.0
        # the round loops its requests run on, by their number of rows (`wiring.engine_for` builds them), and
        # the prompt prefix cache they share (`specdec.prefix.PrefixCache`, or None)
        self.engines: dict[int, Any] = {}
        self.prefix_store: Any = None
        self.branches = 1  # > 1: an eagle grows a token tree each round, up to this many children a node
        self.eos_token_ids = set(eos_token_ids)
        # the grammar engine's view of the tokens: the tokenizer's, read at first use (or set)
        self.vocabulary: Vocabulary | None = None
        self._feature_readers = [d for d in self.prophets if d.reads_features]
        if self._feature_readers and not target.offers_hidden:
            raise ValueError(f"target '{target.name}' does not expose its hidden states, which "
                             f"'{self._feature_readers[0].name}' drafts from")

    # ----------------------------------------------------------------- public API
    def plain(self) -> SpeculativeDecoder:
        """A decoder with no prophet over the same target model (its own cache)."""
        return SpeculativeDecoder(self.target.view(1), None, self.tokenizer, Policy(1),
                                  eos_token_ids=self.eos_token_ids)

    def generate(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int | None = None,
                 temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
                 seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
                 messages: Sequence[dict[str, str]] | None = None,
                 prophets: Sequence[str] | None = None, policy: str | None = None,
                 sampling: str = "rejection", response_format: dict[str, Any] | None = None,
                 regex: str | None = None, grammar: str | None = None) -> Generation:
        """Generate a continuation; the same arguments as `stream`, all rounds collected."""
        req, finish = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_tokens, stop,
                                   messages, prophets, policy, sampling, response_format=response_format,
                                   regex=regex, grammar=grammar)
        return self.run(req, finish)

    def run(self, req: Request, finish: Finish) -> Generation:
        """Run a request made by `request` (alone, on the decoder's own loop) to its end: what
        `generate` returns. The request keeps its state (its grammar's `Constraint`, say)."""
        events = list(self._step_alone(req, finish, False))
        return Generation(finish.final_text(req.generated), list(req.generated), list(req.prompt),
                          req.finish_reason or "length", events, summarize(events))

    def generate_many(self, prompts: Sequence[str | Sequence[int] | dict[str, Any]], max_batch: int = 16,
                      **settings: Any) -> list[Generation]:
        """Generate for many prompts; each may be a dict carrying its own settings
        ({"prompt" or "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
        "draft_tokens", "stop", "sampling", "prophets", "policy", "response_format", "regex",
        "grammar"}), the rest take `settings`. They run as rows of one
        batch on the one loop (specdec.batch: rows join and leave, each accepts its own number
        of tokens), each request made as `generate` makes it (`request`). Each result follows
        the target's distribution exactly; greedy results are the tokens `generate` gives for
        that prompt alone, and so are seeded sampled ones (their K comes from costs fixed for
        the request, never from the batch)."""
        items = [dict(p) if isinstance(p, dict) else {"prompt": p} for p in prompts]
        jobs = [{**settings, **item} for item in items]
        for job in jobs:
            unknown = set(job) - {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                  "draft_tokens", "stop", "sampling", "prophets", "policy", "response_format",
                                  "regex", "grammar"}
            if unknown:
                raise ValueError(f"unknown generation setting(s) {sorted(unknown)}")
        from specdec.wiring import engine_for

        rows = [Row(*self.request(**job), release_text=False) for job in jobs]  # each made as `generate` makes it
        events: dict[int, list[RoundEvent]] = {id(row): [] for row in rows}
        for row, event in run_rows(engine_for(self, max_batch), rows):
            if event is not None:
                events[id(row)].append(event)
        return [Generation(row.finish.final_text(row.request.generated), list(row.request.generated),
                           list(row.request.prompt), row.request.finish_reason or "length", events[id(row)],
                           summarize(events[id(row)])) for row in rows]

    def stream(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int | None = None,
               temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
               seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
               messages: Sequence[dict[str, str]] | None = None,
               prophets: Sequence[str] | None = None, policy: str | None = None,
               sampling: str = "rejection", response_format: dict[str, Any] | None = None,
               regex: str | None = None, grammar: str | None = None) -> Iterator[RoundEvent]:
        """Yield one event per round; each carries the text it releases (`event.text`).
        `messages` ([{"role": ..., "content": ...}], instead of a prompt) is formatted with the
        tokenizer's chat template; the template's end token ends the answer. `prophets`: only
        these of the loaded prophets draft for this request (by name; None: all). `policy`: a
        K policy of another kind for this request ("auto", "fixed", ...; None: the decoder's).
        `sampling`: "rejection" (default: the verifier's own draws) or "coupled" (every draw
        keyed by the seed and the token's position, so a seeded output equals seeded plain
        coupled sampling token for token, whatever the prophets, K or batch; an exact sample
        of the target either way, see specdec.sampling). `response_format` (OpenAI's: {"type":
        "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}), `regex` or
        `grammar` (Lark): the answer follows it (specdec.grammar), an exact sample of the
        target's distribution under the constraint; it ends where the grammar is complete."""
        req, finish = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_tokens, stop,
                                   messages, prophets, policy, sampling, response_format=response_format,
                                   regex=regex, grammar=grammar)
        yield from self._step_alone(req, finish, True)

    def request(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int | None = None,
                temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
                seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
                messages: Sequence[dict[str, str]] | None = None, prophets: Sequence[str] | None = None,
                policy: str | None = None, sampling: str = "rejection", plain: bool = False,
                response_format: dict[str, Any] | None = None, regex: str | None = None,
                grammar: str | None = None) -> tuple[Request, Finish]:
        """The front door: a request for the one loop (the arguments of `generate`), checked,
        with a K policy of its own (the decoder's, copied, or one of the kind named), and its
        finishing (stop strings, text). `generate`, `stream`, `generate_many` and the server
        run only what it makes. The prompt and `max_new_tokens` together must fit the target's
        context (None: MAX_NEW_TOKENS, or the room the prompt leaves if that is less). plain:
        no prophet drafts for it. response_format, regex, grammar: the output's constraint (at
        most one; `specdec.grammar.GrammarError`, a ValueError, where it is malformed)."""
        constraint = self.constraint(response_format, regex, grammar)
        ids, allowed, pol, stops, max_new_tokens = self._checked(
            self._chat_or_prompt(prompt, messages), max_new_tokens, draft_tokens, stop, prophets, policy, sampling)
        if pol is self.policy:
            pol = copy.deepcopy(pol)  # the request's own: interleaved requests never share one
        k = (draft_tokens or self.policy.k0) if self.prophets and not plain else 0
        req = Request(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p), k, seed, pol if k else None,
                      allowed, sampling, constraint=constraint)
        return req, Finish(self.tokenizer, stops)

    def constraint(self, response_format: dict[str, Any] | None = None, regex: str | None = None,
                   grammar: str | None = None) -> Constraint | None:
        """A fresh grammar state for one request (`specdec.grammar`), or None where nothing is
        asked; the model's vocabulary is read for the grammar engine once per decoder."""
        spec = grammar_of(response_format, regex, grammar)
        if spec is None:
            return None
        if self.vocabulary is None:
            self.vocabulary = Vocabulary.of(self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))
        return self.vocabulary.compile(spec)

    @property
    def prefix_cache(self) -> Any:
        """The prompt prefix cache this decoder's engines share (`specdec.prefix.PrefixCache`),
        or None: `prefix_cache_mb` is 0, or no request has run yet."""
        return self.prefix_store

    # ----------------------------------------------------------------- a request
    def _checked(self, prompt: str | Sequence[int], max_new_tokens: int | None, draft_tokens: int | None,
                 stop: str | Sequence[str] | None, prophets: Sequence[str] | None, policy_name: str | None,
                 sampling: str) -> tuple[list[int], frozenset[str] | None, Policy, tuple[str, ...], int]:
        """A request's settings, checked as every path checks them: its prompt ids, the
        prophets that may draft for it, its K policy (reset for it), its stop strings and its
        max_new_tokens."""
        allowed = check_prophets(prophets, [d.name for d in self.prophets])
        check_sampling(sampling)
        ids = self._encode(prompt)
        room = self.target.max_length - len(ids)
        if max_new_tokens is None:
            max_new_tokens = min(MAX_NEW_TOKENS, room)
        if room < 1:
            raise ContextLengthError(f"the prompt is {len(ids)} tokens but the target's context is "
                                     f"{self.target.max_length} tokens: shorten the prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if max_new_tokens > room:
            raise ContextLengthError(f"the prompt is {len(ids)} tokens and max_new_tokens {max_new_tokens}: "
                                     f"{len(ids) + max_new_tokens} in all, but the target's context is "
                                     f"{self.target.max_length} tokens: ask for at most {room} new tokens or "
                                     "shorten the prompt")
        policy = self.policy if policy_name in (None, self.policy.name) else \
            make_policy(policy_name, draft_tokens or self.policy.k0)
        if policy.needs_costs and policy.costs is None and self.prophets:
            policy.costs = self.decision_costs()  # each step then reads them at its temperature and length
        policy.reset(draft_tokens)  # this request's K; nothing from the last request carries over
        return ids, allowed, policy, check_stops(stop, self.tokenizer), max_new_tokens

    # ----------------------------------------------------------------- the one loop
    def _one_loop(self) -> BatchEngine:
        """The batched engine this decoder's requests step on, each a batch of one
        (`wiring.engine_for`). The engine is the decoder's own
        (`ONE_LOOP_SLOTS` rows, memory per row as it grows): interleaved streams and threads
        take rows of it."""
        from specdec.wiring import engine_for

        engine: BatchEngine = engine_for(self, ONE_LOOP_SLOTS)
        engine.commits.eos_token_ids = self.eos_token_ids  # the decoder's, as they are now
        # Each request steps alone here: its prompt goes in whole with its first round (in
        # the target's aligned attention blocks, as everywhere), nothing waits behind it.
        engine.slots.prefill_chunk = engine.target.max_length
        if self._costs is not None:
            engine.kchoice.by_bucket.setdefault(1, self._costs)  # a row alone decides K from the decoder's stored costs
        return engine

    def _step_alone(self, req: Request, finish: Finish, release_text: bool) -> Iterator[RoundEvent]:
        """Step one request alone on the decoder's own engine to its end (`specdec.driver`): one
        RoundEvent per round; its row is freed when it ends or the caller stops early."""
        for _, event in run_rows(self._one_loop(), [Row(req, finish, release_text)]):
            if event is None:
                raise ValueError(req.error)
            yield event

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a conversation in the tokenizer's chat template, ready for the answer."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: pass a plain prompt instead of messages")
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in messages):
            raise ValueError('messages must be a non-empty list of {"role": str, "content": str}')
        for m in messages:
            _check_text(m["content"], "a message")
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def prompt_ids(self, prompt: str | Sequence[int] | None = None,
                   messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        """A request's prompt as checked token ids: text (encoded), token ids, or messages in the
        chat template; the same checks and errors as `generate`."""
        return self._encode(self._chat_or_prompt(prompt, messages))

    def _chat_or_prompt(self, prompt: str | Sequence[int] | None,
                        messages: Sequence[dict[str, str]] | None) -> str | Sequence[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("pass either a prompt or messages, not both")
            return self.chat_ids(messages)
        if prompt is None:
            raise ValueError("a prompt (text or token ids) or messages is needed")
        return prompt

    @property
    def weights(self) -> str:
        """The target's weights as `--dtype` names them: "int4" (4-bit products), "float32", "bfloat16"."""
        if getattr(self.target, "int4", False):
            return "int4"
        return str(getattr(getattr(self.target, "model", None), "dtype", "float32")).removeprefix("torch.")

    @property
    def weights_detail(self) -> str:
        """`weights`, naming the 4-bit kernel where it is int4: "int4 (blocks kernel)" or "int4 (torch kernel)"."""
        kernel = getattr(self.target, "int4_kernel", "")
        return f"int4 ({kernel} kernel)" if self.weights == "int4" and kernel else self.weights

    def costs_key(self) -> dict[str, Any]:
        """What this decoder's step costs depend on (`coststore.costs_key`)."""
        return coststore.costs_key(self)

    def decision_costs(self) -> Costs:
        """The costs this decoder's K policies decide from, fixed once per decoder, whichever
        policy asks first: its policy's own (set by hand), else the stored ones."""
        if self._costs is None:
            self._costs = self.policy.costs or self.stored_costs()
        return self._costs

    def stored_costs(self) -> Costs:
        """The step costs K policies decide from, measured once (`calibrate`) and stored under
        the cache directory, keyed by `costs_key` (`specdec.coststore`)."""
        return coststore.stored(self.costs_key(), self.calibrate)

    def stored_batch_costs(self, bucket: int, k_max: int, measure: Callable[[], Costs]) -> Costs:
        """The costs of a batched step of `bucket` rows (per row; `coststore.measure_rows`),
        stored as `stored_costs` is."""
        return coststore.stored({**self.costs_key(), "batch_bucket": bucket, "batch_k_max": k_max}, measure,
                                f"the step costs of {bucket} rows")

    def calibrate(self, n_context: int = 64, repeats: int = 7, long_context: int = 1024,
                  budget_s: float | None = coststore.DECODER_BUDGET_S) -> Costs:
        """Time what a round of this decoder's requests costs (`coststore.calibrate`)."""
        from specdec.wiring import engine_for

        engine = engine_for(self, ONE_LOOP_SLOTS, costs=False)
        return coststore.calibrate(self, engine, n_context, repeats, long_context, budget_s)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            _check_text(prompt, "the prompt")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = _check_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        return ids

