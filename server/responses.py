"""OpenAI's Responses API, ``POST /v1/responses``, over the chat path.

The request's ``instructions`` (a system message) and ``input`` (a user's text, or items:
messages of text parts, earlier ``function_call`` items and their ``function_call_output``)
become a chat; ``max_output_tokens`` its max_tokens, ``text.format`` its response_format (a
JSON schema or any JSON object), function ``tools`` and ``tool_choice`` its tools. The reply's
text is an output message and each call it makes a ``function_call`` item: in the response
object, or streamed as the API's typed events (``response.created``, ...,
``response.completed``) as the reply is generated. A reply with ``auto`` tools is items in the
order it wrote them: a message for each text before, between and after its calls. A reply
cut off by ``max_output_tokens`` is ``incomplete``. With ``store`` (the default) a finished
response is kept in the data dir's database (the newest ``MAX_KEPT``) for ``GET`` and
``DELETE /v1/responses/{id}``, and a request naming it as ``previous_response_id`` goes on
from its conversation: its input and reply come before the new input (its instructions do
not). ``background: true`` runs it in a task of its own (``background.py``), answered at once.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
import uuid
from typing import Awaitable, Callable

from aiohttp import web

from tandem.server.app import (STATE, STORE, Choice, Prepared, all_or_none, choice_json, json_response, new_choices,
                               prepare, prepare_online, read_json, ready_engine, room_to_wait, run_choice, run_to_end,
                               served_tier, unsent_logprobs, usage)
from tandem.server.background import Background, EventLog, sse
from tandem.server.connections import stream_writer
from tandem.server.errors import ApiError, bad_request, out_of_storage, storage_full, when_stored
from tandem.server.logprobs import chat_logprobs
from tandem.server.listing import newest_first, page, query_limit
from tandem.server.protocol import chat_input, reject_unsupported
from tandem.server.schema import (OUTPUT_LOGPROBS, RESPONSES_BODY, RESPONSES_CHAT_ONLY, RESPONSES_PASSED,
                                  RESPONSES_UNSUPPORTED, validate)
from tandem.server.store import Store
from tandem.server.tools import ContentStream, ToolChoice, finish_reason, reply_parts

# chat fields the translation writes -> the Responses fields they came from (for error messages)
RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"))


MAX_KEPT = 4096         # stored responses kept, the oldest forgotten first (not one still running)
RETRY_S = 1.0           # a background response run again and refused for now tries again after this
BACKGROUND = web.AppKey("background", Background)
log = logging.getLogger("tandem.responses")
EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def add_routes(app: web.Application) -> None:
    """After the batch routes, which open the store that keeps the responses too."""
    app[BACKGROUND] = Background(app[STORE])
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)
    app.router.add_post("/v1/responses/{id}/cancel", cancel)
    app.router.add_get("/v1/responses/{id}/input_items", input_items)


def engine_ready(app: web.Application) -> None:
    """Background responses the server stopped before their end run again, from their start."""
    for rid, body in app[STORE].response_jobs():
        app[BACKGROUND].start(rid, functools.partial(_run_again, app, rid, body))


async def stop(app: web.Application) -> None:
    await app[BACKGROUND].stop()


def _kept(request: web.Request) -> tuple[dict, list[dict]]:
    rid = request.match_info["id"]
    kept = request.app[STORE].get_response(rid)
    if kept is None:
        raise ApiError(404, f"Response with id '{rid}' not found.", code="not_found")
    return kept


async def retrieve(request: web.Request) -> web.StreamResponse:
    """The kept response; with ``stream=true`` a background response's events, those after
    ``starting_after`` (a sequence number), as they come until it ends."""
    response = _kept(request)[0]
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad_request("'stream' must be true or false", param="stream")
    if stream == "false":
        return json_response(response)
    if not response.get("background"):
        raise bad_request("only a background response's events can be streamed again", param="stream")
    events = request.app[BACKGROUND].logs.get(response["id"])
    if events is None:
        raise bad_request(f"the events of response '{response['id']}' are no longer kept (those of the "
                          "newest background responses since the server started are); retrieve it "
                          "without stream", param="stream")
    return await _replay(request, events, _starting_after(request.query))


def _starting_after(query) -> int:
    try:
        after = int(query.get("starting_after", "-1"))
    except ValueError:
        raise bad_request("'starting_after' must be an integer", param="starting_after") from None
    if after < -1:
        raise bad_request("'starting_after' must be a sequence number (0 or more)", param="starting_after")
    return after


async def _replay(request: web.Request, events: EventLog, after: int) -> web.StreamResponse:
    """A background response's events after ``after``, to this client; the response runs on
    whether the client stays or not."""
    resp = web.StreamResponse(headers=EVENT_STREAM)
    await resp.prepare(request)
    write = stream_writer(request, resp)
    async for data in events.read(after):
        await write(data)
    await write(None)
    return resp


async def delete(request: web.Request) -> web.Response:
    rid = _kept(request)[0]["id"]
    await request.app[BACKGROUND].cancel(rid)
    request.app[STORE].delete_response(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """A background response stopped and kept ``cancelled``; one that has ended is returned as it
    is (cancelling twice is no error)."""
    if not _kept(request)[0].get("background"):
        raise bad_request("only a response created with background: true can be cancelled", param="response_id")
    await request.app[BACKGROUND].cancel(request.match_info["id"])
    return json_response(_kept(request)[0])


async def input_items(request: web.Request) -> web.Response:
    """OpenAI's list of a kept response's input items (its own input, not the conversation it
    continued), newest first unless ``order=asc``, in pages of ``limit`` after ``after``."""
    rid = _kept(request)[0]["id"]
    q = request.query
    limit, items = query_limit(q, 20, 100), request.app[STORE].response_inputs(rid)
    if newest_first(q):
        items = items[::-1]
    after = q.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = [] if at is None else items[at + 1:]
    return json_response(page(items[:limit], len(items) > limit))


def _input_item(item: dict) -> dict:
    """An input item as OpenAI lists it back: with an id, a status, and a message's text as parts
    (``input_text``; an assistant's ``output_text``)."""
    kind = item.get("type", "message")
    if kind == "message":
        text_type = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        parts = [{"type": text_type, "text": content}] if isinstance(content, str) else \
            [{"type": p["type"], "text": p["text"]} for p in content]
        if text_type == "output_text":
            parts = [p | {"annotations": []} for p in parts]
        return {"id": item.get("id") or "msg_" + uuid.uuid4().hex, "type": "message", "role": item["role"],
                "content": parts, "status": "completed"}
    prefix = "fc_" if kind == "function_call" else "fco_"
    return {**item, "id": item.get("id") or prefix + uuid.uuid4().hex, "status": "completed"}


def _keep(store: Store, body: dict, response: dict, conversation: list[dict], reply: dict | None = None,
          job: bool = False, ends_job: bool = False) -> None:
    """Keep a response, its conversation (with ``reply``, once there is one) and input items,
    unless the request said ``store: false``; ``job``: with the request, to run (again) until it
    ends (a background response's); ``ends_job``: it ended, the request goes."""
    if body.get("store") is False:
        return
    inp = body["input"]
    items = [_input_item(i) for i in ([{"role": "user", "content": inp}] if isinstance(inp, str) else inp)]
    if reply is not None and reply.get("content") is None and not reply.get("tool_calls"):
        reply = reply | {"content": ""}         # cut off before a call's name: a turn that said nothing
    store.keep_response(response, conversation + ([reply] if reply is not None else []), MAX_KEPT, items,
                        job=body if job else None, ends_job=ends_job)


def chat_body(body: dict, store: Store) -> tuple[dict, list[dict]]:
    """The chat completion request a Responses request asks for, and its conversation (the
    messages it continues and its input, without instructions); raises ApiError."""
    validate(body, RESPONSES_BODY)
    reject_unsupported(body, RESPONSES_UNSUPPORTED)
    if body.get("background") and body.get("store") is False:
        raise bad_request("a background response is kept until it is retrieved: 'store' cannot be false",
                          param="background")
    for key, instead in RESPONSES_CHAT_ONLY.items():
        if key in body:
            raise bad_request(f"'{key}' is a chat completion's field, not a response's" +
                              (f": send '{instead}'" if instead else ""), param=key, code="unknown_parameter")
    conversation = _conversation(body, store)
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat = {k: body[k] for k in RESPONSES_PASSED if body.get(k) is not None} | {"messages": system + conversation}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat | _tools(body) | _format(body) | _logprobs(body), conversation


def _logprobs(body: dict) -> dict:
    """The chat's logprobs and top_logprobs, where ``include`` asks for the output's."""
    include = body.get("include") or []
    for item in include:
        if item != OUTPUT_LOGPROBS:
            raise bad_request(f"include '{item}' is not supported by this server (only '{OUTPUT_LOGPROBS}')",
                              param="include", code="unsupported_parameter")
    if OUTPUT_LOGPROBS not in include:
        return {}                  # top_logprobs alone gives nothing, as OpenAI takes it
    if body.get("tools"):
        raise bad_request("log probabilities of a reply that may call tools are not supported", param="include",
                          code="unsupported_parameter")
    return {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}


def _conversation(body: dict, store: Store) -> list[dict]:
    """The kept conversation ``previous_response_id`` names, then the input's messages; a call's
    output must follow the call, in the input or the kept conversation, and every call must have
    one."""
    before = body.get("previous_response_id")
    kept = store.get_response(before) if before is not None else None
    if before is not None and kept is None:
        raise bad_request(f"Previous response with id '{before}' not found.", param="previous_response_id",
                          code="previous_response_not_found")
    if kept is not None and kept[0]["status"] in ("queued", "in_progress"):
        raise bad_request(f"Previous response with id '{before}' is still {kept[0]['status']}: go on from it "
                          "once it has ended", param="previous_response_id")
    conversation = kept[1] if kept is not None else []
    calls = {c["id"] for m in conversation for c in m.get("tool_calls") or ()}
    inp = body["input"]
    for item in [{"role": "user", "content": inp}] if isinstance(inp, str) else inp:
        kind = item.get("type")
        if kind == "function_call" and item["call_id"] in calls:     # twice in the prompt, else; as OpenAI refuses it
            raise bad_request(f"Duplicate item found with id {item.get('id') or item['call_id']}: the call is "
                              "in the input or the previous response already", param="input")
        if kind == "function_call":
            calls.add(item["call_id"])
        elif kind == "function_call_output" and item["call_id"] not in calls:   # as OpenAI refuses it
            raise bad_request(f"No tool call found for function call output with call_id {item['call_id']}.",
                              param="input")
        m = _message_of(item, conversation[-1] if conversation else None)
        if not conversation or m is not conversation[-1]:
            conversation.append(m)
    answered = {m["tool_call_id"] for m in conversation if m["role"] == "tool"}
    missing = sorted(calls - answered)                # as OpenAI refuses a call left without its output
    if missing:
        raise bad_request(f"No tool output found for function call {missing[0]}.", param="input")
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
    if choice in ("auto", "none") and not body.get("tools"):
        choice = None                   # what a response echoes back, whether it had tools or not
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
    for field in ("name", "schema"):
        if field not in fmt:
            raise bad_request(f"'text.format.{field}' is required with type json_schema", param=f"text.format.{field}")
    return {"response_format": {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}


def _message_of(item: dict, last: dict | None) -> dict:
    """The chat message an input item is: a message; an earlier call, an assistant's tool call
    (``last`` itself, with this call added, when it is an assistant's turn: its calls, or the
    text a reply wrote before its first call, so a reply's output items sent back are the one
    turn a kept conversation has); a call's output, a tool message."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return last
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        out = item["output"]
        return {"role": "tool", "tool_call_id": item["call_id"],
                "content": out if isinstance(out, str) else "\n".join(p["text"] for p in out)}
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
    if body.get("background"):
        raise bad_request("a batch's line runs in the batch: 'background' is for a request of its own",
                          param="background")
    async with room_to_wait(engine, app[STATE].cfg):
        p, keep = await _start(app, engine, body, force_be=True)
    return await _finish(engine, app[STATE], p, body, int(time.time()), keep)


async def _start(app: web.Application, engine, body: dict, force_be: bool = False, name: str | None = None):
    """The request's chat checked and queued (raises ApiError naming the Responses fields), and
    ``keep(response=, reply=)``, which keeps it (``_keep``). ``name``: the response's id after
    ``resp_`` (else a new one)."""
    chat, conversation = chat_body(body, app[STORE])
    if name is not None:
        chat["request_id"] = name
    if body.get("truncation") == "auto":
        chat["messages"] = await asyncio.get_running_loop().run_in_executor(
            None, fitted_messages, engine.llm, chat, app[STATE].cfg.trust_request_chat_template)
    try:
        if force_be:
            p = await prepare(engine, app[STATE].cfg, chat, True, force_be=True)
        else:
            p = await prepare_online(engine, app[STATE], chat, True)
    except ApiError as e:
        raise _renamed(e) from None
    return p, functools.partial(_keep, app[STORE], body, conversation=conversation)


def fitted_messages(llm, chat: dict, trust_template: bool) -> list[dict]:
    """OpenAI's ``truncation: "auto"``: the chat's messages without the fewest whole turns from
    the start of the conversation (a turn: a user message and what answers it) that leave its
    prompt room for ``max_tokens`` (one token where it is not given) in the context; the system
    messages before it stay. As they are where even the last turn alone does not fit (the
    request is then refused as any prompt past the context is). Leaving out more turns never
    lengthens the prompt, so the first start that fits is searched by halving."""
    messages = chat["messages"]
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    starts = [lead] + [i for i in range(lead + 1, len(messages)) if messages[i]["role"] == "user"]
    limit = llm.max_model_len - min(chat.get("max_tokens") or 1, llm.max_model_len - 1)

    def kept(k: int) -> list[dict]:
        return messages[:lead] + messages[starts[k]:]

    def fits(k: int) -> bool:
        _, flat, template = chat_input(chat | {"messages": kept(k)}, trust_template)
        return len(llm.encode_prompt(flat, template)[0]) <= limit
    try:
        lo, hi = 0, len(starts) - 1
        if not fits(hi):
            return messages
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    except (ApiError, ValueError):      # refused as it is, with the reason, once it is prepared
        return messages
    return kept(lo)


async def _finish(engine, st, p: Prepared, body: dict, created: int, keep) -> dict:
    """Run a prepared request to its end and keep it: the response object."""
    ch = (await run_to_end(engine, st, p))[0]
    c = choice_json(True, ch, st.text_of, p.gen.tools)
    tools = p.gen.tools
    parts = reply_parts(tools, ch.text) if tools is not None and tools.choice is ToolChoice.AUTO else None
    response = response_json(p, body, created, c["message"], c["finish_reason"], usage(p, [ch]), parts,
                             _all_logprobs(ch, st.text_of))
    keep(response=response, reply=c["message"])
    return response


async def create(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    engine = ready_engine(request)
    body = await read_json(request)
    if isinstance(body, dict) and body.get("background") is True:
        return await _create_in_background(request, engine, body)
    p, keep = await _start(request.app, engine, body)
    created = int(time.time())
    if not body.get("stream"):
        return json_response(await _finish(engine, st, p, body, created, keep))
    try:
        return await _stream(request, st, p, body, created, keep)
    finally:
        p.close()


async def _create_in_background(request: web.Request, engine, body: dict) -> web.StreamResponse:
    """Checked and queued now (a bad request is refused here), kept ``queued`` with its request,
    and run in a task of its own: the queued response, or its events as they come."""
    app = request.app
    if body.get("seed") is None:            # kept with it: a run again after a restart samples the same tokens
        body = {**body, "seed": secrets.randbits(63)}
    p, keep = await _start(app, engine, body, name=uuid.uuid4().hex)
    try:
        created = int(time.time())
        queued = response_json(p, body, created, None, None, None) | {"status": "queued"}
        keep(response=queued, job=True)         # one write: a stop never keeps it queued with nothing to run
    except BaseException:
        p.close()
        raise
    events = app[BACKGROUND].start(queued["id"], functools.partial(_run_events_to, app, p, body, created, keep))
    if body.get("stream"):
        return await _replay(request, events, -1)
    return json_response(queued)


async def _run_again(app: web.Application, rid: str, body: dict, events: EventLog) -> None:
    """A background response the server stopped before its end, from its start: queued again
    once there is room (as a batch's line waits for it), then run."""
    store, st = app[STORE], app[STATE]
    kept = store.get_response(rid)
    created = kept[0]["created_at"] if kept is not None else int(time.time())
    while True:
        async with room_to_wait(st.engine, st.cfg):
            pass            # then queued as online requests are, whose check would count a place held
        try:
            p, keep = await _start(app, st.engine, body, name=rid.removeprefix("resp_"))
            break
        except ApiError as e:
            if e.status != 429:
                return await _failed(app, rid, events, e)
            await asyncio.sleep(RETRY_S)          # chats past capacity: not a full queue, so wait here
    if kept is not None:
        store.set_response(kept[0] | {"status": "queued", "output": [], "usage": None})
    await _run_events_to(app, p, body, created, keep, events)


async def _run_events_to(app: web.Application, p: Prepared, body: dict, created: int, keep,
                         events: EventLog) -> None:
    """Run a background response, its events to ``events``; kept in progress from its first
    token, and as it ends (failed, where the engine fails it)."""
    try:
        await _run_events(_Events(events.write, p), app[STATE], p, body, created, keep,
                          background=app[BACKGROUND])
    except ApiError as e:
        await _failed(app, _ids(p)[0], events, e)
    finally:
        p.close()


async def _failed(app: web.Application, rid: str, events: EventLog, e: ApiError) -> None:
    """A background response the server could not run, kept ``failed`` with why."""
    await app[BACKGROUND].failed(rid, events, {"code": "server_error" if e.status >= 500 else "invalid_prompt",
                                               "message": e.message})


def _ids(p: Prepared) -> tuple[str, str]:
    """The response's id and its first output message's, from the completion's."""
    tail = p.id.split("-", 1)[1]
    return "resp_" + tail, "msg_" + tail


def _text_item(p: Prepared, text: str | None, finish: str | None, n: int = 0,
               logprobs: list | None = None) -> dict:
    """The reply's ``n``-th output message: in progress (no ``text`` yet), else whole (with its
    tokens' ``logprobs``, where asked). A reply writes a message before, between or after its
    calls."""
    status = "in_progress" if text is None else "incomplete" if finish == "length" else "completed"
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"id": _ids(p)[1] + (f"_{n}" if n else ""), "type": "message", "status": status,
            "role": "assistant", "content": content}


def _output(p: Prepared, message: dict, finish: str | None, parts: list[str | dict] | None,
            logprobs: list | None = None) -> list[dict]:
    """A chat reply as output items, in the order it wrote them: an ``auto`` reply's ``parts``
    (``ContentStream.parts``: a message per text, a ``function_call`` per call), a constrained
    reply's calls. A reply that makes no call is one message, also when it is empty. Cut off by
    ``max_output_tokens``, the item it was writing is ``incomplete`` (none, where it was a call
    whose name was not written yet). ``logprobs``: the reply's tokens' (asked only without tools)."""
    content, calls = message["content"] or "", message.get("tool_calls") or []
    if not calls:
        return [_text_item(p, content, finish, logprobs=logprobs)]
    items, texts, made = [], 0, iter(calls)
    for part in parts or [{}] * len(calls):
        if isinstance(part, str):
            items.append(_text_item(p, part, "stop", texts))
            texts += 1
        else:
            items.append(_call_item(next(made)))
    if finish == "length" and items[-1]["type"] == "message":
        items[-1]["status"] = "incomplete"
    if finish == "length" and p.gen.tools.choice is not ToolChoice.AUTO and not _whole(items[-1]["arguments"]):
        items[-1]["status"] = "incomplete"      # a constrained call cut off (an auto one's block closed)
    return items


def _whole(arguments: str) -> bool:
    """Whether a constrained call's arguments were written to their end: a reply cut off while it
    began the next call (its name not written yet, so no item) leaves the last call whole."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def response_json(p: Prepared, body: dict, created: int, message: dict | None, finish: str | None,
                  chat_usage: dict | None, parts: list[str | dict] | None = None, logprobs: list | None = None) -> dict:
    """The response object: in progress while ``message`` (the chat's reply) is None, else with
    its output items (``_output``, an ``auto`` reply's from its ``parts``) and usage."""
    if message is None:
        status, details, output = "in_progress", None, []
    else:
        cut = finish == "length"
        status, details = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        output = _output(p, message, finish, parts, logprobs)
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    u = None if chat_usage is None else {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"]}
    return {"id": _ids(p)[0], "object": "response", "created_at": created, "status": status, "error": None,
            "background": body.get("background") is True,
            "incomplete_details": details, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "model": p.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": served_tier(p),
            "store": body.get("store") is not False, "temperature": body.get("temperature", 1.0),
            "text": {"format": fmt},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation") or "disabled",
            "usage": u, "user": body.get("user")}


class _Events:
    """A stream's typed events, numbered in order, and the output items they open and close, each
    at the next output index."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]], p: Prepared):
        self.write, self.p, self.seq = write, p, 0
        self.index = 0                              # the next output item's
        self.text: dict | None = None               # the open message's place
        self.messages = 0                           # messages opened
        self.said: list[str] = []                   # and the text it was sent, in pieces
        self.said_chars = 0
        self.said_logprobs = 0                      # and the log probabilities of its tokens
        self.calls: dict[int, tuple[int, dict]] = {}     # calls opened, by their index among the reply's calls
        self.closed: set[str] = set()               # ids of the items done

    async def send(self, kind: str, payload: dict) -> None:
        self.seq += 1
        await self.write(sse(kind, {"sequence_number": self.seq - 1, **payload}))

    async def _added(self, item: dict) -> int:
        await self.send("response.output_item.added", {"output_index": self.index, "item": item})
        self.index += 1
        return self.index - 1

    async def _text_opens(self, item: dict) -> None:
        self.messages += 1
        self.text = {"item_id": item["id"], "output_index": await self._added(item | {"status": "in_progress",
                                                                                       "content": []}),
                     "content_index": 0}
        await self.send("response.content_part.added",
                        {**self.text, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})

    async def text_piece(self, delta: str, logprobs: list = ()) -> None:
        """A piece of the reply's text (and its tokens' ``logprobs``); the first opens its first
        message."""
        if not delta:
            return
        if self.text is None:
            await self._text_opens(_text_item(self.p, None, None, self.messages))
        self.said.append(delta)
        self.said_chars += len(delta)
        self.said_logprobs += len(logprobs)
        await self.send("response.output_text.delta", {**self.text, "delta": delta, "logprobs": list(logprobs)})

    async def text_closes(self, item: dict) -> None:
        """A message done as ``item``: opened where it was not, and sent the text it was not yet."""
        if self.text is None:
            await self._text_opens(item)
        part = item["content"][0]
        await self.text_piece(part["text"][self.said_chars:], part["logprobs"][self.said_logprobs:])
        at, self.text, self.said, self.said_chars, self.said_logprobs = self.text, None, [], 0, 0
        await self.send("response.output_text.done", {**at, "text": part["text"], "logprobs": part["logprobs"]})
        await self.send("response.content_part.done", {**at, "part": item["content"][0]})
        await self.send("response.output_item.done", {"output_index": at["output_index"], "item": item})
        self.closed.add(item["id"])

    async def call_piece(self, d: dict) -> None:
        """A chat ``tool_calls`` delta: the call's item added with its first piece, then each piece
        of its arguments. A call that begins closes the one before it, whose arguments are whole
        then (each item is done before the next is added)."""
        i, piece = d["index"], d["function"].get("arguments", "")
        if i not in self.calls:
            if i - 1 in self.calls and self.calls[i - 1][1]["id"] not in self.closed:
                await self.call_closes(i - 1, self.calls[i - 1][1] | {"status": "completed"})
            item = _call_item(d, "in_progress") | {"arguments": ""}
            self.calls[i] = (await self._added(item), item)
        if piece:
            self.calls[i][1]["arguments"] += piece
            await self.send("response.function_call_arguments.delta",
                            {"item_id": self.calls[i][1]["id"], "output_index": self.calls[i][0], "delta": piece})

    async def call_closes(self, i: int, item: dict) -> None:
        """The reply's call ``i`` done as ``item``; opened with all its arguments where it was not
        (a call of an ``auto`` reply goes out whole), after the message before it."""
        if i not in self.calls:
            if self.text is not None:
                await self.text_closes(_text_item(self.p, "".join(self.said), "stop", self.messages - 1))
            await self.call_piece({"index": i, "id": item["call_id"], "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        index = self.calls[i][0]
        await self.send("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                  "name": item["name"], "arguments": item["arguments"]})
        await self.send("response.output_item.done", {"output_index": index, "item": item})
        self.closed.add(item["id"])

    async def finish(self, output: list[dict]) -> None:
        """The response's output items not done yet, in order (they follow those done)."""
        calls = 0
        for item in output:
            if item["type"] == "function_call":
                calls += 1
                if item["id"] not in self.closed:
                    await self.call_closes(calls - 1, item)
            elif item["id"] not in self.closed:
                await self.text_closes(item)


def _all_logprobs(ch: Choice, text_of) -> list | None:
    """The log probabilities of the reply's tokens, where asked: those of its text, so not the
    end token that stopped it (a chat's logprobs give that one too, as vLLM's)."""
    if ch.logprobs is None:
        return None
    n = len(ch.logprobs) - (ch.finish_reason == "stop" and not isinstance(ch.stop_reason, str))
    return chat_logprobs(text_of, ch.token_ids[:n], ch.logprobs[:n])["content"]


def _new_logprobs(ch: Choice, text_of) -> list:
    """The log probabilities of the tokens generated since the last piece (none unless asked)."""
    return unsent_logprobs(True, ch, text_of).get("logprobs", {}).get("content", [])


def _call_item(call: dict, status: str = "completed") -> dict:
    """A chat's tool call as a ``function_call`` output item."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


async def _stream(request, st, p: Prepared, body: dict, created: int, keep) -> web.StreamResponse:
    """The response's events to the client that asked (``_run_events``); where generation fails
    after the headers went out, an ``error`` event, as OpenAI sends."""
    resp = web.StreamResponse(headers=EVENT_STREAM)
    await resp.prepare(request)
    ev = _Events(write := stream_writer(request, resp), p)
    try:
        await _run_events(ev, st, p, body, created, keep)
    except ApiError as e:
        await ev.send("error", {"code": e.code, "message": e.message, "param": e.param})
    await write(None)
    return resp


async def _run_events(ev: _Events, st, p: Prepared, body: dict, created: int, keep,
                      background: Background | None = None) -> None:
    """The Responses API's events: the response created and in progress; per output item, it
    added, its text (a part added, deltas, the text and part done) or its call's arguments
    (deltas and done), and it done; the response completed or incomplete. Everything goes out
    as it is generated, as a chat's stream does (``ContentStream``): text, and a constrained
    call's arguments piece by piece; with ``auto`` tools, the text outside call blocks as it is
    written and each call as its block closes, text after a call in a message of its own.
    ``keep(response=, reply=)`` keeps the finished response (``_keep``). With ``background`` (a
    background response's), the response is created queued, is kept in progress from its first
    token and is kept as it ended once the data dir takes the write. Raises ApiError where
    generation fails."""
    tools = p.gen.tools
    content = ContentStream(tools) if tools is not None else None
    started = response_json(p, body, created, None, None, None)
    await ev.send("response.created", {"response": started | ({"status": "queued"} if background is not None else {})})
    waiting = background
    if waiting is None:
        await ev.send("response.in_progress", {"response": started})
    else:
        await ev.send("response.queued", {"response": started | {"status": "queued"}})

    async def sink(ch: Choice, delta: str) -> None:
        nonlocal waiting
        if waiting is not None:
            waiting.in_progress(started)
            waiting = None
            await ev.send("response.in_progress", {"response": started})
        for part in [delta] if content is None else content.feed(delta):
            if isinstance(part, str):
                await ev.text_piece(part, _new_logprobs(ch, st.text_of) if part else ())
            elif tools.choice is ToolChoice.AUTO:
                await ev.call_closes(part["index"], _call_item(part))
            else:
                await ev.call_piece(part)

    choices = new_choices(p, st.text_of)
    await all_or_none(run_choice(sub, st.metrics, r, ch, sink) for sub, r, ch in zip(p.subs, p.requests, choices))
    ch = choices[0]
    text, calls = (ch.text, []) if content is None else content.final(ch.text)
    reply = {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})
    done = response_json(p, body, created, reply, finish_reason(calls, ch.finish_reason), usage(p, choices),
                         content.parts() if content is not None and content.args is None else None,
                         _all_logprobs(ch, st.text_of))
    await ev.finish(done["output"])
    if background is None:
        try:
            keep(response=done, reply=reply)
        except Exception as e:          # noqa: BLE001 -- re-raised unless the disk is full
            if not out_of_storage(e):
                raise
            raise storage_full(e) from e     # the stream's error event says why it was not kept
    else:
        await when_stored(functools.partial(keep, response=done, reply=reply, ends_job=True),
                          f"background response {done['id']}", log)
    await ev.send("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                  {"response": done})
