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
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from specdec import layerloop, qgemm
from specdec.batch import BatchEngine
from specdec.costmodel import Costs, OtherLoad
from specdec.defaults import MAX_NEW_TOKENS, TEMPERATURE, TOP_P
from specdec.errors import ContextLengthError
from specdec.events import RoundEvent
from specdec.finish import Finish, check_stops
from specdec.generation import Generation
from specdec.lm import CausalLM
from specdec.policy import Policy, make_policy
from specdec.prophets.base import Prophet
from specdec.request import Request
from specdec.sampling import SamplingParams, check_sampling
from specdec.stats import summarize

log = logging.getLogger(__name__)
MAX_OTHER_LOAD = 0.25  # cores other processes may use on average while step costs are measured for storing
ONE_LOOP_SLOTS = 64  # rows of a decoder's own batched engine (interleaved streams, threads)


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

    def __init__(self, target: CausalLM, prophets: Prophet | Sequence[Prophet] | None = None,
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
        self.branches = 1  # > 1: an eagle grows a token tree each round, up to this many children a node
        self.eos_token_ids = set(eos_token_ids)
        self._feature_readers = [d for d in self.prophets if d.reads_features]
        if self._feature_readers and not target.offers_hidden:
            raise ValueError(f"target '{target.name}' does not expose its hidden states, which "
                             f"'{self._feature_readers[0].name}' drafts from")

    # ----------------------------------------------------------------- public API
    def plain(self) -> SpeculativeDecoder:
        """A decoder with no prophet over the same target model (its own cache)."""
        return SpeculativeDecoder(self.target.fresh(), None, self.tokenizer, Policy(1),
                                  eos_token_ids=self.eos_token_ids)

    def generate(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                 temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
                 seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
                 messages: Sequence[dict[str, str]] | None = None,
                 prophets: Sequence[str] | None = None, policy: str | None = None,
                 sampling: str = "rejection") -> Generation:
        """Generate a continuation; the same arguments as `stream`, all rounds collected."""
        req, finish = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_tokens, stop,
                                   messages, prophets, policy, sampling)
        events = list(self._step_alone(self._one_loop(), req, finish, False))
        return Generation(finish.final_text(req.generated), list(req.generated), list(req.prompt),
                          req.finish_reason or "length", events, summarize(events))

    def generate_many(self, prompts: Sequence[str | Sequence[int] | dict[str, Any]], max_batch: int = 16,
                      **settings: Any) -> list[Generation]:
        """Generate for many prompts; each may be a dict carrying its own settings
        ({"prompt" or "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
        "draft_tokens", "stop", "sampling", "prophets", "policy"}), the rest take `settings`. They run as rows of one
        batch on the one loop (specdec.batch: rows join and leave, each accepts its own number
        of tokens), each request made as `generate` makes it (`request`). Each result follows
        the target's distribution exactly; greedy results are the tokens `generate` gives for
        that prompt alone, and so are seeded sampled ones (their K comes from costs fixed for
        the request, never from the batch)."""
        items = [dict(p) if isinstance(p, dict) else {"prompt": p} for p in prompts]
        jobs = [{**settings, **item} for item in items]
        for job in jobs:
            unknown = set(job) - {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                  "draft_tokens", "stop", "sampling", "prophets", "policy"}
            if unknown:
                raise ValueError(f"unknown generation setting(s) {sorted(unknown)}")
        from specdec.wiring import engine_for

        return engine_for(self, max_batch).run_jobs(self, jobs)

    def stream(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
               temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
               seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
               messages: Sequence[dict[str, str]] | None = None,
               prophets: Sequence[str] | None = None, policy: str | None = None,
               sampling: str = "rejection") -> Iterator[RoundEvent]:
        """Yield one event per round; each carries the text it releases (`event.text`).
        `messages` ([{"role": ..., "content": ...}], instead of a prompt) is formatted with the
        tokenizer's chat template; the template's end token ends the answer. `prophets`: only
        these of the loaded prophets draft for this request (by name; None: all). `policy`: a
        K policy of another kind for this request ("auto", "fixed", ...; None: the decoder's).
        `sampling`: "rejection" (default: the verifier's own draws) or "coupled" (every draw
        keyed by the seed and the token's position, so a seeded output equals seeded plain
        coupled sampling token for token, whatever the prophets, K or batch; an exact sample
        of the target either way, see specdec.sampling)."""
        req, finish = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_tokens, stop,
                                   messages, prophets, policy, sampling)
        yield from self._step_alone(self._one_loop(), req, finish, True)

    def request(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
                seed: int | None = None, draft_tokens: int | None = None, stop: str | Sequence[str] | None = None,
                messages: Sequence[dict[str, str]] | None = None, prophets: Sequence[str] | None = None,
                policy: str | None = None, sampling: str = "rejection") -> tuple[Request, Finish]:
        """A request for the one loop (the arguments of `generate`), checked, with a K policy
        of its own (the decoder's, copied, or one of the kind named), and its finishing (stop
        strings, text): what `generate`, `stream` and `generate_many` run."""
        ids, allowed, pol, stops = self._checked(self._chat_or_prompt(prompt, messages), max_new_tokens,
                                                 draft_tokens, stop, prophets, policy, sampling)
        if pol is self.policy:
            pol = copy.deepcopy(pol)  # the request's own: interleaved requests never share one
        k = (draft_tokens or self.policy.k0) if self.prophets else 0
        req = Request(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p), k, seed, pol if k else None,
                      allowed, sampling)
        return req, Finish(self.tokenizer, stops)

    @property
    def prefix_cache(self) -> Any:
        """The prompt prefix cache this decoder's engines share (`specdec.prefix.PrefixCache`),
        or None: `prefix_cache_mb` is 0, or no request has run yet."""
        return self.__dict__.get("_prefix_cache")

    # ----------------------------------------------------------------- a request
    def _checked(self, prompt: str | Sequence[int], max_new_tokens: int, draft_tokens: int | None,
                 stop: str | Sequence[str] | None, prophets: Sequence[str] | None, policy_name: str | None,
                 sampling: str) -> tuple[list[int], frozenset[str] | None, Policy, tuple[str, ...]]:
        """A request's settings, checked as every path checks them: its prompt ids, the
        prophets that may draft for it, its K policy (reset for it) and its stop strings."""
        allowed = check_prophets(prophets, [d.name for d in self.prophets])
        check_sampling(sampling)
        ids = self._encode(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(ids) >= self.target.max_length:
            raise ContextLengthError(f"the prompt is {len(ids)} tokens but the target's context is "
                                     f"{self.target.max_length} tokens: shorten the prompt")
        policy = self.policy if policy_name in (None, self.policy.name) else \
            make_policy(policy_name, draft_tokens or self.policy.k0)
        if policy.needs_costs and policy.costs is None and self.prophets:
            policy.costs = self.decision_costs()  # each step then reads them at its temperature and length
        policy.reset(draft_tokens)  # this request's K; nothing from the last request carries over
        return ids, allowed, policy, check_stops(stop, self.tokenizer)

    # ----------------------------------------------------------------- the one loop
    def _one_loop(self) -> BatchEngine:
        """The batched engine this decoder's requests step on, each a batch of one
        (`wiring.engine_for`). The engine is the decoder's own
        (`ONE_LOOP_SLOTS` rows, memory per row as it grows): interleaved streams and threads
        take rows of it."""
        from specdec.wiring import engine_for

        engine: BatchEngine = engine_for(self, ONE_LOOP_SLOTS)
        engine.eos_token_ids = self.eos_token_ids  # the decoder's, as they are now
        # Each request steps alone here: its prompt goes in whole with its first round (in
        # the target's aligned attention blocks, as everywhere), nothing waits behind it.
        engine.prefill_chunk = engine.target.max_length
        if self._costs is not None:
            engine._costs.setdefault(1, self._costs)  # a row alone decides K from the decoder's stored costs
        return engine

    @staticmethod
    def _step_alone(engine: BatchEngine, req: Request, finish: Finish, release_text: bool) -> Iterator[RoundEvent]:
        """Step one request on the batched engine to its end: one RoundEvent per round, its
        stop strings and text finished by `specdec.finish`; its row is freed when it ends or
        the caller stops early."""
        t0, index = time.perf_counter(), 0
        try:
            while not req.done:
                for e in engine.step([req]):  # none while a long prompt is still being prefilled
                    if req.error is not None:
                        raise ValueError(req.error)
                    added = engine.finish_step(e, finish)
                    text = finish.release(req.generated, req.done) if release_text else ""
                    yield engine.round_event(e, index, t0, added, text, req.finish_reason)
                    index += 1
        finally:
            engine.release(req)

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
        """What the step costs depend on: the models, prophets, K, precision, device and machine.
        The version changes when a step itself does (6: the blocks kernel's panels and the C++
        loop's attention on raw buffers; 7: eagle's head on the target's blocks; 8: the blocks kernel's
        prefetch and register-blocked products of many rows; 9: costs measured under load are no longer
        stored, so those stored before may be such; 10: 6-7 row products without panels, a full tile first; 11: each
        prophet's dtype and head in the key, eagle's head on the target's blocks whatever its dtype; 12: the
        bfloat16 kernel on Q4_1 panels; 13: the layer loop's raw layers; 14: one query's attention 8 keys at a
        time; 15: the bfloat16 kernel's codes as 128 + q, two pairs a load, and its prefetch; 16: a prophet's
        drafting cost at least its drafting timed alone; 17: the bfloat16 kernel's m - 128 d once a tile; 18: a feature
        prophet's own products on the target's block kernel; 19: Q8_0 products (SmolLM2's head, a prophet's own) on the
        bfloat16 kernel; 20: greedy rows verified from the target's choices; 21: the verifier's fewer passes and
        calls: two-level inversion in `sample`, greedy rows from one NumPy argmax, sampled plain steps' bonus token
        alone; 22: the calibration times the step's own verification, `_verify_chains`; 23: the KV cache's dtype,
        float16 for a 4-bit target, and a pass's queries ordered by key head; 24: the sampler's scan and a Q8_0
        table's lookups in the extension, a lone prophet's q not copied; 25: an eagle's step as one call of the
        extension), so that costs stored before are measured again. A lean float32 target whose products run on
        specdec's float32 kernel (`BatchLlama.f32_rows_exact`) also names them in its key (`f32_products`: the
        kernel's rows, its scored rows attending alone, its tile: "f32mm-64-exact-6x4"), so its costs were
        measured again and no other target's were."""
        import platform

        from specdec.defaults import cpu_model

        model = getattr(self.target, "model", None)
        rows = getattr(self.target, "rows", None)  # a lean target's BatchLlama: which layer loop runs it
        loop = "" if rows is None else "C++" if layerloop.stack_for(rows) is not None else "Python"
        key = {"version": 25, "target": self.target.name, "target_class": type(self.target).__name__,
               "dtype": str(getattr(model, "dtype", "")), "int4": bool(getattr(self.target, "int4", False)),
               "int4_kernel": str(getattr(self.target, "int4_kernel", "")), "layer_loop": loop,
               "kv_dtype": str(getattr(rows, "kv_dtype", "")),
               "device": str(self.target.device),
               "prophets": [_prophet_key(d) for d in self.prophets], "multi": self.multi,
               "k": self.policy.k0, "cpu": cpu_model(), "machine": platform.machine(),
               "threads": torch.get_num_threads(), "torch": torch.__version__}
        if rows is not None and rows.f32_rows_exact():  # its products on kernels/f32mm.cpp, scored rows alone
            key["f32_products"] = f"f32mm-{qgemm.f32_rows()}-exact-{qgemm.f32_tile()}"
        return key

    def decision_costs(self) -> Costs:
        """The costs this decoder's K policies decide from, fixed once per decoder, whichever
        policy asks first: its policy's own (set by hand), else the stored ones."""
        if self._costs is None:
            self._costs = self.policy.costs or self.stored_costs()
        return self._costs

    def stored_costs(self) -> Costs:
        """The step costs K policies decide from, measured once (`calibrate`) and stored under
        the cache directory, keyed by `costs_key`: every decoder loaded later with the same
        settings on this machine decides from the same numbers, so a seed fixes the output
        of every policy across loads and processes. Delete the cache's costs/ folder (or call
        `calibrate` and set `decoder.policy.costs`) to measure again. Costs measured while other
        processes used more than MAX_OTHER_LOAD cores on average (`OtherLoad`) are used by this
        decoder only and not stored, so one busy moment does not set every later load's K
        (SPECDEC_STORE_COSTS_UNDER_LOAD=1 stores them anyway: the tests, which run two at a time)."""
        return self._stored({}, self.calibrate)

    def stored_batch_costs(self, bucket: int, k_max: int, measure: Callable[[], Costs]) -> Costs:
        """The costs of a batched step of `bucket` rows (per row; `BatchEngine._measure`),
        stored as `stored_costs` is: measured once per machine and settings, not again in
        every process (a first `generate_many` of 8 rows spent 4 s measuring buckets 4 and 8)."""
        return self._stored({"batch_bucket": bucket, "batch_k_max": k_max}, measure)

    def _stored(self, extra: dict[str, Any], measure: Callable[[], Costs]) -> Costs:
        import hashlib
        import json

        from specdec.defaults import cache_dir

        key = {**self.costs_key(), **extra}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = cache_dir() / "costs" / f"{digest}.json"
        try:
            return Costs.from_dict(json.loads(path.read_text())["costs"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured yet (or unreadable): measure now
        load = OtherLoad()
        costs = measure()
        busy = load.cores()
        if busy > MAX_OTHER_LOAD and not os.environ.get("SPECDEC_STORE_COSTS_UNDER_LOAD"):
            # used by this decoder, not kept: the next load on a quieter machine measures again
            log.info("step costs measured while other processes used %.2f cores: not stored", busy)
            return costs
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "costs": costs.to_dict()}, indent=1))
            os.replace(tmp, path)  # atomic: a process reading it sees all or nothing
        except OSError:
            pass  # a read-only cache: this decoder still decides from its own measurement
        return costs

    def calibrate(self, n_context: int = 64, repeats: int = 7, long_context: int = 1024) -> Costs:
        """Time, once, what a round of this decoder's requests costs on the one loop
        (`BatchEngine.measure`, one placeholder row of `n_context` tokens, and again of
        `long_context` tokens where the target's context allows: `Costs.at` weighs the two
        by a request's length): a plain step, steps scoring n = 2.. tokens (up to a round of
        the policy's largest K) and each prophet's drafting, greedy and at temperature 1;
        the auto policy chooses K from these costs. Each figure is the fastest of `repeats`
        calls taken in turn, and the verification curve never falls with n."""
        from specdec.wiring import engine_for

        engine = engine_for(self, ONE_LOOP_SLOTS, costs=False)
        k = self.policy.k0
        room = self.target.max_length - 2 * (1 + len(self.prophets) * k)

        def at(n: int) -> Costs:
            ctx = [1 + i % max(1, self.target.vocab_size - 1) for i in range(n)]
            return engine.measure(1, k, ctx, repeats)

        short = at(max(2, min(n_context, room)))
        if min(long_context, room) >= 2 * short.context:
            long = at(min(long_context, room))
            short.long = long
            if short.sampled is not None:
                short.sampled.long = long.sampled
        return short

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


def _prophet_key(prophet: Any) -> str:
    """What a prophet's step costs depend on: its kind, name, dtype and (a feature prophet) whether its
    head multiplies the target's 4-bit blocks or float rows."""
    dtype = str(getattr(prophet, "dtype", "")).removeprefix("torch.")
    head = "" if getattr(prophet, "block_head", None) is None else ":block-head"
    return f"{type(prophet).__name__}:{prophet.name}" + (f":{dtype}" if dtype else "") + head
