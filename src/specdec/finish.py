"""Finishing a request, written once for every path (`generate`/`stream`, `generate_many`'s
batched rows and the server's): stop strings cut the answer, text is released round by
round, and the answer's final text.

A `Finish` belongs to one request. After each round has appended its tokens to the
request's generated ids (EOS, the length and the context are the loop's, see
`events.finish_reason`), the loop calls:
- `cut(generated, before)`: where a stop string now appears in the answer's text, the
  number of tokens to keep (the fewest whose text reaches the end of that stop string);
  the loop deletes the rest and the request finishes with "stop". None when none appears.
- `release(generated, finished)`: the text a stream may show now, never a half-decoded
  UTF-8 character, and never text that a stop string could still cut away.
- `final_text(generated)`: the whole answer, ending where the stop string began.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.text import INCOMPLETE, IncrementalText


def check_stops(stop: str | Sequence[str] | None, tokenizer: Any) -> tuple[str, ...]:
    """A request's stop strings, checked: one string, a list of them, or None (none)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    if stops and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    return stops


class Finish:
    """One request's stop strings and the text it has released (see the module's docstring)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.text = IncrementalText(tokenizer) if tokenizer is not None else None
        self.stop_at: int | None = None  # the character where a stop string begins, once one has
        self.sent = 0  # characters of text released so far
        self._decoded = 0  # characters of the text after the previous round (where the stop search resumes)

    def cut(self, generated: Sequence[int], before: int) -> int | None:
        """After a round appended generated[before:]: how many of the generated tokens to keep
        if a stop string appears in the answer's text now (None: none appears)."""
        if not self.stop or self.text is None or self.stop_at is not None:
            return None
        text = self.text(generated)
        # Resume where the last round's text ended, less a stop string's length and the few
        # characters an incomplete UTF-8 tail may have shown as U+FFFD.
        search_from = max(0, self._decoded - max(len(s) for s in self.stop) - 4)
        self._decoded = len(text)
        hits = [(pos, s) for s in self.stop if (pos := text.find(s, search_from)) >= 0]
        if not hits:
            return None
        pos, s = min(hits)
        self.stop_at = pos
        for j in range(before + 1, len(generated) + 1):
            if len(self.text.decode(generated[:j])) >= pos + len(s):
                return j
        return len(generated)

    def final_text(self, generated: Sequence[int]) -> str:
        if self.text is None:
            return ""
        text = self.text(generated)
        return text[: self.stop_at] if self.stop_at is not None else text

    def release(self, generated: Sequence[int], finished: bool) -> str:
        """The text to show after this round that was not shown before."""
        if self.text is None:
            return ""
        text = self.final_text(generated)
        if not finished:
            text = text.rstrip(INCOMPLETE)
            if self.stop:
                text = text[: max(self.sent, len(text) - max(len(s) for s in self.stop) + 1)]
        delta = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return delta
