"""The auto policy: the K the measured costs and this request's acceptance predict to pay
most, plain steps while none pays, drafting again after a pause; nothing carries over
between requests."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec.costmodel import Costs, expected_tokens_per_round
from specdec.policy import AdaptivePolicy, AutoPolicy, RoundOutcome


def drafted_round(k, accepted):
    return RoundOutcome(drafted=k, accepted=accepted, draft_s=0.0, target_s=0.0, draft_calls=k)


def plain_round():
    return RoundOutcome(drafted=0, accepted=0, draft_s=0.0, target_s=0.0, draft_calls=0)


EXPENSIVE = Costs(t_plain=1.0, t_verify={1: 1.0, 2: 1.5, 5: 2.0}, t_draft=0.25)  # a round costs >= 1.75 steps
# Shaped like SmolLM2's measured curve on this CPU: 2-3 tokens cost about one step, 5 cost 1.6.
STEP_CURVE = Costs(t_plain=1.0, t_verify={1: 1.0, 2: 1.04, 3: 1.1, 4: 1.45, 5: 1.6}, t_draft=0.05)


def auto(costs, k=4, **kw):
    policy = AutoPolicy(k, **kw)
    policy.costs = costs
    policy.reset()
    return policy


def test_auto_pauses_when_drafting_cannot_pay_and_tries_again():
    policy = auto(EXPENSIVE, min_rounds=2)
    for _ in range(2):
        assert policy.next_k() > 0
        policy.observe(drafted_round(policy.next_k(), 0))  # nothing accepted
    assert policy.gains[-1] < 1
    for _ in range(4):  # the first pause: 4 plain steps
        assert policy.next_k() == 0
        policy.observe(plain_round())
    assert policy.next_k() > 0  # then it drafts again, from the prior
    while policy.next_k() > 0:
        policy.observe(drafted_round(policy.next_k(), 0))
    paused = 0
    while policy.next_k() == 0:
        policy.observe(plain_round())
        paused += 1
    assert paused == 8  # the pause doubles


def test_auto_follows_acceptance_along_the_measured_curve():
    low, high = auto(STEP_CURVE), auto(STEP_CURVE)
    for _ in range(20):
        k = low.next_k()
        low.observe(drafted_round(k, 1 if k > 1 else 0))  # about one in two positions accepted
        high.observe(drafted_round(high.next_k(), high.next_k()))  # everything accepted
    assert low.next_k() == 2  # past 3 scored tokens the pass gets dearer than more drafts pay
    assert high.next_k() == 4 and min(high.gains[3:]) > 2.5
    assert min(low.gains) > 1


@given(a=st.floats(0.0, 0.999), k_max=st.integers(1, 12), t_draft=st.floats(0.0, 0.5),
       slope=st.floats(0.0, 0.5), jump=st.floats(0.0, 1.0))
def test_best_k_is_the_argmax_of_the_cost_model(a, k_max, t_draft, slope, jump):
    costs = Costs(1.0, {1: 1.0, 3: 1.0 + 2 * slope, 4: 1.0 + 3 * slope + jump, 8: 1.0 + 7 * slope + jump}, t_draft)
    k, gain = costs.best_k(a, k_max)
    brute = [expected_tokens_per_round(a, j) / (j * t_draft + costs.verify_time(j + 1)) for j in range(1, k_max + 1)]
    assert 1 <= k <= k_max and gain == pytest.approx(max(brute))


def test_verify_time_interpolates_and_extrapolates():
    costs = Costs(1.0, {1: 1.0, 3: 2.0, 5: 4.0}, 0.0)
    assert [costs.verify_time(n) for n in (1, 2, 3, 4, 5, 7)] == [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        Costs(1.0, {}, 0.0)


def test_nothing_carries_over_between_requests():
    policy = AdaptivePolicy(3)
    for _ in range(3):
        policy.observe(drafted_round(policy.k, policy.k))  # fully accepted: K grows
    assert policy.k > 3
    policy.reset(5)  # a request with its own K
    assert policy.k == 5
    policy.reset()  # the next request without one: the decoder's K, not the last request's
    assert policy.k == 3
    policy = auto(EXPENSIVE)
    first = policy.next_k()
    for _ in range(4):
        policy.observe(drafted_round(policy.next_k() or 1, 0))
    assert policy.next_k() == 0
    policy.reset()
    assert policy.next_k() == first and policy.gains == []
    policy.reset(2)  # a request's K bounds what auto may choose
    assert policy.next_k() <= 2


def test_auto_keeps_evidence_per_prophet():
    costs = Costs(1.0, {1: 1.0, 2: 1.04, 3: 1.1, 5: 1.6}, 0.05, t_draft_by={"lookup": 0.0, "model": 0.2})
    policy = auto(costs)
    for _ in range(6):
        k = policy.next_k("lookup")
        policy.observe(RoundOutcome(k, k, 0.0, 0.0, 0, "lookup"))  # all accepted
        k = policy.next_k("model")
        if k:
            policy.observe(RoundOutcome(k, 0, 0.0, 0.0, k, "model"))  # nothing accepted
    assert policy.next_k("lookup") == 4 and policy.acceptance("lookup") > 0.8
    assert policy.next_k("model") == 0  # this prophet pauses; the other goes on
    assert costs.round_time(2, "model") == pytest.approx(0.4 + 1.1)


def test_median_seconds_warms_up_and_runs_after_outside_the_timing():
    from specdec.costmodel import median_seconds

    calls = []
    t = median_seconds(lambda: calls.append("fn"), 3, after=lambda: calls.append("after"))
    assert calls == ["fn", "after"] * 4 and t >= 0


def test_every_policy_says_what_acceptance_it_has_seen():
    """A batched step reads each row's acceptance through the one Policy method; a policy
    that keeps no estimate says so (None) instead of the engine special-casing classes."""
    from specdec.policy import OptimalPolicy, Policy, RoundOutcome

    assert Policy(3).acceptance() is None
    optimal = OptimalPolicy(3)
    before = optimal.acceptance()
    for _ in range(20):
        optimal.observe(RoundOutcome(4, 0, 0.01, 0.1, 4, "x"))
    assert optimal.acceptance() < before


def test_a_prophets_own_chain_costs_in_a_tree():
    """Costs.alone: a tree's costs (width 2: every prophet's chain in the pass) as one prophet's
    chain weighs it, cached; width-1 costs are themselves."""
    tree = Costs(1.0, {1: 1.0, 3: 1.2, 5: 1.6, 9: 2.4}, 0.05, width=2)
    assert tree.round_time(2) == pytest.approx(2 * 0.05 + 1.6)
    assert tree.alone().round_time(2) == pytest.approx(2 * 0.05 + 1.2) and tree.alone() is tree.alone()
    assert tree.alone().alone() is tree.alone()


def test_a_trees_chains_pass_a_pause_once_a_round():
    """Two prophets' chains of one tree round observed one by one (the second as the same round):
    a third prophet's pause counts the round once."""
    costs = Costs(1.0, {1: 1.0, 2: 1.04, 3: 1.1, 5: 1.6}, 0.05, t_draft_by={"a": 0.0, "b": 0.0, "c": 0.3})
    policy = auto(costs)
    while (k := policy.next_k("c")) > 0:  # c never pays: it pauses for 4 rounds
        policy.observe(RoundOutcome(k, 0, 0.0, 0.0, 1, "c"))
    assert policy.evidence["c"].pause == 4
    policy.observe(RoundOutcome(2, 2, 0.0, 0.0, 0, "a"))
    policy.observe(RoundOutcome(2, 1, 0.0, 0.0, 0, "b", same_round=True))
    assert policy.evidence["c"].pause == 3
    assert policy.acceptance("a") > policy.acceptance("b")


