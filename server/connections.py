"""Connections, below HTTP: a cap on how many are open, and deadlines for a request's head and
body, so that clients that connect and send nothing (or send it slowly) cannot hold the
server's file descriptors or its attention.

Every accepted connection is wrapped in a ``Guarded`` protocol in front of aiohttp's own.
A connection is *idle* from its accept until a request's head is parsed, and again from the
end of each response until the next head (keep-alive). An idle connection is closed after
``head_timeout_s``. A request's body must arrive within ``body_timeout_s`` of its head, plus
the time its bytes so far take at ``BODY_RATE_FLOOR`` (a large upload that keeps coming is not
cut; a body trickled a byte at a time is); otherwise the client gets a 408 and the connection
is closed. At the cap, a new connection
closes the oldest idle one in its place. Only when every open connection is serving a request
does the new one get a 503 and close. A flood of half-open connections therefore never locks
out a client that is really talking. A stream's client that takes none of what it was sent
for ``WRITE_STALL_S`` is dropped (``stream_writer``), as if it had left.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from tandem.server.errors import ApiError


def default_max_connections() -> int:
    """Half the process's open-file limit (the rest: worker pipes, files, the database), at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 16
    return max(16, min(4096, limit // 2))


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int = field(default_factory=default_max_connections)
    head_timeout_s: float = 15.0     # idle: from accept (or a response's end) to the next request head
    body_timeout_s: float = 60.0     # from a request's head to the last byte of its body (plus BODY_RATE_FLOOR's)


log = logging.getLogger("tandem.connections")
BODY_RATE_FLOOR = 64 << 10           # bytes/s: each received byte of a body buys this much more time
WRITE_STALL_S = 60.0                 # a stream's client that takes none of a write this long is dropped


def stream_writer(request: web.Request, resp: web.StreamResponse) -> Callable:
    """``resp.write`` for a stream (``write(None)``: its end), but a client that takes almost
    none of it for ``WRITE_STALL_S`` (the socket's buffers stay full: aiohttp waits for them to
    drain from 64 KiB to 16 KiB) is dropped: its connection is closed and the write raises
    ConnectionResetError, as when a client leaves, so its request ends. Otherwise the reply
    waited in memory and the connection stayed open for as long as the client liked (17 MB and a
    connection per stalled stream of 8,000 tokens with log probabilities)."""
    async def write(data: bytes | None) -> None:
        try:
            await asyncio.wait_for(resp.write_eof() if data is None else resp.write(data), WRITE_STALL_S)
        except asyncio.TimeoutError:
            log.warning("%s %s: the client took nothing of its stream for %g s; dropping it", request.method,
                        request.path, WRITE_STALL_S)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client stopped reading its stream") from None
    return write


def _raw_response(status: int, reason: str, error: ApiError, extra: str = "") -> bytes:
    body = orjson.dumps(error.body())
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head + body


BUSY = _raw_response(503, "Service Unavailable", ApiError(
    503, "too many open connections; retry shortly", type="service_unavailable"), "Retry-After: 1\r\n")
BODY_TIMEOUT = _raw_response(408, "Request Timeout", ApiError(
    408, "the request body did not arrive in time (the server's --body-timeout)", type="invalid_request_error"))


class Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol behind the guard's books and timers."""

    def __init__(self, guard: ConnectionGuard):
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False
        self.body_since: float | None = None      # a body is awaited: when its head came
        self.body_bytes = 0                       # bytes received since that head
        self.early: list[bytes] = []              # TLS: what came with the handshake's end, before aiohttp's
        self.handshake: asyncio.Task | None = None   # TLS: held here, or the loop's weak reference lets it go

    # asyncio.Protocol: forwarded to aiohttp's handler once admitted
    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            if self.guard.ssl is None:       # a TLS client could not read it
                transport.write(BUSY)
            transport.close()
            return
        if self.guard.ssl is not None:
            self.idle()                      # the handshake has the head deadline, and the cap may close it
            self.handshake = asyncio.ensure_future(self._handshake())
            return
        self._serve(transport)

    def _serve(self, transport) -> None:
        self.inner = self.guard.factory()
        self.inner.connection_made(transport)
        self.idle()
        for data in self.early:
            self.inner.data_received(data)
        self.early = []

    async def _handshake(self) -> None:
        """HTTPS: TLS over the connection the guard already counts, so a client that connects and
        never completes a handshake is held to the same cap and deadline as a silent one."""
        raw = self.transport
        try:
            tls = await asyncio.get_running_loop().start_tls(raw, self, self.guard.ssl, server_side=True,
                                                             ssl_handshake_timeout=self.guard.limits.head_timeout_s)
        except Exception:                    # noqa: BLE001 -- refused, timed out, closed at the cap, gone
            tls = None
        if tls is None or raw.is_closing():  # (closed while shaking hands: no error, and no transport)
            self._cancel()
            self.guard.forget(self)
            return
        self.guard.moved(self, tls)
        self.transport = tls
        self._serve(tls)

    def data_received(self, data: bytes) -> None:
        if self.body_since is not None:
            self.body_bytes += len(data)
        if self.inner is not None:
            self.inner.data_received(data)
        elif self.guard.ssl is not None and self.guard.of(self.transport) is self:
            self.early.append(data)           # a request sent as the handshake ended: served next

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self._cancel()
        self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # the request cycle, told by the middleware
    def begin(self, has_body: bool) -> None:
        """A request's head was parsed: not idle; its body (if any) now has a deadline."""
        self.busy = True
        self.guard.idle.pop(self, None)
        self._cancel()
        if has_body:
            self.body_since, self.body_bytes = asyncio.get_running_loop().time(), 0
            self._arm(self.guard.limits.body_timeout_s, self._body_late)

    def body_read(self) -> None:
        self.body_since = None
        self._cancel()

    def idle(self) -> None:
        """No request in progress: the next head must come within the head timeout."""
        self.busy, self.body_since = False, None
        self.guard.idle[self] = None
        self.guard.idle.move_to_end(self)
        self._arm(self.guard.limits.head_timeout_s, self._head_late)

    def close(self) -> None:
        """Close an idle connection: over TLS without waiting for the client's close_notify (up
        to 30 s of a file held otherwise)."""
        if self.transport is not None and not self.transport.is_closing():
            if self.guard.ssl is not None:
                self.transport.abort()
            else:
                self.transport.close()

    def _head_late(self) -> None:
        self.guard.timed_out += 1
        self.close()

    def _body_late(self) -> None:
        if self.body_since is not None:      # the body kept coming: the time its bytes bought
            due = self.body_since + self.guard.limits.body_timeout_s + self.body_bytes / BODY_RATE_FLOOR
            left = due - asyncio.get_running_loop().time()
            if left > 0:
                self._arm(left, self._body_late)
                return
        self.body_since = None
        self.guard.timed_out += 1
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(BODY_TIMEOUT)
            self.transport.close()           # after the 408 goes out

    def _arm(self, delay: float, fn) -> None:
        self._cancel()
        self.timer = asyncio.get_running_loop().call_later(delay, fn)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ConnectionGuard:
    """The books over all open connections; ``protocol`` is the server's protocol factory."""

    def __init__(self, factory, limits: Limits, ssl=None):
        self.factory, self.limits, self.ssl = factory, limits, ssl     # ssl: an SSLContext (HTTPS)
        self.open: dict[object, Guarded] = {}           # by transport
        self.idle: OrderedDict[Guarded, None] = OrderedDict()   # oldest first
        self.refused = self.evicted = self.timed_out = 0

    def protocol(self) -> Guarded:
        return Guarded(self)

    def admit(self, conn: Guarded) -> bool:
        """Room for ``conn``: under the cap, or made by closing the oldest idle connection."""
        if len(self.open) >= self.limits.max_connections:
            if not self.idle:
                self.refused += 1
                return False
            oldest, _ = self.idle.popitem(last=False)
            self.open.pop(oldest.transport, None)
            oldest.close()
            self.evicted += 1
        self.open[conn.transport] = conn
        return True

    def moved(self, conn: Guarded, transport) -> None:
        """``conn`` now talks over ``transport`` (TLS over its connection)."""
        if self.open.get(conn.transport) is conn:
            del self.open[conn.transport]
            self.open[transport] = conn

    def forget(self, conn: Guarded) -> None:
        if self.open.get(conn.transport) is conn:
            del self.open[conn.transport]
        self.idle.pop(conn, None)

    def of(self, transport) -> Guarded | None:
        return self.open.get(transport)

    def counts(self) -> dict[str, int]:
        return {"open": len(self.open), "idle": len(self.idle), "refused": self.refused,
                "evicted": self.evicted, "timed_out": self.timed_out}


GUARD = web.AppKey("connection_guard", ConnectionGuard)
STOP = web.AppKey("stop", Callable)        # stops ``serve`` as SIGTERM does (the app's own reason)


def connection(request: web.Request) -> Guarded | None:
    """The guarded connection a request came on (None when the app runs without a guard)."""
    guard = request.app.get(GUARD)
    return guard.of(request.transport) if guard is not None else None


def client_gone(request: web.Request) -> bool:
    """Whether the request's client has closed its connection (or is closing it)."""
    return request.transport is None or request.transport.is_closing()


def body_read(request: web.Request) -> None:
    """The request's body has been read whole: its deadline no longer applies."""
    if (conn := connection(request)) is not None:
        conn.body_read()


@web.middleware
async def connections_middleware(request: web.Request, handler):
    """Tell the request's connection when a request starts and ends (the head/body deadlines);
    log a request whose client went away before its response ended."""
    conn, t0 = connection(request), time.monotonic()
    # the client's address and port, while its transport is open (a request whose client left
    # is logged once it has closed)
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if conn is not None:
        conn.begin(request.body_exists)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if (gone := request.app.get(GONE_LOG)) is not None:
            gone.line(request, CLIENT_GONE, time.monotonic() - t0, peer)
        raise
    finally:
        if conn is not None and not conn.transport.is_closing():
            conn.idle()


class JsonErrors(RequestHandler):
    """aiohttp's handler of one connection, answering a request it cannot parse (a bad
    Content-Length, an oversized header, a NUL in the path) with OpenAI's error JSON, as every
    other refusal is answered, instead of a text/plain page. Server errors stay aiohttp's."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        resp = super().handle_error(request, status, exc, message)     # logs it (MalformedRequests)
        if status >= 500:
            return resp
        what = exc.message if isinstance(exc, HttpProcessingError) and exc.message else message or resp.reason
        out = web.json_response(ApiError(status, f"invalid HTTP request: {what}").body(), status=status)
        out.force_close()
        return out


def handlers(server: web.Server) -> Callable[[], JsonErrors]:
    """The guard's factory of aiohttp handlers: aiohttp's own (``web.Server.__call__``), with
    the server's handler arguments, as ``JsonErrors``."""
    loop = asyncio.get_running_loop()
    return lambda: JsonErrors(server, loop=loop, **server._kwargs)


class MalformedRequests(logging.Filter):
    """aiohttp logs each request it cannot parse (a bad Content-Length, an oversized header) as an
    error with a traceback: any client could fill the log. One warning line instead, as uvicorn
    (vLLM's server) writes ("Invalid HTTP request received.")."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            why = " ".join(str(exc.message or type(exc).__name__).split())    # aiohttp's spans lines
            record.msg, record.args, record.exc_info = "invalid HTTP request from %s: %s", (
                record.args[0] if record.args else "?", why), None
        return True


class AccessLog(AbstractAccessLogger):
    """One line per request answered, as uvicorn (vLLM's server) writes it, with the time taken:
    ``127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 0.412s`` (a stream's time is
    until its last byte). Paths in ``quiet`` are not logged (health probes, metric scrapes)."""
    quiet: frozenset[str] = frozenset()

    @classmethod
    def without(cls, paths: tuple[str, ...]) -> type[AccessLog]:
        return type("AccessLog", (cls,), {"quiet": frozenset(paths)})

    def log(self, request, response, time: float) -> None:
        self.line(request, response.status, time)

    def line(self, request, status: int, time: float, peer=None) -> None:
        """The request's line: ``status`` 499 (nginx's "client closed request") for one whose
        client went away before its response ended (a stream broken off), which aiohttp does not
        log; ``peer``: the client's (address, port), where its transport is gone by now."""
        if request.path in self.quiet:
            return
        if peer is None and request.transport is not None:
            peer = request.transport.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else request.remote or "-"
        v = request.version
        self.logger.info('%s - "%s %s HTTP/%d.%d" %d %.3fs', who, request.method, request.path_qs, v.major,
                         v.minor, status, time)


@dataclass(frozen=True, slots=True)
class Listen:
    """How the server listens: the address, TLS, the access log."""
    host: str = "127.0.0.1"
    port: int = 8000
    ssl: object | None = None                 # an ssl.SSLContext: HTTPS
    access_log: bool = True
    access_log_quiet: tuple[str, ...] = ()    # paths not logged


ACCESS_LOG = logging.getLogger("tandem.access")
CLIENT_GONE = 499
GONE_LOG = web.AppKey("gone_log", AccessLog)      # logs the requests aiohttp does not: cancelled ones


async def serve(app: web.Application, listen: Listen, limits: Limits, *,
                shutdown_timeout: float = 30.0, listening: Callable[[str], None] | None = None,
                stopping: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` behind a ConnectionGuard until SIGINT or SIGTERM, then shut it down as
    aiohttp's run_app does (connections closed, the app's cleanup run). ``listening`` gets the
    address once the socket is bound; OSError where it cannot be. ``stopping`` gets the signal's
    name when one stops it, before the shutdown begins. With ``listen.ssl`` each connection
    speaks TLS (``Guarded._handshake``)."""
    import signal
    if not any(isinstance(f, MalformedRequests) for f in logging.getLogger("aiohttp.server").filters):
        logging.getLogger("aiohttp.server").addFilter(MalformedRequests())
    guard = ConnectionGuard(None, limits, listen.ssl)
    app[GUARD] = guard
    stop = asyncio.Event()
    app[STOP] = stop.set
    logs = dict(access_log=ACCESS_LOG, access_log_class=AccessLog.without(listen.access_log_quiet)) \
        if listen.access_log else dict(access_log=None)
    if listen.access_log:
        app[GONE_LOG] = logs["access_log_class"](ACCESS_LOG, "")
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, **logs)
    await runner.setup()
    guard.factory = handlers(runner.server)
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(guard.protocol, listen.host, listen.port, backlog=1024,
                                          reuse_address=True)
    except OSError:                 # the port is taken, the host does not resolve: nothing to serve
        await runner.cleanup()
        raise
    if listening is not None:        # port 0: the one given
        scheme = "https" if listen.ssl is not None else "http"
        listening(f"{scheme}://{listen.host}:{server.sockets[0].getsockname()[1]}")
    signalled: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        signalled.append(sig.name)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
        if signalled and stopping is not None:
            stopping(signalled[0])
    finally:
        server.close()
        await runner.cleanup()
