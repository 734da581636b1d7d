"""Request bodies as JSON Schema, and the validator the server checks them with.

The schemas below are the one description of what a request may carry: ``validate`` checks
a body against them (a small JSON-Schema subset: type, bounds, lengths, enum, anyOf,
properties/required), and ``server.openapi`` publishes the same dicts in /openapi.json.
What a schema cannot say is checked in ``server.protocol`` afterwards: fields that depend on
each other, and limits that depend on the model (vocabulary, context).
"""
from __future__ import annotations

import functools
import logging
import math
import re

from tandem.engine.params import MAX_BIAS, MAX_LOGPROBS, MAX_REPETITION
from tandem.server.batches import ENDPOINTS, WINDOWS
from tandem.server.errors import bad_request

MAX_N = 16
MAX_PROMPTS = 64            # prompts in one /v1/completions request
MAX_STOPS = 16              # stop strings per request
MAX_STOP_CHARS = 512        # each: the stream holds back up to this many characters while matching
INT64 = 2 ** 63 - 1
MAX_TOKENS_CAP = 2 ** 31 - 1
MAX_SLO_MS = 1e9
MAX_BIASED = 1024           # logit_bias entries per request
MAX_BAD_WORDS = 128         # bad_words per request
MAX_ALLOWED = 1 << 20       # allowed_token_ids per request (more than any vocabulary)
MAX_STOP_IDS = 4096         # stop_token_ids per request: every step of the request checks them

UNSUPPORTED = ("functions", "function_call",
               "best_of", "suffix", "prediction", "audio", "modalities",
               # vLLM's extensions this server does not implement
               "logits_processors", "priority",
               "prompt_embeds", "mm_processor_kwargs")
# the value of an unsupported field that asks nothing of it (besides null, false and empty)
ASKS_NOTHING = {"best_of": 1, "modalities": ["text"], "priority": 0}


def _int(lo: int, hi: int, doc: str) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi, "description": doc}


def _num(lo: float, hi: float, doc: str, exclusive_lo: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return {"type": "number", **low, "maximum": hi, "description": doc}


STRUCTURED = {
    "json": {"anyOf": [{"type": "object"}, {"type": "string", "minLength": 1}],
             "description": "a JSON schema, or its JSON text"},
    "regex": {"type": "string", "minLength": 1, "description": "a regular expression (Rust regex syntax)"},
    "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
               "description": "the output is one of these strings"},
    "grammar": {"type": "string", "minLength": 1, "description": "a Lark (or GBNF) grammar"},
    "json_object": {"type": "boolean", "description": "the output is a JSON object"},
    "disable_any_whitespace": {"type": "boolean", "description": "taken either way: JSON is written compact"},
    "disable_additional_properties": {
        "type": "boolean", "description": "objects that list properties and say nothing of others take no others"},
    "whitespace_pattern": {"type": "string", "minLength": 1,
                           "description": "json, json_object: the whitespace allowed between tokens (a regex)"}}
STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
SAMPLING = {
    "model": {"type": "string", "description": "the served model's name (optional)"},
    "request_id": {"type": "string", "minLength": 1, "maxLength": 256,
                   "pattern": r"^(?! *$)[^\x00-\x1f\x7f]*$",
                   "x-pattern": "must hold no control characters and not be blank (it may be sent back as a header)",
                   "description": "vLLM's extension: names the completion (chatcmpl-<request_id>); a request's "
                                  "X-Request-Id header goes first"},
    "temperature": _num(0, 2, "0: greedy"),
    "top_p": _num(0, 1, "nucleus sampling mass", exclusive_lo=True),
    "top_k": _int(-1, MAX_TOKENS_CAP, "-1: off (vLLM's extension)"),
    "min_p": _num(0, 1, "vLLM's extension: tokens less likely than min_p times the likeliest are dropped (0: off)"),
    "seed": _int(-INT64 - 1, INT64, "seeded sampling; choice i of n uses seed + i"),
    "n": _int(1, MAX_N, "choices per request"),
    "stream": {"type": "boolean", "description": "server-sent events"},
    "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"},
        "continuous_usage_stats": {"type": "boolean", "description": "vLLM's usage in every chunk: not "
                                   "supported (rejected unless false)"}},
                       "description": "only with stream=true"},
    "stop": {"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOPS}],
             "description": f"up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters"},
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_IDS,
                       "items": _int(0, INT64, "a token id of the vocabulary"),
                       "description": f"vLLM's extension; ids must be inside the vocabulary (at most {MAX_STOP_IDS})"},
    "ignore_eos": {"type": "boolean", "description": "vLLM's extension"},
    "prompt_logprobs": _int(0, MAX_LOGPROBS, "vLLM's extension, without stream: each prompt token's log "
                            "probability and rank and the likeliest this many (the prompt is computed whole)"),
    "include_stop_str_in_output": {"type": "boolean", "description": "vLLM's extension: the stop string that "
                                   "ended the output stays at its end (each choice's stop_reason names it)"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 1024,
                   "description": "vLLM's extension: only requests with the same salt reuse each other's "
                   "cached prompt blocks (prefix caching), so one tenant cannot time another's prompts"},
    "return_tokens_as_token_ids": {"type": "boolean", "description": "vLLM's extension: log probabilities "
                                   "name each token \"token_id:<id>\" instead of its text (a token that is "
                                   "part of a character is then still told apart)"},
    "return_token_ids": {"type": "boolean", "description": "vLLM's extension: the token ids of the output "
                         "(and of the prompt) beside its text"},
    "min_tokens": _int(0, MAX_TOKENS_CAP, "vLLM's extension; at most max_tokens"),
    "logit_bias": {"type": "object", "maxProperties": MAX_BIASED,
                   "propertyNames": {"maxLength": 20, "pattern": "^[0-9]+$"},
                   "additionalProperties": _num(-MAX_BIAS, MAX_BIAS, "added to the token's logit"),
                   "description": "token id (a decimal string) -> bias; -100 bans the token"},
    "allowed_token_ids": {"type": "array", "minItems": 1, "maxItems": MAX_ALLOWED,
                          "items": _int(0, INT64, "a token id of the vocabulary"),
                          "description": "vLLM's extension: only these tokens may be generated (stop ids "
                                         "included: without them the output runs to max_tokens)"},
    "bad_words": {"type": "array", "maxItems": MAX_BAD_WORDS, "items": STOP_STRING,
                  "description": "vLLM's extension: words the output never completes, at its start or "
                                 "after a space (the word's last token is banned once the output ends "
                                 "with the ones before it)"},
    "truncate_prompt_tokens": {"anyOf": [{"enum": [-1]}, _int(1, MAX_TOKENS_CAP, "")],
                               "description": "vLLM's extension: only the prompt's last this many tokens are "
                                              "kept (-1: the model context's worth); at most the context"},
    "skip_special_tokens": {"type": "boolean", "description": "vLLM's extension: false keeps the text of "
                            "special tokens in the output (default true; a stop token's stays out)"},
    "spaces_between_special_tokens": {"type": "boolean", "description": "vLLM's extension, accepted: this "
                                      "server's fast tokenizers put nothing between special tokens, as "
                                      "vLLM's do with one"},
    "max_tokens": _int(1, MAX_TOKENS_CAP, "prompt + max_tokens must fit the context"),
    "use_beam_search": {"type": "boolean", "description": "vLLM's extension: the n choices are the n best "
                        f"beams of a beam search of width n (at most {MAX_LOGPROBS // 2}), best first"},
    "length_penalty": _num(-MAX_SLO_MS, MAX_SLO_MS, "vLLM's extension, with use_beam_search: a beam's log "
                           "probability is divided by its length (prompt and output) to this power (default 1)"),
    "presence_penalty": _num(-2, 2, "subtracted from the logit of every token already output"),
    "frequency_penalty": _num(-2, 2, "times how often a token was output, subtracted from its logit"),
    "repetition_penalty": _num(0, MAX_REPETITION, "vLLM's extension: tokens of the prompt or output have "
                               "positive logits divided by it, negative ones multiplied (1: off)", exclusive_lo=True),
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64}, "description": {"type": "string"},
            "schema": {"type": "object", "description": "the JSON schema the output follows (absent: any object)"},
            "strict": {"type": "boolean", "description": "the output always follows the schema"}}}},
        "description": "json_object: the output is a JSON object; json_schema: it follows json_schema.schema"},
    "structured_outputs": {"type": "object", "properties": STRUCTURED,
                           "description": "vLLM's extension: exactly one of json, regex, choice, grammar, "
                                          "json_object; the output matches it whole"},
    **{f"guided_{k}": {**STRUCTURED[k], "description": f"vLLM's older spelling of structured_outputs.{k}"}
       for k in ("json", "regex", "choice", "grammar", "whitespace_pattern")},
    "service_tier": {"enum": ["auto", "default", "flex", "priority"],
                     "description": "flex: best-effort (BE); the others: real-time (RT)"},
    "slo_ttft_ms": _num(0, MAX_SLO_MS, "time-to-first-token target (default: the server's, RT only)",
                        exclusive_lo=True),
    "slo_tbt_ms": _num(0, MAX_SLO_MS, "time-between-tokens target (default: the server's, RT only)",
                       exclusive_lo=True),
    "user": {"type": "string"},
}
TEXT_PART = {"type": "object", "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
             "required": ["type", "text"]}