def test_a_prophet_that_never_pays_is_probed_once_per_pause_at_the_cheapest_k_and_pauses_double():
    """The default must not lose to plain decoding: a prophet whose drafts are never accepted
    costs a few cheap probes, each pause twice as long as the last (it was stuck at 4 rounds
    when one probe from the prior reset the back-off)."""
    policy = auto(STEP_CURVE, k=8)
    trace = []
    for _ in range(200):
        k = policy.next_k("eagle")
        trace.append(k)
        policy.observe(RoundOutcome(k, 0, 0.0, 0.0, k, "eagle") if k else plain_round())
    pauses = [len(run) for run in "".join("p" if k == 0 else "|" for k in trace).split("|") if run]
    assert pauses[:5] == [4, 8, 16, 32, 64]
    first_pause = trace.index(0)
    assert all(k == 1 for k in trace[first_pause:] if k)  # every probe after the first try: K = 1
    # what the wasted drafts cost: each round yields one token; a plain round costs one step
    cost = sum(STEP_CURVE.round_time(k) if k else 1.0 for k in trace)
    assert len(trace) / cost > 0.97


def test_a_probe_that_pays_brings_the_prophet_back():
    policy = auto(STEP_CURVE, k=4)
    for _ in range(3):
        k = policy.next_k("eagle")
        policy.observe(RoundOutcome(k, 0, 0.0, 0.0, k, "eagle") if k else plain_round())
    while policy.next_k("eagle") == 0:
        policy.observe(plain_round())
    for _ in range(6):  # the text turns predictable: every draft accepted
        k = policy.next_k("eagle")
        policy.observe(RoundOutcome(k, k, 0.0, 0.0, k, "eagle") if k else plain_round())
    assert policy.next_k("eagle") >= 2 and policy.evidence["eagle"].backoff == 4


