"""Structured outputs: the tokens a request's constraint allows next, as a mask over its logits.

A request's StructuredOutputs compiles to one llguidance grammar (``compile_grammar``): a JSON
schema, a regular expression, a choice of strings or a Lark grammar. Where the request is
sampled, a matcher follows its output token by token. Before each sample it gives the set of
tokens that keep the output a prefix of some sentence of the grammar (a bit per vocabulary
entry; llguidance walks the tokenizer's token trie through the grammar's lexer and Earley
parser, about 0.1 ms a token for a JSON schema); the sampled token then advances it. Once the
grammar is complete only the model's end-of-sequence tokens remain, so the output ends there.

The matcher is built at a request's first sample on a worker from the output so far, so a
request recomputed, swapped or moved to another device goes on where it was.
"""
from __future__ import annotations

import functools
import json
import logging

import numpy as np
import torch

from tandem.engine.params import StructuredOutputs

log = logging.getLogger(__name__)

# Compact JSON ("," and ":" with no whitespace between tokens): a model offered free whitespace
# can emit newlines for ever, and OpenAI's structured outputs are compact too.
JSON_OPTIONS = {"whitespace_flexible": False}
PROBE_TOKENS = 2        # the tokens ``Vocabulary.check`` follows a grammar through before a request runs


