"""Log probabilities in OpenAI's two response shapes: a chat choice's ``logprobs.content`` (one
entry per token, with its text, UTF-8 bytes and the likeliest alternatives) and a completion
choice's ``logprobs`` (parallel lists: tokens, token_logprobs, top_logprobs, text_offset)."""
from __future__ import annotations

import codecs

from tandem.engine.messages import TokenLogprobs
from tandem.sched.detok import REPLACEMENT, Decoder, IncrementalDetokenizer, TokenBytes, decoded_token

FLOOR = -9999.0          # what a token the model rules out (-inf) is shown as: JSON has no infinity


class TokenText:
    """Each token id's text and bytes as a log-probability entry shows them. The text is the token
    decoded alone (special tokens included); the bytes are the token's own, so a character split
    over several tokens can be put together again from them (its text alone shows U+FFFD).
    Without a tokenizer each token is named ``token_id:<id>``."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._alone: dict[int, str | None] = {}
        fast = getattr(tokenizer, "_tokenizer", None)      # the Rust tokenizer directly: faster
        self._decode = None if tokenizer is None else fast.decode if fast is not None else tokenizer.decode
        self._bytes = None if tokenizer is None else TokenBytes(tokenizer)
        self.decoder = Decoder(self.decode, self.own_bytes)
        # a byte-level BPE vocabulary decodes ids as their tokens' bytes joined (the Rust decode
        # cleans no spaces): a sequence's pieces then follow from those bytes alone (``Pieces``)
        self.byte_level = type(getattr(fast, "decoder", None)).__name__ == "ByteLevel"

    def decode(self, ids: list[int]) -> str:
        """The ids' text, special tokens included."""
        if self._decode is None:
            return "".join(self(t)[0] for t in ids)
        return self._decode(ids, skip_special_tokens=False)

    def alone(self, tid: int) -> str | None:
        """The text the token's own bytes make alone, None where they are no whole characters (or
        end in U+FFFD): what it adds to a byte-level text with nothing held back."""
        if tid not in self._alone:
            try:
                text = self.own_bytes(tid).decode()
                self._alone[tid] = None if text.endswith(REPLACEMENT) else text
            except UnicodeDecodeError:
                self._alone[tid] = None
        return self._alone[tid]

    def own_bytes(self, tid: int) -> bytes:
        """The token's own bytes (``TokenBytes``; without a tokenizer, those of its name)."""
        return self._bytes(tid) if self._bytes is not None else self(tid)[0].encode()

    def spelled(self, tid: int) -> str:
        """The token as OpenAI's log probabilities spell it: its text, where its bytes are whole
        characters; else its bytes, each one that is no part of a whole character as ``\\xNN``."""
        text, raw = self(tid)
        return bytes(raw).decode("utf-8", "backslashreplace") if REPLACEMENT in text else text

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self._cache.get(tid)
        if got is None:
            got = self._cache[tid] = self._lookup(tid)
        return got

    def _lookup(self, tid: int) -> tuple[str, list[int]]:
        if self.tok is None:
            text = f"token_id:{tid}"
            return text, list(text.encode())
        return self.tok.decode([tid], skip_special_tokens=False), list(self._bytes(tid))


