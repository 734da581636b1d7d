"""aiohttp application: OpenAI-compatible endpoints over the AsyncEngine. Thin by design:
validate, build Requests, stream results. No scheduling decisions live here."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import re
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
from aiohttp import web

from tandem.engine.messages import DeviceError
from tandem.sched.async_engine import AsyncEngine, Event, GenerationFailed, Submission
from tandem.sched.llm import PromptTooLong
from tandem.sched.request import FinishReason, Request, ServiceClass, error_id
from tandem.server.config import ServerConfig
from tandem.server.cors import preflight
from tandem.server.connections import (CLIENT_GONE, GUARD, STOP, body_read, client_gone, connections_middleware,
                                       stream_writer)
from tandem.server.errors import (MAX_NESTING, ApiError, bad_request, nests_deeper, out_of_storage, storage_full,
                                  structured_error, too_deep)
from tandem.server.logprobs import Pieces, TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_json
from tandem.server.metrics import Metrics
from tandem.server.store import Store
from tandem.server.protocol import (GenRequest, check_model, parse_chat, parse_completion, parse_detokenize,
                                    parse_tokenize)
from tandem.server.tools import ContentStream, ToolPlan, finish_reason

# no API key needed: what /metrics shows, no request text
OPEN_PATHS = ("/health", "/ping", "/version", "/load", "/metrics", "/status", "/dashboard", "/openapi.json")
PAST_CAPACITY = "chats_past_capacity"      # the error code of a chat refused by --shed-chats-after
TOKEN_IDS = TokenText(None)                 # each token as "token_id:<id>" (what a model without a tokenizer shows)
DASHBOARD = Path(__file__).parent / "static" / "dashboard.html"
log = logging.getLogger(__name__)


@dataclass
class AppState:
    cfg: ServerConfig
    metrics: Metrics
    engine: AsyncEngine | None = None
    load_error: str | None = None
    text_of: TokenText | None = None        # token texts for log probabilities, once the model is loaded
    created: int = field(default_factory=lambda: int(time.time()))


ADMISSION_POLL_S = 0.1
STATE = web.AppKey("state", AppState)
STORE = web.AppKey("store", Store)      # files, batches and kept responses (routes_batch opens it)


def json_response(obj, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return json_response(e.body(), e.status, e.headers)
    except web.HTTPRequestEntityTooLarge as e:
        return json_response(ApiError(413, f"request body too large: {e.text}").body(), 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None    # 405 must say it
        why = e.reason if e.status != 404 else f"{request.method} {request.path} is not an operation of " \
            "this server (GET /openapi.json lists them)"
        return json_response(ApiError(e.status, why, type=kind).body(), e.status, allow)
    except RecursionError:
        return json_response(too_deep().body(), 400)
    except Exception as e:   # a bug: logged with an id the client can quote, never a traceback
        if out_of_storage(e):                   # not a bug: the disk is full
            log.warning("%s %s: the data dir refused a write: %s", request.method, request.path, e)
            return json_response(storage_full(e).body(), 507)
        if isinstance(e, ConnectionError) and client_gone(request):
            return web.Response(status=CLIENT_GONE)     # nobody to answer: its write fails, the access log says 499
        eid = error_id()
        log.exception("%s %s failed (%s)", request.method, request.path, eid)
        return json_response(ApiError(500, f"internal error (error id {eid})", type="server_error").body(), 500)


REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = "tandem.request_id"     # the id a completion was given (a request's own key)
CLIENT_ID = re.compile(r"[\x21-\x7e]{1,256}")     # a client's id: printable ASCII, no spaces


def client_request_id(request: web.Request) -> str | None:
    """The request's X-Request-Id, where it is one to name things by (printable ASCII, at most
    256 characters; anything else is ignored, as if not given)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return given if given is not None and CLIENT_ID.fullmatch(given) else None


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``--enable-request-id-headers``: every response says X-Request-Id, as vLLM's: the
    completion's id without its prefix, else the request's own header, else a new id."""
    response.headers[REQUEST_ID_HEADER] = request.get(REQUEST_ID) or client_request_id(request) \
        or uuid.uuid4().hex


def bearer_ok(header: str, key: str) -> bool:
    """``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.strip().partition(" ")
    # a header's bytes that are not UTF-8 arrive as surrogates: compare them back as bytes
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(errors="surrogateescape"),
                                                              key.encode())


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = request.app[STATE].cfg.api_keys
    if keys and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        if not any([bearer_ok(given, key) for key in keys]):     # every key compared: no early exit
            raise ApiError(401, "Incorrect or missing API key", code="invalid_api_key")
    return await handler(request)


def served_model(body: dict, cfg: ServerConfig, engine: AsyncEngine | None = None) -> str:
    """The served model's name for a body that names it by any of its names, or none; the LoRA
    adapter's for one that names an adapter the engine serves (404 else)."""
    return check_model(body, cfg.served_model_name, cfg.model_aliases, {} if engine is None else engine.llm.adapters)


@contextlib.asynccontextmanager
async def room_to_wait(engine: AsyncEngine, cfg: ServerConfig):
    """Until the waiting queue has room: work the server queues by itself (a batch's line, a
    request run again) waits for it rather than be refused. Its place is held (counted as
    waiting) until its requests are queued: lines passing the check at once went past the
    limit."""
    while engine.num_waiting() >= cfg.max_waiting:
        await asyncio.sleep(ADMISSION_POLL_S)
    engine.admitting += 1
    engine.admitting_be += 1
    try:
        yield
    finally:
        engine.admitting -= 1
        engine.admitting_be -= 1


def ready_engine(request: web.Request) -> AsyncEngine:
    st = request.app[STATE]
    if st.engine is None:
        msg = f"model failed to load: {st.load_error}" if st.load_error else "model is loading"
        raise ApiError(503, msg, type="service_unavailable", headers={"Retry-After": "5"})
    if st.engine.dead:
        raise ApiError(503, f"engine failed: {st.engine.dead}", type="service_unavailable")
    return st.engine


async def read_json(request: web.Request) -> dict:
    limit = request.app[STATE].cfg.max_body_bytes
    if (request.content_length or 0) > limit:          # refused before a byte of it is read
        raise ApiError(413, f"request body of {request.content_length} bytes is over the {limit}-byte limit")
    raw = await request.read()                          # a chunked one: aiohttp stops it at the limit
    body_read(request)
    raw = decoded(raw, request.headers.get("Content-Encoding", ""), limit)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if nests_deeper(body):
        raise bad_request(f"the request body nests deeper than {MAX_NESTING} levels")
    return body


WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decoded(raw: bytes, encoding: str, limit: int) -> bytes:
    """A body as it was before its ``Content-Encoding`` (gzip, deflate or none: the app decodes
    bodies itself, so that a bad one is answered as any bad request is). ApiError: 415 for
    another encoding, 400 for a body that does not decode whole, 413 past ``limit`` bytes
    decoded."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return raw
    if enc not in WBITS:
        raise ApiError(415, f"Content-Encoding '{encoding}' is not supported: send gzip, deflate or none",
                       code="unsupported_content_encoding")
    d = zlib.decompressobj(WBITS[enc])
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise bad_request(f"the body is not valid {enc} data: {e}") from None
    if len(out) > limit:
        raise ApiError(413, f"request body is over the {limit}-byte limit once decoded")
    if not d.eof:
        raise bad_request(f"the {enc} body ends before its data does")
    return out


# ---- generation ------------------------------------------------------------------
@dataclass
class Prepared:
    gen: GenRequest
    model: str
    rid: str                        # its requests' ids begin with it
    prompt_tokens: int              # over all its prompts
    requests: list[Request]
    subs: list[Submission]          # already queued in the engine
    id: str                         # the completion's id (chatcmpl-..., cmpl-...)

    def close(self) -> None:
        """Abort whatever has not finished (client gone, or an error)."""
        for sub in self.subs:
            sub.close()


async def prepare(engine: AsyncEngine, cfg: ServerConfig, body: dict, chat: bool,
                  force_be: bool = False, request_id: str | None = None) -> Prepared:
    """Validate a body and build its engine Requests, n per prompt (raises ApiError). Prompts are
    tokenized on a worker thread: a long one never holds up the event loop. The completion is
    named by ``request_id`` (a client's X-Request-Id), else by the body's ``request_id``, else
    anew; its requests' ids stay unique when a client names two alike."""
    model = served_model(body, cfg, engine)
    adapter = engine.llm.adapters.get(model)
    defaults = dict(default_ttft_s=None, default_tbt_s=None) if force_be else \
        dict(default_ttft_s=cfg.slo_ttft_ms / 1000, default_tbt_s=cfg.slo_tbt_ms / 1000)  # RT targets only
    defaults["model_defaults"] = engine.llm.sampling_defaults
    gen = parse_chat(body, cfg.trust_request_chat_template, **defaults) if chat else \
        parse_completion(body, **defaults)
    if force_be:                      # batch-job lines are best-effort whatever they ask
        gen.service_class = ServiceClass.BE
    sp = gen.sampling
    try:      # off the event loop: a structured output's grammar is compiled to check it
        bad_words = await asyncio.get_running_loop().run_in_executor(None, checked_sampling, engine.llm, sp)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("structured_outputs"):
            raise structured_error(msg, gen.structured_param) from None
        raise bad_request(msg, param=msg.split(":")[0]) from None     # "stop: ...", "stop_token_ids: ..."
    param = "messages" if chat else "prompt"
    try:
        encoded = await asyncio.get_running_loop().run_in_executor(
            None, lambda: [engine.llm.encode_prompt(prompt, gen.template, sp.truncate_prompt_tokens, sp.max_tokens)
                           for prompt in gen.prompts])
    except ValueError as e:
        raise bad_request(str(e), param=prompt_param(e, param),
                          code="context_length_exceeded" if isinstance(e, PromptTooLong) else None) from None
    budgets = [max_tokens_for(engine, sp, len(ids), param, gen.max_tokens_param, gen.max_tokens_given)
               for ids, _ in encoded]
    if not force_be and engine.num_waiting(rt_only=gen.service_class is ServiceClass.RT) >= cfg.max_waiting:
        raise ApiError(429, "too many requests are waiting; retry later", type="rate_limit_error",
                       headers={"Retry-After": "1"})
    if (gen.service_class is ServiceClass.RT and cfg.shed_chats_after
            and engine.chats_overdue(cfg.shed_chats_after)):
        raise ApiError(429, f"chats are waiting more than {cfg.shed_chats_after:g} times their first-token "
                            "target: the server is past its capacity for chats; retry later",
                       type="rate_limit_error", code=PAST_CAPACITY, headers={"Retry-After": "5"})
    named = request_id or body.get("request_id")
    shown = ("chatcmpl-" if chat else "cmpl-") + (named or uuid.uuid4().hex)
    rid = shown if named is None else f"{shown}-{uuid.uuid4().hex[:8]}"
    now = time.monotonic()
    reqs = [Request(f"{rid}-{j * gen.n + i}", ids,          # choice index: prompt j's i-th choice
                    replace(sp, max_tokens=mt, seed=None if sp.seed is None else sp.seed + i, stop=list(sp.stop),
                            stop_token_ids=list(sp.stop_token_ids)),
                    gen.service_class, now, gen.slo_ttft_s, gen.slo_tbt_s, text, stream_text=gen.stream,
                    cache_salt=gen.cache_salt, bad_words_ids=bad_words, adapter=adapter)
            for j, ((ids, text), mt) in enumerate(zip(encoded, budgets)) for i in range(gen.n)]
    p = Prepared(gen, model, rid, sum(len(ids) for ids, _ in encoded), reqs, [], shown)
    if gen.beam is not None:         # each step submits its own requests (run_beams)
        return p
    lengths = engine.llm.lengths
    if lengths is not None:          # embeds the prompt: off the event loop, one at a time
        engine.admitting += len(reqs)          # counted as waiting meanwhile (admission control)
        be = len(reqs) if gen.service_class is ServiceClass.BE else 0
        engine.admitting_be += be
        try:
            texts = [text for prompt, e in zip(gen.prompts, encoded)
                     for text in [engine.llm.prediction_text(prompt, sp, e)] * gen.n]
            await predict_lengths(lengths, reqs, texts)
        finally:
            engine.admitting -= len(reqs)
            engine.admitting_be -= be
    try:
        for r in reqs:
            p.subs.append(engine.submit(r))
    except (DeviceError, ValueError) as e:
        p.close()
        if lengths is not None:
            lengths.forget([r.req_id for r in reqs])
        if isinstance(e, DeviceError):
            raise ApiError(503, str(e), type="service_unavailable", headers={"Retry-After": "5"}) from None
        raise bad_request(str(e), param=param) from None
    return p


def loading(build) -> asyncio.Future:
    """``build()`` (the engine) on a daemon thread. A server stopped while it loads exits without
    waiting for it (a thread of the loop's executor would be waited for, for the whole load): the
    worker processes it started are daemons and end with the server, and an engine that is built
    once nobody waits for it is shut down."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.cancelled():
            if result is not None:
                result.shutdown()
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        result = error = None
        try:
            result = build()
        except Exception as e:          # noqa: BLE001 -- handed to the waiting task
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:            # the loop is closed: the server stopped meanwhile
            if result is not None:
                result.shutdown()
    threading.Thread(target=run, name="tandem-load", daemon=True).start()
    return fut


def prompt_param(e: ValueError, param: str) -> str:
    """The field a prompt's encoding error names: a request's own chat template, else ``param``."""
    return "chat_template" if str(e).startswith("chat_template:") else param


def checked_sampling(llm, sp) -> tuple[tuple[int, ...], ...]:
    """``sp`` checked against the model (ValueError naming the field), and its bad words in tokens."""
    llm.check_sampling(sp)
    return llm.bad_words_ids(sp)


async def predict_lengths(lengths, reqs: list[Request], texts: list[str]) -> None:
    """The requests' predicted lengths, from the prediction thread. A client that leaves
    meanwhile cannot stop the prediction under way; its requests are forgotten once it ends."""
    job = _predicting().submit(lengths.assign, reqs, texts)
    try:
        await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        job.add_done_callback(lambda _: lengths.forget([r.req_id for r in reqs]))
        raise


def max_tokens_for(engine: AsyncEngine, sp, prompt_tokens: int, param: str, mt_param: str, given: bool) -> int:
    """A prompt's max_tokens, once it is known to fit the context and the pool (raises
    ApiError naming ``mt_param``, the field that gave it). When the request set none:
    ``LLM.output_room``, or the default (``given`` False: a completion's 16, the model's
    generation config's) where that is less, as vLLM cuts a default to the room left."""
    limit = engine.llm.max_model_len
    if prompt_tokens >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{prompt_tokens}, which leaves no room for output", param=param,
                          code="context_length_exceeded")
    room = engine.llm.output_room(prompt_tokens)
    mt = room if sp.max_tokens is None else sp.max_tokens if given else min(sp.max_tokens, room)
    if prompt_tokens + mt > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{prompt_tokens} and {mt_param} asks for {mt}", param=mt_param,
                          code="context_length_exceeded")
    try:
        replace(sp, max_tokens=mt)                  # validates
        engine.scheduler.check_fits(prompt_tokens, mt)
    except ValueError as e:
        field_name = str(e).split(":", 1)[0]
        raise bad_request(str(e), param=param if field_name == "prompt" else field_name) from None
    return mt


