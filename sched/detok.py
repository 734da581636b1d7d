"""Incremental detokenization and stop strings: O(new tokens) per token, whatever the output length.

``IncrementalDetokenizer`` decodes only a short window of ids each time (the ids since the last
point where text was safely released, plus the new ones) and releases the new characters once
they are complete: byte-level tokenizers split multi-byte characters (emoji, CJK) over several
ids, and a window that ends inside one decodes to U+FFFD, so such text is held back until the
character completes. ``TextTracker`` adds stop strings on a sliding window: a match can only end
in the new text, so only the last ``max(len(stop)) - 1`` old characters are searched again, and
the text that could still turn into a stop string is held back from the stream.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
WINDOW = 6          # ids decoded before the release point: enough context for merges and spaces


class IncrementalDetokenizer:
    """Text deltas of a growing id list; their concatenation equals ``decode(all ids)``."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0          # window start: ids[prefix:read] decode to text already released
        self.read = 0            # ids before this are released

    def push(self, new_ids: list[int]) -> str:
        """Append ids; the newly complete text (may be empty while a character is incomplete)."""
        self.ids.extend(new_ids)
        done = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = max(self.prefix, self.read - WINDOW), len(self.ids)
        return text[len(done):]

    def would_add(self, ids: list[int]) -> list[str | None]:
        """For each of ``ids``, what ``push([id])`` would release now, none of them pushed: None
        where it would hold the text back, the text ending inside a character."""
        done = self.decode(self.ids[self.prefix:self.read])
        head = self.ids[self.prefix:]
        texts = [self.decode(head + [t]) for t in ids]
        return [None if text.endswith(REPLACEMENT) else text[len(done):] for text in texts]

    def flush(self) -> str:
        """At the end: whatever is held back (a character left incomplete decodes as U+FFFD)."""
        done = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


class TextTracker:
    """One request's text: deltas safe to stream, and where a stop string cut it (after the
    string where ``include_stop``, vLLM's include_stop_str_in_output; ``stopped`` names it).

    Only the last ``max(len(stop)) - 1`` known characters are ever held back (they could be
    the start of a stop string); a match can only end in new text, so each push searches those
    held characters plus the new ones. As in vLLM, text produced while ``check_stop`` is False
    (before ``min_tokens``) is released without being searched.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | tuple[str, ...] = (),
                 include_stop: bool = False):
        self.detok = IncrementalDetokenizer(decode)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop    # the matched stop string stays in the text
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.released: list[str] = []   # text handed out, in pieces (joined only by text())
        self.num_released = 0            # characters handed out
        self.pending = ""                # known text held back: at most ``hold`` characters
        self.stopped: str | None = None  # the stop string that matched; the text ends before it (or with it)

    def push(self, new_ids: list[int], check_stop: bool = True) -> str:
        """Add ids; the delta that can be streamed now."""
        delta = self.detok.push(new_ids)
        if not delta or self.stopped:
            return ""
        text = self.pending + delta
        if check_stop and self.stop:
            hits = [(i, -len(s), s) for s in self.stop if (i := text.find(s)) >= 0]
            if hits:            # of the matches this text completed: the first to begin (then the longest)
                at, _, self.stopped = min(hits)
                self.pending = ""
                return self._release(text[:at + (len(self.stopped) if self.include_stop else 0)])
        keep = min(self.hold, len(text))
        self.pending = text[len(text) - keep:]
        return self._release(text[:len(text) - keep])

    def finish(self) -> str:
        """The rest of the text at the end (nothing more after a stop string)."""
        if self.stopped:
            return ""
        rest, self.pending = self.pending + self.detok.flush(), ""
        return self._release(rest)

    def text(self) -> str:
        """Everything released so far (after ``finish``: the request's whole text)."""
        return "".join(self.released)

    def _release(self, s: str) -> str:
        if s:
            self.released.append(s)
            self.num_released += len(s)
        return s
