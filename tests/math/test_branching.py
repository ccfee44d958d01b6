"""An eagle's grown draft trees (branches > 1, specdec.branching): exact at every temperature on
the one loop (the chi-square of every row against the target's exact distribution, greedy rows
equal to plain decoding, coupled rows equal to plain coupled sampling), and the rule that sizes
them follows the costs it is given."""

from collections import Counter

import pytest
import torch

from specdec import load
from specdec.batch import BatchEngine
from specdec.branching import FIT_RANGE, TreeBudget, draw_gains, fit_scale
from specdec.certify import goodness_of_fit
from specdec.costmodel import Costs
from specdec.prophets.base import Prophet
from specdec.prophets.combine import FirstProphet, TreeProphet
from specdec.prophets.ngram import NgramProphet
from specdec.request import Request
from specdec.sampling import SamplingParams
from specdec.toy import MarkovLM, sequence_distribution
from tests.helpers import ALPHA
from tests.loop.test_batch import LENGTH, PROMPT, ROWS, SLOTS, MarkovBatch, markov_models, row_params
from tests.prophets.test_feature import toy_prophet

N = 2000


class TreeMarkovBatch(MarkovBatch):
    """MarkovBatch with token trees: a node's logits and feature are the Markov model's after the
    row's chain and the node's path; `keep_path` keeps the accepted path's tokens."""

    def __init__(self, lm: MarkovLM, slots: int) -> None:
        super().__init__(lm, slots)
        self.trees = 0  # passes that scored a tree of more than one node

    def forward_features(self, slots, starts, new_ids, n_logits, trees=None):
        if not any(trees or []):
            return super().forward_features(slots, starts, new_ids, n_logits)
        out = torch.zeros(len(slots), max(n_logits), self.vocab_size)
        hidden = torch.zeros(len(slots), max(n_logits), MarkovLM.FEATURE_DIM)
        for b, (slot, start, ids, n) in enumerate(zip(slots, starts, new_ids, n_logits, strict=True)):
            parents = (trees or [None] * len(slots))[b] or []
            assert start <= len(self.tokens[slot])
            self.tokens[slot] = self.tokens[slot][:start] + list(ids)
            chain = self.tokens[slot][: len(self.tokens[slot]) - len(parents)]
            nodes = list(ids)[len(ids) - len(parents):]
            self.trees += len(parents) > 1
            scored = n - len(parents)  # the chain's last tokens with logits, then each node
            contexts = [chain[: len(chain) - scored + j + 1] for j in range(scored)]
            for j in range(len(parents)):
                path, a = [], j
                while a >= 0:
                    path.insert(0, nodes[a])
                    a = parents[a]
                contexts.append(chain + path)
            for j, ctx in enumerate(contexts):
                out[b, j], hidden[b, j] = self.lm.logits_after(ctx), self.lm.feature_after(ctx)
        return out, hidden

    def keep_path(self, slot, base, path):
        nodes = self.tokens[slot][base:]
        self.tokens[slot] = self.tokens[slot][:base] + [nodes[node] for node in path]


def tree_engine(branches: int = 3, with_ngram: str = "") -> tuple[BatchEngine, MarkovLM]:
    """with_ngram: "first" (lookup where it matches, the eagle's tree elsewhere) or "tree" (lookup's
    chain and the eagle's tree merged into one tree), else the eagle alone."""
    target, _ = markov_models()
    # seed 2: an eagle whose q is spread enough that independent draws often differ (wide trees)
    rows = TreeMarkovBatch(target, SLOTS)
    eagle = toy_prophet(target, "eagle", (0, 1, 3), seed=2).for_engine(rows, SLOTS, branches)
    prophet: Prophet = eagle
    if with_ngram == "first":
        prophet = FirstProphet([NgramProphet(2), eagle])
    elif with_ngram == "tree":
        prophet = TreeProphet([NgramProphet(2), eagle])
    return BatchEngine(rows, prophet), target


@pytest.mark.parametrize("with_ngram", ["", "first", "tree"])
@pytest.mark.slow
def test_every_row_drafting_grown_trees_matches_the_exact_distribution(with_ngram, monkeypatch):
    """Rows of mixed temperatures, top-k and top-p, each drafting trees of up to 3 children a node
    (independent draws from q; every draw pays here, up to 6 nodes), alone, after prompt lookup
    or merged with its chain: each row's tokens follow the target's exact distribution
    (chi-square, alpha 0.001), and trees of several nodes were really scored."""
    monkeypatch.setattr(TreeBudget, "pays", lambda self, s, new_step=False, nodes=1.0: self.nodes < 6)
    engine, target = tree_engine(3, with_ngram)
    requests = [Request(PROMPT, LENGTH, row_params(s), k, seed=i) for i in range(N) for k, s in ROWS]
    engine.generate(requests)
    assert engine.target.trees > N // 2
    for j, (k, s) in enumerate(ROWS):
        counts = Counter(tuple(r.generated) for r in requests[j :: len(ROWS)])
        result = goodness_of_fit(counts, sequence_distribution(target, PROMPT, LENGTH, row_params(s)), alpha=ALPHA)
        assert result.passed, (k, s, result)