@functools.cache
def _predicting() -> ThreadPoolExecutor:
    """One thread for length predictions: the encoder uses one core, never the workers' others."""
    return ThreadPoolExecutor(1, thread_name_prefix="predict")


def _save_lengths(engine, cfg: ServerConfig) -> None:
    """Keep what the predictor learned from this run's requests in the data dir."""
    lengths = engine.llm.lengths
    if lengths is not None and lengths.predictor is not None and lengths.learned:
        lengths.predictor.save(Path(cfg.data_dir) / "predictor")


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    parts: list[str] = field(default_factory=list)      # text deltas, joined once at the end
    prompt_ids: list[int] | None = None     # set where the request asked for token ids back
    ids_sent: int = 0                       # of token_ids, how many a stream has sent
    logprobs: list | None = None            # TokenLogprobs per token, where the request asked for them
    lps_sent: int = 0                       # of logprobs, how many a stream has sent
    text_offset: int = 0                    # a completion's: characters its sent logprobs' tokens span
    pieces: Pieces | None = None            # a completion's: what its sent logprobs' tokens added to the text
    echo: str | None = None                 # a completion's prompt text, to go before its output (echo)
    echo_ids: list[int] | None = None       # and the prompt's ids, for its log probabilities
    prompt_logprobs: list | None = None     # the echoed prompt's, from the first event
    echo_sent: bool = False                 # a stream sends the echo in its first chunk
    echo_top: int = 0                       # the likeliest tokens its log probabilities list
    echo_only: bool = False                 # max_tokens 0: the prompt alone, the token that scored it unshown
    tokens_as_ids: bool = False             # its log probabilities name tokens "token_id:<id>"
    content: ContentStream | None = None    # a streamed chat with tools: what goes out before the end
    cached_tokens: int = 0                  # prompt tokens found in the prefix cache
    stop_reason: str | int | None = None    # vLLM's: the stop string or stop token id that ended it
    tokens_counted: int = 0                 # of its tokens, those the metrics counted as they came

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def echo_pending(self) -> bool:
        return self.echo is not None and not self.echo_sent

    def take_echo(self) -> tuple[str, list[int], list]:
        """The echoed prompt's text, and its ids and log probabilities where the request asked
        for them, the first time (empty after, and without echo)."""
        if not self.echo_pending:
            return "", [], []
        self.echo_sent = True
        if self.logprobs is None or self.prompt_logprobs is None:
            return self.echo, [], []
        k = self.echo_top         # the prompt may have been scored with more (prompt_logprobs)
        return self.echo, self.echo_ids, [lp if lp is None or len(lp.top_ids) <= k else replace(
            lp, top_ids=lp.top_ids[:k], top_logprobs=lp.top_logprobs[:k]) for lp in self.prompt_logprobs]