REFUSAL_PART = {"type": "object", "properties": {"type": {"enum": ["refusal"]}, "refusal": {"type": "string"}},
                "required": ["type", "refusal"], "description": "an assistant's (its text, as written)"}
TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [TEXT_PART, REFUSAL_PART]}}],
                "description": "required, except in an assistant message with tool_calls"},
    "name": {"type": "string"},
    "tool_calls": {"type": "array", "items": TOOL_CALL, "description": "an assistant's earlier calls"},
    "tool_call_id": {"type": "string", "description": "a tool message: the call it answers"}}}
MAX_TOOLS = 128
TOOLS = {
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "description": "functions the model may call", "items": {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[a-zA-Z0-9_-]+$"},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "JSON schema of the arguments"},
                "strict": {"type": "boolean"}}}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}],
        "description": "auto (the default with tools): the model decides; required: at least one call; "
                       "a function: that one"},
    "parallel_tool_calls": {"type": "boolean", "description": "false: one call at most (default true)"}}
TOKEN_IDS = {"type": "array", "items": _int(0, INT64, "token id"), "minItems": 1}
PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                     "items": {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS]}}],
          "description": f"a string or token ids, or a list of up to {MAX_PROMPTS} of them (one "
                         "set of choices each)"}


TEMPLATE = {      # vLLM's chat options: how the messages are rendered
    "add_generation_prompt": {"type": "boolean", "description": "vLLM's extension: the assistant's turn opened "
                              "after the messages (default true)"},
    "continue_final_message": {"type": "boolean", "description": "vLLM's extension: the last message, an "
                               "assistant's, left open and continued by the reply (needs add_generation_prompt "
                               "false)"},
    "chat_template_kwargs": {"type": "object", "maxProperties": 32, "propertyNames": {"maxLength": 64},
                             "description": "vLLM's extension: more variables for the chat template "
                                            "(enable_thinking, ...); one the template does not read is ignored"},
    "chat_template": {"type": "string", "minLength": 1, "maxLength": 1 << 16,
                      "description": "vLLM's extension: a Jinja template rendering this chat instead of the "
                                     "model's (only where the server trusts request templates: "
                                     "--trust-request-chat-template)"},
    "documents": {"type": "array", "maxItems": 64, "items": {"type": "object", "maxProperties": 16,
                                                             "additionalProperties": {"type": "string"}},
                  "description": "vLLM's extension: documents for a template that reads them (RAG); "
                                 "ignored by one that does not"}}