def test_step_costs_are_the_fastest_of_interleaved_repeats_and_the_verify_curve_never_falls():
    from specdec.costmodel import interleaved_times, monotone

    calls = []
    times = {1: iter([9.0, 0.5, 0.2, 0.7]), 2: iter([9.0, 0.3, 0.9, 0.4])}  # the first call of each is the warm-up
    clock = [0.0]

    def timed(key):
        def fn():
            calls.append(key)
            clock[0] += next(times[key])
        return fn

    import specdec.costmodel as cm

    real = cm.time.perf_counter
    cm.time.perf_counter = lambda: clock[0]
    try:
        timings = interleaved_times({1: timed(1), 2: timed(2)}, 3, after=lambda: calls.append("after"))
        best = {key: min(ts) for key, ts in timings.items()}
    finally:
        cm.time.perf_counter = real
    assert calls == [1, "after", 2, "after"] * 4  # taken in turn, `after` after every call
    assert best == pytest.approx({1: 0.2, 2: 0.3})
    assert monotone({1: 1.0, 2: 1.8, 3: 1.4, 5: 1.3, 6: 2.0}) == {1: 1.0, 2: 1.8, 3: 1.8, 5: 1.8, 6: 2.0}


def test_costs_at_a_context_weigh_the_short_and_long_measurements_and_round_trip():
    """Costs.at: the short measurement up to its context, the long one past its own, linear
    between (in buckets of 64 tokens), the verification curve still rising; for_params picks
    the sampled measurement, which keeps its own long one; to_dict/from_dict keep all four."""
    short = Costs(1.0, {1: 1.0, 2: 1.1, 3: 1.2}, 0.1, t_draft_by={"e": 0.1}, t_call_by={"e": 0.2}, context=64)
    long = Costs(2.0, {1: 2.0, 2: 2.6, 3: 3.0}, 0.3, t_draft_by={"e": 0.3}, t_call_by={"e": 0.4}, context=1088)
    short.long = long
    short.sampled = Costs(1.5, {1: 1.5, 2: 1.8, 3: 2.0}, 0.2, context=64,
                          long=Costs(2.5, {1: 2.5, 2: 3.5, 3: 4.0}, 0.4, context=1088))
    assert short.at(10) is short and short.at(64) is short and short.at(5000) is long
    mid = short.at(576)  # halfway
    assert mid is short.at(540)  # same bucket, same object: a request's choices depend on its length only
    assert mid.t_plain == pytest.approx(1.5) and mid.t_verify[2] == pytest.approx(1.85)
    assert mid.t_draft_by["e"] == pytest.approx(0.2) and mid.t_call_by["e"] == pytest.approx(0.3)
    assert list(mid.t_verify.values()) == sorted(mid.t_verify.values())
    sampled = short.for_params(greedy=False)
    assert sampled is short.sampled and short.for_params(greedy=True) is short
    assert sampled.at(5000).t_plain == 2.5
    again = Costs.from_dict(short.to_dict())
    assert again == short and again.sampled == short.sampled and again.long == long
    assert again.sampled is not None and again.sampled.long == short.sampled.long
    # a drafting call's fixed cost is paid once per round, not per token, and not by a plain step
    assert short.round_time(0, "e") == short.verify_time(1)
    assert short.round_time(2, "e") == pytest.approx(2 * 0.1 + 0.2 + short.verify_time(3))