async def run_choice(sub: Submission, metrics: Metrics, req: Request, ch: Choice, sink=None, n: int = 1) -> None:
    """Drive one request to its end, appending text; ``sink(choice, delta)`` is called for each
    event that brings text, token ids or the end (it sends what its stream carries). ``n``: the
    choices its prompt asked for (metrics count it at each prompt's first choice).

    If the caller goes away (cancellation), the request is aborted in the engine
    and counted with finish reason "abort".
    """
    queue_s = None

    def record(reason: str, end: float) -> None:
        record_choice(metrics, req, ch, reason, end, queue_s, n)
    try:
        async for ev in sub.events():
            if ch.echo_only:
                ev = prompt_alone(ev)
            now = time.monotonic()
            ch.token_ids.extend(ev.new_token_ids)
            ch.token_times.extend([now] * len(ev.new_token_ids))
            if ev.new_token_ids:
                metrics.tokens_out(req.service_class.value, len(req.prompt_token_ids), len(ev.new_token_ids),
                                   ch.tokens_counted)
                ch.tokens_counted += len(ev.new_token_ids)
            if ch.logprobs is not None and ev.logprobs:
                ch.logprobs.extend(ev.logprobs)
            if ev.prompt_logprobs is not None:
                ch.prompt_logprobs = ev.prompt_logprobs
            delta = ev.text
            if ev.queue_s is not None:      # with the first token: a request aborted later still has it
                queue_s = ev.queue_s
            if ev.finish_reason is not None:
                ch.finish_reason = ev.finish_reason.value
                ch.cached_tokens, ch.stop_reason = ev.cached_tokens, ev.stop_reason
                record(ch.finish_reason, now)
            if delta:
                ch.parts.append(delta)
            if ev.finish_reason is not None and ev.error:   # an error event ends the stream, no finish chunk
                raise ApiError(500, f"generation failed: {ev.error}", type="server_error")
            if sink is not None and (delta or ev.new_token_ids or ev.finish_reason is not None):
                await sink(ch, delta)
    except ApiError:
        raise
    except BaseException:           # cancelled, or the client's connection broke mid-stream
        if ch.finish_reason is None:
            record("abort", time.monotonic())
        raise


def prompt_alone(ev: Event) -> Event:
    """An event of a request that scores its prompt for ``max_tokens: 0`` (one token generated),
    as vLLM answers one: without the token, its text and its log probabilities, and ended by
    the length it was given ("length"), whatever ended the token."""
    ended = ev.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    return replace(ev, new_token_ids=[], text="", logprobs=None, stop_reason=None,
                   finish_reason=FinishReason.LENGTH if ended else ev.finish_reason)


def record_choice(metrics: Metrics, req: Request, ch: Choice, reason: str, end: float, queue_s: float | None,
                  n: int) -> None:
    """One choice's end in the metrics (its prompt's n counted at its first choice)."""
    metrics.request_done(req.service_class.value, prompt_tokens=len(req.prompt_token_ids),
                         token_times=ch.token_times, arrival=req.arrival_time, end=end,
                         queue_s=queue_s, finish_reason=reason, slo_ttft_s=req.slo_ttft_s,
                         slo_tbt_s=req.slo_tbt_s, max_tokens=req.sampling.max_tokens,
                         n=n if ch.index % n == 0 else None, counted=ch.tokens_counted)


