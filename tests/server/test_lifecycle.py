"""Start-up (503 while loading; SIGTERM while loading), back-pressure (429), upload limit (413), SIGTERM drain."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from tests.conftest import environ_of
from tests.server.conftest import API_KEY, ROOT, free_port, start_server, stop_server
from tests.server.test_load import metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_503_while_loading_then_ready(tiny_chat_model, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(tiny_chat_model), "--port",
                             str(port), "--api-key", API_KEY, "--data-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            req = urllib.request.Request(url + "/v1/completions", method="POST", headers=AUTH | {
                "Content-Type": "application/json"}, data=json.dumps({"prompt": "a", "max_tokens": 1}).encode())
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    seen.append(r.status)
                    break
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                assert e.code == 503 and body["error"]["type"] == "service_unavailable"
                assert e.headers["Retry-After"]
                seen.append(503)
            except OSError:
                pass                       # not listening yet
            time.sleep(0.05)
        assert seen and seen[-1] == 200
        assert 503 in seen, "the server listens before the model is loaded and says so"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.asyncio
async def test_429_and_413(tiny_chat_model, tmp_path):
    srv = start_server(tiny_chat_model, tmp_path, "--max-waiting", "2", "--max-num-seqs", "2",
                       "--max-upload-mb", "0.01")
    try:
        async def flood():
            async with aiohttp.ClientSession(headers=AUTH) as s:
                body = {"prompt": "Long story:", "max_tokens": 40, "ignore_eos": True}

                async def one():
                    async with s.post(srv.url + "/v1/completions", json=body) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()
                return await asyncio.gather(*(one() for _ in range(24)))
        res = await flood()
        statuses = [r[0] for r in res]
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
        for status, retry, body in res:
            if status == 429:
                assert retry and body["error"]["type"] == "rate_limit_error"
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/metrics", headers=AUTH), timeout=30) as r:
            text = r.read().decode()
        assert metric(text, "tandem:queue_full_refusals_total") == statuses.count(429)
        big = b"x" * 20_000
        boundary = "tandemboundary"
        payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                   f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
                   f"Content-Type: application/octet-stream\r\n\r\n").encode() + big + f"\r\n--{boundary}--\r\n".encode()
        req = urllib.request.Request(srv.url + "/v1/files", data=payload, method="POST", headers=AUTH | {
            "Content-Type": f"multipart/form-data; boundary={boundary}"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("an upload over the limit must be refused")
        except urllib.error.HTTPError as e:
            assert e.code == 413 and "error" in json.loads(e.read())
        with urllib.request.urlopen(srv.url + "/health", timeout=5) as r:
            assert r.status == 200
    finally:
        stop_server(srv)


@pytest.mark.asyncio
async def test_sigterm_finishes_in_flight_stream(tiny_chat_model, tmp_path):
    srv = start_server(tiny_chat_model, tmp_path)

    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            body = {"prompt": "Count:", "max_tokens": 150, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                await r.content.readline()
                srv.proc.send_signal(signal.SIGTERM)
                usage, done = None, False
                async for line in r.content:
                    if line.strip() == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        usage = json.loads(line[6:]).get("usage") or usage
                return done, usage
    try:
        done, usage = await run()
        assert done and usage["completion_tokens"] == 150, "the in-flight request finishes"
        assert srv.proc.wait(timeout=40) == 0
        assert ("tandem: SIGTERM: stopping; new connections are refused; requests in flight: 1, of which clients' "
                "finish first (30 s at most) and batch lines' (0 lines) stop") in srv.log.read_text()
    finally:
        stop_server(srv)


# the workers are up and the load goes on (a start-up profile, a kernel build) for 10 minutes
SLOW_LOAD = """
import time
import tandem.engine.worker as w
real = w.wait_all
def slow(*a, **k):
    real(*a, **k)
    time.sleep(600)
w.wait_all = slow
import tandem.sched.llm as llm
llm.wait_all = slow
"""


def test_a_server_stopped_while_loading_exits_at_once_with_its_workers(tiny_chat_model, tmp_path):
    """SIGTERM while the model loads (here the workers are ready and the load is held for 10
    minutes) stops the server within seconds, not once the load ends, and its worker processes
    end with it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD + "\nimport sys\nfrom tandem.server.__main__ import "
                             "main\nmain(sys.argv[1:])", "--model", str(tiny_chat_model), "--port", str(port),
                             "--data-dir", str(tmp_path), "--dtype", "float32"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, workers = time.monotonic() + 120, []
        while time.monotonic() < deadline and not workers:
            time.sleep(0.5)
            workers = children(proc.pid)
        assert workers, "the workers start"
        time.sleep(3)                      # loaded by now: the held load is under way
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        assert e.value.code == 503
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
        assert "tandem: SIGTERM: stopping while the model loads" in err, err[-2000:]
        time.sleep(2)
        assert not [p for p in workers if alive(p)], "the workers end with the server"
    finally:
        proc.kill()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    """Running (a zombie left for the container's init to reap has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def descendants(pid: int) -> list[int]:
    out = children(pid)
    return out + [d for c in out for d in descendants(c)]


@pytest.mark.parametrize("exported", [{}, {"OMP_WAIT_POLICY": "passive"}])
def test_the_servers_workers_wait_for_the_next_op_as_exported_else_spin_briefly(tiny_chat_model, tmp_path,
                                                                                 exported):
    """With no OpenMP policy exported, the server's workers (and the fork server they come from)
    start with libgomp's policy unset and a short spin count; an exported policy is theirs."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | exported
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(tiny_chat_model), "--port", str(port),
                             "--data-dir", str(tmp_path), "--dtype", "float32", "--policy", "fcfs",
                             "--threads-per-worker", "1", "--watch-parent", str(os.getpid())],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        workers = [p for p in descendants(proc.pid)
                   if any(m in open(f"/proc/{p}/cmdline", "rb").read() for m in (b"forkserver", b"spawn_main"))]
        assert workers, "the workers and their fork server are found"
        for p in workers:
            got = environ_of(p)
            if exported:
                assert got.get("OMP_WAIT_POLICY") == "PASSIVE" and "GOMP_SPINCOUNT" not in got
            else:
                assert "OMP_WAIT_POLICY" not in got and got.get("GOMP_SPINCOUNT") == "30000"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_restarted_server_reads_its_start_up_profile_from_the_data_dir(tiny_chat_model, tmp_path):
    """The default policy's start-up profile is kept under the data dir; the server started again
    reads it back, and with --startup-profile fresh measures it again and keeps the new one."""
    srv = start_server(tiny_chat_model, tmp_path)
    stop_server(srv)
    assert "tandem: SIGTERM: stopping; new connections are refused; no requests in flight" in srv.log.read_text()
    (kept,) = (tmp_path / "data" / "profiles").iterdir()
    measured = json.loads(kept.read_text())["measured_at"]
    assert "start-up profile (iteration cost model) took" in srv.log.read_text()
    srv = start_server(tiny_chat_model, tmp_path)
    try:
        assert f"start-up profile (iteration cost model) read from {kept} (measured" in srv.log.read_text()
        body = json.dumps({"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", method="POST",
                                     headers=AUTH | {"Content-Type": "application/json"}, data=body)
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    finally:
        stop_server(srv)
    srv = start_server(tiny_chat_model, tmp_path, "--startup-profile", "fresh")
    stop_server(srv)
    assert "start-up profile (iteration cost model) took" in srv.log.read_text()
    assert list(kept.parent.iterdir()) == [kept] and json.loads(kept.read_text())["measured_at"] > measured
