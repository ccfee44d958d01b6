"""Batched speculative decoding: many requests in one step, each accepting its own number
of drafted tokens (terms as in `specdec.verify`: accepted, recovered, bonus).

Words, used one way throughout: a *round* is one request's draft -> verify -> commit (one
`RoundEvent`); a *step* is one iteration of this loop, a round for every active row at once
(one drafting pass, one target forward); a *prophet* is whatever drafts (a model, a lookup, a
head, the target's early exit); a *draft* is what a prophet proposed; a *pass* is one forward
of a model.

- `BatchLlama` (`specdec.llama`): the one Llama path, with B cache slots. One forward
  scores a ragged batch (row b feeds n_b new tokens after start_b cached ones; rows are
  padded to the longest and masked). Keys and values are written by position, so entries
  of rejected drafts are simply overwritten by the next step: a row's cache length is its
  request's `target_cached` (or `draft_cached`), nothing else to roll back.
- `Request` (`specdec.request`): one sequence and all of its state (ids, sampling settings,
  generator, K, cache slot, cache lengths, finish reason). Nothing about a request lives in
  the engine. The prophets draft for rows (`specdec.prophets.base.Prophet`); any other model
  scores rows in turn through `specdec.rows.RowsLM`.
- `BatchEngine.step(requests)`: one drafting pass, one target forward for all active rows,
  ragged verification (`specdec.ragged`), commit per row; rows that finish free their slot
  and new rows take free slots between steps. K = 0 is plain batched decoding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from specdec.branching import record_fit
from specdec.commit import Committer, Spans
from specdec.costmodel import Costs
from specdec.defaults import MAX_NEW_TOKENS, PREFILL_CHUNK, TEMPERATURE, TOP_P
from specdec.driver import Row, run_rows
from specdec.finish import Finish
from specdec.grammar import inside_rows, masks_for
from specdec.kchoice import KChoice
from specdec.llama import BatchLlama
from specdec.lm import LM, attention_backends, common_prefix, tree_depths
from specdec.prophets.base import TREE, BatchDraft, Prophet, chain_draft, in_row_order, is_chain, probs_by_params
from specdec.ragged import RaggedVerdict, greedy_verdicts, verify_greedy_rows, verify_rows
from specdec.request import TARGET, Request, StepEvent, batch_free, row_prefilled, row_slot
from specdec.rows import prefill_rows
from specdec.sampling import SamplingParams, checked_argmax, couple, logits_to_probs, sample
from specdec.slots import Slots
from specdec.verify import Verdict, verify_chain, verify_greedy_tree, verify_tree


def _verdict(logits: torch.Tensor, rows: Sequence[Request], draft_tokens: torch.Tensor, lens: Sequence[int],
             probs: torch.Tensor | None, one_hot: Sequence[bool] | None, who: str) -> RaggedVerdict:
    """Verify a scored pass: logits (B, K+1, V), each row's draft (B, K) of lens[b] tokens, q
    (B, K, V) or None, `one_hot` the rows whose q is one-hot. Greedy rows (not coupled) by the
    target's choices alone (`verify_greedy_rows`: no distribution over the vocabulary is
    built); the others by their sampling distributions (`verify_rows`); the same verdicts."""
    greedy = [b for b, r in enumerate(rows) if r.params.greedy and r.params.coupled is None]
    if len(greedy) == len(rows):
        return verify_greedy_rows(draft_tokens, lens, checked_argmax(logits, who))
    chosen_rows = set(greedy)
    rest = [b for b in range(len(rows)) if b not in chosen_rows]
    sub = [rows[b] for b in rest]

    def of_rest(x: torch.Tensor) -> torch.Tensor:  # the sampled rows' part (no copy where that is every row)
        return x if not greedy else x[rest]

    target_probs = probs_by_params(of_rest(logits), sub, who)  # checks their logits
    for i, r in enumerate(sub):  # a coupled row: each position one-hot on its keyed draw
        if r.params.coupled is not None:
            target_probs[i] = couple(target_probs[i], r.params, r.length)
    q = None if probs is None else of_rest(probs)
    hot = None if one_hot is None or q is None else \
        torch.tensor([one_hot[b] for b in rest], dtype=torch.bool, device=logits.device)
    sampled = verify_rows(of_rest(draft_tokens), [lens[b] for b in rest], q, hot, target_probs,
                          [r.generator for r in sub])
    if not greedy:
        return sampled
    chosen = verify_greedy_rows(draft_tokens[greedy], [lens[b] for b in greedy], checked_argmax(logits[greedy], who))
    return RaggedVerdict(*(in_row_order(greedy + rest, [getattr(chosen, f), getattr(sampled, f)])
                           for f in ("n_accepted", "next_tokens", "bonus")))


def from_entries(x: torch.Tensor, first: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """Row b's entries first[b] .. first[b] + counts[b] - 1 of x (B, n, ...), padded with zeros
    to the most counts: (B, max(counts), ...)."""
    out = torch.zeros((x.shape[0], max(counts), *x.shape[2:]), dtype=x.dtype, device=x.device)
    for b, (a, n) in enumerate(zip(first, counts, strict=True)):
        out[b, :n] = x[b, a: a + n]
    return out


class BatchEngine:
    def __init__(self, target: LM, prophet: Prophet | None = None, eos_token_ids: Iterable[int] = (),
                 tokenizer: Any = None) -> None:
        lm = prophet.draft_lm if prophet is not None else None
        if lm is not None and (lm.vocab_size != target.vocab_size or lm.slots != target.slots):
            raise ValueError("the prophet must score the target's vocabulary and have as many slots")
        self.target, self.prophet, self.tokenizer = target, prophet, tokenizer
        # the prophets one by one (several under first, best or tree), and the draft models'
        # own slots among them (an early exit drafts in the target's)
        self.parts: list[Prophet] = list(prophet.parts) if prophet is not None else []
        self.model_names = {p.name for p in self.parts if p.model_steps}  # prophets whose draft steps are passes
        self.draft_lms: list[LM] = [p.draft_lm for p in self.parts if p.draft_lm is not None
                                         and p.draft_lm is not target]
        # target layers whose outputs an eagle3 prophet drafts from (every pass keeps them per row)
        self.fused_layers: tuple[int, ...] = next((tuple(p.fused_layers) for p in self.parts if p.fused_layers), ())
        # One step (or release) at a time: requests of several threads may step on one engine
        # (a decoder's interleaved streams, generate beside a server); each sees its own rows.
        self.lock = threading.RLock()
        # which request holds which cache row, the prefill chunk, the prefix cache (`specdec.slots`)
        self.slots = Slots(target, self.draft_lms, prophet, PREFILL_CHUNK, self.fused_layers, self.lock)
        self.kchoice = KChoice(self)  # how many tokens each row drafts (`specdec.kchoice`)
        self.commits = Committer(target.max_length, eos_token_ids, self.kchoice, prophet is not None, self.slots)
        # Seconds one measurement (greedy or sampled, one batch size) may take before it stops
        # repeating (`costmodel.interleaved_times`); None: all its repeats
        self.measure_budget_s: float | None = None
        self.prefix_mb = 0.0  # the MiB of prompt prefixes the decoder asked it to keep (`wiring.engine_for`)
        # perf_counter spans of the last step's drafting and target forward (for timelines)
        self.last_spans: Spans = ((0.0, 0.0), (0.0, 0.0))

    # ----------------------------------------------------------------- one step
    def step(self, requests: Sequence[Request]) -> list[StepEvent]:
        """One round for every unfinished request: draft, score, verify, commit. Safe to call
        from several threads (one step at a time), each with requests of its own."""
        with self.lock, attention_backends(self.target.device):
            return self._step(requests)

    def _step(self, requests: Sequence[Request]) -> list[StepEvent]:
        active = [r for r in requests if not r.done]
        slots = self.slots
        refused = [slots.refuse(r, why) for r in active if r.slot is None and (why := slots.invalid(r))]
        active = [r for r in active if not r.done]
        if not active:
            return refused
        # 1. Join: new rows take a free cache slot; prompts are prefilled a chunk per step
        #    (`prefill_chunk` tokens at most), so a long prompt never stalls the running rows
        #    for more than one chunk's time; a row drafts and decodes once its prompt is in.
        slots.admit(active)
        if slots.prefix_cache is not None:
            slots.prefix_cache.store_rows(self.target, active)
            slots.prefix_cache.take_rows(self.target, active)
        alone = len(active) == 1 and len(active[0].prompt) - active[0].target_cached <= slots.prefill_chunk
        if not alone:  # a row alone takes the rest of its prompt into this step's own pass (no extra pass)
            prefill_rows(self.target, active, TARGET, slots.prefill_chunk, self.fused_layers)
            active = [r for r in active if row_prefilled(r, TARGET)]
        # 1b. Tokens a row's grammar forces (one token allowed, `specdec.grammar`) are committed
        #     now, with no draft and no pass; the prophets draft from after them.
        refused += self.commits.force(active)
        active = [r for r in active if not r.done]
        if not active:
            return refused
        # 2. Draft up to k_b tokens per row (never past max_new_tokens or a context). Rows are
        #    padded to the longest feed, so with auto rows one K for the step is chosen from
        #    the rows' drafts (prompt lookup: after proposing, it is free; a model: before).
        costs = self.kchoice.policy_costs(active)
        d0 = time.perf_counter()
        draft = self._draft(active, costs)
        if draft.trees is None and any(r.constraint is not None for r in active):  # cut after a token outside
            draft = draft.cut(inside_rows(active, draft.tokens))
        d1 = time.perf_counter()
        if draft.trees is not None:
            return refused + self._tree_step(active, draft, d0, d1)
        # 3. One target forward: each row's pending tokens then its draft; p_1..p_{k_b+1} per row.
        starts = [r.target_cached for r in active]  # each row's first position in the pass
        logits, hidden, fused = self._score(active, draft.tokens)  # (B, K+1, V), (B, K+1, D) or None, fused
        # 4. Ragged verification.
        verdicts = self.verify_chains(logits, active, draft.tokens, draft.probs, draft.one_hot)
        share = self._timed(len(active), d0, d1)
        # 5. Commit per row; finished rows leave and free their slot.
        names = draft.names or [self.prophet.name if self.prophet else None] * len(active)
        return refused + [self.commits.chain(r, b, t, v, names[b], share, self.last_spans, hidden, fused, starts[b])
                          for b, (r, t, v) in enumerate(zip(active, draft.tokens, verdicts, strict=True))]

    def verify_chains(self, logits: torch.Tensor, rows: Sequence[Request], drafts: Sequence[list[int]],
                       probs: torch.Tensor | None, one_hot: Sequence[bool] | None) -> list[Verdict]:
        """Each row's chain (its own length) verified from the pass's logits (B, >= K+1, V)
        and q (B, >= K, V) or None: `_verdict` on the rows padded to the longest, or (the same
        verdicts with fewer calls, each of which costs ~10 us right after a pass) greedy rows from
        the target's choices, a sampled row alone by `verify_chain`, sampled plain steps' tokens
        drawn from p."""
        lens = [len(t) for t in drafts]
        k_max = max(lens)
        who = f"target '{self.target.name}'"
        if all(r.params.greedy and r.params.coupled is None for r in rows):  # the target's choices alone
            return greedy_verdicts(drafts, checked_argmax(logits[:, : k_max + 1], who).tolist())
        if len(rows) == 1 and rows[0].params.coupled is None:  # a row alone that samples: the specification itself
            p = probs_by_params(logits[:, : k_max + 1], rows, who)[0]  # checks the logits
            q = None if probs is None or k_max == 0 or (one_hot is not None and one_hot[0]) else probs[0, :k_max]
            draft = torch.tensor(drafts[0], dtype=torch.long, device=logits.device)
            return [verify_chain(draft, q, p, rows[0].generator)]
        if k_max == 0 and all(r.params.coupled is None for r in rows):  # sampled plain steps: the bonus token
            p = probs_by_params(logits[:, :1], rows, who)  # checks the logits
            return [Verdict(0, int(sample(p[b, 0], r.generator)), "bonus") for b, r in enumerate(rows)]
        tokens = torch.tensor([t + [-1] * (k_max - len(t)) for t in drafts], dtype=torch.long,
                              device=logits.device).reshape(len(rows), k_max)  # (B, K)
        q = None if probs is None or k_max == 0 else probs[:, :k_max]
        return _verdict(logits[:, : k_max + 1], rows, tokens, lens, q, one_hot, who).rows()

    def _score(self, active: Sequence[Request], drafts: Sequence[Sequence[int]],
               trees: Sequence[Sequence[int]] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The step's one target pass: each row's pending tokens then its draft (or its tree's
        nodes, `trees`: their parents), logits after the last pending token and each drafted
        one, the features the head read where a prophet reads them (else None) and the fused
        layers' outputs an eagle3 prophet drafts from (else None). The rows' target caches
        then hold all of it (the commit cuts them back)."""
        feeds = [r.context_from(r.target_cached) + list(t) for r, t in zip(active, drafts, strict=True)]
        # tokens a grammar forced this step are scored too (their logits dropped below): a scored token
        # attends alone, as a one-token step attends (`llama.exact_attention`), so greedy rows keep
        # plain decoding's bits, which a pending run of several tokens attended at once would not
        lead = [r.forced if trees is None else 0 for r in active]  # (a tree pass lays out its rows itself)
        args = ([row_slot(r) for r in active], [r.target_cached for r in active], feeds,
                [len(t) + 1 + x for t, x in zip(drafts, lead, strict=True)])
        # p under each row's grammar (`specdec.grammar`): every constrained row's masks in one call of the
        # engine, filled on a worker thread while the pass runs (the matchers are the fill's until applied)
        masks = masks_for(active, drafts, trees, background=True) \
            if any(r.constraint is not None for r in active) else None
        try:
            logits, hidden, fused = self._forward(args, trees)
        finally:
            if masks is not None:
                masks.wait()
        if any(lead):  # each row's entries from its last pending token on
            logits = from_entries(logits, lead, [len(t) + 1 for t in drafts])
            hidden = None if hidden is None else from_entries(hidden, lead, [len(t) + 1 for t in drafts])
        if masks is not None:
            logits = masks.apply(logits)
        for r, f in zip(active, feeds, strict=True):
            r.target_cached += len(f)
        return logits, hidden, fused

    def _forward(self, args: tuple[list[int], list[int], list[list[int]], list[int]],
                 trees: Sequence[Sequence[int]] | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The target's pass: its logits, the features a feature prophet reads and the fused
        layers' outputs an eagle3 prophet reads (else None)."""
        hidden = fused = None
        if self.fused_layers:
            # only a BatchLlama target gets an eagle3 prophet (wiring._eagle3)
            logits, hidden, fused = self.target.forward_fused(  # type: ignore[attr-defined]
                *args, capture=self.fused_layers, trees=trees)
            if not (self.prophet is not None and self.prophet.reads_features):
                hidden = None
        elif self.prophet is not None and self.prophet.reads_features:
            logits, hidden = self.target.forward_features(*args, trees=trees)
        else:
            logits = self.target.forward(*args, trees=trees)
        return logits, hidden, fused

    def _timed(self, rows: int, d0: float, d1: float) -> tuple[float, float]:
        """Record the step's drafting and target spans (d1 to now); each row's share of both,
        split evenly (what its policy observes)."""
        t1 = time.perf_counter()
        self.last_spans = ((d0, d1), (d1, t1))
        return (d1 - d0) / rows, (t1 - d1) / rows

    def _tree_step(self, active: Sequence[Request], draft: BatchDraft, d0: float, d1: float) -> list[StepEvent]:
        """Steps 3-5 with a token tree per row: one target pass scores each row's pending
        tokens then its tree (nodes at chain end + depth, each seeing its ancestors only);
        each row's tree is verified by recursive rejection sampling; the accepted path's
        cache entries move next to the committed ones. A grown tree that stayed a chain is
        scored and verified as the chain it is (`chain_draft`, the chain step's verification
        and commit), so a row's round never depends on whether the rows beside it branched."""
        assert draft.trees is not None and draft.chains is not None
        trees = draft.trees
        chained = [b for b, tree in enumerate(trees) if draft.names is not None and is_chain(tree)]
        starts = [r.target_cached for r in active]  # each row's first position in the pass
        scored_as = [[] if b in chained else t.parents for b, t in enumerate(trees)]
        logits, hidden, fused = self._score(active, [t.tokens for t in trees], scored_as)
        as_chain: dict[int, Verdict] = {}
        if chained:  # those rows' chains, verified together as the chain step verifies
            drafts, probs, one_hot = chain_draft([trees[b] for b in chained])
            as_chain = dict(zip(chained, self.verify_chains(logits[chained], [active[b] for b in chained], drafts,
                                                             probs, one_hot), strict=True))
        share = self._timed(len(active), d0, d1)
        events = []
        for b, (r, tree) in enumerate(zip(active, trees, strict=True)):
            n, at = len(tree.tokens), r.length  # at: the root's position
            if b in as_chain:
                record_fit(r.tree_fit, tree.expected, as_chain[b].n_accepted)
                events.append(self.commits.chain(r, b, list(tree.tokens), as_chain[b], draft.names[b],  # type: ignore[index]
                                                 share, self.last_spans, hidden, fused, starts[b]))
                continue
            if r.params.greedy:  # p one-hot on the target's choices: follow them (no probabilities)
                picks = checked_argmax(logits[b, : n + 1], f"target '{self.target.name}'")
                verdict = verify_greedy_tree(tree, picks.tolist())
            else:
                p = logits_to_probs(logits[b, : n + 1], r.params, who=f"target '{self.target.name}'")
                p = couple(p, r.params, at, [at] + [at + d for d in tree_depths(tree.parents)])  # nodes' positions
                verdict = verify_tree(tree, p, r.generator)
            self.target.keep_path(row_slot(r), at, verdict.path)
            path = [tree.tokens[node] for node in verdict.path]
            for name, chain in draft.chains[b].items():  # a draft model's cache: what agrees with the path
                if name in r.draft_cached:
                    r.draft_cached[name] = min(r.draft_cached[name], at + common_prefix(chain, path))
            k = max((len(c) for c in draft.chains[b].values()), default=0)
            if tree.expected:  # a grown tree: how well its prophet's expectation held, for the request's next ones
                record_fit(r.tree_fit, tree.expected, len(path))
            # a grown tree (or a chain beside grown trees) is its prophet's evidence; multi tree's merged chains
            # each their prophet's where the row's policy keeps evidence per prophet (the tokens of the accepted
            # path its chain agrees with), else TREE's
            who = (draft.names[b] if draft.names else None) or TREE
            each = {name: (len(c), common_prefix(c, path)) for name, c in draft.chains[b].items() if c} \
                if who == TREE and r.policy is not None and r.policy.per_prophet else None
            e = self.commits.commit(r, path, len(path), verdict.next_token, verdict.next_kind, who if n else None,
                                    share, n_drafted=k, each=each)
            e.spans, e.tree_size, e.accepted_by = self.last_spans, n, verdict.accepted_by
            e.proposals = {name: len(c) for name, c in draft.chains[b].items()}
            e.prophet = "+".join(e.proposals) if n else None
            self.commits.keep_feature(e, hidden, b, 1 + verdict.path[-1] if verdict.path else 0)  # last accepted node
            pending = at - starts[b]  # the row's tokens before the tree in the pass
            order = [*range(pending), *(pending + node for node in verdict.path)]
            self.commits.keep_fused(r, fused, b, starts[b], order)
            events.append(e)
        return events

    def _draft(self, active: Sequence[Request], costs: Costs | None) -> BatchDraft:
        """Up to k_b tokens per row (never past max_new_tokens or a context). Rows are padded
        to the longest feed, so with auto rows one K for the step is chosen from the rows'
        acceptance and drafts: before drafting for a model (each step costs), after it for
        the others (a lookup is free, a feature prophet's batched step nearly so)."""
        if self.prophet is None:
            return BatchDraft([[] for _ in active], None)
        if self.prophet.combine == "tree":  # a tree per row: each prophet's chain of its own K
            ks = [self.kchoice.budget(r, None if r.policy is not None and r.policy.per_prophet else TREE)
                  for r in active]

            def own(r: Request, name: str) -> int:  # the row's policy's K of a prophet, or of the whole tree
                return self.kchoice.budget(r, name if r.policy is not None and r.policy.per_prophet else TREE)

            return self.prophet.propose(active, ks, own) if any(ks) else BatchDraft([[] for _ in active], None)
        skip: set[str] = set()
        if costs is not None:
            self.kchoice.costed_steps += 1
            skip = self.kchoice.not_paying(active, costs, self.kchoice.costed_steps)

        def budget(r: Request, name: str | None = None) -> int:
            return 0 if name in skip and batch_free(r) else self.kchoice.budget(r, name)

        if self.prophet.combine == "first":
            if all(p.name in skip for p in self.parts) and all(batch_free(r) for r in active):
                return BatchDraft([[] for _ in active], None)  # no prophet pays: nothing asked
            ks = [self.kchoice.budget(r) for r in active]
            draft = self.prophet.propose(active, ks, budget=budget) if any(ks) else \
                BatchDraft([[] for _ in active], None)
        else:
            ks = [budget(r, self.prophet.name) for r in active]
            if costs is not None and self.prophet.model_steps:  # early exit too
                ks = self.kchoice.batch_cut(active, ks, self.kchoice.step_k(active, ks, costs))
            draft = self.prophet.propose(active, ks) if any(ks) else BatchDraft([[] for _ in active], None)
        if costs is not None and not self.prophet.model_steps and draft.trees is None:
            lens = [len(t) for t in draft.tokens]
            cut = self.kchoice.step_k(active, lens, costs, draft.names)
            draft = draft.cut(self.kchoice.batch_cut(active, lens, cut))
        return draft


    def finish_step(self, e: StepEvent, finish: Finish) -> list[int]:
        """A row's part in the last step, finished (specdec.finish): where a stop string now
        appears, its tokens are cut there and the row ends ("stop", its slot freed). Returns
        the tokens this step added to the row's output."""
        r = e.request
        before = len(r.generated) - len(e.committed)
        keep = finish.cut(r.generated, before)
        if keep is not None:
            del r.generated[keep:]
            r.finish_reason = "stop"
            self.slots.release(r)
        return r.generated[before:]

    def release(self, req: Request) -> None:
        """Free the cache slot of a request that leaves before it is done (`Slots.release`)."""
        self.slots.release(req)

    # ----------------------------------------------------------------- many prompts
    def generate(self, prompts: Sequence[Sequence[int] | str | Request], max_new_tokens: int = MAX_NEW_TOKENS,
                 temperature: float = TEMPERATURE, top_k: int | None = None, top_p: float = TOP_P,
                 seed: int | None = None, draft_tokens: int = 4, max_batch: int | None = None) -> list[Request]:
        """Run every prompt to its end, at most max_batch (default: all slots) at a time: rows
        leave as they finish and waiting ones join. A Request keeps its own settings; other
        prompts get these, and prompt i the seed seed + i. Returns the requests, in order."""
        params = SamplingParams(temperature, top_k, top_p)
        requests = [p if isinstance(p, Request) else
                    Request(self._encode(p), max_new_tokens, params, draft_tokens,
                            None if seed is None else seed + i) for i, p in enumerate(prompts)]
        for _ in run_rows(self, [Row(r, Finish(self.tokenizer), release_text=False) for r in requests], max_batch):
            pass
        return requests

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)


__all__ = ["BatchEngine", "BatchLlama"]
