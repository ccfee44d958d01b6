"""What one round of the engine did: the single record from which text, stats and
pictures are all derived. Times are seconds relative to the start of the generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RoundEvent:
    index: int
    prophet: str | None  # who drafted this round; None for a plain decoding step
    # K of the round: the tokens drafted after the step's cuts (policy, length, context, the
    # step's common K); for a tree, the longest prophet's chain
    k: int
    drafted: list[int]  # proposed tokens (for a tree: the accepted path)
    accepted: int  # how many drafted tokens the verifier accepted (a prefix; see accepted_out)
    next_token: int  # the recovered or bonus token that ends the round
    next_kind: str  # "recovered" or "bonus"
    committed: list[int]  # tokens appended to the output this round, after stop cuts
    draft_calls: int  # prophet forward passes this round
    target_calls: int  # target forward passes this round (1)
    start: float
    end: float
    draft_spans: list[tuple[float, float]] = field(default_factory=list)
    target_span: tuple[float, float] = (0.0, 0.0)
    tree_size: int = 0  # nodes scored in a token tree (several prophets' chains, or an eagle's grown tree)
    accepted_by: list[str] = field(default_factory=list)  # prophet of each accepted token
    proposals: dict[str, int] = field(default_factory=dict)  # tokens proposed per prophet
    text: str = ""  # text released to a stream this round
    finish_reason: str | None = None
    # leading committed tokens the request's grammar forced (specdec.grammar: one token allowed,
    # so no draft and no pass); a round that ended inside them has next_kind "forced", no pass
    forced: int = 0

    @property
    def accepted_out(self) -> int:
        """Accepted drafted tokens that reached the output, the round's closing token aside:
        `accepted`, unless EOS, a stop string or the length cut the round inside its accepted
        run; then the last token that reached the output closes the round (`cut`), and the
        tokens the cut threw away count nowhere. forced + accepted_out + 1 == len(committed)
        (forced == len(committed) in a round that ended inside its forced tokens)."""
        return min(self.accepted, max(len(self.committed) - self.forced - 1, 0))

    @property
    def closing_kind(self) -> str:
        """How the round's last output token came: "recovered" or "bonus" (the target's
        token), "cut" (an accepted drafted token after which the output ended), or "forced"
        (the output ended inside the tokens its grammar forced, before any pass)."""
        if self.next_kind == "forced":
            return "forced"
        return self.next_kind if len(self.committed) - self.forced > self.accepted else "cut"

    @property
    def draft_s(self) -> float:
        return sum(b - a for a, b in self.draft_spans)

    @property
    def target_s(self) -> float:
        return self.target_span[1] - self.target_span[0]

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(draft_s=self.draft_s, target_s=self.target_s, wall_s=self.wall_s)
        return d


def finish_reason(token: int, n_generated: int, n_context: int, eos_token_ids: set[int], max_new_tokens: int,
                  max_length: int) -> str | None:
    """Why a generation ends after appending `token` (checked token by token as a round's
    tokens are committed): "eos", "length" (max_new_tokens) or "context"; None to go on."""
    if token in eos_token_ids:
        return "eos"
    if n_generated >= max_new_tokens:
        return "length"
    if n_context >= max_length:
        return "context"
    return None
