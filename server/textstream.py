"""Incremental text for streaming: deltas that never split a UTF-8 character or leak a stop string."""
from __future__ import annotations

from typing import Callable


class TextStream:
    """Turns growing token ids into text deltas.

    Text that could still become the start of a stop string is held back
    (at most max(len(stop)) - 1 characters) until the request ends; a
    trailing replacement character (half of a multi-byte character) too.
    """

    def __init__(self, detokenize: Callable[[list[int]], str], stop: list[str]):
        self.detokenize = detokenize
        self.ids: list[int] = []
        self.sent = 0                       # characters already emitted
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.detokenize(self.ids)
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._emit(text, end)

    def finish(self, stop_text_end: int | None) -> str:
        """The rest of the text; cut where a stop string matched."""
        text = self.detokenize(self.ids)
        return self._emit(text, len(text) if stop_text_end is None else stop_text_end)

    def _emit(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta
