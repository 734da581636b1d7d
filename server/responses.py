"""OpenAI's Responses API, ``POST /v1/responses``, over the chat path.

The request's ``instructions`` (a system message) and ``input`` (a user's text, or messages of
text parts) become a chat; ``max_output_tokens`` its max_tokens, ``text.format`` its
response_format (a JSON schema or any JSON object). The reply is one output message: in the
response object, or streamed as the API's typed events (``response.created``, then
``response.output_text.delta`` per piece of text, ..., ``response.completed``). A reply cut off
by ``max_output_tokens`` is ``incomplete``. Responses are not kept (``store`` is accepted, there
is no ``GET /v1/responses/{id}``), so ``previous_response_id`` is refused, as are tools, with a
400 naming the field.
"""
from __future__ import annotations

import time

import orjson
from aiohttp import web

from tandem.server.app import (STATE, Choice, Prepared, all_or_none, complete, json_response, new_choices,
                               prepare_online, read_json, ready_engine, run_choice, usage)
from tandem.server.errors import ApiError, bad_request
from tandem.server.protocol import reject_unsupported
from tandem.server.schema import RESPONSES_BODY, RESPONSES_UNSUPPORTED, validate

PASSED = ("model", "temperature", "top_p", "top_k", "seed", "stream", "service_tier", "slo_ttft_ms", "slo_tbt_ms",
          "user", "cache_salt", "ignore_eos", "min_tokens")
# chat fields the translation writes -> the Responses fields they came from (for error messages)
RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)


def chat_body(body: dict) -> dict:
    """The chat completion request a Responses request asks for (raises ApiError)."""
    validate(body, RESPONSES_BODY)
    reject_unsupported(body, RESPONSES_UNSUPPORTED)
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    inp = body["input"]
    for m in [{"role": "user", "content": inp}] if isinstance(inp, str) else inp:
        content = m["content"]
        parts = content if isinstance(content, str) else [{"type": "text", "text": p["text"]} for p in content]
        messages.append({"role": m["role"], "content": parts})
    chat = {k: body[k] for k in PASSED if body.get(k) is not None} | {"messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        if "name" not in fmt:
            raise bad_request("'text.format.name' is required with type json_schema", param="text.format.name")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return chat


def _renamed(e: ApiError) -> ApiError:
    """An error about the chat a request became, naming the Responses fields it came from."""
    for chat_name, name in RENAMED:
        e.message = e.message.replace(chat_name, name)
        if e.param is not None and e.param.startswith(chat_name):
            e.param = name + e.param[len(chat_name):]
    e.args = (e.message,)
    return e


async def create(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    engine = ready_engine(request)
    body = await read_json(request)
    try:
        p = await prepare_online(engine, st, chat_body(body), chat=True)
    except ApiError as e:
        raise _renamed(e) from None
    created = int(time.time())
    if body.get("stream"):
        try:
            return await _stream(request, st, p, body, created)
        finally:
            p.close()
    out = await complete(engine, st, p, chat=True)
    c = out["choices"][0]
    return json_response(response_json(p, body, created, c["message"]["content"] or "", c["finish_reason"],
                                       out["usage"]))


def _ids(p: Prepared) -> tuple[str, str]:
    """The response's id and its output message's, from the chat's."""
    tail = p.rid.split("-", 1)[1]
    return "resp_" + tail, "msg_" + tail


def _message(p: Prepared, text: str | None, finish: str | None) -> dict:
    """The output message: in progress (no ``text`` yet), else whole."""
    status = "in_progress" if text is None else "incomplete" if finish == "length" else "completed"
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": _ids(p)[1], "type": "message", "status": status, "role": "assistant", "content": content}


def response_json(p: Prepared, body: dict, created: int, text: str | None, finish: str | None,
                  chat_usage: dict | None) -> dict:
    """The response object: in progress while ``text`` is None, else with its output and usage."""
    if text is None:
        status, details, output = "in_progress", None, []
    else:
        cut = finish == "length"
        status, details = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        output = [_message(p, text, finish)]
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    u = None if chat_usage is None else {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"]}
    return {"id": _ids(p)[0], "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": details, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "model": p.model, "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "flex" if body.get("service_tier") == "flex" else "default",
            "store": False, "temperature": body.get("temperature", 1.0), "text": {"format": fmt},
            "tool_choice": "auto", "tools": [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
            "usage": u, "user": body.get("user")}


async def _stream(request, st, p: Prepared, body: dict, created: int) -> web.StreamResponse:
    """The Responses API's events: the response created and in progress, the message and its
    text part added, a delta per piece of text, the text, part and message done, the response
    completed (or an ``error`` event, when generation fails after the headers went out)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    seq = 0
    msg_id = _ids(p)[1]
    at = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    async def send(kind: str, payload: dict) -> None:
        nonlocal seq
        data = orjson.dumps({"type": kind, "sequence_number": seq, **payload})
        seq += 1
        await resp.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    await send("response.created", {"response": response_json(p, body, created, None, None, None)})
    await send("response.in_progress", {"response": response_json(p, body, created, None, None, None)})
    await send("response.output_item.added", {"output_index": 0, "item": _message(p, None, None)})
    await send("response.content_part.added", {**at, "part": {"type": "output_text", "text": "", "annotations": []}})

    async def sink(ch: Choice, delta: str) -> None:
        if delta:
            await send("response.output_text.delta", {**at, "delta": delta, "logprobs": []})

    choices = new_choices(p, st.text_of)
    try:
        await all_or_none(run_choice(sub, st.metrics, r, ch, sink) for sub, r, ch in zip(p.subs, p.requests, choices))
        ch = choices[0]
        done = response_json(p, body, created, ch.text, ch.finish_reason, usage(p, choices))
        item = done["output"][0]
        await send("response.output_text.done", {**at, "text": ch.text, "logprobs": []})
        await send("response.content_part.done", {**at, "part": item["content"][0]})
        await send("response.output_item.done", {"output_index": 0, "item": item})
        await send("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                   {"response": done})
    except ApiError as e:                 # headers are out: report in-band, as OpenAI does
        await send("error", {"code": e.code, "message": e.message, "param": e.param})
    await resp.write_eof()
    return resp
