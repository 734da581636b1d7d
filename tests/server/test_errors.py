"""Malformed requests: each gets the right status and OpenAI error shape, and the server stays healthy."""
import gzip
import json
import urllib.error
import zlib
import urllib.request

import pytest

from tests.server.conftest import call

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 5000          # far past the tiny model's 512-token context
FILES = "/v1/files"
GOOD_PART = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B--\r\n')
NESTED_PART = (b'--B\r\nContent-Disposition: form-data; name="file"\r\nContent-Type: multipart/mixed; boundary=C'
               b'\r\n\r\n--C\r\n\r\nx\r\n--C--\r\n--B--\r\n')
FILE_ONLY_PART = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\r\n--B--\r\n')
NOT_UTF8_NAME_PART = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
                      b'Content-Disposition: form-data; name="file"; filename="\xff\xfe.jsonl"\r\n\r\n{}\r\n--B--\r\n')
SUPERSCRIPT_EXPIRY_PART = ('--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
                           'Content-Disposition: form-data; name="expires_after[anchor]"\r\n\r\ncreated_at\r\n--B\r\n'
                           'Content-Disposition: form-data; name="expires_after[seconds]"\r\n\r\n\u00b3\u2076\u2070\u2070\r\n'
                           '--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\r\n'
                           '--B--\r\n').encode()
CHARSET_PART = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\nContent-Type: text/plain; '
                b'charset=no-such-charset\r\n\r\nbatch\r\n--B--\r\n')


def multipart(content_type: str):
    """Headers for an upload with this Content-Type (and the server's key)."""
    return lambda server: {**server.headers(), "Content-Type": content_type}

def encoded(encoding: str, content_type: str = "application/json"):
    """Headers for a body sent with this Content-Encoding (and the server's key)."""
    return lambda server: {**server.headers(), "Content-Type": content_type, "Content-Encoding": encoding}


def expecting(what: str):
    """Headers with this ``Expect`` (and the server's key)."""
    return lambda server: {**server.headers(), "Expect": what}


ASK = b'{"prompt": "a", "max_tokens": 2}'


