"""The OpenAPI 3.1 document served at /openapi.json. Request bodies are server.schema's dicts,
the same ones the server validates with; responses describe what the handlers return."""
from __future__ import annotations

from tandem.server.schema import (BATCH_BODY, CHAT_BODY, COMPLETION_BODY, DETOKENIZE_BODY, EXPIRES_AFTER,
                                  RESPONSES_BODY, TOKENIZE_BODY)

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
        "cached_tokens": {"type": "integer", "minimum": 0,
                          "description": "prompt tokens whose cache an earlier request had computed"}}}}}
FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", "abort", "error", None]}


IDS = {"type": "array", "items": {"type": "integer"}, "description": "with return_token_ids"}
STOP_REASON = {"type": ["string", "integer", "null"], "description": "vLLM's: the stop string or stop token id "
                                                                    "that ended the choice (null: the end token, "
                                                                    "max_tokens)"}
PROMPT_LOGPROBS = {"type": ["array", "null"], "items": {"type": ["object", "null"], "additionalProperties": {
    "type": "object", "required": ["logprob", "rank", "decoded_token"], "properties": {
        "logprob": {"type": "number"}, "rank": {"type": "integer", "minimum": 1},
        "decoded_token": {"type": "string"}}}},
    "description": "with prompt_logprobs: k (vLLM's): per prompt token null for the first, then the token's and "
                   "the k likeliest tokens' log probabilities and ranks, by token id"}


_BYTES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
_ALT = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
    "token": {"type": "string"}, "logprob": {"type": "number"}, "bytes": _BYTES}}
CHAT_LOGPROBS = {"type": ["object", "null"], "required": ["content"], "properties": {"content": {
    "type": "array", "items": {"type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
                               "properties": {**_ALT["properties"], "top_logprobs": {"type": "array",
                                                                                    "items": _ALT}}}}},
    "description": "with logprobs: true; each output token's log probability and top_logprobs alternatives"}
COMPLETION_LOGPROBS = {
    "type": ["object", "null"], "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                   "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                   "top_logprobs": {"type": "array", "items": {"type": ["object", "null"],
                                                                "additionalProperties": {"type": "number"}}},
                   "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
    "description": "with logprobs: k; each output token's log probability, the k likeliest and the sampled "
                   "one (with echo, the prompt's tokens first: the first one's null)"}


def _completion(object_name: str, choice: dict, **extra) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE, **extra,
        "service_tier": {"enum": ["default", "flex"], "description": "how it was served: flex best-effort (BE), "
                                                                     "default real-time (RT)"},
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                               "properties": {"index": {"type": "integer"},
                                                              "finish_reason": FINISH, "token_ids": IDS,
                                                              "stop_reason": STOP_REASON, **choice}}}}}


TOOL_CALLS = {"type": "array", "description": "the calls a chat with tools made (finish_reason tool_calls)",
              "items": {"type": "object", "required": ["id", "type", "function"], "properties": {
                  "id": {"type": "string"}, "type": {"const": "function"}, "index": {"type": "integer"},
                  "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                      "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON"}}}}}}
CHAT_COMPLETION = _completion("chat.completion", {"message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string", "description": "assistant; with add_generation_prompt false, "
                                                             "the role of the last message, whose turn it continues"},
                   "content": {"type": ["string", "null"]},
                   "tool_calls": TOOL_CALLS}},
    "logprobs": CHAT_LOGPROBS}, prompt_token_ids=IDS, prompt_logprobs=PROMPT_LOGPROBS)
COMPLETION = _completion("text_completion", {"text": {"type": "string"}, "prompt_token_ids": IDS,
                                             "logprobs": COMPLETION_LOGPROBS, "prompt_logprobs": PROMPT_LOGPROBS})