def test_a_tree_whose_prophets_choose_their_own_k_matches_the_exact_distribution():
    """--multi tree with each row's AutoPolicy choosing each prophet's K from that prophet's own
    evidence (lookup's chain beside the eagle's grown tree, costs given): every row's tokens
    follow the target's exact distribution, and the prophets' chains did differ in length."""
    from specdec.policy import AutoPolicy

    engine, target = tree_engine(3, "tree")
    engine.kchoice.set_costs(Costs(1.0, {1: 1.0, 5: 1.4}, 0.05, width=2))
    settings = dict(temperature=0.9, top_p=0.95)
    requests = [Request([1, 2, 1, 2, 1], LENGTH + 2, row_params(settings), 4, seed=i,
                        policy=AutoPolicy(4, min_rounds=1)) for i in range(N)]
    lengths = set()
    step = engine._tree_step

    def seen(active, draft, d0, d1):
        lengths.update(tuple(len(c) for c in row.values()) for row in draft.chains if len(row) == 2)
        return step(active, draft, d0, d1)

    engine._tree_step = seen  # type: ignore[method-assign]
    engine.generate(requests)
    counts = Counter(tuple(r.generated) for r in requests)
    want = sequence_distribution(target, [1, 2, 1, 2, 1], LENGTH + 2, row_params(settings))
    result = goodness_of_fit(counts, want, alpha=ALPHA)
    assert result.passed, result
    assert any(a != b for a, b in lengths), lengths


@pytest.mark.slow
def test_grown_trees_are_exact_with_draws_that_repeat_and_deep_trees(monkeypatch):
    """Every node pays (up to 12 a tree, 4 draws a node, depth 4): repeated draws share a node
    and keep both proposals; still the exact distribution."""
    monkeypatch.setattr(TreeBudget, "pays", lambda self, s, new_step=False, nodes=1.0: self.nodes < 12)
    engine, target = tree_engine(4)
    settings = dict(temperature=0.8, top_p=0.9)
    requests = [Request(PROMPT, 4, row_params(settings), 4, seed=i) for i in range(3 * N)]
    engine.generate(requests)
    counts = Counter(tuple(r.generated) for r in requests)
    result = goodness_of_fit(counts, sequence_distribution(target, PROMPT, 4, row_params(settings)), alpha=ALPHA)
    assert result.passed, result
    assert engine.target.trees > N


def test_greedy_and_coupled_rows_with_grown_trees_equal_plain_decoding(monkeypatch):
    """Where the target's choice is deterministic the tree's nodes are q's top tokens: greedy rows
    give plain greedy decoding's tokens, coupled rows plain coupled sampling's (the same seed)."""
    monkeypatch.setattr(TreeBudget, "pays", lambda self, s, new_step=False, nodes=1.0: self.nodes < 9)
    engine, target = tree_engine(3)
    plain = BatchEngine(MarkovBatch(target, SLOTS), None)
    for params, sampling in ((SamplingParams(0.0), "rejection"), (SamplingParams(1.0), "coupled")):
        reqs = [Request([1 + i % 3, 2, i % 5], 12, params, 3, seed=i, sampling=sampling) for i in range(12)]
        want = [Request(r.prompt, 12, params, 0, seed=i, sampling=sampling) for i, r in enumerate(reqs)]
        engine.generate(reqs)
        plain.generate(want)
        assert [r.generated for r in reqs] == [w.generated for w in want]
    assert engine.target.trees > 0


def test_a_seeded_row_draws_the_same_trees_alone_and_in_a_batch():
    """A seeded sampled row's trees (and so its tokens) depend on its own state only."""
    engine, _ = tree_engine(3)
    params = SamplingParams(0.9)
    alone = Request([1, 2, 3], 10, params, 3, seed=7)
    engine.generate([alone])
    batch = [Request([1, 2, 3], 10, params, 3, seed=7)] + [Request([i % 5, 1], 10, params, 3, seed=i)
                                                           for i in range(8)]
    engine.generate(batch)
    assert batch[0].generated == alone.generated