CHAT_UNSUPPORTED = UNSUPPORTED
COMPLETION_UNSUPPORTED = (*TOOLS, *UNSUPPORTED)


def _body(extra: dict, required: list[str], refused: tuple[str, ...] = UNSUPPORTED) -> dict:
    doc = ("not supported: rejected unless null, false, empty or the value that asks nothing "
           "(best_of 1, modalities [text], priority 0)")
    unsupported = {k: {"description": doc} for k in refused}
    return {"type": "object", "required": required, "properties": {**SAMPLING, **extra, **unsupported}}


CHAT_BODY = _body({"messages": {"type": "array", "items": MESSAGE, "minItems": 1},
                   "max_completion_tokens": _int(1, MAX_TOKENS_CAP, "alias of max_tokens"),
                   "logprobs": {"type": "boolean", "description": "each output token's log probability under "
                                "the model (before temperature, top-k/p)"},
                   "top_logprobs": _int(0, MAX_LOGPROBS, "with logprobs: the likeliest tokens at each position"),
                   "echo": {"type": "boolean", "description": "vLLM's extension: the reply's content begins with "
                            "the last message's where that message is the assistant's (or add_generation_prompt "
                            "is false), e.g. a reply continued with continue_final_message"},
                   **TOOLS, **TEMPLATE},
                  ["messages"], CHAT_UNSUPPORTED)
COMPLETION_BODY = _body({"prompt": PROMPT,
                         "max_tokens": _int(0, MAX_TOKENS_CAP, "prompt + max_tokens must fit the context; 0 "
                                            "only with echo: the prompt alone, scored with logprobs"),
                         "echo": {"type": "boolean", "description": "the prompt before the output, in the text "
                                  "and (with logprobs) the log probabilities: the first token's null"},
                         "logprobs": _int(0, MAX_LOGPROBS, "each output token's log probability under the "
                                          "model (before temperature, top-k/p) and the likeliest this many")},
                        ["prompt"], COMPLETION_UNSUPPORTED)
METADATA = {"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                  "additionalProperties": {"type": "string", "maxLength": 512}}
# a chat request's fields a Responses request names otherwise (or not at all): refused, naming what
# to send instead, where they would otherwise be dropped without a word (max_tokens would not cap)
RESPONSES_CHAT_ONLY = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                       "messages": "input", "response_format": "text.format", "functions": "tools",
                       "function_call": "tool_choice", "stop": None, "n": None, "logprobs": None,
                       "logit_bias": None}
RESPONSES_UNSUPPORTED = ("conversation", "prompt", "max_tool_calls", "reasoning")
OUTPUT_LOGPROBS = "message.output_text.logprobs"        # the one ``include`` a response can give
INPUT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
INPUT_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "type": {"enum": ["message"]}, "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_PART, "minItems": 1}]},
    "id": {"type": "string"}, "status": {"type": "string"}}}
FUNCTION_CALL_ITEM = {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
    "type": {"enum": ["function_call"]}, "call_id": {"type": "string"}, "name": {"type": "string"},
    "arguments": {"type": "string", "description": "JSON text"}, "id": {"type": "string"},
    "status": {"type": "string"}}}
FUNCTION_OUTPUT_ITEM = {"type": "object", "required": ["type", "call_id", "output"], "properties": {
    "type": {"enum": ["function_call_output"]}, "call_id": {"type": "string"},
    "output": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["input_text"]}, "text": {"type": "string"}}}}],
               "description": "the call's result: text, or text parts (joined with newlines)"},
    "id": {"type": "string"}, "status": {"type": "string"}}}