TOKENS = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "token_strs": {"type": "array", "items": {"type": "string"}, "description": "with return_token_strs"}}}
RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"], "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
    "status": {"enum": ["completed", "incomplete", "in_progress", "queued", "failed", "cancelled"]},
    "model": {"type": "string"}, "background": {"type": "boolean"},
    "error": {"type": ["object", "null"], "description": "why a background response failed"},
    "output": {"type": "array", "items": {"type": "object", "required": ["type", "role", "content"]}},
    "incomplete_details": {"type": ["object", "null"]}, "usage": {"type": ["object", "null"]}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": ["integer", "null"]},
    "root": {"type": "string", "description": "vLLM's: the model as --model named it"}, "parent": {"type": "null"},
    "permission": {"type": "array", "items": {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model_permission"}}}}}}
FILE = {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"], "properties": {
    "id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "filename": {"type": "string"}, "purpose": {"type": "string"},
    "expires_at": {"type": ["integer", "null"]}}}
COUNTS = {"type": "object", "required": ["total", "completed", "failed"],
          "properties": {k: {"type": "integer", "minimum": 0} for k in ("total", "completed", "failed")}}
BATCH = {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                                        "request_counts", "created_at"], "properties": {
    "id": {"type": "string"}, "object": {"const": "batch"}, "endpoint": {"type": "string"},
    "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
    "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                        "cancelling", "cancelled"]},
    "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
    "request_counts": COUNTS, "created_at": {"type": "integer"},
    "metadata": {"type": ["object", "null"]}, "model": {"type": ["string", "null"]},
    "usage": {"type": ["object", "null"], "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("input_tokens", "output_tokens", "total_tokens")}}}}


SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json"}, "event": {"type": "string"}}}


ID_OR_NULL = {"type": ["string", "null"]}


def _list(item: dict, **extra) -> dict:
    return {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": item}, "has_more": {"type": "boolean"},
        **extra}}


def _json(schema: dict, what: str) -> dict:
    return {"description": what, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, ok: dict, body: dict | None = None, params: list | None = None, open_: bool = False,
        stream: bool = False) -> dict:
    """One operation: its 200 response, every error as the OpenAI error object."""
    ok_resp = _json(ok, "success")
    if stream:      # each event's data: a JSON chunk (the same object, one token's worth), then [DONE]
        ok_resp["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    op = {"summary": summary, "responses": {"200": ok_resp, "default": _json(ERROR, "an error")}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    if open_:
        op["security"] = []
    return op


def _path_id(name: str) -> list:
    return [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}, "description": name}]


def _text_op(summary: str, body: dict) -> dict:
    """An operation answering plain text (vLLM's runtime LoRA routes), errors as OpenAI's."""
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "success", "content": {"text/plain": {"schema": {"type": "string"}}}},
                          "default": _json(ERROR, "an error")}}


def _lora_paths() -> dict:
    name = {"type": "string", "minLength": 1}
    return {"/v1/load_lora_adapter": {"post": _text_op(
                "serve a LoRA adapter from a directory on the server's machine", {
                    "type": "object", "required": ["lora_name", "lora_path"],
                    "properties": {"lora_name": name, "lora_path": name}})},
            "/v1/unload_lora_adapter": {"post": _text_op("serve a LoRA adapter no more", {
                "type": "object", "required": ["lora_name"], "properties": {"lora_name": name}})}}


