"""The server behind TLS with client certificates, request ids, the access log and a proxy's
path prefix, as an operator sets them with vLLM's flags: checked with real clients (the openai
client, urllib, a raw socket) and certificates from a test CA (trustme)."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import ssl
import urllib.error
import urllib.request

import openai
import pytest
import trustme

from tests.server.conftest import API_KEY, hf_texts, start_server, stop_server

PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_CONNECTIONS = 16


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def certs(ca, tmp_path_factory):
    """The server's certificate and key, and the CA's, as files."""
    d = tmp_path_factory.mktemp("certs")
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    return d


def client_context(ca, with_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if with_cert:
        ca.issue_cert("client@example.com").configure_cert(ctx)
    return ctx


@pytest.fixture(scope="module")
def tls_server(tiny_chat_model, tmp_path_factory, ca, certs):
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("tls"),
                     "--ssl-certfile", str(certs / "cert.pem"), "--ssl-keyfile", str(certs / "key.pem"),
                     "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", "2",
                     "--enable-request-id-headers", "--disable-access-log-for-endpoints", "/health,/metrics",
                     "--root-path", "/api", "--max-connections", str(MAX_CONNECTIONS), tls=client_context(ca))
    yield s
    stop_server(s)


def get(server, path: str, ctx: ssl.SSLContext, body: dict | None = None, headers: dict | None = None):
    """(status, headers, JSON) of one request by urllib over ``ctx``."""
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(server.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=h, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def test_completions_over_https_with_a_client_certificate(tls_server, tiny_chat_model, ca):
    client = openai.OpenAI(base_url=tls_server.url + "/v1", api_key=API_KEY,
                           http_client=openai.DefaultHttpxClient(verify=client_context(ca)))
    out = client.completions.create(model=tls_server.model, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == hf_texts(tiny_chat_model, PROMPTS, 8)


def test_clients_without_a_certificate_or_tls_are_refused_and_others_still_served(tls_server, ca):
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        get(tls_server, "/v1/models", client_context(ca, with_cert=False))
    port = int(tls_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:    # plain HTTP to the TLS port
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = sock.recv(4096)
    assert not answer.startswith(b"HTTP/")
    status, _, body = get(tls_server, "/v1/models", client_context(ca))
    assert status == 200 and body["data"][0]["id"] == tls_server.model


def test_connections_that_never_finish_a_handshake_are_held_to_the_cap(tls_server, ca):
    """Three times the cap of TCP connections that never send a TLS hello: the oldest are closed
    to make room (counted as evicted), and a real client still gets its answer."""
    from tests.server.test_connections import counter, recv_all
    port = int(tls_server.url.rsplit(":", 1)[1])
    ctx = client_context(ca)
    metrics = urllib.request.Request(tls_server.url + "/metrics", headers=tls_server.headers())

    def evicted() -> float:
        with urllib.request.urlopen(metrics, timeout=60, context=ctx) as r:
            text = r.read().decode()
        m = re.search(r'^tandem:http_connections_closed_total\{reason="evicted"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0
    before = evicted()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        assert recv_all(silent[0], 30) == b""             # the oldest was closed, without a word
        status, _, body = get(tls_server, "/v1/models", ctx)
        assert status == 200 and body["data"][0]["id"] == tls_server.model
        assert evicted() - before >= 2 * MAX_CONNECTIONS
    finally:
        for sock in silent:
            sock.close()


def test_an_id_that_is_not_printable_ascii_is_not_taken(tls_server, ca):
    """X-Request-Id names things only as printable ASCII of at most 256 characters; another is
    ignored (a new id instead), never a failure."""
    ctx = client_context(ca)
    chat = {"model": tls_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for given in ("x" * 257, "two words"):
        status, headers, body = get(tls_server, "/v1/chat/completions", ctx, chat, {"X-Request-Id": given})
        assert status == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
        assert headers["X-Request-Id"] == body["id"].removeprefix("chatcmpl-")
    port = int(tls_server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=ctx)
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in (("Authorization", f"Bearer {API_KEY}"), ("Content-Type", "application/json"),
                        ("Content-Length", str(len(json.dumps(chat))))):
        conn.putheader(name, value)
    conn.putheader("X-Request-Id", b"caf\xe9")                # not UTF-8
    conn.endheaders(json.dumps(chat).encode())
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["id"].startswith("chatcmpl-")
    conn.close()
    assert get(tls_server, "/status", ctx)[0] == 200


def test_request_ids_name_completions_and_come_back_as_headers(tls_server, ca, tiny_chat_model):
    ctx = client_context(ca)
    chat = {"model": tls_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, headers, body = get(tls_server, "/v1/chat/completions", ctx, chat, {"X-Request-Id": "abc-123"})
    assert status == 200 and body["id"] == "chatcmpl-abc-123" and headers["X-Request-Id"] == "abc-123"
    status, headers, body = get(tls_server, "/v1/completions", ctx,
                                {"model": tls_server.model, "prompt": "x", "max_tokens": 2, "request_id": "mine"})
    assert status == 200 and body["id"] == "cmpl-mine" and headers["X-Request-Id"] == "mine"
    status, headers, body = get(tls_server, "/v1/chat/completions", ctx, chat)
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]) and body["id"] == "chatcmpl-" + headers["X-Request-Id"]
    status, headers, body = get(tls_server, "/v1/nothing", ctx, headers={"X-Request-Id": "lost-1"})
    assert status == 404 and headers["X-Request-Id"] == "lost-1"
    status, headers, body = get(tls_server, "/v1/chat/completions", ctx, {**chat, "request_id": ""})
    assert status == 400 and body["error"]["param"] == "request_id" and headers["X-Request-Id"]
    for bad in ("a\nb", "\r\nX-Injected: 1", "x\u0000", " "):        # no header could carry it back
        status, headers, body = get(tls_server, "/v1/completions", ctx,
                                    {"model": tls_server.model, "prompt": "x", "max_tokens": 2, "request_id": bad})
        assert status == 400 and body["error"]["param"] == "request_id" and "X-Injected" not in headers
    # streamed: the header before the first event, the id on every chunk
    req = urllib.request.Request(tls_server.url + "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(),
                                 {**tls_server.headers(), "Content-Type": "application/json", "X-Request-Id": "s-1"})
    with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream") and r.headers["X-Request-Id"] == "s-1"
        ids = {json.loads(line[6:])["id"] for line in r.read().decode().splitlines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-s-1"}


@pytest.mark.asyncio
async def test_two_requests_named_alike_each_get_their_own_reply(tls_server, ca, tiny_chat_model):
    client = openai.AsyncOpenAI(base_url=tls_server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(verify=client_context(ca)))
    outs = await asyncio.gather(*[client.completions.create(
        model=tls_server.model, prompt=p, max_tokens=12, temperature=0, extra_headers={"X-Request-Id": "same"})
        for p in PROMPTS])
    assert [o.id for o in outs] == ["cmpl-same"] * 2
    assert [o.choices[0].text for o in outs] == hf_texts(tiny_chat_model, PROMPTS, 12)


def test_the_access_log_has_each_request_but_the_quiet_paths(tls_server, ca):
    # one connection: a request is logged before the next on it is read, so once the last
    # (quiet) one is answered, the log has every one before it
    conn = http.client.HTTPSConnection("127.0.0.1", int(tls_server.url.rsplit(":", 1)[1]), timeout=60,
                                       context=client_context(ca))
    for path in ("/v1/models", "/health", "/metrics", "/v1/models?x=1", "/health"):
        conn.request("GET", path, headers=tls_server.headers())
        r = conn.getresponse()
        r.read()
        assert r.status == 200
    conn.close()
    log = tls_server.log.read_text()
    lines = re.findall(r'127\.0\.0\.1:\d+ - "(\w+) (\S+) HTTP/1\.1" (\d{3}) \d+\.\d{3}s', log)
    assert ("GET", "/v1/models", "200") in lines and ("GET", "/v1/models?x=1", "200") in lines
    assert not [p for _, p, _ in lines if p in ("/health", "/metrics")]     # polled at start-up, scraped above


def test_openapi_names_the_proxy_prefix(tls_server, ca):
    status, _, doc = get(tls_server, "/openapi.json", client_context(ca))
    assert status == 200 and doc["servers"] == [{"url": "/api"}] and "/v1/chat/completions" in doc["paths"]


def test_a_key_that_is_not_the_certificate_s_or_is_encrypted_is_refused_at_start(ca, certs, tmp_path):
    """One line and exit status 2, before anything loads; an encrypted key is refused rather than
    OpenSSL asking for its passphrase on the terminal (stdin here is empty)."""
    import subprocess
    import sys
    from cryptography.hazmat.primitives import serialization
    from tests.server.conftest import ROOT
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(tmp_path / "other.pem"))
    key = serialization.load_pem_private_key((certs / "key.pem").read_bytes(), None)
    (tmp_path / "locked.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    for keyfile, says in (("other.pem", "mismatch"), ("locked.pem", "is encrypted")):
        r = subprocess.run([sys.executable, "-m", "server", "--ssl-certfile", str(certs / "cert.pem"),
                            "--ssl-keyfile", str(tmp_path / keyfile)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and "ssl-" in r.stderr and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