FUNCTION_NAME = TOOLS["tools"]["items"]["properties"]["function"]["properties"]["name"]
RESPONSES_TOOLS = {
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "description": "functions the model may call", "items": {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"enum": ["function"]}, "name": FUNCTION_NAME, "description": {"type": "string"},
            "parameters": {"type": "object", "description": "JSON schema of the arguments"},
            "strict": {"type": "boolean"}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"enum": ["function"]}, "name": {"type": "string"}}}]},
    "parallel_tool_calls": TOOLS["parallel_tool_calls"]}
# the chat fields a Responses request takes as they are
RESPONSES_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "service_tier",
                    "slo_ttft_ms", "slo_tbt_ms", "user", "cache_salt", "ignore_eos", "min_tokens", "presence_penalty",
                    "frequency_penalty", "structured_outputs")
RESPONSES_BODY = {"type": "object", "required": ["input"], "properties": {
    **{k: SAMPLING[k] for k in RESPONSES_PASSED},
    "input": {"anyOf": [{"type": "string", "minLength": 1}, {
        "type": "array", "minItems": 1, "items": {"anyOf": [INPUT_MESSAGE, FUNCTION_CALL_ITEM, FUNCTION_OUTPUT_ITEM]}}],
              "description": "the user's text, or items: messages (text parts only), earlier function calls "
                             "and their outputs"},
    "instructions": {"type": "string", "description": "a system message before the input"},
    "max_output_tokens": _int(1, MAX_TOKENS_CAP, "input + max_output_tokens must fit the context"),
    "text": {"type": "object", "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "name": {"type": "string", "minLength": 1, "maxLength": 64}, "description": {"type": "string"},
            "schema": {"type": "object"}, "strict": {"type": "boolean"}}}},
        "description": "format json_schema: the output follows its schema; json_object: any JSON object"},
    "metadata": METADATA,
    "store": {"type": "boolean", "description": "false: not kept (default: kept in the data dir, the newest "
                                                "4,096, for GET /v1/responses/{id} and previous_response_id)"},
    "previous_response_id": {"type": "string", "description": "a kept response whose conversation this one "
                                                              "goes on from"},
    "truncation": {"enum": ["disabled", "auto"], "description": "disabled: an input past the context is refused; "
                   "auto: the conversation's first turns are left out until it fits"},
    "include": {"type": "array", "items": {"type": "string"},
                "description": f"['{OUTPUT_LOGPROBS}']: each output token's log probability (and top_logprobs "
                               "alternatives) in the output text; other values are refused"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20,
                     "description": "with include's logprobs: the likeliest tokens given at each position"},
    "background": {"type": "boolean", "description": "true: answered at once, queued; it runs on its own (kept, "
                                                     "run again after a restart) and is polled, cancelled or its "
                                                     "events streamed again by id"},
    **RESPONSES_TOOLS,
    "stream_options": {"type": "object"},
    **{k: {"description": "not supported: rejected unless null, false or empty"} for k in RESPONSES_UNSUPPORTED},
    **{k: {"description": "a chat request's field: refused" + (f" (send {v})" if v else "")}
       for k, v in RESPONSES_CHAT_ONLY.items()}}}
TOKENIZE_BODY = {"type": "object", "properties": {   # vLLM's /tokenize: one of prompt and messages
    "model": SAMPLING["model"],
    "prompt": {"type": "string", "minLength": 1, "description": "text, tokenized as a completion's prompt is"},
    "messages": {"type": "array", "items": MESSAGE, "minItems": 1,
                 "description": "a chat, rendered by the model's template as a chat request's prompt is"},
    "return_token_strs": {"type": "boolean", "description": "also each token as the tokenizer spells it"},
    **TOOLS, **TEMPLATE}}
DETOKENIZE_BODY = {"type": "object", "required": ["tokens"], "properties": {    # vLLM's /detokenize
    "model": SAMPLING["model"], "tokens": {"type": "array", "items": _int(0, INT64, "token id")}}}