class Pieces:
    """What each token of one sequence (a prompt, or a choice's output) adds to its text, token by
    token, as vLLM shows a completion's tokens: a token that ends inside a character adds nothing,
    and the one that completes it adds the whole character (with what came before it since the
    last whole one), so the pieces join to the sequence's text (special tokens' text included).

    For a byte-level vocabulary the pieces are the tokens' own bytes through an incremental
    UTF-8 decoder (a few microseconds a token, on the event loop); for others, the tokenizer's
    decode of a sliding window (``IncrementalDetokenizer``), several decodes a token."""

    def __init__(self, text_of: TokenText):
        self.text_of = text_of
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if text_of.byte_level else None
        self.detok = None if text_of.byte_level else IncrementalDetokenizer(text_of.decoder)
        self.held = ""        # byte-level: text held back (the decode ends in U+FFFD, or inside a character)

    def add(self, tid: int, others: list[int]) -> tuple[str, list[str]]:
        """``tid``'s piece, and for each of ``others`` the piece it would have been in its place;
        one that would end inside a character too is spelled as OpenAI spells such tokens,
        ``bytes:`` and its own bytes (a piece of "" could not tell them apart)."""
        would = self.detok.would_add(others) if self.utf8 is None else [self._would_add(a) for a in others]
        alts = [f"bytes:{self.text_of.spelled(a)}" if p is None else p for a, p in zip(others, would)]
        if self.utf8 is None:
            return self.detok.push([tid]), alts
        if not self.held and not self.utf8.getstate()[0]:
            alone = self.text_of.alone(tid)
            if alone is not None:
                return alone, alts
        piece = self.held + self.utf8.decode(self._bytes(tid))
        self.held = piece if self.utf8.getstate()[0] or piece.endswith(REPLACEMENT) else ""
        return ("" if self.held or self.utf8.getstate()[0] else piece), alts

    def _bytes(self, tid: int) -> bytes:
        return self.text_of.own_bytes(tid)

    def _would_add(self, tid: int) -> str | None:
        """What ``tid`` would add in place of the next token: None where it ends inside a character."""
        if not self.held and not self.utf8.getstate()[0]:      # nothing held back: its bytes alone
            return self.text_of.alone(tid)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.setstate(self.utf8.getstate())
        piece = self.held + utf8.decode(self._bytes(tid))
        return None if utf8.getstate()[0] or piece.endswith(REPLACEMENT) else piece

    def end(self) -> str:
        """What the last token adds once the sequence has ended (the text held back till then),
        less a character the sequence leaves incomplete."""
        if self.utf8 is None:
            return self.detok.flush()
        self.utf8.reset()
        held, self.held = self.held, ""
        return held


def _value(x: float) -> float:
    return max(x, FLOOR)


def chat_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs]) -> dict:
    """A chat choice's (or chunk's) ``logprobs`` for tokens ``ids``: each token spelled as OpenAI
    spells it (``TokenText.spelled``), with its own UTF-8 bytes."""
    def entry(tid: int, lp: float) -> dict:
        return {"token": text_of.spelled(tid), "logprob": _value(lp), "bytes": text_of(tid)[1]}
    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(a, v) for a, v in
                                                                 zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(ids, lps, strict=True)]}


def completion_logprobs(pieces: Pieces, ids: list[int], lps: list[TokenLogprobs | None], offset: int,
                        ends: bool) -> tuple[dict, int]:
    """A completion choice's (or chunk's) ``logprobs`` for tokens ``ids``, whose text starts at
    character ``offset`` of the choice's text; and the offset after them. Each token is the
    piece it adds to the text (``Pieces``: its sequence's, which ``ends`` with the last of
    ``ids``), so the tokens join to the text and each offset is where its piece begins. Each
    position's ``top_logprobs`` holds the likeliest tokens asked for and the sampled one (OpenAI's
    and vLLM's legacy shape: up to logprobs + 1 entries), each as the piece it would have added.
    An echoed prompt's first token has no log probability (None: nothing comes before it)."""
    tokens, values, tops, offsets = [], [], [], []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        others = [] if lp is None else [a for a in lp.top_ids if a != tid]
        s, alts = pieces.add(tid, others)
        if ends and i == len(ids) - 1:
            s += pieces.end()
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(lp.logprob))
        named = dict(zip(others, alts)) | {tid: s}
        top = {named[a]: _value(v) for a, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(s, _value(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def prompt_logprobs_json(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None], k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None for the first (nothing comes before it),
    then {token id (a string): {"logprob", "rank", "decoded_token"}} for the token itself and the
    ``k`` likeliest (ranks 1 to k). A token that is part of a character shows the character it
    completes after the prompt tokens before it, or "" (``decoded_token``: vLLM's correction;
    the first prompt token, which has no entry, is no context)."""
    def entry(tid: int, lp: float, rank: int, pos: int) -> dict:
        text = decoded_token(tid, ids, pos, 1, text_of.decode, lambda t: text_of(t)[0])
        return {"logprob": _value(lp), "rank": rank, "decoded_token": text}
    out = []
    for pos, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        if lp is None:
            out.append(None)
            continue
        at = {str(tid): entry(tid, lp.logprob, lp.rank, pos)}
        for rank, (a, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), 1):
            at.setdefault(str(a), entry(a, v, rank, pos))
        out.append(at)
    return out
