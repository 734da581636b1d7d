"""Where requests' predicted output lengths come from, and where real lengths go back.

A source is either the length predictor (predictor/: retrieval over past prompts, taught
every naturally finished request's real length) or ``"max_tokens"``: each request's own
max_tokens taken as its length (an oracle when, as in benchmarks, max_tokens is the
length to generate; an upper bound otherwise). The predictor embeds prompts on the
calling thread with one torch thread, so it never competes with the workers for cores
beyond the one the server already uses.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from tandem.sched.actor import Update
from tandem.sched.request import FinishReason, Request

MAX_TOKENS = "max_tokens"
_MAX_PENDING = 100_000


# a user turn of the ChatML (SmolLM2, Qwen) and Llama 3 chat templates, spelled out in a prompt
USER_TURNS = (re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", re.S),
              re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\s*(.*?)(?:<\|eot_id\|>|$)", re.S))


def last_user_turn(text: str) -> str:
    """The last user message of a prompt that spells out a chat template; else the text itself."""
    for pattern in USER_TURNS:
        turns = pattern.findall(text)
        if turns:
            return turns[-1]
    return text


def prediction_text(prompt: Any, detokenize=None) -> str:
    """The text a prediction reads: a chat's last user message (the template's system text would
    only fill the encoder's few tokens), also when a completion prompt (text or token ids) spells
    the template out; else the prompt as given, or its decoded token ids."""
    if isinstance(prompt, str):
        return last_user_turn(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        users = [m for m in prompt if m.get("role") == "user"] or prompt
        content = users[-1].get("content") or ""
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    if isinstance(prompt, list) and prompt and detokenize is not None:
        return last_user_turn(detokenize(prompt))
    return ""


class LengthSource:
    """``cap``: a prediction never exceeds the request's max_tokens (right for users; benchmarks
    that fix each reply's length through max_tokens turn it off, or the cap tells the predictor
    every over-estimate's answer). ``max_learned``: real lengths a predictor it loads keeps
    beyond its trained ones (None: the predictor's default)."""

    def __init__(self, source: "str | Path | Any | None", cap: bool = True, max_learned: int | None = None):
        self.predictor = None
        self.cap = cap
        if source != MAX_TOKENS:
            from tandem.predictor import LengthPredictor
            if isinstance(source, LengthPredictor):
                self.predictor = source
            else:
                try:
                    self.predictor = LengthPredictor.load(source, max_learned)
                except FileNotFoundError as e:
                    raise ValueError(f"length_predictor: {e}") from None
            import torch
            torch.set_num_threads(1)
            # the sentence encoder loads and runs once now: the first request paid about a second
            # for it on a CPU core (a chat's whole TTFT target)
            self.predictor.encode(["Hello"])
        self._lock = threading.Lock()
        self._pending: dict[str, list] = {}    # req_id -> [vector, tokens so far, ignore_eos]
        self.predicted = 0
        self.retrieved = 0
        self.learned = 0                        # real lengths added to the predictor
        self.errors: list[tuple[int, int]] = []   # (predicted, real) of finished requests, drained by metrics

    @property
    def name(self) -> str:
        return MAX_TOKENS if self.predictor is None else "predictor"

    def assign(self, reqs: list[Request], texts: list[str]) -> None:
        """Set each request's predicted_len (capped by its max_tokens)."""
        if self.predictor is None:
            for r in reqs:
                r.predicted_len = r.sampling.max_tokens
            return
        # one prediction per distinct text: n choices of a prompt are n requests
        distinct = list(dict.fromkeys(texts))
        row = {t: i for i, t in enumerate(distinct)}
        distinct_vecs = self.predictor.encode(distinct)
        distinct_preds = self.predictor.predict_vectors(distinct_vecs, distinct)
        vecs = [distinct_vecs[row[t]] for t in texts]
        preds = [distinct_preds[row[t]] for t in texts]
        with self._lock:
            for r, p, v in zip(reqs, preds, vecs):
                cap = r.sampling.max_tokens if self.cap else None
                r.predicted_len = p.length if cap is None else min(p.length, cap)
                r.predicted_spread = p.spread if cap is None else tuple(min(x, cap) for x in p.spread)
                if len(self._pending) < _MAX_PENDING:
                    self._pending[r.req_id] = [v, 0, r.sampling.ignore_eos, r.predicted_len]
                self.predicted += 1
                self.retrieved += p.retrieved

    def forget(self, req_ids: list[str]) -> None:
        """Requests predicted for that will never run (their client left, or they were refused):
        nothing to learn from them."""
        with self._lock:
            for rid in req_ids:
                self._pending.pop(rid, None)

    def drain(self) -> list[tuple[int, int]]:
        """(predicted, real) of the requests learned from since the last call."""
        with self._lock:
            out, self.errors = self.errors, []
        return out

    def observe(self, updates: list[Update]) -> None:
        """Count tokens; a request that ended by itself teaches the predictor its real length
        (one cut off by max_tokens did not show it, unless it was told to ignore EOS)."""
        if self.predictor is None or not self._pending:
            return
        done = []
        with self._lock:
            for u in updates:
                rec = self._pending.get(u.req_id)
                if rec is None:
                    continue
                rec[1] += len(u.new_token_ids)
                if u.finish_reason is not None:
                    del self._pending[u.req_id]
                    if u.finish_reason is FinishReason.STOP or (u.finish_reason is FinishReason.LENGTH and rec[2]):
                        done.append(rec)
            self.errors += [(rec[3], rec[1]) for rec in done]
            del self.errors[:-10_000]
        if done:
            import numpy as np
            self.predictor.add(np.stack([r[0] for r in done]), [r[1] for r in done])
            self.learned += len(done)