# values nested within the JSON parser's 1,024 levels, but past the server's 128 (written as text:
# this process could not write them either); and JSON inside a string, past Python's recursion limit
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 510 + '{"type": "object"}' + "}}" * 510
DEEP_ITEMS = '{"items": ' * 1015 + "{}" + "}" * 1015
DEEP_TOOLS = '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": ' \
    '{"name": "f", "parameters": %s}}]}' % DEEP_ITEMS
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES = [
    # (name, method, path, raw body or dict, headers override, status, error type, param)
    ("malformed json", "POST", CHAT, b"{not json", None, 400, "invalid_request_error", None),
    ("body is a list", "POST", CHAT, b"[1,2]", None, 400, "invalid_request_error", None),
    ("empty body", "POST", COMP, b"", None, 400, "invalid_request_error", None),
    ("no messages", "POST", CHAT, {"model": "M"}, None, 400, "invalid_request_error", "messages"),
    ("messages not a list", "POST", CHAT, {"messages": "hi"}, None, 400, "invalid_request_error", "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, None, 400, "invalid_request_error", "messages"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "invalid_request_error", "messages[0].role"),
    ("content not string", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400,
     "invalid_request_error", "messages[0].content"),
    ("image content part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "invalid_request_error",
     "messages[0].content"),
    ("max_tokens zero", "POST", CHAT, {"messages": MSG, "max_tokens": 0}, None, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens negative", "POST", COMP, {"prompt": "a", "max_tokens": -5}, None, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens string", "POST", COMP, {"prompt": "a", "max_tokens": "10"}, None, 400, "invalid_request_error", "max_tokens"),
    ("max_completion_tokens float", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 1.5}, None, 400,
     "invalid_request_error", "max_completion_tokens"),
    ("temperature too high", "POST", CHAT, {"messages": MSG, "temperature": 3}, None, 400, "invalid_request_error", "temperature"),
    ("temperature string", "POST", CHAT, {"messages": MSG, "temperature": "hot"}, None, 400, "invalid_request_error", "temperature"),
    ("top_p zero", "POST", COMP, {"prompt": "a", "top_p": 0}, None, 400, "invalid_request_error", "top_p"),
    ("top_p above one", "POST", COMP, {"prompt": "a", "top_p": 1.2}, None, 400, "invalid_request_error", "top_p"),
    ("min_p above one", "POST", COMP, {"prompt": "a", "min_p": 1.5}, None, 400, "invalid_request_error", "min_p"),
    ("top_k below -1", "POST", COMP, {"prompt": "a", "top_k": -3}, None, 400, "invalid_request_error", "top_k"),
    ("n zero", "POST", CHAT, {"messages": MSG, "n": 0}, None, 400, "invalid_request_error", "n"),
    ("n too large", "POST", CHAT, {"messages": MSG, "n": 1000}, None, 400, "invalid_request_error", "n"),
    ("too many stop ids", "POST", COMP, {"prompt": "a", "stop_token_ids": [1] * 4097}, None, 400,
     "invalid_request_error", "stop_token_ids"),
    ("seed string", "POST", COMP, {"prompt": "a", "seed": "x"}, None, 400, "invalid_request_error", "seed"),
    ("stop token id past the vocabulary", "POST", CHAT, {"messages": MSG, "max_tokens": 4, "min_tokens": 1,
     "stop_token_ids": [10 ** 6]}, None, 400, "invalid_request_error", "stop_token_ids"),
    ("stop not strings", "POST", COMP, {"prompt": "a", "stop": [1, 2]}, None, 400, "invalid_request_error", "stop"),
    ("stop empty string", "POST", COMP, {"prompt": "a", "stop": ""}, None, 400, "invalid_request_error", "stop"),
    ("stop string of 1 MiB", "POST", COMP, {"prompt": "a", "stop": "x" * (1 << 20)}, None, 400,
     "invalid_request_error", "stop"),
    ("too many stop strings", "POST", COMP, {"prompt": "a", "stop": ["s"] * 17}, None, 400,
     "invalid_request_error", "stop"),
    ("stream not bool", "POST", COMP, {"prompt": "a", "stream": "yes"}, None, 400, "invalid_request_error", "stream"),
    ("stream_options without stream", "POST", COMP, {"prompt": "a", "stream_options": {"include_usage": True}},
     None, 400, "invalid_request_error", "stream_options"),
    ("continuous usage stats", "POST", COMP, {"prompt": "a", "stream": True, "stream_options": {
        "continuous_usage_stats": True}}, None, 400, "invalid_request_error", "stream_options.continuous_usage_stats"),
    # vLLM's fields this server does not implement are refused, not silently ignored
    *[(f"vLLM's {k}", "POST", path, {**body, k: v}, None, 400, "invalid_request_error", k) for path, body, k, v in [
        (COMP, {"prompt": "a"}, "logits_processors", ["x"]),
        (CHAT, {"messages": MSG}, "chat_template_kwargs", {"tokenize": True}),
        (CHAT, {"messages": MSG}, "documents", "x"), (COMP, {"prompt": "a"}, "priority", 3)]],
    # and those it implements refuse what vLLM refuses, naming the field
    *[(f"{k} {why}", "POST", path, {**body, k: v}, None, 400, "invalid_request_error", k) for path, body, k, v, why in [
        (COMP, {"prompt": "a"}, "allowed_token_ids", [], "empty"),
        (COMP, {"prompt": "a"}, "allowed_token_ids", [5, 49152], "outside the vocabulary"),
        (CHAT, {"messages": MSG, "guided_choice": ["x"]}, "allowed_token_ids", [5], "with a grammar"),
        (CHAT, {"messages": MSG}, "bad_words", [""], "with an empty word"),
        (CHAT, {"messages": MSG}, "bad_words", "x", "not a list"),
        (COMP, {"prompt": "a", "allowed_token_ids": [2], "max_tokens": 3}, "min_tokens", 1,
         "holding back the only allowed token, a stop"),
        (COMP, {"prompt": "a"}, "truncate_prompt_tokens", 0, "of zero"),
        (COMP, {"prompt": "a"}, "truncate_prompt_tokens", -2, "below -1"),
        (COMP, {"prompt": "a"}, "truncate_prompt_tokens", 1 << 20, "past the context"),
        (CHAT, {"messages": MSG}, "skip_special_tokens", "no", "not a boolean"),
        (CHAT, {"messages": MSG}, "chat_template", "{{ messages }}", "from a request the server does not trust"),
        ("/tokenize", {"messages": MSG}, "chat_template", "{{ messages }}", "to /tokenize, not trusted"),
        (COMP, {"prompt": "a"}, "length_penalty", "x", "not a number")]],
    # a beam search takes each step's likeliest tokens as the model gives them: what would change
    # them is refused with it, naming the field
    *[(f"beam search with {k}", "POST", path, {**body, "use_beam_search": True, k: v}, None, 400,
       "invalid_request_error", k) for path, body, k, v in [
        (COMP, {"prompt": "a", "logprobs": 1}, "echo", True), (COMP, {"prompt": "a"}, "prompt_logprobs", 1),
        (COMP, {"prompt": "a"}, "stop", "x"), (COMP, {"prompt": "a"}, "length_penalty", 1e300),
        (CHAT, {"messages": MSG}, "top_p", 0.5),
        (CHAT, {"messages": MSG}, "tools", [TOOL]), (COMP, {"prompt": "a"}, "guided_choice", ["x"]),
        (CHAT, {"messages": MSG}, "response_format", {"type": "json_object"}),
        (COMP, {"prompt": "a"}, "repetition_penalty", 1.2), (COMP, {"prompt": "a"}, "n", 11)]],
    ("min_tokens over max", "POST", COMP, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, None, 400,
     "invalid_request_error", "min_tokens"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, None, 400,
     "invalid_request_error", "top_logprobs"),
    ("top_logprobs past 20", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None, 400,
     "invalid_request_error", "top_logprobs"),
    ("chat logprobs not a boolean", "POST", CHAT, {"messages": MSG, "logprobs": 3}, None, 400,
     "invalid_request_error", "logprobs"),
    ("completion logprobs past 20", "POST", COMP, {"prompt": "a", "logprobs": 21}, None, 400,
     "invalid_request_error", "logprobs"),
    ("a chat's echo not a boolean", "POST", CHAT, {"messages": MSG, "echo": "yes"}, None, 400,
     "invalid_request_error", "echo"),
    ("tools in a completion", "POST", COMP, {"prompt": "a", "tools": [TOOL]}, None, 400,
     "invalid_request_error", "tools"),
    ("tool without a function", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400,
     "invalid_request_error", "tools[0].function"),
    ("tool name with a space", "POST", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, None, 400, "invalid_request_error",
     "tools[0].function"),
    ("two tools of one name", "POST", CHAT, {"messages": MSG, "tools": [TOOL, TOOL]}, None, 400,
     "invalid_request_error", "tools"),
    ("tool_choice naming no tool", "POST", CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, None, 400, "invalid_request_error", "tool_choice"),
    ("guided_json that is no JSON beside tools", "POST", CHAT, {"messages": MSG, "tools": [TOOL],
        "guided_json": "{not json"}, None, 400, "invalid_request_error", "guided_json"),
    ("response format of no known type beside tools", "POST", CHAT, {"messages": MSG, "tools": [TOOL],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     None, 400, "invalid_request_error", "response_format"),
    ("text.format of no known type beside tools", "POST", "/v1/responses", {"input": "a", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}], "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, None, 400, "invalid_request_error",
     "text.format"),
    ("a user's refusal part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "refusal", "refusal": "no"}]}]}, None, 400, "invalid_request_error", "messages[0].content"),
    ("an image part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None, 400, "invalid_request_error",
     "messages[0].content"),
    ("tool_choice without tools", "POST", CHAT, {"messages": MSG, "tool_choice": "required"}, None, 400,
     "invalid_request_error", "tool_choice"),
    ("required tool call and a response format", "POST", CHAT, {
        "messages": MSG, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     None, 400, "invalid_request_error", "tool_choice"),
    ("tool parameters that are no schema", "POST", CHAT, {"messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, None, 400,
     "invalid_request_error", "tools"),
    ("message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, None, 400,
     "invalid_request_error", "messages[0].content"),
    ("tool result answering no call", "POST", CHAT, {"messages": [*MSG, {"role": "tool", "content": "3"}]}, None, 400,
     "invalid_request_error", "messages[1].tool_call_id"),
    ("tool result answering a call never made", "POST", CHAT, {"messages": [
        *MSG, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"}]},
     None, 400, "invalid_request_error", "messages[3].tool_call_id"),
    ("deprecated functions", "POST", CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, None, 400,
     "invalid_request_error", "functions"),
    ("presence penalty past 2", "POST", CHAT, {"messages": MSG, "presence_penalty": 2.5}, None, 400,
     "invalid_request_error", "presence_penalty"),
    ("repetition penalty 0", "POST", COMP, {"prompt": "a", "repetition_penalty": 0}, None, 400,
     "invalid_request_error", "repetition_penalty"),
    ("invalid regex", "POST", COMP, {"prompt": "a", "structured_outputs": {"regex": "[a-"}}, None, 400,
     "invalid_request_error", "structured_outputs"),
    ("two structured outputs", "POST", CHAT, {"messages": MSG, "response_format": {"type": "json_object"},
                                              "guided_choice": ["a"]}, None, 400, "invalid_request_error",
     "guided_choice"),
    ("json schema of no known type", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, None, 400,
     "invalid_request_error", "response_format"),
    ("json_schema format without its schema", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema"}}, None, 400, "invalid_request_error", "response_format"),
    ("unknown response format", "POST", CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, None, 400,
     "invalid_request_error", "response_format"),
    ("guided_json not JSON", "POST", COMP, {"prompt": "a", "guided_json": "{no"}, None, 400,
     "invalid_request_error", "guided_json"),
    ("unknown structured output", "POST", COMP, {"prompt": "a", "structured_outputs": {"structural_tag": "x"}},
     None, 400, "invalid_request_error", "structured_outputs"),
    ("grammar that does not parse", "POST", COMP, {"prompt": "a", "structured_outputs": {"grammar": "start: ("}},
     None, 400, "invalid_request_error", "structured_outputs"),
    ("whitespace pattern with nothing to apply to", "POST", COMP, {"prompt": "a", "guided_whitespace_pattern": " "},
     None, 400, "invalid_request_error", "guided_whitespace_pattern"),
    ("whitespace pattern of a regex", "POST", COMP, {"prompt": "a", "structured_outputs": {
        "regex": "a", "whitespace_pattern": " "}}, None, 400, "invalid_request_error", "structured_outputs"),
    ("choice only a special token spells", "POST", COMP, {"prompt": "a", "guided_choice": ["<|im_end|>"]},
     None, 400, "invalid_request_error", "guided_choice"),
    ("bad service tier", "POST", CHAT, {"messages": MSG, "service_tier": "turbo"}, None, 400,
     "invalid_request_error", "service_tier"),
    ("bad slo", "POST", CHAT, {"messages": MSG, "slo_ttft_ms": -1}, None, 400, "invalid_request_error", "slo_ttft_ms"),
    ("empty prompt", "POST", COMP, {"prompt": ""}, None, 400, "invalid_request_error", "prompt"),
    ("prompt wrong type", "POST", COMP, {"prompt": {"text": "a"}}, None, 400, "invalid_request_error", "prompt"),
    ("token id out of vocab", "POST", COMP, {"prompt": [1, 2, 10 ** 9]}, None, 400, "invalid_request_error", "prompt"),
    ("prompt too long", "POST", COMP, {"prompt": LONG}, None, 400, "invalid_request_error", "prompt"),
    ("prompt of 2 million characters", "POST", COMP, {"prompt": "x" * 2_000_000}, None, 400,
     "invalid_request_error", "prompt"),
    ("chat of 2 million characters", "POST", CHAT, {"messages": [{"role": "user", "content": "x" * 2_000_000}]},
     None, 400, "invalid_request_error", "messages"),
    ("body over the size limit", "POST", COMP, b'{"prompt": "' + b"x" * (9 << 20) + b'"}', None, 413,
     "invalid_request_error", None),
    ("chat too long", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, None, 400,
     "invalid_request_error", "messages"),
    ("max_tokens past context", "POST", COMP, {"prompt": "a", "max_tokens": 100000}, None, 400,
     "invalid_request_error", "max_tokens"),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, None, 404, "invalid_request_error", "model"),
    ("model not string", "POST", CHAT, {"model": 3, "messages": MSG}, None, 400, "invalid_request_error", "model"),
    ("missing key", "POST", CHAT, {"messages": MSG}, {}, 401, "invalid_request_error", None),
    ("wrong key", "POST", CHAT, {"messages": MSG}, {"Authorization": "Bearer nope"}, 401, "invalid_request_error", None),
    ("key not UTF-8", "POST", CHAT, {"messages": MSG}, {"Authorization": "Bearer \xff\xfe"}, 401,
     "invalid_request_error", None),
    ("unknown path", "GET", "/v1/nothing", None, None, 404, "not_found_error", None),
    ("no embeddings API", "POST", "/v1/embeddings", {"input": "a"}, None, 404, "not_found_error", None),
    ("wrong method", "GET", CHAT, None, None, 405, "invalid_request_error", None),
    ("upload without a purpose", "POST", FILES, FILE_ONLY_PART, multipart("multipart/form-data; boundary=B"), 400,
     "invalid_request_error", "purpose"),
    ("batch of a file that does not exist", "POST", "/v1/batches", {
        "input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, None, 404,
     "invalid_request_error", "input_file_id"),
    ("upload not multipart", "POST", FILES, b"purpose=batch", multipart("text/plain"), 400,
     "invalid_request_error", None),
    ("multipart without boundary", "POST", FILES, GOOD_PART, multipart("multipart/form-data"), 400,
     "invalid_request_error", None),
    ("multipart with the wrong boundary", "POST", FILES, GOOD_PART, multipart("multipart/form-data; boundary=Z"),
     400, "invalid_request_error", None),
    ("multipart cut off", "POST", FILES, GOOD_PART[:40], multipart("multipart/form-data; boundary=B"), 400,
     "invalid_request_error", None),
    ("multipart nested in a part", "POST", FILES, NESTED_PART, multipart("multipart/form-data; boundary=B"), 400,
     "invalid_request_error", None),
    ("purpose in an unknown charset", "POST", FILES, CHARSET_PART, multipart("multipart/form-data; boundary=B"),
     400, "invalid_request_error", None),
    ("structured outputs naming no constraint", "POST", COMP, {"prompt": "a", "structured_outputs": {}}, None, 400,
     "invalid_request_error", "structured_outputs"),
    ("gzip that is not gzip", "POST", COMP, ASK, encoded("gzip"), 400, "invalid_request_error", None),
    ("gzip cut off", "POST", COMP, gzip.compress(ASK)[:-12], encoded("gzip"), 400, "invalid_request_error", None),
    ("deflate that is not deflate", "POST", CHAT, ASK, encoded("deflate"), 400, "invalid_request_error", None),
    ("gzip over the size limit once decoded", "POST", COMP, gzip.compress(b'{"prompt": "' + b"x" * (9 << 20) + b'"}'),
     encoded("gzip"), 413, "invalid_request_error", None),
    ("brotli", "POST", COMP, ASK, encoded("br"), 415, "invalid_request_error", None),
    ("zstd", "POST", "/tokenize", ASK, encoded("zstd"), 415, "invalid_request_error", None),
    ("upload named in bytes that are not UTF-8", "POST", FILES, NOT_UTF8_NAME_PART,
     multipart("multipart/form-data; boundary=B"), 400, "invalid_request_error", "file"),
    ("upload expiry in superscript digits", "POST", FILES, SUPERSCRIPT_EXPIRY_PART,
     multipart("multipart/form-data; boundary=B"), 400, "invalid_request_error", "expires_after"),
    ("logit_bias value null", "POST", CHAT, {"messages": MSG, "logit_bias": {"1": None}}, None, 400,
     "invalid_request_error", "logit_bias"),
    ("metadata value null", "POST", "/v1/responses", {"input": "a", "metadata": {"k": None}}, None, 400,
     "invalid_request_error", "metadata"),
    ("schema past the nesting limit, closed", "POST", CHAT, ('{"messages": [{"role": "user", "content": "hi"}], '
     '"structured_outputs": {"disable_additional_properties": true, "json": %s}}' % DEEP_SCHEMA).encode(), None,
     400, "invalid_request_error", None),
    ("schema text past the recursion limit", "POST", COMP, {"prompt": "a", "guided_json": "[" * 5000 + "]" * 5000},
     None, 400, "invalid_request_error", "guided_json"),
    ("tool schema past the nesting limit", "POST", CHAT, DEEP_TOOLS.encode(), None, 400, "invalid_request_error",
     None),
    ("tool schema past the nesting limit, tokenized", "POST", "/tokenize", DEEP_TOOLS.encode(), None, 400,
     "invalid_request_error", None),
    ("template arguments past the nesting limit", "POST", CHAT, ('{"messages": [{"role": "user", "content": "hi"}], '
     '"chat_template_kwargs": {"x": %s}}' % ("[" * 900 + "]" * 900)).encode(), None, 400, "invalid_request_error",
     None),
    ("call arguments past the recursion limit", "POST", CHAT, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}, {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "user", "content": "hi"}]}, None, 400, "invalid_request_error", None),
    ("compressed upload", "POST", FILES, gzip.compress(GOOD_PART), encoded("gzip", "multipart/form-data; boundary=B"),
     415, "invalid_request_error", None),
    ("expectation other than 100-continue", "POST", COMP, ASK, expecting("200-ok"), 417, "invalid_request_error",
     "Expect"),
    ("expectation on a read", "GET", "/v1/models", None, expecting("x"), 417, "invalid_request_error", "Expect"),
]


@pytest.mark.parametrize("name, method, path, body, headers, status, etype, param", CASES,
                         ids=[c[0] for c in CASES])
def test_malformed_request(server, name, method, path, body, headers, status, etype, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body = dict(body, model=server.model)
    got, payload = call(server, method, path, body, headers)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"] and ".py" not in err["message"], "no internals in errors"
    assert err["type"] == etype
    if status == 404 and err["param"] is None:                  # a path the server does not have says so
        assert err["message"] == f"{method} {path} is not an operation of this server (GET /openapi.json " \
            "lists them)"
    if param is not None:
        assert err["param"] == param
    assert call(server, "GET", "/health", None, None) == (200, {"status": "ok"}), "healthy after a bad request"
    ok, _ = call(server, "POST", COMP, {"prompt": "a", "max_tokens": 2}, None)
    assert ok == 200, "the server must keep serving after a bad request"


def test_an_integer_past_64_bits_is_refused_as_too_large(server):
    """JSON has no integer size; the body's parser reads one past 64 bits as a float, which the
    error called a float."""
    raw = b'{"prompt": "a", "max_tokens": 100000000000000000000000}'
    got, payload = call(server, "POST", COMP, raw)
    assert got == 400 and payload["error"]["param"] == "max_tokens", payload
    assert "at most 64 bits" in payload["error"]["message"] and "float" not in payload["error"]["message"]
    for other in (b"2.5", b"3.0"):
        got, payload = call(server, "POST", COMP, b'{"prompt": "a", "max_tokens": ' + other + b"}")
        assert got == 400 and payload["error"]["message"].endswith("got float"), payload


def test_a_body_nests_at_most_128_levels(server):
    """The body, its chat_template_kwargs and 126 lists are 128 levels: served; one list more is
    refused, naming the limit."""
    for lists, status in ((126, 200), (127, 400)):
        body = {"messages": MSG, "max_tokens": 1, "chat_template_kwargs": {"x": json.loads("[" * lists + "]" * lists)}}
        got, payload = call(server, "POST", CHAT, body)
        assert got == status, payload
    assert payload["error"]["message"] == "the request body nests deeper than 128 levels"


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": MSG, "logprobs": False, "top_logprobs": 0}),
    (COMP, {"prompt": "a", "best_of": 1, "logprobs": None, "echo": False, "suffix": ""}),
    (CHAT, {"messages": MSG, "modalities": ["text"]}),
    (CHAT, {"messages": MSG, "modalities": [], "priority": False, "best_of": None}),
    (CHAT, {"messages": MSG, "skip_special_tokens": True, "spaces_between_special_tokens": False, "min_p": 0,
            "length_penalty": 1.0, "priority": 0, "use_beam_search": False, "bad_words": [],
            "chat_template_kwargs": {}, "stream_options": None}),
])
def test_unsupported_fields_that_ask_for_nothing_are_accepted(server, path, body):
    """What OpenAI's SDKs and eval harnesses send as their defaults is served, not refused."""
    got, payload = call(server, "POST", path, dict(body, max_tokens=2), None)
    assert got == 200, payload
    assert payload["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_bearer_scheme_is_case_insensitive(server, scheme):
    key = server.headers()["Authorization"].split(" ", 1)[1]
    got, payload = call(server, "POST", COMP, {"prompt": "a", "max_tokens": 2},
                        {"Authorization": f"{scheme} {key}"})
    assert got == 200, payload


def test_405_says_which_methods_are_allowed(server):
    """RFC 9110: a 405 carries Allow; the JSON error body keeps it."""
    req = urllib.request.Request(server.url + "/v1/models", headers=server.headers(), method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 405
    assert "GET" in {m.strip() for m in e.value.headers.get("Allow", "").split(",")}
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("encoding, pack", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                            ("identity", bytes)])
def test_a_compressed_body_is_read_as_the_same_body_plain(server, encoding, pack):
    body = {"prompt": "Hello, compressed world", "max_tokens": 3, "temperature": 0}
    plain = call(server, "POST", COMP, body, None)
    got = call(server, "POST", COMP, pack(json.dumps(body).encode()), encoded(encoding))
    assert plain[0] == got[0] == 200, got
    assert got[1]["choices"][0]["text"] == plain[1]["choices"][0]["text"]
    assert got[1]["usage"] == plain[1]["usage"]


@pytest.mark.parametrize("path, body", [(COMP, {"prompt": [5] * 600}), (COMP, {"prompt": "x" * 2_000_000}),
                                        (CHAT, {"messages": [{"role": "user", "content": "x" * 2_000_000}]})])
def test_a_prompt_past_the_context_says_so_in_its_code(server, path, body):
    """Whether the prompt's tokens were counted or its characters alone tell (before tokenizing)."""
    got, payload = call(server, "POST", path, body, None)
    assert got == 400 and payload["error"]["code"] == "context_length_exceeded", payload


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_output_past_the_context_names_the_field_that_asked_for_it(server, field):
    got, payload = call(server, "POST", CHAT, {"messages": MSG, field: 600}, None)
    assert got == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    assert payload["error"]["param"] == field and f"{field} asks for 600" in payload["error"]["message"], payload


@pytest.mark.parametrize("prompt", [["a"] * 65, [[1, 2]] * 65])
def test_too_many_prompts_are_refused_as_too_many(server, prompt):
    got, payload = call(server, "POST", COMP, {"prompt": prompt, "max_tokens": 1}, None)
    assert got == 400 and "at most 64 items" in payload["error"]["message"], payload


def test_a_request_expecting_100_continue_is_served(server):
    """The one expectation HTTP/1.1 defines is met: the client sends its body only once the
    interim 100 came, then gets the answer."""
    import socket
    host, port = server.url.removeprefix("http://").split(":")
    head = (f"POST {COMP} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(ASK)}\r\nExpect: 100-Continue\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in server.headers().items()) + "\r\n")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode())
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += s.recv(1)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        s.sendall(ASK)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"][0]["text"] is not None, answer
