"""Round events -> the figures users judge a prophet by.

Terms (defined once, see verify.py): drafted = tokens proposed; accepted = drafted tokens
that passed; recovered = resampled at a rejection; bonus = sampled after a fully accepted
draft. acceptance_rate = accepted / drafted; tokens_per_round = output tokens / rounds
(the mean accepted run length + 1).

Only tokens that reached the output count. Each round's output is its accepted run and one
closing token: the recovered or bonus token, or, where EOS, a stop string or the length
ended the output inside the accepted run, the last accepted token kept (counted as `cut`;
the drafted tokens after it count nowhere). So accepted + rounds == new_tokens ==
accepted + recovered + bonus + cut, always, for an unconstrained request. Under a grammar
(specdec.grammar) a round's output starts with the tokens the grammar forced (`forced`, no
draft, no pass), and a round may end inside them (closing kind "forced"): then
forced + accepted + recovered + bonus + cut == new_tokens.

`alpha` is the per-position acceptance probability of the theory (Leviathan et al.'s
alpha): of the drafted tokens that were actually tested (those up to and including the
first rejection), the fraction accepted = accepted / (accepted + rejections). It is what
the formula (1 - alpha^(K+1)) / (1 - alpha) expects; accepted / drafted is lower, since
tokens after a rejection count as drafted but are never tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.events import RoundEvent


@dataclass
class Stats:
    rounds: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    cut: int = 0  # rounds that EOS, a stop string or the length ended inside the accepted run
    forced: int = 0  # tokens a grammar forced (specdec.grammar): no draft, no pass
    new_tokens: int = 0
    acceptance_rate: float = 0.0
    alpha: float = 0.0
    tokens_per_round: float = 0.0
    mean_accepted_run: float = 0.0
    wall_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    tokens_per_s: float = 0.0
    # accepted / proposed at draft positions 1..K: a mean can hide a collapse late in the draft
    acceptance_by_position: list[float] = field(default_factory=list)
    per_prophet: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _position_profile(events: Sequence[RoundEvent]) -> list[float]:
    proposed: list[int] = []
    accepted: list[int] = []
    for e in events:
        if e.tree_size:  # a tree has no single draft position order
            continue
        for i in range(len(e.drafted)):
            if e.closing_kind == "cut" and i >= e.accepted_out:
                break  # the closing token and what the cut threw away
            if i >= len(proposed):
                proposed.append(0)
                accepted.append(0)
            proposed[i] += 1
            accepted[i] += i < e.accepted_out
    return [a / p for a, p in zip(accepted, proposed, strict=True)]


def _per_prophet(events: Sequence[RoundEvent]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for e in events:
        for name, n in e.proposals.items():
            d = out.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0})
            d["rounds"] += 1
            d["drafted"] += n
        for name in e.accepted_by[: e.accepted_out]:
            out.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0})["accepted"] += 1
    for d in out.values():
        d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
    return out


def summarize(events: Sequence[RoundEvent]) -> Stats:
    s = Stats()
    if not events:
        return s
    s.rounds = len(events)
    for e in events:
        s.target_calls += e.target_calls
        s.draft_calls += e.draft_calls
        s.drafted += sum(e.proposals.values()) if e.proposals else len(e.drafted)
        s.accepted += e.accepted_out
        kind = e.closing_kind
        s.recovered += kind == "recovered"
        s.bonus += kind == "bonus"
        s.cut += kind == "cut"
        s.forced += e.forced
        s.new_tokens += len(e.committed)
        s.draft_s += e.draft_s
        s.target_s += e.target_s
    s.wall_s = events[-1].end - events[0].start
    s.other_s = max(0.0, s.wall_s - s.draft_s - s.target_s)
    s.acceptance_rate = s.accepted / s.drafted if s.drafted else 0.0
    rejections = sum(1 for e in events if e.closing_kind == "recovered" and (e.drafted or e.proposals))
    s.alpha = s.accepted / (s.accepted + rejections) if s.accepted + rejections else 0.0
    s.tokens_per_round = s.new_tokens / s.rounds
    s.mean_accepted_run = s.accepted / s.rounds
    s.tokens_per_s = s.new_tokens / s.wall_s if s.wall_s > 0 else 0.0
    s.acceptance_by_position = _position_profile(events)
    s.per_prophet = _per_prophet(events)
    return s
