"""The text of a growing list of token ids, decoding only its newest tokens.

A stream releases text after every round. Decoding the whole answer each time costs
O(n) per round and O(n^2) per request; `IncrementalText` keeps the text of the ids it
has already read and decodes only a short window: ids[prefix:] and ids[prefix:read],
whose difference is the new text. The window starts at the previous chunk, so the
tokenizer sees the context it needs at the boundary (a word's leading space, the bytes
of a character split across tokens). The result always equals decoding the ids whole
(tested on real tokenizers); where a window's text is not a prefix of the next one, it
falls back to decoding them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"  # what a tokenizer shows for the bytes of a character not yet complete


class IncrementalText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._reset()

    def _reset(self) -> None:
        self._seen: list[int] = []  # ids[:read] of the last call
        self._text = ""  # the text of ids[:read]
        self._prefix = 0  # where the decoding window starts (ids before it are settled)
        self._read = 0  # ids whose text is in _text
        self._last: tuple[list[int], str] = ([], "")  # the last call's ids and answer (asked twice a round)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def __call__(self, ids: Sequence[int]) -> str:
        """The text of ids, equal to decoding them whole; it may end with U+FFFD while a
        character's bytes are incomplete. ids usually extend the previous call's; anything
        else starts over."""
        ids = list(ids)
        if ids == self._last[0]:
            return self._last[1]
        text = self._text_of(ids)
        self._last = (ids, text)
        return text

    def _text_of(self, ids: list[int]) -> str:
        if ids[: self._read] != self._seen:
            self._reset()  # ids were cut or replaced
        before = self.decode(ids[self._prefix : self._read])
        window = self.decode(ids[self._prefix :])
        if not window.startswith(before):
            return self.decode(ids)
        new = window[len(before) :]
        if new and not new.endswith(INCOMPLETE) and len(ids) > self._read:  # complete: settle it
            self._text += new
            self._prefix, self._read = self._read, len(ids)
            self._seen = ids
            return self._text
        return self._text + new
