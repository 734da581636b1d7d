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

import json
import logging

import numpy as np
import torch

from tandem.engine.params import StructuredOutputs

log = logging.getLogger(__name__)

# Compact JSON ("," and ":" with no whitespace between tokens): a model offered free whitespace
# can emit newlines for ever, and OpenAI's structured outputs are compact too.
JSON_OPTIONS = {"whitespace_flexible": False}


def compile_grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) of a constraint; not yet checked (``Vocabulary.check``)."""
    from llguidance import LLMatcher, grammar_from
    kind = so.kind()
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json: a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
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

    def check(self, grammar: str) -> None:
        """ValueError with llguidance's message unless the grammar compiles for this vocabulary."""
        from llguidance import LLMatcher
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {messages[0].strip() if messages else 'invalid'}")

    def matcher(self, grammar: str, output: list[int]):
        """A matcher at the end of ``output`` (the tokens already generated under it)."""
        from llguidance import LLMatcher
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if output and not m.consume_tokens(output):
            log.warning("structured output: the tokens so far do not follow the grammar (%s)", m.get_error())
        return m

    def allowed(self, matchers: list) -> torch.Tensor:
        """[m, V] bool on the CPU: the tokens each matcher allows next. A matcher in error (it
        cannot happen to a request sampled under its own mask) allows only the end tokens."""
        nbytes = (self.vocab_size + 7) // 8
        packed = np.zeros((len(matchers), nbytes), dtype=np.uint8)
        for row, m in enumerate(matchers):
            if not m.is_error():
                packed[row] = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)[:nbytes]
        # llguidance's bit j of 32-bit word w is token 32 w + j: little-endian bytes, low bit first
        mask = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :self.vocab_size]).bool()
        for row in np.flatnonzero(~packed.any(axis=1)):
            mask[row, list(self.eos_ids)] = True
        return mask
