"""What a generation returns, on the ground floor: the loop, generate_many, the CLI and the
server all hand back this type, and it depends on nothing but events and stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.events import RoundEvent
from specdec.stats import Stats


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated ids only (the prompt excluded)
    prompt_ids: list[int]
    finish_reason: str  # "eos", "length", "stop" or "context"
    events: list[RoundEvent] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}
