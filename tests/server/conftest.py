"""Start the real server (python -m server) on loopback for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    model: str
    log: Path

    def headers(self, key: str | None = API_KEY) -> dict:
        return {"Authorization": f"Bearer {key}"} if key else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, tmp: Path, *extra: str, inject: str = "",
                 tls: ssl.SSLContext | None = None) -> Server:
    """``inject``: Python run in the server process before it starts (fault injection); the
    workers it spawns do not run it. ``tls``: the client context of a server started with
    HTTPS (its URL is https://)."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    # float32: tests compare tokens with HF transformers in float32 (``auto`` is bfloat16 on a CPU
    # with AMX or AVX-512 BF16); a test's own --dtype comes later and wins
    args = ["--model", str(model_dir), "--port", str(port), "--api-key", API_KEY, "--data-dir",
            str(tmp / "data"), "--kv-cache-bytes", str(64 << 20), "--watch-parent", str(os.getpid()),
            "--dtype", "float32", *extra]
    launch = ["-m", "server"] if not inject else \
        ["-c", inject + "\nimport sys\nfrom tandem.server.__main__ import main\nmain(sys.argv[1:])"]
    cmd = [sys.executable, *launch, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2, context=tls) as r:
                if r.status == 200:
                    return Server(url, proc, model_dir.name, log)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def call(server: Server, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    """One request with a real HTTP client: (status, JSON body). ``body``: bytes as they are, else
    JSON; ``headers``: the API key's unless given (a dict, or a function of the server)."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    h.update(server.headers() if headers is None else headers(server) if callable(headers) else headers)
    req = urllib.request.Request(server.url + path, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stop_server(s: Server) -> int:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()
    return s.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("srv"))
    yield s
    stop_server(s)


def hf_texts(model_dir: Path, prompts: list, max_new_tokens: int, adapter=None) -> list[str]:
    """What a greedy completion of each prompt (text, or token ids) must say: HF transformers'
    tokens (``adapter``: with this LoRA adapter), the prompt tokenized and the reply decoded by
    the model's own tokenizer (special tokens skipped; a character the last token leaves
    incomplete left out, as vLLM leaves it)."""
    from transformers import AutoTokenizer
    from tests.conftest import hf_greedy, hf_whole
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p)["input_ids"] if isinstance(p, str) else p for p in prompts]
    texts = [(tok._tokenizer.decode(r, skip_special_tokens=True), r)
             for r in hf_greedy(model_dir, ids, max_new_tokens, adapter=adapter)]
    return [hf_whole(tok, r) if text.endswith("\ufffd") else text for text, r in texts]
