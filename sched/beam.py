"""Beam search as vLLM serves it: each step asks the engine for one token of every live beam,
with its 2·width likeliest next tokens, and keeps the width best extensions.

A step is an ordinary one-token request whose prompt is the beam so far, so the scheduler,
the prefix cache (a beam's earlier tokens are cached blocks), placement and every policy serve
it like any request; nothing in the engine knows of beams. This module keeps the books of one
prompt's search; ``LLM.beam_search`` and the server drive the steps.

Scores, as vLLM's: a beam's cumulative log probability (each token's log-softmax under the
model, before temperature) over ``L ** length_penalty``, where L counts the prompt and the
output, less a final EOS. A candidate that ends in EOS (unless ``ignore_eos``) leaves the search
finished; the others compete for the width places by score. After ``max_tokens`` steps, or
when no live beam is left, the width best of the finished and the live ones are the result.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tandem.engine.messages import TokenLogprobs
from tandem.engine.params import MAX_LOGPROBS, SamplingParams, _is_int, _is_num

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2      # each step lists 2 x width alternatives per beam


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's names: ``beam_width`` beams kept (and returned), ``max_tokens`` steps at most."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0            # only which extra token each step samples (it competes too)
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        w = self.beam_width
        if not _is_int(w) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}], got {w!r}")
        lp = self.length_penalty
        if not _is_num(lp):
            raise ValueError(f"length_penalty: must be a finite number, got {lp!r}")
        m = self.max_tokens
        if not _is_int(m) or m <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {m!r}")
        self.step_params(None)          # temperature, ignore_eos: as SamplingParams checks them

    def step_params(self, seed: int | None) -> SamplingParams:
        """What one step asks of the engine for one beam."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=self.ignore_eos, seed=seed)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the output (vLLM's shape)."""
    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)     # each output token's
    finish_reason: str | None = None        # "stop" (ended in EOS) or "length", once it is a result
    text: str | None = None                 # the output's text, filled in for results


@dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's result: the best ``beam_width`` sequences, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_ids: frozenset[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_ids else 0)
    return seq.cum_logprob / (n ** length_penalty)


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
        return beam_score(seq, self.eos, self.params.length_penalty)

    def advance(self, results: list[TokenLogprobs], sampled: list[int]) -> None:
        """One step: ``results[i]`` / ``sampled[i]`` are beam i's log probabilities and the
        token its step chose (a candidate too, as vLLM lists it beside the likeliest)."""
        grown = []
        for beam, lp, tok in zip(self.beams, results, sampled, strict=True):
            cands = dict(zip(lp.top_ids, lp.top_logprobs))
            cands.setdefault(tok, lp.logprob)
            for t, v in cands.items():
                seq = BeamSearchSequence(beam.tokens + [t], beam.cum_logprob + v, beam.logprobs + [v])
                if t in self.eos and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.finished.append(seq)
                else:
                    grown.append(seq)
        grown.sort(key=self._key, reverse=True)      # stable: ties keep the order the steps listed
        self.beams = grown[:self.params.beam_width]
        self.steps += 1

    def result(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and the live beams, best first."""
        live = [replace(b, finish_reason="length") for b in self.beams]
        return sorted(self.finished + live, key=self._key, reverse=True)[:self.params.beam_width]

    def output_ids(self, seq: BeamSearchSequence) -> list[int]:
        return seq.tokens[self.prompt_len:]
