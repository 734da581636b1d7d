"""OpenAI's Responses API, ``POST /v1/responses``, over the chat path.

The request's ``instructions`` (a system message) and ``input`` (a user's text, or items:
messages of text parts, earlier ``function_call`` items and their ``function_call_output``)
become a chat; ``max_output_tokens`` its max_tokens, ``text.format`` its response_format (a
JSON schema or any JSON object), function ``tools`` and ``tool_choice`` its tools. The reply's
text is an output message and each call it makes a ``function_call`` item: in the response
object, or streamed as the API's typed events (``response.created``, ...,
``response.completed``). Text streams as it is generated, and so do the calls of a reply that
must call; with ``auto`` tools the text may turn out to be calls, so its events come once the
reply has ended. A reply cut off by ``max_output_tokens`` is ``incomplete``. With ``store``
(the default) a finished response is kept in the data dir's database (the newest
``MAX_KEPT``) for ``GET`` and ``DELETE /v1/responses/{id}``, and a request naming it as
``previous_response_id`` goes on from its conversation: its input and reply come before the
new input (its instructions do not).
"""
from __future__ import annotations

import functools
import time

import orjson
from aiohttp import web

from tandem.server.app import (STATE, STORE, Choice, Prepared, all_or_none, choice_json, complete, json_response,
                               new_choices, prepare, prepare_online, read_json, ready_engine, run_choice, served_tier,
                               usage)
from tandem.server.errors import ApiError, bad_request
from tandem.server.protocol import reject_unsupported
from tandem.server.schema import RESPONSES_BODY, RESPONSES_UNSUPPORTED, validate
from tandem.server.store import Store
from tandem.server.tools import ContentStream, ToolChoice, finish_reason

PASSED = ("model", "temperature", "top_p", "top_k", "seed", "stream", "service_tier", "slo_ttft_ms", "slo_tbt_ms",
          "user", "cache_salt", "ignore_eos", "min_tokens")
# chat fields the translation writes -> the Responses fields they came from (for error messages)
RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"))


MAX_KEPT = 4096         # stored responses kept, the oldest forgotten first


def add_routes(app: web.Application) -> None:
    """After the batch routes, which open the store that keeps the responses too."""
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)


def _kept(request: web.Request) -> tuple[dict, list[dict]]:
    rid = request.match_info["id"]
    kept = request.app[STORE].get_response(rid)
    if kept is None:
        raise ApiError(404, f"Response with id '{rid}' not found.", code="not_found")
    return kept


async def retrieve(request: web.Request) -> web.Response:
    return json_response(_kept(request)[0])