# a file's expiry: seconds after it is made, one hour to 30 days (OpenAI's bounds)
EXPIRES_AFTER = {"type": "object", "required": ["anchor", "seconds"], "properties": {
    "anchor": {"enum": ["created_at"]}, "seconds": {"type": "integer", "minimum": 3600, "maximum": 2_592_000}}}
BATCH_BODY = {"type": "object", "required": ["input_file_id", "endpoint"], "properties": {
    "input_file_id": {"type": "string", "description": "a file uploaded with purpose 'batch'"},
    "endpoint": {"enum": list(ENDPOINTS)},
    "completion_window": {"enum": list(WINDOWS), "description": "default 24h"},
    "metadata": METADATA,
    "output_expires_after": EXPIRES_AFTER | {"description": "when the output and error files expire"}}}
UPLOAD_FIELDS = {"type": "object", "properties": {"expires_after": EXPIRES_AFTER}}

_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
          "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
          "null": lambda v: v is None}
_NAMES = {"integer": "an integer", "number": "a number", "boolean": "a boolean", "string": "a string",
          "array": "an array", "object": "an object", "null": "null"}


# the parts of OpenAI's multimodal messages (chat, Responses API): the models served read text only
MEDIA_PARTS = {"image_url", "input_audio", "file", "video_url", "audio_url", "input_image", "input_file"}


def _part_type(given, accepted: list) -> str:
    """What is wrong with a value outside ``accepted``; a content part's type (what accepts
    text parts) that names an image, audio or file part says so."""
    one_of = "must be one of " + ", ".join(map(str, accepted))
    if isinstance(given, str) and given in MEDIA_PARTS and {"text", "input_text"} & set(accepted):
        return f"is {given}, but the model served here reads text only: it {one_of}"
    return one_of


def problem(schema: dict, v) -> tuple[list, str] | None:
    """The first way ``v`` breaks ``schema``: (path inside v, what is wrong), or None."""
    if "anyOf" in schema:
        found = [problem(s, v) for s in schema["anyOf"]]
        if not all(found):
            return None
        # a form of the right type that breaks only a bound of its own (too many items, too
        # short) says more than forms whose insides are of the wrong types
        bounded = [f for s, f in zip(schema["anyOf"], found) if not f[0] and "type" in s and _TYPES[s["type"]](v)]
        if len(bounded) == 1:
            return bounded[0]
        kinds = [s.get("properties", {}).get("type", {}).get("enum") for s in schema["anyOf"]]
        if isinstance(v, dict) and "type" in v and all(kinds):    # forms told apart by their "type" (parts)
            named = [f for k, f in zip(kinds, found) if v.get("type") in k]
            return named[0] if named else (["type"], _part_type(v["type"], [e for k in kinds for e in k]))
        fitting = [(s, f) for s, f in zip(schema["anyOf"], found) if f[0]]       # right type, wrong inside
        if len(fitting) > 1 and isinstance(v, dict):       # the one form that names every key given
            fitting = [(s, f) for s, f in fitting if set(v) <= set(s.get("properties", {}))] or fitting
        return fitting[0][1] if len(fitting) == 1 else ([], "has none of the accepted forms")
    if "enum" in schema and v not in schema["enum"]:
        return [], _part_type(v, schema["enum"])
    t = schema.get("type")
    if t is not None and not _TYPES[t](v):
        if t == "integer" and isinstance(v, float) and abs(v) >= 2 ** 63:   # the parser reads those as floats
            return [], f"must be an integer of at most 64 bits, got one of about {v:.3g}"
        return [], f"must be {_NAMES[t]}, got {type(v).__name__}"
    for key, ok, what in (("minimum", lambda b: v >= b, ">="), ("maximum", lambda b: v <= b, "<="),
                          ("exclusiveMinimum", lambda b: v > b, ">")):
        if key in schema and not ok(schema[key]):
            return [], f"must be {what} {schema[key]} (got {v!r})"
    for key, ok, what in (("minLength", lambda b: len(v) >= b, "at least"), ("maxLength", lambda b: len(v) <= b, "at most"),
                          ("minItems", lambda b: len(v) >= b, "at least"), ("maxItems", lambda b: len(v) <= b, "at most")):
        if key in schema and not ok(schema[key]):
            unit = "characters" if "Length" in key else "items"
            return [], f"must have {what} {schema[key]} {unit}"
    if "pattern" in schema and not re.search(schema["pattern"], v):     # (after the length: a long string
        return [], schema.get("x-pattern", f"must match {schema['pattern']}")      # costs a pattern more)
    if t == "array" and "items" in schema:
        for i in _suspects(schema["items"], v):
            if (p := problem(schema["items"], v[i])) is not None:
                return [i, *p[0]], p[1]
    if t == "object":
        if "maxProperties" in schema and len(v) > schema["maxProperties"]:
            return [], f"must have at most {schema['maxProperties']} keys"
        longest = schema.get("propertyNames", {}).get("maxLength")
        if longest is not None and any(len(k) > longest for k in v):
            return [], f"keys must have at most {longest} characters"
        props, rest = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in v.items():
            sub = props.get(key, rest if isinstance(rest, dict) else None)
            if sub is not None and (value is not None or key not in props) and (p := problem(sub, value)) is not None:
                return [key, *p[0]], p[1]
        for key in schema.get("required", ()):
            if v.get(key) is None:
                return [key], "is required"
    return None


