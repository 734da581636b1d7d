"""Files and Batch API routes (OpenAI semantics), backed by server/store.py and server/batches.py."""
from __future__ import annotations

import asyncio
import re

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from tandem.server import responses
from tandem.server.app import STATE, STORE, complete, json_response, prepare, read_json, room_to_wait
from tandem.server.batches import WINDOWS, BatchRunner
from tandem.server.connections import body_read
from tandem.server.errors import ApiError, bad_request
from tandem.server.listing import newest_first, page, query_limit
from tandem.server.schema import BATCH_BODY, UPLOAD_FIELDS, validate
from tandem.server.store import Store

RUNNER = web.AppKey("runner", BatchRunner)
PURPOSES = ("batch", "user_data")


def add_routes(app: web.Application) -> None:
    cfg = app[STATE].cfg
    store = Store(cfg.data_dir)
    app[STORE] = store

    async def run_line(body: dict, endpoint: str):
        engine = app[STATE].engine
        if endpoint == "/v1/responses":
            return 200, await responses.run_line(app, engine, body)
        chat = endpoint == "/v1/chat/completions"
        async with room_to_wait(engine, cfg):
            p = await prepare(engine, app[STATE].cfg, body, chat, force_be=True)
        return 200, await complete(engine, app[STATE], p, chat)
    app[RUNNER] = BatchRunner(store, run_line, concurrency=cfg.max_num_seqs)
    r = app.router
    r.add_post("/v1/files", upload_file)
    r.add_get("/v1/files", list_files)
    r.add_get("/v1/files/{id}", get_file)
    r.add_get("/v1/files/{id}/content", file_content)
    r.add_delete("/v1/files/{id}", delete_file)
    r.add_post("/v1/batches", create_batch)
    r.add_get("/v1/batches", list_batches)
    r.add_get("/v1/batches/{id}", get_batch)
    r.add_post("/v1/batches/{id}/cancel", cancel_batch)


def batch_progress(app: web.Application, recent: int = 10) -> list[dict]:
    """The most recent batches (active ones first): id, status, request_counts."""
    store = app[STORE]
    active = store.active_batches()
    listed, _ = store.list_batches(recent, None)
    rows = [store.get_batch(b) for b in active] + [b for b in listed if b["id"] not in active]
    return [{"id": b["id"], "status": b["status"], "endpoint": b["endpoint"],
             "request_counts": b["request_counts"], "created_at": b["created_at"]} for b in rows if b]


def engine_ready(app: web.Application) -> None:
    """Batches wait for the model; once it is loaded every unfinished batch resumes."""
    app[RUNNER].resume_all()


async def stop(app: web.Application) -> None:
    await app[RUNNER].stop()
    app[STORE].close()


def _store(request) -> Store:
    return request.app[STORE]


async def upload_file(request: web.Request):
    if request.content_type != "multipart/form-data":
        raise bad_request("upload with multipart/form-data (fields 'purpose' and 'file')")
    if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        raise ApiError(415, "an upload's body must not be compressed (its parts may say their own encoding)",
                       code="unsupported_content_encoding")
    try:
        purpose, data, filename, fields = await _read_upload(request, request.app[STATE].cfg.max_upload_bytes)
        body_read(request)
    except (ValueError, AssertionError, LookupError, RuntimeError, HttpProcessingError) as e:   # a bad body
        raise bad_request(f"malformed multipart/form-data body: {str(e) or type(e).__name__}") from None
    if purpose is None:
        raise bad_request(f"'purpose' is required (one of {', '.join(PURPOSES)})", param="purpose")
    if purpose not in PURPOSES:
        raise bad_request(f"'purpose' must be one of {', '.join(PURPOSES)}", param="purpose")
    if data is None:
        raise bad_request("missing 'file' part", param="file")
    expiry = upload_expiry(fields)
    return json_response(_store(request).add_file(data, filename, purpose, expiry and expiry["seconds"]))


def upload_expiry(fields: dict[str, str]) -> dict | None:
    """An upload's ``expires_after``: as the openai client sends it (``expires_after[anchor]`` and
    ``expires_after[seconds]`` parts) or as one part of JSON text; checked as a JSON body is."""
    if "expires_after" in fields:
        try:
            expiry = orjson.loads(fields["expires_after"])
        except orjson.JSONDecodeError:
            raise bad_request("'expires_after' must be a JSON object", param="expires_after") from None
    else:
        expiry = {k: fields[f"expires_after[{k}]"] for k in ("anchor", "seconds") if f"expires_after[{k}]" in fields}
        if not expiry:
            return None
        if re.fullmatch(r"[0-9]{1,20}", expiry.get("seconds", "").strip()):      # a form's parts are text
            expiry["seconds"] = int(expiry["seconds"])
    validate({"expires_after": expiry}, UPLOAD_FIELDS)
    return expiry


