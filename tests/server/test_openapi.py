"""The live server fuzzed against its own /openapi.json with schemathesis (its command line, as a
user would run it): generated requests, valid and not, to every operation. No answer may be a
5xx or off the schema, and the server must be healthy and serving at the end."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, call, start_server, stop_server

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
EXAMPLES = 24                 # per operation: a few hundred cases in all
CONTEXT = 64                  # --max-model-len: a generated request without max_tokens stays short


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model, tmp_path_factory):
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("fuzz"), "--max-model-len", str(CONTEXT))
    yield s
    stop_server(s)


def test_every_operation_against_its_schema(fuzz_server, tmp_path):
    cli = Path(sys.executable).with_name("schemathesis")
    cli = str(cli) if cli.exists() else shutil.which("schemathesis")
    report = tmp_path / "report.json"
    run = subprocess.run([cli, "run", fuzz_server.url + "/openapi.json", "--checks", CHECKS,
                          "--phases", "fuzzing", "--max-examples", str(EXAMPLES), "--seed", "1",
                          "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "120",
                          "--continue-on-failure", "--report", "json", "--report-json-path", str(report)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]
    result = json.loads(report.read_text())
    assert result["operations"]["tested"] == result["operations"]["total"] >= 16
    cases = result["test_cases"]
    assert cases["generated"] >= 200 and cases["with_failures"] == 0 and cases["errored"] == 0, cases


def test_still_serving_after_the_fuzzing(fuzz_server):
    with urllib.request.urlopen(fuzz_server.url + "/health", timeout=10) as r:
        assert r.status == 200
    req = urllib.request.Request(fuzz_server.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["choices"]


def test_document_describes_what_the_server_validates(fuzz_server):
    """The request schemas in /openapi.json are the ones the server checks bodies against."""
    from tandem.server.schema import CHAT_BODY, COMPLETION_BODY
    with urllib.request.urlopen(fuzz_server.url + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    body = lambda p: doc["paths"][p]["post"]["requestBody"]["content"]["application/json"]["schema"]  # noqa: E731
    assert body("/v1/chat/completions") == json.loads(json.dumps(CHAT_BODY))
    assert body("/v1/completions") == json.loads(json.dumps(COMPLETION_BODY))


def test_max_model_len_cuts_the_context(fuzz_server, tiny_chat_model):
    """The server's context is --max-model-len, not the model's 512 positions: every endpoint
    reports it, an open-ended request generates up to it, and what cannot fit in it is refused."""
    model_len = json.loads((tiny_chat_model / "config.json").read_text())["max_position_embeddings"]
    assert model_len > CONTEXT
    assert call(fuzz_server, "GET", "/v1/models")[1]["data"][0]["max_model_len"] == CONTEXT
    assert call(fuzz_server, "POST", "/tokenize", {"prompt": "Hi"})[1]["max_model_len"] == CONTEXT
    # a chat without max_tokens may use the rest of the context (a completion's default, 16, no more)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    status, out = call(fuzz_server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == CONTEXT and out["usage"]["prompt_tokens"] > 1, out["usage"]
    # nor does a completion's default: with 5 tokens of room left it generates those 5
    status, out = call(fuzz_server, "POST", "/v1/completions",
                       {"prompt": list(range(100, 100 + CONTEXT - 5)), "temperature": 0, "ignore_eos": True})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 5, out["usage"]
    prompt = list(range(100, 110))
    for body, param in (({"prompt": list(range(100, 100 + CONTEXT))}, "prompt"),
                        ({"prompt": prompt, "max_tokens": CONTEXT - 9}, "max_tokens")):
        status, out = call(fuzz_server, "POST", "/v1/completions", body)
        assert status == 400 and out["error"]["param"] == param, out
        assert out["error"]["code"] == "context_length_exceeded", out