async def run_beams(engine: AsyncEngine, st: AppState, p: Prepared, choices: list[Choice], sink=None) -> None:
    """vLLM's use_beam_search: one search per prompt, whose n best beams are its n choices, best
    first, each whole once the search ends (a stream gets them then). As vLLM answers: a beam
    that picked an end token has ``stop_reason`` that token, which is left out of its text and
    (unless ``include_stop_str_in_output``) of its token ids and log probabilities. Each token's
    time in the metrics is the end of the step that chose it."""
    n, beam, top = p.gen.n, p.gen.beam, p.gen.sampling.logprobs

    async def search(j: int) -> None:
        req, mine = p.requests[j * n], choices[j * n:(j + 1) * n]
        try:
            found, ends, cached = await engine.beam_search(req, beam, top or 0)
        except GenerationFailed as e:
            _beams_ended(st, req, mine, "error", n)
            raise ApiError(500, str(e), type="server_error") from None
        except DeviceError as e:
            raise ApiError(503, str(e), type="service_unavailable", headers={"Retry-After": "5"}) from None
        except ValueError as e:           # a step that can never run (checked before: not expected)
            raise bad_request(str(e)) from None
        except BaseException:             # the client went away: the search stopped where it was
            _beams_ended(st, req, mine, "abort", n)
            raise
        for seq, ch in zip(found.result(), mine):
            ids = found.output_ids(seq)
            ended = seq.stop_reason is not None
            kept = ids if beam.include_stop_str_in_output or not ended else ids[:-1]
            text = engine.llm.detokenize(ids[:-1] if ended else ids, beam.skip_special_tokens) \
                if st.text_of.tok is not None else ""
            ch.token_ids, ch.parts, ch.token_times = kept, [text], ends[:len(kept)]
            ch.finish_reason, ch.stop_reason, ch.cached_tokens = seq.finish_reason, seq.stop_reason, cached
            if ch.logprobs is not None:
                ch.logprobs = [replace(lp, top_ids=lp.top_ids[:top], top_logprobs=lp.top_logprobs[:top])
                               for lp in seq.logprobs[:len(kept)]]
            record_choice(st.metrics, req, ch, ch.finish_reason, ends[-1], None, n)
            if sink is not None:
                await sink(ch, ch.text)
    await all_or_none(search(j) for j in range(len(p.requests) // n))


def _beams_ended(st: AppState, req: Request, choices: list[Choice], reason: str, n: int) -> None:
    """A search that did not finish: each of its choices counted in the metrics as ``reason``."""
    for ch in choices:
        if ch.finish_reason is None:
            record_choice(st.metrics, req, ch, reason, time.monotonic(), None, n)


def drive(engine: AsyncEngine, st: AppState, p: Prepared, choices: list[Choice], sink=None):
    """The coroutine that runs a prepared request's choices to their ends; ``sink`` as run_choice's."""
    if p.gen.beam is not None:
        return run_beams(engine, st, p, choices, sink)
    return all_or_none(run_choice(sub, st.metrics, r, ch, sink, n=p.gen.n)
                       for sub, r, ch in zip(p.subs, p.requests, choices))


def usage(p: Prepared, choices: list[Choice]) -> dict:
    """Token counts, as OpenAI gives them; a prompt's cached tokens are those every one of its n
    choices found in the prefix cache (each prompt counts once, as in prompt_tokens)."""
    c = sum(len(ch.token_ids) for ch in choices)
    n = p.gen.n
    cached = sum(min(ch.cached_tokens for ch in choices[j:j + n]) for j in range(0, len(choices), n))
    return {"prompt_tokens": p.prompt_tokens, "completion_tokens": c, "total_tokens": p.prompt_tokens + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_json(chat: bool, ch: Choice, text_of: TokenText, tools: ToolPlan | None = None, echo: str = "",
                role: str = "assistant") -> dict:
    """A whole response's choice; ``echo``: the text a chat's content begins with (vLLM's echo);
    ``role``: its message's."""
    if chat:
        content, calls = tools.parse(ch.text) if tools else (ch.text, [])
        content = echo + (content or "") if echo else content
        message = {"role": role, "content": content, "refusal": None} | ({"tool_calls": calls} if calls else {})
        c = {"index": ch.index, "message": message, "logprobs": None,
             "finish_reason": finish_reason(calls, ch.finish_reason, tools), "stop_reason": ch.stop_reason} | \
            unsent_logprobs(chat, ch, text_of)
    else:
        c = completion_choice(ch, ch.text, ch.finish_reason, text_of)
    return c | token_ids_json(chat, ch, ch.token_ids)


def completion_choice(ch: Choice, text: str, finish: str | None, text_of: TokenText) -> dict:
    """A completion's choice (or chunk) with new ``text``: the echoed prompt goes first, once."""
    echo, ids, lps = ch.take_echo()
    return {"index": ch.index, "text": echo + text, "logprobs": None, "finish_reason": finish} | \
        ended(ch, finish) | unsent_logprobs(False, ch, text_of, ids, lps)


def ended(ch: Choice, finish: str | None) -> dict:
    """vLLM's ``stop_reason``, in a choice (or the chunk) that ends."""
    return {"stop_reason": ch.stop_reason} if finish is not None else {}


def unsent_logprobs(chat: bool, ch: Choice, text_of: TokenText, first_ids=(), first_lps=()) -> dict:
    """``logprobs`` of the tokens whose log probabilities are not sent yet (all of them, for a
    whole response), after ``first_ids``' (an echoed prompt's); nothing where the request did not
    ask or none is new."""
    if ch.logprobs is None or (ch.lps_sent == len(ch.logprobs) and not first_ids):
        return {}
    lps = ch.logprobs[ch.lps_sent:]
    ids = ch.token_ids[ch.lps_sent:len(ch.logprobs)]
    ch.lps_sent = len(ch.logprobs)
    if ch.tokens_as_ids:                  # vLLM's return_tokens_as_token_ids: "token_id:<id>" for each token
        text_of = TOKEN_IDS
    if chat:
        return {"logprobs": chat_logprobs(text_of, ids, lps)}
    if ch.pieces is None:
        ch.pieces = Pieces(text_of)
    echoed, offset = completion_logprobs(Pieces(text_of), list(first_ids), list(first_lps), ch.text_offset, True)
    body, ch.text_offset = completion_logprobs(ch.pieces, ids, lps, offset, ch.finish_reason is not None)
    return {"logprobs": {k: echoed[k] + v for k, v in body.items()}}


def token_ids_json(chat: bool, ch: Choice, ids: list[int]) -> dict:
    """vLLM's ``return_token_ids`` fields of a choice: its (new) output ids; a completion's choice
    also carries its prompt's ids (a chat response carries them once, beside the choices)."""
    if ch.prompt_ids is None:
        return {}
    return {"token_ids": ids} if chat else {"prompt_token_ids": ch.prompt_ids, "token_ids": ids}


def new_choices(p: Prepared, text_of: TokenText) -> list[Choice]:
    asked = p.gen.sampling.logprobs is not None
    return [Choice(i, prompt_ids=list(r.prompt_token_ids) if p.gen.return_token_ids else None,
                   logprobs=[] if asked else None, tokens_as_ids=p.gen.tokens_as_ids, echo_only=p.gen.echo_only,
                   **(echo_of(r, text_of) if p.gen.echo else {}))
            for i, r in enumerate(p.requests)]


def echo_of(r: Request, text_of: TokenText) -> dict:
    """A completion's echo: its prompt text (a prompt of token ids: their text, less a character
    they leave incomplete at the end; none where the model has no tokenizer, since it makes no
    text) and ids."""
    text = r.prompt if r.prompt is not None else "" if text_of.tok is None else \
        text_of.decoder.whole(r.prompt_token_ids)
    return {"echo": text, "echo_ids": list(r.prompt_token_ids), "echo_top": r.sampling.logprobs or 0}


def chat_prompt_ids(p: Prepared) -> dict:
    """A chat response's ``prompt_token_ids`` (one conversation, so one prompt), when asked for."""
    return {"prompt_token_ids": list(p.requests[0].prompt_token_ids)} if p.gen.return_token_ids else {}


async def all_or_none(coros) -> None:
    """Await every coroutine; when one fails (or this is cancelled) the others are cancelled
    too, so none of them waits for ever on a request already closed."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def served_tier(p: Prepared) -> str:
    """OpenAI's ``service_tier`` of how the request was served: "flex" best-effort, "default" real-time."""
    return "flex" if p.gen.service_class is ServiceClass.BE else "default"


def head(p: Prepared, obj: str, created: int) -> dict:
    """The fields a response (or each event of a stream) begins with."""
    return {"id": p.id, "object": obj, "created": created, "model": p.model, "service_tier": served_tier(p)}


async def run_to_end(engine: AsyncEngine, st: AppState, p: Prepared) -> list[Choice]:
    """Run a prepared, non-streamed request to its end; its choices."""
    choices = new_choices(p, st.text_of)
    try:
        await drive(engine, st, p, choices)
    finally:
        p.close()
    return choices


async def complete(engine: AsyncEngine, st: AppState, p: Prepared, chat: bool) -> dict:
    """Run a prepared, non-streamed request to its end; the OpenAI response body."""
    created = int(time.time())
    choices = await run_to_end(engine, st, p)
    body = [choice_json(chat, ch, st.text_of, p.gen.tools, p.gen.chat_echo, p.gen.reply_role) for ch in choices]
    top = chat_prompt_ids(p) if chat else {}
    if p.gen.prompt_logprobs is not None:   # where vLLM puts them: beside a chat's choices (one
        scored = scored_prompts(st, p, choices)     # prompt), in each completion choice
        if chat:
            top["prompt_logprobs"] = scored[0]
        else:
            for c, lp in zip(body, scored):
                c["prompt_logprobs"] = lp
    return head(p, "chat.completion" if chat else "text_completion", created) | {
        "choices": body, "usage": usage(p, choices)} | top


def scored_prompts(st: AppState, p: Prepared, choices: list[Choice]) -> list:
    """vLLM's ``prompt_logprobs`` of each choice's prompt (None where it ended before scoring)."""
    return [prompt_logprobs_json(st.text_of, list(r.prompt_token_ids), ch.prompt_logprobs, p.gen.prompt_logprobs)
            if ch.prompt_logprobs is not None else None for r, ch in zip(p.requests, choices)]


async def prepare_online(engine: AsyncEngine, st: AppState, body: dict, chat: bool,
                         request: web.Request | None = None) -> Prepared:
    """``prepare`` for a client's request: a refusal for the waiting queue, or of a chat past
    capacity, is counted. The
    completion takes the id the request's X-Request-Id header gives, and its response's header
    says it (``request_id_header``)."""
    try:
        p = await prepare(engine, st.cfg, body, chat,
                          request_id=None if request is None else client_request_id(request))
        if request is not None:
            request[REQUEST_ID] = p.id.split("-", 1)[1]
        return p
    except ApiError as e:
        if e.code == PAST_CAPACITY:
            st.metrics.chats_refused.labels(st.metrics.model).inc()
        elif e.status == 429:
            st.metrics.queue_full.labels(st.metrics.model).inc()
        raise


async def generate_handler(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[STATE]
    engine = ready_engine(request)
    p = await prepare_online(engine, st, await read_json(request), chat, request)
    if p.gen.stream:
        try:
            return await stream_handler(request, engine, st, p, new_choices(p, st.text_of), chat, int(time.time()))
        finally:
            p.close()
    return json_response(await complete(engine, st, p, chat))


async def stream_handler(request, engine, st, p: Prepared, choices, chat, created) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    top = head(p, obj, created)         # the same in every event: built once, not per token
    write = stream_writer(request, resp)

    async def send(payload) -> None:
        await write(b"data: " + orjson.dumps(payload) + b"\n\n")

    def event(c: dict) -> dict:
        return {**top, "choices": [c]}

    def chunk(ch: Choice, delta: str, finish: str | None, first: bool = False) -> dict:
        if chat:
            d = {"role": p.gen.reply_role, "content": ""} if first else ({"content": delta} if delta else {})
            c = {"index": ch.index, "delta": d, "logprobs": None, "finish_reason": finish} | ended(ch, finish)
            if not first:
                c |= unsent_logprobs(chat, ch, st.text_of)
        else:
            c = completion_choice(ch, delta, finish, st.text_of)
        if ch.prompt_ids is not None and not first:     # the ids not sent yet; a completion's
            c |= token_ids_json(chat, ch, ch.token_ids[ch.ids_sent:])     # prompt ids go once,
            if ch.ids_sent:                                   # with its first ids
                c.pop("prompt_token_ids", None)
            ch.ids_sent = len(ch.token_ids)
        return event(c)

    if chat:
        for i, ch in enumerate(choices):
            await send(chunk(ch, "", None, first=True) | (chat_prompt_ids(p) if i == 0 else {}))
            if p.gen.chat_echo:
                await send(event({"index": ch.index, "delta": {"content": p.gen.chat_echo}, "logprobs": None,
                                  "finish_reason": None}))

    tools = p.gen.tools
    for ch in choices if tools is not None else ():
        ch.content = ContentStream(tools)

    def call_event(ch: Choice, calls: list[dict]) -> dict:
        return event({"index": ch.index, "logprobs": None, "finish_reason": None, "delta": {"tool_calls": calls}})

    async def sink(ch: Choice, delta: str) -> None:
        closed = []
        if ch.content is not None:            # content outside call blocks; the calls' deltas
            parts = ch.content.feed(delta)
            delta = "".join(part for part in parts if isinstance(part, str))
            closed = [part for part in parts if isinstance(part, dict)]
        if delta or ch.echo_pending or (ch.prompt_ids is not None and len(ch.token_ids) > ch.ids_sent) or (
                ch.logprobs is not None and len(ch.logprobs) > ch.lps_sent):
            await send(chunk(ch, delta, None))
        if closed:
            await send(call_event(ch, closed))
        if ch.finish_reason is None:
            return
        finish = ch.finish_reason
        if ch.content is not None:
            content, calls = ch.content.final(ch.text)
            if content and len(content) > ch.content.sent:
                await send(chunk(ch, content[ch.content.sent:], None))
            finish = finish_reason(calls, finish, ch.content.plan)
            if calls:
                rest = [c | {"index": i} for i, c in enumerate(calls) if i >= ch.content.calls_sent]
                if rest:
                    await send(call_event(ch, rest))
        await send(chunk(ch, "", finish))

    try:
        await drive(engine, st, p, choices, sink)
        if p.gen.include_usage:
            await send({**top, "choices": [], "usage": usage(p, choices)})
    except ApiError as e:                 # headers are out: report in-band, as OpenAI does
        await send(e.body())
    await write(b"data: [DONE]\n\n")
    await write(None)
    return resp


# ---- small endpoints ----------------------------------------------------------------
async def chat_completions(request):
    return await generate_handler(request, chat=True)


async def completions(request):
    return await generate_handler(request, chat=False)


async def tokenize(request):
    """vLLM's /tokenize: a prompt's token ids as a completion (text) or a chat (messages) would
    see them, on a worker thread."""
    engine = ready_engine(request)
    body = await read_json(request)
    served_model(body, request.app[STATE].cfg, engine)
    prompt, template = parse_tokenize(body, request.app[STATE].cfg.trust_request_chat_template)
    try:
        ids, _ = await asyncio.get_running_loop().run_in_executor(None, engine.llm.encode_prompt, prompt, template)
    except ValueError as e:
        raise bad_request(str(e), param=prompt_param(e, "prompt" if isinstance(prompt, str) else "messages")) from None
    out = {"count": len(ids), "max_model_len": engine.llm.max_model_len, "tokens": ids}
    if body.get("return_token_strs"):           # vLLM's: each token as the tokenizer spells it
        out["token_strs"] = engine.llm.tokenizer.convert_ids_to_tokens(ids)
    return json_response(out)


async def server_load(request):
    """vLLM's /load: the requests in flight (accepted and not ended), for a load balancer."""
    st = request.app[STATE]
    return json_response({"server_load": 0 if st.engine is None else st.engine.num_requests()})


STATS_EVERY_S = 10.0


async def log_stats(metrics: Metrics) -> None:
    """vLLM's periodic log line, every STATS_EVERY_S while there is work: prompt and generation
    tokens computed per second, requests running and waiting, pool use, prefix-cache hit rate."""
    before = metrics.activity()
    while True:
        await asyncio.sleep(STATS_EVERY_S)
        now = metrics.activity()
        rate = {k: (now[k] - before[k]) / STATS_EVERY_S for k in ("prefill", "decode")}
        queried, hits = now["queried"] - before["queried"], now["hits"] - before["hits"]
        if rate["prefill"] or rate["decode"] or now["running"] or now["waiting"]:
            log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: "
                     "%d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                     rate["prefill"], rate["decode"], now["running"], now["waiting"], 100 * now["kv"],
                     100 * hits / queried if queried else 0.0)
        before = now


async def detokenize(request):
    """vLLM's /detokenize: token ids to text, special tokens kept."""
    engine = ready_engine(request)
    body = await read_json(request)
    served_model(body, request.app[STATE].cfg, engine)
    ids = parse_detokenize(body)
    try:
        text = await asyncio.get_running_loop().run_in_executor(None, engine.llm.ids_to_text, ids)
    except ValueError as e:
        raise bad_request(str(e), param="tokens") from None
    return json_response({"prompt": text})


def _model_object(st, name: str | None = None, adapter=None) -> dict:
    """OpenAI's model object for a served name (the first by default) with vLLM's additions:
    ``root`` (the model as --model named it; an adapter's directory), ``parent`` (null; an
    adapter's: the served model's name), ``max_model_len``, ``permission``."""
    name = name or st.cfg.served_model_name
    root, parent = (st.cfg.model, None) if adapter is None else (adapter.ref.path, st.cfg.served_model_name)
    return {"id": name, "object": "model", "created": st.created, "owned_by": "tandem",
            "root": root, "parent": parent, "max_model_len": st.engine.llm.max_model_len if st.engine else None,
            "permission": [{"id": f"modelperm-{name}", "object": "model_permission",
                            "created": st.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}


async def models(request):
    """Every name --served-model-name gives, as vLLM lists them (each answers requests), then the
    LoRA adapters served."""
    st = request.app[STATE]
    adapters = {} if st.engine is None else st.engine.llm.adapters
    return json_response({"object": "list", "data": [_model_object(st, n) for n in _served_names(st.cfg)]
                          + [_model_object(st, n, a) for n, a in list(adapters.items())]})


def _served_names(cfg) -> tuple[str, ...]:
    return cfg.listed_names or (cfg.served_model_name,)


async def model(request):
    """One model by id, as ``GET /v1/models`` lists it; 404 for a model not served here."""
    st = request.app[STATE]
    name = request.match_info["id"]
    served_model({"model": name}, st.cfg, st.engine)
    adapter = None if st.engine is None else st.engine.llm.adapters.get(name)
    return json_response(_model_object(st, name if name in _served_names(st.cfg) or adapter else None, adapter))


async def health(request):
    st = request.app[STATE]
    if st.engine is None or not st.engine.serving():
        status = "failed" if st.load_error else ("loading" if st.engine is None else "unavailable")
        return json_response({"status": status}, 503)
    return json_response({"status": "ok"})


async def version(request):
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        v = installed("tandem")
    except PackageNotFoundError:          # a checkout run without installing
        v = "unknown"
    return json_response({"version": v})


async def status(request):
    """The dashboard's data: per device the pool by owner and cache type, requests per class with
    why each waits (and its level under alise), tokens/s; SLO attainment over the last minutes;
    batch jobs' progress; connections."""
    from tandem.server.routes_batch import batch_progress
    st = request.app[STATE]
    out = st.metrics.status() | {
        "status": "ok" if st.engine is not None and st.engine.serving() else
                  ("failed" if st.load_error else "loading" if st.engine is None else "unavailable"),
        "policy": st.cfg.policy, "uptime_s": round(time.time() - st.created, 1),
        "slo_targets_ms": {"ttft": st.cfg.slo_ttft_ms, "tbt": st.cfg.slo_tbt_ms},
        "batches": batch_progress(request.app)}
    if (guard := request.app.get(GUARD)) is not None:
        out["connections"] = guard.counts()
    workers = st.engine.llm.worker_pids() if st.engine is not None else []
    out["processes"] = {"server": process_stats(os.getpid()),
                        "workers": [process_stats(pid) for pid in workers]}
    return json_response(out)


def process_stats(pid: int) -> dict | None:
    """Resident memory (MiB), open files, threads and CPU seconds used so far (user and system,
    all its threads) of a process, from /proc (None elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"pid": pid, "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
                "open_files": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(fields["Threads"]),
                "cpu_s": cpu_seconds(pid)}
    except (OSError, KeyError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat (utime and stime, the 14th and 15th
    fields, in clock ticks; the 2nd, its name, is parenthesized and may hold spaces)."""
    rest = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return round((int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"), 2)


async def openapi(request):
    from tandem.server.openapi import document
    cfg = request.app[STATE].cfg
    return json_response(document(root_path=cfg.root_path, runtime_lora=cfg.runtime_lora))


async def dashboard(request):
    return web.FileResponse(DASHBOARD, headers={"Cache-Control": "no-cache"})


async def metrics(request):
    if (guard := request.app.get(GUARD)) is not None:
        request.app[STATE].metrics.http_connections(guard.counts())
    return web.Response(body=request.app[STATE].metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def serving_summary(engine: AsyncEngine, cfg: ServerConfig) -> str:
    """What the server runs with, once loaded: the cache pool (as vLLM logs its blocks) and the
    limits a request meets."""
    block, dtype, blocks = engine.llm.cache_config()
    return (f"{blocks:,} cache blocks of {block} tokens (each K or V: {blocks * block // 2:,} tokens of KV cache, "
            f"{dtype}) on "
            f"{cfg.devices}; policy {cfg.policy}, max-model-len {engine.llm.max_model_len:,}, "
            f"max-num-seqs {cfg.max_num_seqs}, max-waiting {cfg.max_waiting:,}")


def expectation_in_json(answer):
    """A route's ``Expect`` handler, refusing an expectation other than 100-continue with 417 in
    the API's error JSON: aiohttp's own refusal runs before any middleware and is plain text."""
    async def handler(request: web.Request):
        try:
            return await answer(request)
        except web.HTTPExpectationFailed:
            asked = request.headers.get("Expect", "")[:100]
            return json_response(ApiError(417, f"Expect: {asked!r} cannot be met (only 100-continue can)",
                                          param="Expect").body(), 417)
    return handler


def create_app(cfg: ServerConfig, build_engine) -> web.Application:
    """``build_engine()`` runs in a thread at start-up and returns an AsyncEngine."""
    # JSON bodies are read whole and capped here; file uploads stream their parts (routes_batch)
    app = web.Application(middlewares=[connections_middleware, preflight(cfg.cors), errors_middleware,
                                       auth_middleware],
                          client_max_size=cfg.max_body_bytes, handler_args={"auto_decompress": False})
    state = AppState(cfg, Metrics(cfg.served_model_name))
    app[STATE] = state
    cfg.cors.install(app)
    if cfg.request_id_headers:
        app.on_response_prepare.append(request_id_header)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)     # ids may hold slashes ("org/model"), unencoded
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)                    # vLLM's health check, GET and POST
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/load", server_load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/openapi.json", openapi)
    from tandem.server import responses, routes_batch
    routes_batch.add_routes(app)
    responses.add_routes(app)
    from tandem.server import adapters
    adapters.add_routes(app)
    for route in app.router.routes():      # aiohttp has no public way to wrap a route's expect handler
        route._expect_handler = expectation_in_json(route._expect_handler)

    async def load(app_):
        t0 = time.monotonic()
        try:
            engine = await loading(build_engine)
        except Exception as e:     # the server stops (exit status 1), as vLLM's: a supervisor sees it
            state.load_error = f"{type(e).__name__}: {e}"
            print(f"tandem: model failed to load: {state.load_error}", flush=True)
            if STOP in app_:
                app_[STOP]()
            return
        engine.step_listeners.append(state.metrics.engine_step)
        engine.plan_listeners.append(state.metrics.device_planned)
        # /status and /metrics show every device from the start
        if not await asyncio.get_running_loop().run_in_executor(None, engine.runtime.report):
            log.warning("a device did not report within 30 s (stuck in a step?); /status may show it late")
        state.metrics.cache_configured(*engine.llm.cache_config())
        state.metrics.lengths = engine.llm.lengths
        state.text_of = TokenText(engine.llm.tokenizer)
        state.engine = engine
        routes_batch.engine_ready(app_)
        responses.engine_ready(app_)
        if cfg.log_stats:
            app_["stats"] = asyncio.create_task(log_stats(state.metrics))
        print(f"tandem: model {cfg.model!r} ready in {time.monotonic() - t0:.1f} s", flush=True)
        print("tandem: " + serving_summary(engine, cfg), flush=True)

    async def on_startup(app_):
        app_["loader"] = asyncio.create_task(load(app_))

    async def on_cleanup(app_):
        app_["loader"].cancel()
        if "stats" in app_:
            app_["stats"].cancel()
        await responses.stop(app_)
        await routes_batch.stop(app_)          # closes the store
        if state.engine is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, _save_lengths, state.engine, cfg)
            except Exception:            # noqa: BLE001 -- the engine still shuts down cleanly
                log.exception("saving the learned output lengths to %s failed", cfg.data_dir)
            finally:
                await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
