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
                     "--root-path", "/api", tls=client_context(ca))
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


def test_a_key_that_is_not_the_certificate_s_is_refused_at_start(ca, certs, tmp_path):
    import subprocess
    import sys
    from tests.server.conftest import ROOT
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(tmp_path / "other.pem"))
    r = subprocess.run([sys.executable, "-m", "server", "--ssl-certfile", str(certs / "cert.pem"),
                        "--ssl-keyfile", str(tmp_path / "other.pem")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "ssl-certfile" in r.stderr and "mismatch" in r.stderr
    assert "Traceback" not in r.stderr
