"""Log probabilities in OpenAI's two response shapes: a chat choice's ``logprobs.content`` (one
entry per token, with its text, UTF-8 bytes and the likeliest alternatives) and a completion
choice's ``logprobs`` (parallel lists: tokens, token_logprobs, top_logprobs, text_offset)."""
from __future__ import annotations

import functools
import re

from tandem.engine.messages import TokenLogprobs

FLOOR = -9999.0          # what a token the model rules out (-inf) is shown as: JSON has no infinity
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


class TokenText:
    """Each token id's text and bytes as a log-probability entry shows them. The text is the token
    decoded alone (special tokens included); the bytes are the token's own, so a character split
    over several tokens can be put together again from them (its text alone shows U+FFFD)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self._cache.get(tid)
        if got is None:
            got = self._cache[tid] = self._lookup(tid)
        return got

    def _lookup(self, tid: int) -> tuple[str, list[int]]:
        if self.tok is None:
            text = f"token_id:{tid}"
            return text, list(text.encode())
        text = self.tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        piece = self.tok.convert_ids_to_tokens(tid) or ""
        raw = _BYTE_TOKEN.fullmatch(piece)
        if raw:
            return text, [int(raw.group(1), 16)]
        table = _byte_level_map()
        if piece and all(c in table for c in piece):
            return text, [table[c] for c in piece]
        return text, list(text.encode())


def _value(x: float) -> float:
    return max(x, FLOOR)


def chat_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs]) -> dict:
    """A chat choice's (or chunk's) ``logprobs`` for tokens ``ids``."""
    def entry(tid: int, lp: float) -> dict:
        s, b = text_of(tid)
        return {"token": s, "logprob": _value(lp), "bytes": b}
    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(a, v) for a, v in
                                                                 zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(ids, lps, strict=True)]}


def completion_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None],
                        offset: int) -> tuple[dict, int]:
    """A completion choice's (or chunk's) ``logprobs`` for tokens ``ids``, whose text starts at
    character ``offset`` of the choice's text; and the offset after them. Each position's
    ``top_logprobs`` holds the likeliest tokens asked for and the sampled one (OpenAI's and vLLM's
    legacy shape: up to logprobs + 1 entries). An echoed prompt's first token has no log
    probability (None: nothing comes before it)."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, lps, strict=True):
        s, _ = text_of(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(lp.logprob))
        top = {text_of(a)[0]: _value(v) for a, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(s, _value(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def prompt_logprobs_json(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None], k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None for the first (nothing comes before it),
    then {token id (a string): {"logprob", "rank", "decoded_token"}} for the token itself and the
    ``k`` likeliest (ranks 1 to k)."""
    def entry(tid: int, lp: float, rank: int) -> dict:
        return {"logprob": _value(lp), "rank": rank, "decoded_token": text_of(tid)[0]}
    out = []
    for tid, lp in zip(ids, lps, strict=True):
        if lp is None:
            out.append(None)
            continue
        at = {str(tid): entry(tid, lp.logprob, lp.rank)}
        for rank, (a, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), 1):
            at.setdefault(str(a), entry(a, v, rank))
        out.append(at)
    return out