def test_calibrate_times_the_one_loop_greedy_and_sampled_at_a_short_and_a_long_context(tiny_pair, tiny_eagle):
    """The decoder's costs come from its own engine (every prophet's round as the loop runs it),
    at two contexts and two temperatures, and leave every slot of the engine free."""
    from specdec import load

    decoder = load(tiny_pair["target"], draft=f"ngram+{tiny_eagle}", draft_tokens=3)
    costs = decoder.calibrate(n_context=16, repeats=2, long_context=64)
    assert costs.context == 16 and costs.long is not None and costs.long.context == 64
    assert costs.sampled is not None and costs.sampled.context == 16 and costs.sampled.long is costs.long.sampled
    names = {d.name for d in decoder.prophets}
    for c in (costs, costs.long, costs.sampled, costs.long.sampled):
        assert set(c.t_draft_by) == names and set(c.t_call_by) == names
        assert min(c.t_draft_by.values()) >= 0 and min(c.t_call_by.values()) >= 0
        assert sorted(c.t_verify) == [1, 2, 3, 4] and list(c.t_verify.values()) == sorted(c.t_verify.values())
    engine = decoder._one_loop()
    assert sorted(engine.slots.free) == list(range(engine.target.slots))  # the placeholder rows left
    assert Costs.from_dict(costs.to_dict()) == costs


# SmolLM2 int4's stored costs at temperature 1 on an AVX-512 CPU (verification in plain steps)
SMOLLM2_T1 = Costs(t_plain=1.0, t_verify={1: 1.0, 2: 1.18, 3: 1.36, 4: 1.56, 5: 2.66}, t_draft=0.1)


def test_a_sampled_request_starts_from_a_lower_prior():
    """Drafts are accepted less often when the target samples, so a request at temperature 1
    starts from prior_a_sampled (0.4) and its first K is the one that prior pays for; greedy
    keeps prior_a (0.6); in between, linearly. A later greedy request is not affected."""
    policy = auto(SMOLLM2_T1)
    first_k = {}
    for t in (0.0, 0.5, 1.0, 1.5, 0.0):
        policy.reset(None, t)
        assert abs(policy.acceptance() - {0.0: 0.6, 0.5: 0.5, 1.0: 0.4, 1.5: 0.4}[t]) < 1e-12
        first_k[t] = policy.next_k()
        assert first_k[t] == SMOLLM2_T1.best_k(policy.acceptance(), policy.k_max, "*")[0]
    assert first_k[1.0] < first_k[0.0]  # fewer tokens drafted before any evidence when sampling


def test_a_request_carries_its_temperature_to_its_policy():
    from specdec.request import Request
    from specdec.sampling import SamplingParams

    policy = auto(STEP_CURVE)
    Request([1, 2, 3], 8, SamplingParams(1.0), 4, policy=policy)
    assert abs(policy.acceptance() - 0.4) < 1e-12
    Request([1, 2, 3], 8, SamplingParams(0.0), 4, policy=policy)
    assert abs(policy.acceptance() - 0.6) < 1e-12


def test_a_sampled_request_keeps_a_paused_prophets_evidence_whole():
    """After a pause a greedy request weighs what the prophet showed by resume_weight (0.5);
    a request at temperature 1 keeps all of it (resume_weight_sampled), so one lucky probe
    does not restart drafting that did not pay."""
    def after_pause(temperature):
        policy = auto(EXPENSIVE, min_rounds=2)
        policy.reset(None, temperature)
        for _ in range(2):
            policy.observe(drafted_round(policy.next_k(), 0))
        before = policy._of(None).tested
        while policy.next_k() == 0:
            policy.observe(plain_round())
        return policy._of(None).tested / before

    assert abs(after_pause(0.0) - 0.5) < 1e-12
    assert abs(after_pause(1.0) - 1.0) < 1e-12
    assert abs(after_pause(0.5) - 0.75) < 1e-12
