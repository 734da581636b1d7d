"""Clients that connect and send nothing, send slowly or send too much cannot lock others out.

Each test talks raw TCP to the real server on loopback and checks the server's state through
a fresh client: /health, a normal completion, /metrics and the process's own file descriptors
and memory (/proc).
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import API_KEY, start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
SERVER_FILES = 1024          # the flood server's open-file limit: far fewer than the flood's sockets


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def complete(url: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers=AUTH,
                                 data=json.dumps({"prompt": "Hello", "max_tokens": 3}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def counter(url: str, name: str, **labels) -> float:
    text = get(url + "/metrics")[1].decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def proc_status(pid: int) -> tuple[int, int]:
    """(open file descriptors, resident KiB) of a process."""
    rss = int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1))
    return len(os.listdir(f"/proc/{pid}/fd")), rss


def addr(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


def recv_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


@pytest.fixture(scope="module")
def flood_server(tiny_chat_model, tmp_path_factory):
    """A server whose open-file limit is lower than the number of connections thrown at it."""
    inject = ("import resource\n"
              f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SERVER_FILES}, "
              "resource.getrlimit(resource.RLIMIT_NOFILE)[1]))")
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("flood"), inject=inject)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def strict_server(tiny_chat_model, tmp_path_factory):
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("strict"), "--max-connections", "6",
                     "--header-timeout", "1", "--body-timeout", "1.5", "--max-body-mb", "200")
    yield s
    stop_server(s)


def test_twenty_thousand_half_open_connections(flood_server):
    """20,000 connections that never send a byte, up to 4,000 of them held at once (four times the
    server's whole file limit): a fresh client still gets /health and a completion."""
    total, held_max = 20_000, 4_000
    fds_before, _ = proc_status(flood_server.proc.pid)
    held: list[socket.socket] = []
    try:
        for _ in range(total):
            held.append(socket.create_connection(addr(flood_server), timeout=10))
            if len(held) > held_max:
                held.pop(0).close()
        t0 = time.monotonic()
        status, body = get(flood_server.url + "/health", timeout=10)
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert time.monotonic() - t0 < 5
        assert complete(flood_server.url)["choices"][0]["text"] is not None
        fds, _ = proc_status(flood_server.proc.pid)
        assert fds <= SERVER_FILES, f"{fds} open files against a limit of {SERVER_FILES}"
    finally:
        for s in held:
            s.close()
    assert counter(flood_server.url, "tandem:http_connections_closed_total", reason="evicted") > 0
    assert flood_server.proc.poll() is None
    assert proc_status(flood_server.proc.pid)[0] <= fds_before + 16


def test_idle_connection_closed_after_the_head_timeout(strict_server):
    with socket.create_connection(addr(strict_server)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")       # a head never finished
        t0 = time.monotonic()
        assert recv_all(s, timeout=10) == b""                            # closed, nothing said
        assert 0.5 < time.monotonic() - t0 < 5
    assert counter(strict_server.url, "tandem:http_connections_closed_total", reason="timed_out") >= 1


def test_a_download_slower_than_the_head_timeout_arrives_whole(strict_server):
    """A file read by a client slower than the 1 s head timeout: the connection is serving a
    request until the last byte is sent, so nothing cuts it."""
    import io
    import openai
    size = 24 << 20
    data = bytes(range(256)) * (size // 256)
    client = openai.OpenAI(base_url=strict_server.url + "/v1", api_key=API_KEY, max_retries=0)
    fid = client.files.create(file=("big.bin", io.BytesIO(data)), purpose="user_data").id
    s = socket.create_connection(addr(strict_server))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.sendall(f"GET /v1/files/{fid}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
              "\r\n".encode())
    s.settimeout(30)
    got = bytearray()
    with s:
        while b"\r\n\r\n" not in got or len(got) < got.index(b"\r\n\r\n") + 4 + size:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            time.sleep(0.005)           # at most ~13 MB/s: the whole file takes seconds
        head, body = bytes(got).split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        assert len(body) == size and body == data
        # the connection is kept alive and serves its next request
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Connection: close\r\n\r\n".encode())
        assert recv_all(s, timeout=10).startswith(b"HTTP/1.1 200")


def test_slow_body_gets_408(strict_server):
    with socket.create_connection(addr(strict_server)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        reply = recv_all(s, timeout=10)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    assert complete(strict_server.url)["choices"]


def test_a_body_that_keeps_coming_is_not_cut_at_the_body_timeout(strict_server):
    """A 450 KB body sent over about three seconds (twice the 1.5 s body timeout, at about 150
    KB/s, above the 64 KiB/s floor) is read whole: the server answers it (a prompt too long for
    the model, 400), not 408."""
    body = json.dumps({"prompt": "word " * 90_000, "max_tokens": 1}).encode()
    with socket.create_connection(addr(strict_server)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n")
        step = len(body) // 30
        for i in range(0, len(body), step):
            s.sendall(body[i:i + step])
            time.sleep(0.1)
        reply = recv_all(s, timeout=10)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["param"] == "prompt"


def test_a_request_http_cannot_parse_is_one_warning_line(strict_server):
    """A bad Content-Length, an oversized header or a NUL in the path gets a 400 with OpenAI's
    error JSON (aiohttp's was a text/plain page) and one warning line in the log, as uvicorn
    writes it; aiohttp logged an error with a traceback for each, so any client could fill the
    log. Others are served meanwhile."""
    bad = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
           b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n"]
    before = strict_server.log.read_text().count("invalid HTTP request from")
    for raw in bad:
        with socket.create_connection(addr(strict_server)) as s:
            s.sendall(raw)
            head, _, body = recv_all(s, timeout=5).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400"), raw[:40]
            assert b"\r\nContent-Type: application/json" in head, head
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith("invalid HTTP request: ")
            assert set(error) == {"message", "type", "param", "code"}
    assert complete(strict_server.url)["choices"]
    log = strict_server.log.read_text()
    assert log.count("invalid HTTP request from") - before == len(bad)
    assert "Traceback" not in log and "Error handling request" not in log
    lines = log.splitlines()
    warned = [i for i, line in enumerate(lines) if "invalid HTTP request from" in line]
    # each warning is one line: the next begins a record of its own (aiohttp's reason spanned three)
    assert all(lines[i + 1].startswith(("20", "tandem")) for i in warned if i + 1 < len(lines)), \
        [lines[i:i + 3] for i in warned]


def test_503_beyond_the_cap_only_when_every_connection_is_busy(strict_server):
    """Six connections each in the middle of a request (body still arriving) fill the cap: a
    seventh is answered 503 with the JSON error and a Retry-After, and closed. Once they end,
    clients are served."""
    busy = []
    try:
        for _ in range(6):
            s = socket.create_connection(addr(strict_server))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            busy.append(s)
        time.sleep(0.3)
        with socket.create_connection(addr(strict_server)) as s:
            reply = recv_all(s, timeout=5)
        assert reply.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: 1\r\n" in reply, reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "service_unavailable"
    finally:
        for s in busy:
            s.close()
    time.sleep(0.3)
    assert get(strict_server.url + "/health")[0] == 200
    assert counter(strict_server.url, "tandem:http_connections_closed_total", reason="refused") >= 1


def test_100_mib_prompt_refused_fast_with_health_answering(strict_server):
    """A 100 MiB prompt under a 200 MiB body limit: refused on its length in characters, before
    it is tokenized (tokenizing it took minutes); /health answers all along, and the server's
    memory goes back to where it was."""
    pid = strict_server.proc.pid
    _, rss_before = proc_status(pid)
    prompt = "ab " * ((100 << 20) // 3)
    body = json.dumps({"model": strict_server.model, "prompt": prompt}).encode()
    health: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.monotonic()
            try:
                ok = get(strict_server.url + "/health", timeout=5)[0] == 200
            except OSError:
                ok = False
            health.append(time.monotonic() - t0 if ok else float("inf"))
            time.sleep(0.05)
    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        req = urllib.request.Request(strict_server.url + "/v1/completions", method="POST", headers=AUTH,
                                     data=body)
        try:
            urllib.request.urlopen(req, timeout=120)
            status, reply = 200, b""
        except urllib.error.HTTPError as e:
            status, reply = e.code, e.read()
    finally:
        done.set()
        watcher.join()
    err = json.loads(reply)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded", err
    assert f"prompt: {len(prompt)} characters are more than the model context" in err["message"], err
    assert health and all(math.isfinite(t) for t in health), health         # answering, not stalled
    time.sleep(1)
    _, rss_after = proc_status(pid)
    assert rss_after < rss_before + 64 * 1024, f"RSS {rss_before} -> {rss_after} KiB"
    assert complete(strict_server.url)["choices"]


def test_cross_origin_pages_are_answered_only_for_allowed_origins(tiny_chat_model, tmp_path, strict_server):
    """--allowed-origins (vLLM's): a browser's preflight from an allowed origin is answered without
    the API key, and every answer to that origin (a stream's too) names it; another origin, or a
    server started without the flag, gets no CORS header."""
    def ask(srv, method, path, headers, body=None):
        req = urllib.request.Request(srv.url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()
    ui, evil = "http://ui.example:3000", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    srv = start_server(tiny_chat_model, tmp_path, "--allowed-origins", ui)
    try:
        status, h, _ = ask(srv, "OPTIONS", "/v1/chat/completions", {"Origin": ui} | preflight)
        assert status == 204 and h["Access-Control-Allow-Origin"] == ui and "Origin" in h.get_all("Vary")
        assert h["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in h["Access-Control-Allow-Methods"]
        for stream in (False, True):
            status, h, body = ask(srv, "POST", "/v1/completions", AUTH | {"Origin": ui},
                                  {"prompt": "Hello", "max_tokens": 3, "stream": stream})
            assert status == 200 and h["Access-Control-Allow-Origin"] == ui, body[:200]
        status, h, _ = ask(srv, "POST", "/v1/completions", {"Origin": ui, "Content-Type": "application/json"},
                           {"prompt": "Hello"})
        assert status == 401 and h["Access-Control-Allow-Origin"] == ui      # the page can read why
        status, h, _ = ask(srv, "POST", "/v1/completions", AUTH | {"Origin": evil}, {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and "Access-Control-Allow-Origin" not in h
        assert ask(srv, "OPTIONS", "/v1/completions", {"Origin": evil} | preflight)[0] != 204
    finally:
        stop_server(srv)
    status, h, _ = ask(strict_server, "OPTIONS", "/v1/completions", {"Origin": ui} | preflight)
    assert status != 204 and "Access-Control-Allow-Origin" not in h


def test_a_request_whose_client_left_before_its_end_is_logged_499(caplog):
    """aiohttp logs no line for a handler cancelled because its client went away (a stream broken
    off); the middleware does, with nginx's 499. Read once the handler has seen the cancel: the
    middleware writes the line as the same cancel unwinds, before the handler's task yields."""
    import asyncio
    import logging
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from tandem.server.connections import ACCESS_LOG, GONE_LOG, AccessLog, connections_middleware

    async def main():
        left = asyncio.Event()

        async def stream(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"data: 1\n\n")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                left.set()
                raise
        app = web.Application(middlewares=[connections_middleware])
        app.router.add_post("/v1/completions", stream)
        app[GONE_LOG] = AccessLog(ACCESS_LOG, "")
        server = TestServer(app, handler_cancellation=True)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(server.make_url("/v1/completions"))
                assert await r.content.readline() == b"data: 1\n"
                r.close()
            await left.wait()
        finally:
            await server.close()
    with caplog.at_level(logging.INFO, logger="tandem.access"):
        asyncio.run(main())
    assert any(re.fullmatch(r'127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 499 \d+\.\d{3}s', r.getMessage())
               for r in caplog.records), [r.getMessage() for r in caplog.records]



@pytest.mark.parametrize("closing, status", [(True, 499), (False, 500)])
def test_a_write_that_finds_the_client_gone_is_a_499_not_an_error(closing, status, caplog):
    """A stream whose client closed the connection fails on its next write, before any cancel
    reaches its handler: the answer is a 499 (which nobody reads; the access log writes it), with
    no error logged. The same ConnectionError while the client is still there (a worker's pipe)
    is a bug: a 500 with an error id, logged with its traceback."""
    import asyncio
    import logging
    from unittest import mock
    from aiohttp.client_exceptions import ClientConnectionResetError
    from aiohttp.test_utils import make_mocked_request
    from tandem.server.app import errors_middleware

    async def handler(request):
        raise ClientConnectionResetError("Cannot write to closing transport") if closing else BrokenPipeError()
    transport = mock.Mock(is_closing=mock.Mock(return_value=closing))
    request = make_mocked_request("POST", "/v1/completions", transport=transport)
    with caplog.at_level(logging.INFO):
        resp = asyncio.run(errors_middleware(request, handler))
    assert resp.status == status
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (len(errors), bool(errors and errors[0].exc_info)) == ((0, False) if closing else (1, True))


def load(srv) -> int:
    """The requests the server holds (/load)."""
    with urllib.request.urlopen(srv.url + "/load", timeout=10) as r:
        return json.loads(r.read())["server_load"]


STALL = """
import tandem.server.connections as c
c.WRITE_STALL_S = 2.0
"""


def test_a_stream_whose_client_reads_nothing_is_dropped(tiny_chat_model, tmp_path):
    """A client that asks for a long stream and reads none of it: the server held the reply in
    memory and the connection open for as long as the client liked (the request never ended).
    Once nothing of a write is taken for the stall limit (2 s here), the connection is closed
    and the request ends, while the client still holds its end open and unread."""
    srv = start_server(tiny_chat_model, tmp_path, inject=STALL)
    try:
        body = json.dumps({"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "n": 16, "max_tokens": 400, "ignore_eos": True, "logprobs": True, "top_logprobs": 20})
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # the server's writes back up soon
        s.connect(addr(srv))
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 120
        while "took nothing of its stream" not in srv.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "took nothing of its stream for 2 s" in srv.log.read_text(), srv.log.read_text()[-3000:]
        while load(srv) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load(srv) == 0, "the stalled request still holds its place"
        s.close()
        assert "Traceback" not in srv.log.read_text()
    finally:
        stop_server(srv)