async def delete(request: web.Request) -> web.Response:
    rid = _kept(request)[0]["id"]
    request.app[STORE].delete_response(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


def _keep(store: Store, body: dict, response: dict, conversation: list[dict], reply: dict) -> None:
    """Keep a finished response and its conversation, unless the request said ``store: false``."""
    if body.get("store") is False:
        return
    said = {"role": "assistant", "content": reply["content"]} | (
        {"tool_calls": reply["tool_calls"]} if reply.get("tool_calls") else {})
    store.keep_response(response, conversation + [said], MAX_KEPT)


def chat_body(body: dict, store: Store) -> tuple[dict, list[dict]]:
    """The chat completion request a Responses request asks for, and its conversation (the
    messages it continues and its input, without instructions); raises ApiError."""
    validate(body, RESPONSES_BODY)
    reject_unsupported(body, RESPONSES_UNSUPPORTED)
    conversation = _conversation(body, store)
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat = {k: body[k] for k in PASSED if body.get(k) is not None} | {"messages": system + conversation}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat | _tools(body) | _format(body), conversation


def _conversation(body: dict, store: Store) -> list[dict]:
    """The kept conversation ``previous_response_id`` names, then the input's messages."""
    before = body.get("previous_response_id")
    kept = store.get_response(before) if before is not None else None
    if before is not None and kept is None:
        raise bad_request(f"Previous response with id '{before}' not found.", param="previous_response_id",
                          code="previous_response_not_found")
    conversation = kept[1] if kept is not None else []
    inp = body["input"]
    for item in [{"role": "user", "content": inp}] if isinstance(inp, str) else inp:
        m = _message_of(item, conversation[-1] if conversation else None)
        if not conversation or m is not conversation[-1]:
            conversation.append(m)
    return conversation


def _tools(body: dict) -> dict:
    """The chat's tools, tool_choice and parallel_tool_calls (a Responses tool is a chat tool's
    function, flattened)."""
    chat = {}
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                             "strict") if t.get(k) is not None}}
                         for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def _format(body: dict) -> dict:
    """The chat's response_format from ``text.format`` (nothing for plain text)."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt["type"] != "json_schema":
        return {}
    if "name" not in fmt:
        raise bad_request("'text.format.name' is required with type json_schema", param="text.format.name")
    return {"response_format": {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}


def _message_of(item: dict, last: dict | None) -> dict:
    """The chat message an input item is: a message; an earlier call, an assistant's tool call
    (``last`` itself, with this call added, when it is an assistant's turn of calls); a call's
    output, a tool message."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
            return last
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    content = item["content"]
    return {"role": item["role"], "content": content if isinstance(content, str) else
            [{"type": "text", "text": p["text"]} for p in content]}


def _renamed(e: ApiError) -> ApiError:
    """An error about the chat a request became, naming the Responses fields it came from."""
    for chat_name, name in RENAMED:
        e.message = e.message.replace(chat_name, name)
        if e.param is not None and e.param.startswith(chat_name):
            e.param = name + e.param[len(chat_name):]
    e.args = (e.message,)
    return e


async def run_line(app: web.Application, engine, body: dict) -> dict:
    """A batch line: best-effort, never refused for the waiting queue; its response object."""
    p, keep = await _start(app, engine, body, force_be=True)
    return await _finish(engine, app[STATE], p, body, int(time.time()), keep)


async def _start(app: web.Application, engine, body: dict, force_be: bool = False):
    """The request's chat checked and queued (raises ApiError naming the Responses fields), and
    ``keep(response=, reply=)``, which keeps it once finished (``_keep``)."""
    chat, conversation = chat_body(body, app[STORE])
    try:
        if force_be:
            p = await prepare(engine, app[STATE].cfg, chat, True, force_be=True)
        else:
            p = await prepare_online(engine, app[STATE], chat, True)
    except ApiError as e:
        raise _renamed(e) from None
    return p, functools.partial(_keep, app[STORE], body, conversation=conversation)


async def _finish(engine, st, p: Prepared, body: dict, created: int, keep) -> dict:
    """Run a prepared request to its end and keep it: the response object."""
    out = await complete(engine, st, p, chat=True)
    c = out["choices"][0]
    response = response_json(p, body, created, c["message"], c["finish_reason"], out["usage"])
    keep(response=response, reply=c["message"])
    return response


async def create(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    engine = ready_engine(request)
    body = await read_json(request)
    p, keep = await _start(request.app, engine, body)
    created = int(time.time())
    if not body.get("stream"):
        return json_response(await _finish(engine, st, p, body, created, keep))
    try:
        return await _stream(request, st, p, body, created, keep)
    finally:
        p.close()


def _ids(p: Prepared) -> tuple[str, str]:
    """The response's id and its output message's, from the chat's."""
    tail = p.rid.split("-", 1)[1]
    return "resp_" + tail, "msg_" + tail


def _text_item(p: Prepared, text: str | None, finish: str | None) -> dict:
    """The output message: in progress (no ``text`` yet), else whole."""
    status = "in_progress" if text is None else "incomplete" if finish == "length" else "completed"
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": _ids(p)[1], "type": "message", "status": status, "role": "assistant", "content": content}


def _output(p: Prepared, message: dict, finish: str | None) -> list[dict]:
    """A chat reply's message as output items: its text (when it has some, or makes no call),
    then a ``function_call`` per tool call."""
    calls = message.get("tool_calls") or []
    items = [_text_item(p, message["content"] or "", finish)] if message["content"] or not calls else []
    return items + [{"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                     "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                    for c in calls]


def response_json(p: Prepared, body: dict, created: int, message: dict | None, finish: str | None,
                  chat_usage: dict | None) -> dict:
    """The response object: in progress while ``message`` (the chat's reply) is None, else with
    its output items and usage."""
    if message is None:
        status, details, output = "in_progress", None, []
    else:
        cut = finish == "length"
        status, details = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        output = _output(p, message, finish)
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    u = None if chat_usage is None else {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"]}
    return {"id": _ids(p)[0], "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": details, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "model": p.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": served_tier(p),
            "store": body.get("store") is not False, "temperature": body.get("temperature", 1.0),
            "text": {"format": fmt},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": u, "user": body.get("user")}


class _Events:
    """A stream's typed events, numbered in order, and the output items they open and close."""

    def __init__(self, resp: web.StreamResponse, p: Prepared):
        self.resp, self.p, self.seq = resp, p, 0
        self.calls: dict[int, dict] = {}      # a constrained reply's calls opened so far, by index

    async def send(self, kind: str, payload: dict) -> None:
        data = orjson.dumps({"type": kind, "sequence_number": self.seq, **payload})
        self.seq += 1
        await self.resp.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    async def text_opens(self, index: int) -> dict:
        await self.send("response.output_item.added", {"output_index": index, "item": _text_item(self.p, None, None)})
        at = {"item_id": _ids(self.p)[1], "output_index": index, "content_index": 0}
        await self.send("response.content_part.added",
                        {**at, "part": {"type": "output_text", "text": "", "annotations": []}})
        return at

    async def text_delta(self, at: dict, delta: str) -> None:
        await self.send("response.output_text.delta", {**at, "delta": delta, "logprobs": []})

    async def text_closes(self, at: dict, item: dict) -> None:
        await self.send("response.output_text.done", {**at, "text": item["content"][0]["text"], "logprobs": []})
        await self.send("response.content_part.done", {**at, "part": item["content"][0]})
        await self.send("response.output_item.done", {"output_index": at["output_index"], "item": item})

    async def call_piece(self, d: dict) -> None:
        """A chat ``tool_calls`` delta of a constrained reply: the call's item added with its
        first piece, then each piece of its arguments."""
        i, piece = d["index"], d["function"].get("arguments", "")
        if i not in self.calls:
            self.calls[i] = {"type": "function_call", "id": "fc_" + d["id"].removeprefix("call_"),
                             "call_id": d["id"], "name": d["function"]["name"], "arguments": "",
                             "status": "in_progress"}
            await self.send("response.output_item.added", {"output_index": i, "item": self.calls[i]})
        if piece:
            await self.send("response.function_call_arguments.delta",
                            {"item_id": self.calls[i]["id"], "output_index": i, "delta": piece})

    async def call_closes(self, index: int, item: dict) -> None:
        if index not in self.calls:
            await self.call_piece({"index": index, "id": item["call_id"], "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        await self.send("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                  "name": item["name"], "arguments": item["arguments"]})
        await self.send("response.output_item.done", {"output_index": index, "item": item})

    async def replay(self, index: int, item: dict) -> None:
        """An output item's events, all at once."""
        if item["type"] != "message":
            return await self.call_closes(index, item)
        at = await self.text_opens(index)
        if item["content"][0]["text"]:
            await self.text_delta(at, item["content"][0]["text"])
        await self.text_closes(at, item)


async def _stream(request, st, p: Prepared, body: dict, created: int, keep) -> web.StreamResponse:
    """The Responses API's events: the response created and in progress; per output item, it
    added, its text (a part added, deltas, the text and part done) or its call's arguments
    (deltas and done), and it done; the response completed or incomplete (or an ``error``
    event, when generation fails after the headers went out). Without tools the text goes out
    as it is generated, and so do the calls of a reply that must call (required or named);
    with ``auto`` tools the text may turn out to be calls, so their events come once the reply
    has ended. ``keep(response=, reply=)`` keeps the finished response (``_keep``)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    ev, tools = _Events(resp, p), p.gen.tools
    calls = ContentStream(tools) if tools is not None and tools.choice is not ToolChoice.AUTO else None
    started = response_json(p, body, created, None, None, None)
    await ev.send("response.created", {"response": started})
    await ev.send("response.in_progress", {"response": started})
    at = await ev.text_opens(0) if tools is None else None

    async def sink(ch: Choice, delta: str) -> None:
        if at is not None and delta:
            await ev.text_delta(at, delta)
        for d in calls.call_deltas(delta, lambda: ch.text) if calls is not None else ():
            await ev.call_piece(d)

    choices = new_choices(p, st.text_of)
    try:
        await all_or_none(run_choice(sub, st.metrics, r, ch, sink) for sub, r, ch in zip(p.subs, p.requests, choices))
        ch = choices[0]
        if calls is not None:             # the calls as streamed, with their ids
            made = calls.final(ch.text)[1]
            reply = {"role": "assistant", "content": None, "tool_calls": made}
            finish = finish_reason(made, ch.finish_reason)
        else:
            c = choice_json(True, ch, st.text_of, tools)
            reply, finish = c["message"], c["finish_reason"]
        done = response_json(p, body, created, reply, finish, usage(p, choices))
        for index, item in enumerate(done["output"]):
            await (ev.text_closes(at, item) if at is not None else ev.replay(index, item))
        keep(response=done, reply=reply)
        await ev.send("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                      {"response": done})
    except ApiError as e:                 # headers are out: report in-band, as OpenAI does
        await ev.send("error", {"code": e.code, "message": e.message, "param": e.param})
    await resp.write_eof()
    return resp