def test_the_rule_grows_trees_where_scoring_is_cheap_and_keeps_chains_where_it_is_dear():
    flat = Costs(1.0, {1: 1.0, 16: 1.05}, 0.02)  # a GPU's curve: 16 tokens cost a step
    steep = Costs(1.0, {1: 1.0, 2: 1.3, 4: 1.9}, 0.05)  # a CPU's: each token ~0.3 of a step
    for costs, wide in ((flat, True), (steep, False)):
        budget = TreeBudget(costs, "eagle")
        budget.add(0.6, new_step=True)
        assert budget.pays(0.15) == wide  # a second child of chance 0.15
        assert budget.pays(0.9)  # one nearly sure pays anywhere
    assert TreeBudget(None, "eagle").pays(0.1) and not TreeBudget(None, "eagle").pays(0.05)


def test_draw_gains_and_the_fit_scale():
    q = torch.tensor([0.7, 0.2, 0.1])
    gains = draw_gains(q, 3)
    assert gains[0][0] == pytest.approx(float((q * q).sum())) and gains[0][1] == pytest.approx(1.0)
    assert gains[0][0] > gains[1][0] > gains[2][0] > 0 and gains[1][1] < 1
    assert sum(g for g, _ in gains) == pytest.approx(float((q * (1 - (1 - q) ** 3)).sum()))
    assert fit_scale([0.0, 0.0]) == 1.0
    assert fit_scale([100.0, 0.0]) == FIT_RANGE[0] and fit_scale([0.0, 100.0]) == FIT_RANGE[1]


def test_branches_on_a_real_eagle_stay_greedy_equal_and_bad_values_are_refused(tiny_pair, tiny_eagle, monkeypatch):
    """A Llama target on the lean path with an eagle growing trees of up to 4 children a node
    (every node pays here, up to 8): greedy equals plain decoding, alone and batched."""
    monkeypatch.setattr(TreeBudget, "pays", lambda self, s, new_step=False, nodes=1.0: self.nodes < 8)
    dec = load(tiny_pair["target"], draft=tiny_eagle, branches=4, draft_dtype=torch.float32, policy="fixed",
               draft_tokens=3)
    plain = load(tiny_pair["target"], draft="none")
    prompts = ["def main():", "import os\n", "x = [1, 2, 3]\n"]
    want = [plain.generate(p, max_new_tokens=20, temperature=0).token_ids for p in prompts]
    sizes = []
    for prompt, w in zip(prompts, want, strict=True):
        got = dec.generate(prompt, max_new_tokens=20, temperature=0)
        assert got.token_ids == w
        sizes += [e.tree_size for e in got.events]
    assert max(sizes) > 3
    batched = dec.generate_many([{"prompt": p, "max_new_tokens": 20, "temperature": 0} for p in prompts])
    assert [g.token_ids for g in batched] == want
    merged = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", multi="tree", branches=4,
                  draft_dtype=torch.float32, policy="fixed", draft_tokens=3)  # lookup's chain in the eagle's tree
    for prompt, w in zip(prompts, want, strict=True):
        got = merged.generate(prompt, max_new_tokens=20, temperature=0)
        assert got.token_ids == w and max(e.tree_size for e in got.events) > 3
    for bad in (0, 9, 2.0, True, "4"):
        with pytest.raises(ValueError, match="branches must be an integer from 1"):
            load(tiny_pair["target"], draft="none", branches=bad)
    with pytest.raises(ValueError, match="has none: add one"):  # no eagle to grow trees from
        load(tiny_pair["target"], draft="ngram", branches=4)


def test_grown_trees_that_stayed_chains_are_the_chain_draft_they_are():
    """chain_draft: chain-shaped grown trees as a chain draft (q kept for sampled rows, one-hot
    for deterministic ones); is_chain tells a chain from a branching tree."""
    from specdec.prophets.base import chain_draft, is_chain
    from specdec.verify import DraftTree

    q = torch.tensor([0.5, 0.3, 0.2])
    sampled, greedy, branching = DraftTree(), DraftTree(), DraftTree()
    sampled.add_chain([2, 0], torch.stack([q, q.flip(0)]), "eagle")
    greedy.add_chain([1, 1, 2], None, "eagle")
    tokens, probs, one_hot = chain_draft([sampled, greedy])
    assert tokens == [[2, 0], [1, 1, 2]] and one_hot == [False, True]
    assert probs is not None and torch.equal(probs[0, :2], torch.stack([q, q.flip(0)]))
    branching.add_chain([1, 2], None, "eagle")
    branching.add_chain([1, 0], None, "eagle")
    assert is_chain(sampled) and is_chain(greedy) and is_chain(DraftTree()) and not is_chain(branching)
    assert chain_draft([greedy])[1] is None
