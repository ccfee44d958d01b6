"""The auto policy: plain steps while the measured costs and this request's acceptance
predict no gain, drafting again after a pause; nothing carries over between requests."""

from specdec.costmodel import Costs
from specdec.policy import AdaptivePolicy, AutoPolicy, RoundOutcome


def drafted_round(k, accepted):
    return RoundOutcome(drafted=k, accepted=accepted, draft_s=0.0, target_s=0.0, draft_calls=k)


def plain_round():
    return RoundOutcome(drafted=0, accepted=0, draft_s=0.0, target_s=0.0, draft_calls=0)


def test_auto_pauses_when_drafting_cannot_pay_and_tries_again():
    policy = AutoPolicy(4, min_rounds=4)
    policy.costs = Costs(t_plain=1.0, t_round=2.0, k=4)  # a round of 4 drafts costs two plain steps
    policy.reset()
    for _ in range(4):
        assert policy.next_k() == 4
        policy.observe(drafted_round(4, 0))  # 1 token per round < 2: predicted gain 0.5
    assert policy.gains[-1] == 0.5
    for _ in range(4):  # the first pause: 4 plain steps
        assert policy.next_k() == 0
        policy.observe(plain_round())
    assert policy.next_k() == 4  # then it drafts again
    for _ in range(4):
        policy.observe(drafted_round(4, 0))
    paused = 0
    while policy.next_k() == 0:
        policy.observe(plain_round())
        paused += 1
    assert paused == 8  # the pause doubles


def test_auto_keeps_drafting_when_it_pays():
    policy = AutoPolicy(4, min_rounds=4)
    policy.costs = Costs(t_plain=1.0, t_round=1.2, k=4)
    policy.reset()
    for _ in range(20):
        assert policy.next_k() == 4
        policy.observe(drafted_round(4, 3))  # 4 tokens per round: gain 3.3
    assert min(policy.gains) > 3


def test_nothing_carries_over_between_requests():
    policy = AdaptivePolicy(3)
    for _ in range(3):
        policy.observe(drafted_round(policy.k, policy.k))  # fully accepted: K grows
    assert policy.k > 3
    policy.reset(5)  # a request with its own K
    assert policy.k == 5
    policy.reset()  # the next request without one: the decoder's K, not the last request's
    assert policy.k == 3
    auto = AutoPolicy(4)
    auto.costs = Costs(1.0, 2.0, 4)
    auto.reset()
    for _ in range(4):
        auto.observe(drafted_round(4, 0))
    assert auto.next_k() == 0
    auto.reset()
    assert auto.next_k() == 4 and auto.gains == []
