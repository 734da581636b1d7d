"""Incremental detokenization and stop strings: O(new tokens) per token, whatever the output length.

``IncrementalDetokenizer`` decodes only a short window of ids each time (the ids since the last
point where text was safely released, plus the new ones) and releases the new characters once
they are complete: byte-level tokenizers split multi-byte characters (emoji, CJK) over several
ids, and a window that ends inside one decodes to U+FFFD, so such text is held back until the
character completes. ``TextTracker`` adds stop strings on a sliding window: a match can only end
in the new text, so only the last ``max(len(stop)) - 1`` old characters are searched again, and
the text that could still turn into a stop string is held back from the stream. A character
still incomplete when the ids end is left out of the text (``Decoder.whole``), as vLLM leaves it.
"""
from __future__ import annotations

import codecs
import functools
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
WINDOW = 6          # ids decoded before the release point: enough context for merges and spaces
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # SentencePiece's byte-fallback pieces


@functools.lru_cache(maxsize=1)
def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary writes
    for each byte -> the byte (printable bytes are themselves, the rest are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenBytes:
    """Each token id's own bytes: its text decoded alone (special tokens included), or where that
    shows U+FFFD, the token holding part of a character, the bytes its vocabulary spells
    (SentencePiece's ``<0xNN>`` pieces, byte-level BPE's alphabet), so the bytes of the tokens
    that split a character put it together again."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, bytes] = {}

    def __call__(self, tid: int) -> bytes:
        got = self._cache.get(tid)
        if got is None:
            got = self._cache[tid] = self._lookup(tid)
        return got

    def _lookup(self, tid: int) -> bytes:
        text = self.tok.decode([tid], skip_special_tokens=False)
        if REPLACEMENT not in text:
            return text.encode()
        piece = self.tok.convert_ids_to_tokens(tid) or ""
        raw = _BYTE_TOKEN.fullmatch(piece)
        if raw:
            return bytes([int(raw.group(1), 16)])
        table = _byte_level_map()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()


@dataclass(frozen=True)
class Decoder:
    """The text of token ids: ``decode``, the tokenizer's (a character the ids cut off shows as
    U+FFFD), and each token's own bytes (``TokenBytes``), which tell such a character from a
    U+FFFD that is one."""
    decode: Callable[[list[int]], str]
    token_bytes: Callable[[int], bytes]

    def __call__(self, ids: list[int]) -> str:
        return self.decode(ids)

    def whole(self, ids: list[int]) -> str:
        """The ids' text without the bytes of a character they leave incomplete at the end (their
        decode shows U+FFFD for them), as vLLM leaves them out; a U+FFFD that is a character of
        its own, or bytes no character can go on from, stay as the decode shows them."""
        text = self.decode(ids)
        if not text.endswith(REPLACEMENT):
            return text
        k, tail = 0, b""
        while k < len(ids) and (not tail or 0x80 <= tail[0] < 0xC0):   # back to where a character starts
            k += 1
            tail = (self.token_bytes(ids[-k]) if self.decode([ids[-k]]) else b"") + tail   # "": skipped
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        head = utf8.decode(tail)            # the tail's text, without the bytes of a character not yet complete
        if not utf8.getstate()[0]:
            return text
        return self.decode(ids[:len(ids) - k]) + head


def decoded_token(tid: int, ids: Sequence[int], pos: int, first: int, decode: Callable[[list[int]], str],
                  text_alone: Callable[[int], str]) -> str:
    """vLLM's ``decoded_token`` for ``tid`` at position ``pos`` of the sequence ``ids``: its text
    alone, or where that ends in U+FFFD (a piece of a character), its text decoded after the last
    1, 2, 3 or 4 tokens before it (from ``first`` on), the first decode that ends cleanly, less the
    text of the tokens before it that end cleanly alone. So the token that completes a character
    shows the whole character, and a token that completes none shows ""."""
    text = text_alone(tid)
    if not text.endswith(REPLACEMENT):
        return text
    before = list(ids[max(first, pos - 4):pos])
    for n in range(1, len(before) + 1):
        ctx = before[-n:]
        full = decode([*ctx, tid])
        if full.endswith(REPLACEMENT):
            continue
        clean = len(ctx)            # the context's own pieces of the character count as this token's
        while clean and text_alone(ctx[clean - 1]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(ctx[:clean]) if clean else ""
        return full[len(os.path.commonprefix([prefix, full])):]
    return ""


class IncrementalDetokenizer:
    """Text deltas of a growing id list; their concatenation equals ``decoder.whole(all ids)``."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.ids: list[int] = []
        self.prefix = 0          # window start: ids[prefix:read] decode to text already released
        self.read = 0            # ids before this are released

    def push(self, new_ids: list[int]) -> str:
        """Append ids; the newly complete text (may be empty while a character is incomplete)."""
        self.ids.extend(new_ids)
        done = self.decoder(self.ids[self.prefix:self.read])
        text = self.decoder(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = max(self.prefix, self.read - WINDOW), len(self.ids)
        return text[len(done):]

    def would_add(self, ids: list[int]) -> list[str | None]:
        """For each of ``ids``, what ``push([id])`` would release now, none of them pushed: None
        where it would hold the text back, the text ending inside a character."""
        done = self.decoder(self.ids[self.prefix:self.read])
        head = self.ids[self.prefix:]
        texts = [self.decoder(head + [t]) for t in ids]
        return [None if text.endswith(REPLACEMENT) else text[len(done):] for text in texts]

    def flush(self) -> str:
        """At the end: whatever is held back, less a character the ids leave incomplete."""
        done = self.decoder(self.ids[self.prefix:self.read])
        text = self.decoder.whole(self.ids[self.prefix:])
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

    def __init__(self, decoder: Decoder, stop: list[str] | tuple[str, ...] = (), include_stop: bool = False):
        self.detok = IncrementalDetokenizer(decoder)
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
