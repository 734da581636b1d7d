"""SamplingParams: what a user asks of generation (vLLM's names and meanings)."""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20       # the most alternatives a token's log probabilities may list (vLLM's default cap)
MAX_REPETITION = 10.0   # repetition_penalty at most this (1: off)
MAX_BIAS = 100.0        # |logit_bias| at most this (OpenAI's range; -100 bans a token, +100 all but forces it)
# the numeric fields, where a numpy scalar is taken as Python's
NUMBER_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "logprobs",
                 "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "truncate_prompt_tokens", "n")


# vLLM's SamplingParams fields this one has not, and what to use instead
VLLM_FIELDS = {
    "best_of": "use n (each choice is its own request); vLLM's V1 engine dropped best_of too",
    "guided_decoding": "give structured_outputs=StructuredOutputs(json=..., regex=..., choice=..., grammar=...)",
    "logits_processors": "custom logits processors are not supported; logit_bias, allowed_token_ids, bad_words "
                         "and structured_outputs shape the logits",
}


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16             # tokens to generate at most (None: as many as the context holds)
    temperature: float = 1.0                # 0 = greedy
    top_p: float = 1.0                      # nucleus mass in (0, 1]
    top_k: int = -1                         # -1 or 0 = off
    min_p: float = 0.0                      # tokens less likely than min_p x the likeliest's are dropped (0 = off)
    seed: int | None = None                 # per-request seed; None = random
    stop: list[str] = field(default_factory=list)          # stop strings (cut from the text, unless:)
    include_stop_str_in_output: bool = False               # the stop string that matched ends the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                     # EOS and stop ids are suppressed before this many
    logprobs: int | None = None             # None: none; k: each token's log probability and the k likeliest
    prompt_logprobs: int | None = None      # the same for each prompt token after the first
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling
    presence_penalty: float = 0.0           # subtracted from the logit of every token already output
    frequency_penalty: float = 0.0          # times how often the token was output, subtracted
    repetition_penalty: float = 1.0         # tokens in the prompt or output: positive logits / p, negative * p
    structured_outputs: StructuredOutputs | None = None    # what the output must match (a JSON schema, ...)
    allowed_token_ids: list[int] | None = None   # only these tokens may be generated (None: any)
    bad_words: list[str] = field(default_factory=list)     # words the output never completes
    truncate_prompt_tokens: int | None = None    # keep the prompt's last k tokens (-1: all that leave room
                                                 # for max_tokens, or for one token where it is None)
    skip_special_tokens: bool = True            # special tokens' text left out of the output text
    n: int = 1                              # LLM.generate: choices per prompt, each its own request (seed + i)
    detokenize: bool = True                 # False: LLM.generate's outputs carry token ids and no text (vLLM's)

    def __new__(cls, *args, **kwargs):
        """ValueError saying what to use instead for a vLLM field this class has not (VLLM_FIELDS),
        before the generated __init__ would raise a bare TypeError."""
        for name in kwargs:
            if name in VLLM_FIELDS:
                raise ValueError(f"{name}: vLLM's; {VLLM_FIELDS[name]}")
        return object.__new__(cls)          # (not super(): slots=True makes a new class)

    def _coerce(self) -> None:
        """What a script computed with numpy, or wrote as tuples, as the fields' own types: numpy
        integers and floats as Python's, tuples and arrays of ids or strings as lists, logit_bias
        keys written as decimal strings (OpenAI's form) as ids. Anything else stays as it is, for
        ``validate`` to name."""
        for name in NUMBER_FIELDS:
            setattr(self, name, _plain(getattr(self, name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            setattr(self, name, int_list(getattr(self, name)))
        for name in ("stop", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        lb = self.logit_bias
        if isinstance(lb, dict):
            self.logit_bias = {int(t) if isinstance(t, str) and t.isascii() and t.isdigit() else _plain(t): _plain(b)
                               for t, b in lb.items()}

    def clone(self) -> "SamplingParams":
        """vLLM's: a copy to change without touching this one."""
        return copy.deepcopy(self)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:                   # vLLM's defaults: none
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (after ``_coerce``)."""
        self._coerce()

        def bad(name, why):
            raise ValueError(f"{name}: {why}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            bad("max_tokens", f"must be None or a positive integer, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        lb = self.logit_bias
        if lb is not None and (not isinstance(lb, dict) or not all(
                _is_int(t) and t >= 0 and _is_num(b) and abs(b) <= MAX_BIAS for t, b in lb.items())):
            bad("logit_bias", f"must map token ids to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION:g}], got {self.repetition_penalty!r}")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids)):
            bad("allowed_token_ids", "must be None or a non-empty list of token ids")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of strings that are not blank")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            bad("truncate_prompt_tokens", f"must be None, -1 or a positive integer, got {k!r}")
        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be a positive integer, got {self.n!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings are matched in the text: not with detokenize=False")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", "must be a StructuredOutputs")
            self.structured_outputs.validate()


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the output must match, as vLLM's structured outputs say it: exactly one of a JSON
    schema (a dict or its JSON text), any JSON object, a regular expression (Rust's regex
    syntax, matched whole), one of a list of strings, or a Lark grammar (llguidance's dialect;
    llama.cpp's GBNF is accepted too). The output ends when the constraint is complete."""
    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's options. JSON is written compact whatever ``disable_any_whitespace`` says (it is
    # taken either way); ``whitespace_pattern``: a regular expression for the whitespace JSON
    # may have between tokens instead; ``disable_additional_properties``: a schema's objects
    # that list properties and say nothing of others take no others
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def kind(self) -> str:
        """The one field that is set; ValueError unless exactly one is."""
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar and "
                             f"json_object, got {given or 'none'}")
        return given[0]

    def validate(self) -> None:
        kind = self.kind()
        ok = {"json": isinstance(self.json, (dict, str)),
              "regex": isinstance(self.regex, str) and bool(self.regex),
              "choice": isinstance(self.choice, (list, tuple)) and bool(self.choice)
              and all(isinstance(c, str) and c for c in self.choice),
              "grammar": isinstance(self.grammar, str) and bool(self.grammar.strip()),
              "json_object": True}[kind]
        if not ok:
            why = {"json": "a JSON schema (an object or its JSON text)", "choice": "a list of non-empty strings"}
            raise ValueError(f"structured_outputs.{kind}: must be {why.get(kind, 'a non-empty string')}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name}: must be a boolean")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise ValueError("structured_outputs.whitespace_pattern: must be a non-empty string")
            if kind not in ("json", "json_object"):
                raise ValueError(f"structured_outputs.whitespace_pattern: only with json or json_object, not {kind}")


StructuredOutputsParams = StructuredOutputs     # vLLM's name for it


def _plain(x):
    """A numpy number as Python's (an integer as int, else float); anything else as it is."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, int)):
        return int(x)
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, int, float)):
        return float(x)
    return x


def int_list(x):
    """``x`` as a list of Python ints where it is a list, tuple or 1-D array of integers (numpy's
    included), else ``x`` as it is."""
    if isinstance(x, list) and all(type(t) is int for t in x):
        return x                                    # the usual case: one quick pass, no copy
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        x = x.tolist()
    if isinstance(x, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x):
        return [int(t) for t in x]
    return x


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