# a schema's keywords whose values are values, not schemas, and those that map names to schemas
LITERAL_KEYS = ("const", "enum", "default", "examples")
NAMED_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_schema(schema, fn):
    """``schema`` with ``fn`` applied to each (sub)schema object in it, the innermost first; the
    values of ``const``, ``enum`` and the like are left as they are, and the names of
    ``properties`` and the like are names, not keywords."""
    if isinstance(schema, list):
        return [map_schema(s, fn) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in LITERAL_KEYS:
            out[k] = v
        elif k in NAMED_KEYS and isinstance(v, dict):
            out[k] = {name: map_schema(sub, fn) for name, sub in v.items()}
        else:
            out[k] = map_schema(v, fn)
    return fn(out)


def closed(schema: dict) -> dict:
    """vLLM's ``disable_additional_properties``: each object that lists its properties and says
    nothing of others takes no others."""
    def close(s: dict) -> dict:
        lists = isinstance(s.get("properties"), dict) or isinstance(s.get("patternProperties"), dict)
        return s | {"additionalProperties": False} if lists and "additionalProperties" not in s else s
    return map_schema(schema, close)


def json_schema(so: StructuredOutputs) -> tuple[dict, dict]:
    """A JSON constraint's schema (closed where it asks) and llguidance's options for it;
    ValueError naming the field for a schema that is not one."""
    options = JSON_OPTIONS | ({"whitespace_pattern": so.whitespace_pattern} if so.whitespace_pattern else {})
    if so.kind() == "json_object":
        return {"type": "object"}, options
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json: a JSON schema must be an object")
    return closed(schema) if so.disable_additional_properties else schema, options


def lark_json(schema: dict, options: dict) -> str:
    """A JSON schema as a term of a Lark grammar (llguidance's ``%json``), its options inline."""
    return "%json " + json.dumps(schema | {"x-guidance": options})


def compile_grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) of a constraint; not yet checked (``Vocabulary.check``).
    ValueError naming the field for one that does not compile, or nests too deeply to be read."""
    try:
        return _compile(so)
    except RecursionError:
        raise ValueError(f"structured_outputs.{so.kind()}: nests too deeply to be read") from None


def _compile(so: StructuredOutputs) -> str:
    from llguidance import LLMatcher, grammar_from
    kind = so.kind()
    if kind in ("json", "json_object"):
        schema, options = json_schema(so)
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return grammar_from("choice", json.dumps(list(so.choice)))
    try:
        return grammar_from("grammar", so.grammar)       # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


class Vocabulary:
    """The tokenizer as llguidance reads it (each token's bytes), built from the HF tokenizer's
    JSON so that no process but the front end loads transformers' tokenizer (~0.5 s)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
        from llguidance import LLTokenizer
        # ``eos_ids``: the tokens that end a request; n_vocab: the logits' width, past the
        # tokenizer's own entries where the embedding is padded (those are never allowed)
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)

    def check(self, grammar: str, text_only: bool = False) -> None:
        """ValueError with llguidance's message unless the grammar compiles for this vocabulary;
        ``text_only`` (all but a Lark grammar, which may name special tokens): also unless a text
        token can begin it."""
        from llguidance import LLMatcher
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {messages[0].strip() if messages else 'invalid'}")
        first = LLMatcher(self.tokenizer, grammar, log_level=0)
        bits = self._bits(first)
        if text_only and self._stuck(first, bits):
            raise ValueError("structured_outputs: no token of this model can begin an output that matches "
                             "(the text of a special token, such as an end marker, cannot be written)")
        self._probe(first, bits)

    def _probe(self, m, bits: np.ndarray) -> None:
        """ValueError where the grammar's lexer runs past llguidance's limits within its first
        PROBE_TOKENS tokens, each the longest text token allowed. Its regular expressions are
        built lazily, as the output reaches them: ``a{300000}`` compiles and allows its first
        token, then fails at the second ("too many expressions constructed"), and the output
        ended there, short of the pattern, as if it had stopped."""
        for _ in range(PROBE_TOKENS):
            allowed = np.flatnonzero(np.unpackbits(bits & self._text_bits, bitorder="little")[:self.vocab_size])
            if not len(allowed):
                return
            m.consume_token(int(allowed[np.argmax(self._token_lengths[allowed])]))
            bits = self._bits(m)
            if m.is_error():
                raise ValueError("structured_outputs: too large for this server to follow ("
                                 f"{(m.get_error() or 'a resource limit').splitlines()[0]})")

    @functools.cached_property
    def _token_lengths(self) -> np.ndarray:
        """Each token's length in bytes."""
        return np.array([len(self.tokenizer.decode_bytes([i])) for i in range(self.vocab_size)])

    def _bits(self, m) -> np.ndarray:
        """A matcher's mask, a bit per token (llguidance's bit j of 32-bit word w is token 32 w + j:
        little-endian bytes, low bit first); none in error."""
        nbytes = (self.vocab_size + 7) // 8
        if m.is_error():
            return np.zeros(nbytes, dtype=np.uint8)
        return np.frombuffer(m.compute_bitmask(), dtype=np.uint8)[:nbytes]

    @functools.cached_property
    def _text_bits(self) -> np.ndarray:
        """The bits of the tokens that are text (not special tokens)."""
        text = [not self.tokenizer.is_special_token(i) for i in range(self.vocab_size)]
        return np.packbits(np.array(text, dtype=bool), bitorder="little")

    def _stuck(self, m, bits: np.ndarray) -> bool:
        """Whether the output cannot go on as text short of the grammar's end: the matcher is in
        error, or only special tokens are allowed while the grammar wants more."""
        return m.is_error() or not m.is_accepting() and not (bits & self._text_bits).any()

    def matcher(self, grammar: str, output: list[int]):
        """A matcher at the end of ``output`` (the tokens already generated under it)."""
        from llguidance import LLMatcher
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if output and not m.consume_tokens(output):
            log.warning("structured output: the tokens so far do not follow the grammar (%s)", m.get_error())
        return m

    def allowed(self, matchers: list) -> torch.Tensor:
        """[m, V] bool on the CPU: the tokens each matcher allows next. A matcher in error allows
        only the end tokens. One stuck short of its grammar's end (a grammar whose text only a
        special token spells: llguidance does not write it as text) is logged."""
        packed = np.zeros((len(matchers), (self.vocab_size + 7) // 8), dtype=np.uint8)
        for row, m in enumerate(matchers):
            packed[row] = self._bits(m)
            if self._stuck(m, packed[row]):
                log.warning("structured output: no text token can go on (%s); the output ends short of it",
                            m.get_error() or "only special tokens are allowed")
        mask = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :self.vocab_size]).bool()
        for row in np.flatnonzero(~packed.any(axis=1)):
            mask[row, list(self.eos_ids)] = True
        return mask