_PLAIN_INT = {"type", "minimum", "maximum", "description"}


def _suspects(items: dict, v: list):
    """The indices of ``v`` whose items ``problem`` must check against ``items``. An array of
    integers within bounds (token ids: a prompt, stop ids, /detokenize's tokens) is scanned in one
    pass, not item by item through the schema: 4M ids, under the body's size limit, took 11 s of
    the event loop that way, and every other request waited."""
    if items.get("type") != "integer" or not items.keys() <= _PLAIN_INT:
        return range(len(v))
    lo, hi = items.get("minimum", -math.inf), items.get("maximum", math.inf)
    if set(map(type, v)) <= {int} and (not v or lo <= min(v) and max(v) <= hi):
        return ()
    bad = next((i for i, x in enumerate(v) if type(x) is not int or not lo <= x <= hi), len(v))
    return range(bad, len(v))       # from the first one the scan doubts on, item by item


def path_text(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def param_of(path: list) -> str:
    """The parameter an error names: the top-level field, and inside an array of objects the
    item's field (``messages[0].content``)."""
    out = str(path[0])
    if len(path) >= 3 and isinstance(path[1], int) and isinstance(path[2], str):
        out += f"[{path[1]}].{path[2]}"
    return out


def validate(body: dict, schema: dict) -> None:
    """Raise a 400 naming the parameter when ``body`` breaks ``schema``. A null field counts as
    absent, as OpenAI's API treats it. Fields the schema does not name are ignored, as vLLM
    ignores them, and said in the log (as vLLM says them), once for each set of names."""
    if (p := problem(schema, body)) is not None:
        path, what = p
        param = param_of(path) if path else None
        raise bad_request(f"'{path_text(path)}' {what}" if path else f"the body {what}", param=param)
    if isinstance(body, dict) and not isinstance(schema.get("additionalProperties"), dict):
        unknown = sorted(k for k in body if k not in schema.get("properties", {}))
        if unknown:         # a few names, each cut short: the log is not the client's to fill
            _say_ignored(tuple(k[:64] for k in unknown[:8]) + ((f"and {len(unknown) - 8} more",) if len(unknown) > 8
                                                                 else ()))


@functools.lru_cache(maxsize=256)
def _say_ignored(names: tuple[str, ...]) -> None:
    """Log ``names`` as ignored fields; cached, so a client that always sends them is said once."""
    logging.getLogger("tandem.server").warning("fields present in a request but ignored (not parameters of its "
                                               "endpoint): %s", ", ".join(names))