async def _read_upload(request: web.Request, limit: int) -> tuple[str | None, bytes | None, str, dict[str, str]]:
    """The parts of a multipart upload: (purpose, file bytes, file name, the other text parts)."""
    reader = await request.multipart()
    purpose, data, filename, fields = None, None, "upload.jsonl", {}
    async for part in reader:
        if not isinstance(part, BodyPartReader):
            raise ValueError("a part holds parts of its own (nested multipart)")
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name and part.name.startswith("expires_after"):
            fields[part.name] = await part.text()
        elif part.name == "file":
            filename = part.filename or filename
            if any("\ud800" <= c <= "\udfff" for c in filename):    # bytes that were not UTF-8, as aiohttp keeps them
                raise bad_request("the file's name must be UTF-8 text", param="file")
            buf = bytearray()
            while chunk := await part.read_chunk(1 << 16):
                buf.extend(chunk)
                if len(buf) > limit:
                    raise ApiError(413, f"file larger than the {limit}-byte limit", param="file")
            data = bytes(buf)
    return purpose, data, filename, fields


def _found(obj: dict | None, kind: str, ident: str, param: str | None = None) -> dict:
    """``obj``, or 404 naming ``param`` (``<kind>_id`` unless given)."""
    if obj is None:
        raise ApiError(404, f"No such {kind}: {ident}", param=param or f"{kind}_id", code="not_found")
    return obj


def _file_or_404(request) -> dict:
    return _found(_store(request).get_file(request.match_info["id"]), "file", request.match_info["id"])


async def list_files(request):
    """OpenAI's list: ``purpose``, ``limit`` (1-10,000, all by default), ``order`` (``desc``,
    newest first, by default, or ``asc``) and ``after`` (the last id of the previous page)."""
    q = request.query
    data, more = _store(request).list_files(q.get("purpose"), query_limit(q, 10_000, 10_000), newest_first(q),
                                            q.get("after"))
    return json_response(page(data, more))


async def get_file(request):
    return json_response(_file_or_404(request))


DOWNLOAD_CHUNK = 1 << 20


async def file_content(request):
    """Sent from disk in chunks read off the event loop (a batch's output may be hundreds of MB:
    read whole, it would stall every stream), all before the handler returns: until its last
    byte the download is a request in progress, so the head timeout that starts when a request
    ends cannot cut it, and its connection is not idle (closed to make room for another)."""
    f = _file_or_404(request)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = f["bytes"]
    try:
        fh = open(_found(_store(request).file_path(f["id"]), "file", f["id"]), "rb")
    except FileNotFoundError:                 # deleted meanwhile
        raise ApiError(404, f"No such file: {f['id']}", param="file_id", code="not_found") from None
    with fh:
        await resp.prepare(request)
        while chunk := await asyncio.to_thread(fh.read, DOWNLOAD_CHUNK):
            await resp.write(chunk)
    await resp.write_eof()
    return resp


async def delete_file(request):
    f = _file_or_404(request)
    _store(request).delete_file(f["id"])
    return json_response({"id": f["id"], "object": "file", "deleted": True})


async def create_batch(request):
    body = await read_json(request)
    validate(body, BATCH_BODY)
    fid, endpoint = body["input_file_id"], body["endpoint"]
    f = _found(_store(request).get_file(fid), "file", fid, "input_file_id")
    if f["purpose"] != "batch":
        raise bad_request("the input file's purpose must be 'batch'", param="input_file_id")
    window = body.get("completion_window") or "24h"
    keep = body.get("output_expires_after")
    b = _store(request).add_batch(fid, endpoint, WINDOWS[window], window, body.get("metadata"),
                                  request.app[STATE].cfg.served_model_name, keep and keep["seconds"])
    if request.app[STATE].engine is not None:
        request.app[RUNNER].start(b["id"])      # else it starts when the model is ready
    return json_response(b)


def _batch_or_404(request) -> dict:
    return _found(_store(request).get_batch(request.match_info["id"]), "batch", request.match_info["id"])


async def get_batch(request):
    return json_response(_batch_or_404(request))


async def list_batches(request):
    data, more = _store(request).list_batches(query_limit(request.query, 20, 100), request.query.get("after"))
    return json_response(page(data, more))


async def cancel_batch(request):
    b = _batch_or_404(request)
    if b["status"] not in ("validating", "in_progress", "cancelling"):
        raise ApiError(409, f"cannot cancel a batch that is {b['status']}", param="batch_id")
    return json_response(request.app[RUNNER].cancel(b["id"]))