def document(version: str = "0.1.0", root_path: str = "", runtime_lora: bool = False) -> dict:
    """The OpenAPI document; ``root_path``: the prefix a proxy serves the API under (its server URL);
    ``runtime_lora``: with the routes that load and unload LoRA adapters."""
    upload = {"type": "object", "required": ["purpose", "file"], "properties": {
        "purpose": {"enum": ["batch", "user_data"]}, "file": {"type": "string", "format": "binary"},
        "expires_after": EXPIRES_AFTER}}
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    query = lambda name, schema: {"name": name, "in": "query", "required": False, "schema": schema}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tandem", "version": version,
                 "description": "OpenAI-compatible LLM server co-serving real-time chat and batch jobs"},
        **({"servers": [{"url": root_path}]} if root_path else {}),
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": _op("chat completion (stream: server-sent events)", CHAT_COMPLETION,
                                                 CHAT_BODY, stream=True)},
            "/v1/completions": {"post": _op("text completion (stream: server-sent events)", COMPLETION,
                                            COMPLETION_BODY, stream=True)},
            "/v1/responses": {"post": _op("a response (OpenAI's Responses API; stream: typed server-sent events)",
                                          RESPONSE, RESPONSES_BODY, stream=True)},
            "/v1/responses/{id}": {"get": _op("a kept response; with stream=true a background response's events, "
                                              "those after starting_after", RESPONSE, stream=True,
                                              params=_path_id("response id") + [
                                                  query("stream", {"type": "boolean"}),
                                                  query("starting_after", {"type": "integer", "minimum": -1})]),
                                   "delete": _op("forget a kept response", {"type": "object",
                                                                            "required": ["id", "deleted"]},
                                                 params=_path_id("response id"))},
            "/v1/responses/{id}/cancel": {"post": _op("stop a background response that is still running",
                                                      RESPONSE, params=_path_id("response id"))},
            "/v1/responses/{id}/input_items": {"get": _op(
                "a kept response's input items", _list({"type": "object", "required": ["id", "type"]},
                                                       first_id=ID_OR_NULL, last_id=ID_OR_NULL),
                params=_path_id("response id") + [
                    query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                    query("order", {"enum": ["asc", "desc"]}), query("after", {"type": "string"})])},
            "/tokenize": {"post": _op("a prompt's token ids (text, or chat messages through the template)",
                                      TOKENS, TOKENIZE_BODY)},
            "/detokenize": {"post": _op("token ids to text", {"type": "object", "required": ["prompt"], "properties": {
                "prompt": {"type": "string"}}}, DETOKENIZE_BODY)},
            "/v1/models": {"get": _op("the served model, then its LoRA adapters", _list(MODEL))},
            "/v1/models/{id}": {"get": _op("a model by id", MODEL, params=_path_id("model id"))},
            "/v1/files": {
                "post": {**_op("upload a file", FILE), "requestBody": {"required": True, "content": {
                    "multipart/form-data": {"schema": upload}}}},
                "get": _op("list files", _list(FILE, first_id=ID_OR_NULL, last_id=ID_OR_NULL), params=[
                    query("purpose", {"type": "string"}),
                    query("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}),
                    query("order", {"enum": ["asc", "desc"]}), query("after", {"type": "string"})])},
            "/v1/files/{id}": {"get": _op("a file", FILE, params=_path_id("file id")),
                               "delete": _op("delete a file", {"type": "object", "required": ["id", "deleted"]},
                                             params=_path_id("file id"))},
            "/v1/files/{id}/content": {"get": {**_op("a file's bytes", {}, params=_path_id("file id")),
                                               "responses": {"200": {"description": "the bytes", "content": {
                                                   "application/octet-stream": {"schema": {"type": "string"}}}},
                                                   "default": _json(ERROR, "an error")}}},
            "/v1/batches": {
                "post": _op("create a batch", BATCH, BATCH_BODY),
                "get": _op("list batches", _list(BATCH), params=[
                    query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                    query("after", {"type": "string"})])},
            "/v1/batches/{id}": {"get": _op("a batch", BATCH, params=_path_id("batch id"))},
            "/v1/batches/{id}/cancel": {"post": _op("cancel a batch", BATCH, params=_path_id("batch id"))},
            "/health": {"get": {"summary": "200 when a device serves, else 503", "security": [], "responses": {
                "200": _json(status, "serving"), "503": _json(status, "loading, failed or no device")}}},
            "/ping": {m: {"summary": "as /health (vLLM's, for load balancers)", "security": [], "responses": {
                "200": _json(status, "serving"), "503": _json(status, "loading, failed or no device")}}
                for m in ("get", "post")},
            "/version": {"get": {"summary": "the server's version", "security": [], "responses": {"200": _json(
                {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
                "version")}}},
            "/load": {"get": {"summary": "requests in flight (vLLM's, for load balancers)", "security": [],
                              "responses": {"200": _json({"type": "object", "required": ["server_load"], "properties": {
                                  "server_load": {"type": "integer", "minimum": 0}}}, "load")}}},
            "/status": {"get": _op("the dashboard's data", {"type": "object", "required": ["devices", "slo"]},
                                   open_=True)},
            "/metrics": {"get": {"summary": "Prometheus text", "security": [], "responses": {"200": {
                "description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/dashboard": {"get": {"summary": "the live dashboard", "security": [], "responses": {"200": {
                "description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "security": [], "responses": {
                "200": _json({"type": "object"}, "OpenAPI 3.1")}}},
            **(_lora_paths() if runtime_lora else {}),
        },
    }
