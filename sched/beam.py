"""Beam search as vLLM serves it: each step asks the engine for one token of every live beam,
with its 2·width likeliest next tokens, and keeps the width best extensions.

A step is an ordinary one-token request whose prompt is the beam so far, so the scheduler,
the prefix cache (a beam's earlier tokens are cached blocks), placement and every policy serve
it like any request; nothing in the engine knows of beams. This module keeps the books of one
prompt's search; ``LLM.beam_search`` and the server drive the steps.

Each step's candidates are, for every live beam, its 2·width likeliest next tokens and the token
its step sampled (only ``temperature`` changes which). A candidate that is an end token (unless
``ignore_eos``) finishes; of the others the width with the highest summed log probability (each
token's log-softmax under the model, before temperature) go on. After ``max_tokens`` steps, or
once no beam is left, the finished and the live ones are ranked by their summed log
probability over ``G ** length_penalty``, G the tokens they generated (a final end token
counted), as vLLM and HF transformers rank them, and the width best are the result.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from tandem.engine.messages import TokenLogprobs
from tandem.engine.params import MAX_LOGPROBS, SamplingParams, _is_int, _is_num
from tandem.sched.request import Request

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2      # each step lists 2 x width alternatives per beam


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's names: ``beam_width`` beams kept (and returned), ``max_tokens`` steps at most; the
    output's text keeps special tokens' text unless ``skip_special_tokens``, and the server's
    token ids keep a final end token only with ``include_stop_str_in_output``."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0            # only which extra token each step samples (it competes too)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None    # vLLM's; not served here: refused when given

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        w = self.beam_width
        if not _is_int(w) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}], got {w!r}")
        if not _is_num(self.length_penalty):
            raise ValueError(f"length_penalty: must be a finite number, got {self.length_penalty!r}")
        m = self.max_tokens
        if not _is_int(m) or m <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {m!r}")
        if self.allowed_token_ids is not None:
            raise ValueError("allowed_token_ids: not supported with beam search by this server")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean")
        self.step_params(None)          # temperature, ignore_eos: as SamplingParams checks them

    def step_params(self, seed: int | None, top: int = 0) -> SamplingParams:
        """What one step asks of the engine for one beam (``top``: alternatives the caller
        reports per token, where more than the 2·width the search reads)."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=max(2 * self.beam_width, top),
                              ignore_eos=self.ignore_eos, seed=seed)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the output, a final end token included (vLLM's
    offline shape); ``logprobs`` one TokenLogprobs per output token (its log probability and
    rank, and its step's likeliest tokens)."""
    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" (ended in an end token) or "length", once a result
    stop_reason: int | None = None          # the end token that finished it
    text: str | None = None                 # filled in for results


@dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's result: the best ``beam_width`` sequences, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(cum_logprob: float, generated: int, length_penalty: float) -> float:
    """``cum_logprob / G ** length_penalty`` (G at least 1), without overflow: where G to that
    power passes a float's range the score is 0 (a huge positive penalty) or -inf."""
    try:
        scale = max(generated, 1) ** length_penalty
    except OverflowError:
        scale = math.inf
    if scale == 0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / scale


def _grown(cum: float, beam: BeamSearchSequence, token: int, lp: TokenLogprobs,
           stop: int | None = None) -> BeamSearchSequence:
    """``beam`` with ``token`` after it (finished when ``stop``, the end token, is given)."""
    return BeamSearchSequence(beam.tokens + [token], cum, beam.logprobs + [lp],
                              None if stop is None else "stop", stop)


class BeamSearch:
    """One prompt's search. ``beams``: the live ones, each the prompt of the next step's request
    (with ``params.step_params``); ``advance`` takes each one's TokenLogprobs; ``done`` says
    when ``result`` is final: after ``max_tokens`` steps, at the end of the model context, or
    with every beam finished."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_ids, room: int) -> None:
        """``room``: the tokens the model context leaves after the prompt (steps stop there)."""
        self.prompt_len = len(prompt_ids)
        self.max_steps = min(params.max_tokens, room)
        self.params, self.eos = params, frozenset(eos_ids)
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.max_steps

    def _key(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq.cum_logprob, len(seq.logprobs), self.params.length_penalty)

    def advance(self, results: list[TokenLogprobs], sampled: list[int]) -> None:
        """One step: ``results[i]`` / ``sampled[i]`` are beam i's log probabilities and the
        token its step sampled (a candidate too, as vLLM lists it beside the likeliest). Only the
        candidates kept (the finished and the width best) become sequences: copying a beam's
        tokens for each of its 2·width candidates would cost the output's length every time."""
        grown, k = [], 2 * self.params.beam_width
        for beam, lp, tok in zip(self.beams, results, sampled, strict=True):
            cands = {t: (v, r + 1) for r, (t, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]))}
            cands.setdefault(tok, (lp.logprob, lp.rank))
            for t, (v, rank) in cands.items():
                cand = (beam.cum_logprob + v, beam, t, replace(lp, logprob=v, rank=rank))
                if t in self.eos and not self.params.ignore_eos:
                    self.finished.append(_grown(*cand, stop=t))
                else:
                    grown.append(cand)
        grown.sort(key=lambda c: c[0], reverse=True)        # stable: ties keep the steps' order
        self.beams = [_grown(*c) for c in grown[:self.params.beam_width]]
        self.steps += 1

    def result(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and the live beams, best first."""
        live = [replace(b, finish_reason="length") for b in self.beams]
        return sorted(self.finished + live, key=self._key, reverse=True)[:self.params.beam_width]

    def output_ids(self, seq: BeamSearchSequence) -> list[int]:
        return seq.tokens[self.prompt_len:]

    def step_requests(self, rid: str, seed: int | None = None, top: int = 0, **request) -> list[Request]:
        """The next step's requests, one per live beam, named ``rid-s<step>-<beam>``: each asks
        one token of the beam (``params.step_params``; beam k of step t seeded seed + t·width + k)
        and is known to make exactly one. ``request``: the rest of each Request's fields."""
        first = self.steps * self.params.beam_width
        return [Request(f"{rid}-s{self.steps}-{k}", list(b.tokens),
                        self.params.step_params(None if seed is None else seed + first + k, top),
                        arrival_time=time.monotonic(), predicted_len=1, **request)
                for k, b in enumerate(self.beams)]
