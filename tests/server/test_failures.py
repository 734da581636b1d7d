"""Failures inside the server never hang a client or leak a traceback: a scheduling loop that
raises, a batch line that raises (injected into the server process)."""
import asyncio
import io
import json
import time
import urllib.error
import urllib.request

import pytest
import aiohttp

from tests.server.conftest import API_KEY, start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}

BROKEN_POLICY = """
import tandem.sched.scheduler as s
def _broken(cfg, cost):
    def policy(snapshot):
        raise RuntimeError("injected policy bug")
    return policy
s.make_policy = _broken
"""

RAISING_LINE = """
import tandem.server.app as app
_prepare = app.prepare
async def prepare(engine, cfg, body, chat, force_be=False):
    if body.get("max_tokens") == 13:
        raise RuntimeError("injected failure for this line")
    return await _prepare(engine, cfg, body, chat, force_be)
app.prepare = prepare
"""


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.asyncio
async def test_a_raising_policy_ends_streams_with_an_error_and_health_turns_503(tiny_chat_model, tmp_path):
    srv = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs", inject=BROKEN_POLICY)

    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async def streamed():
                body = {"prompt": "Hello", "max_tokens": 8, "stream": True}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    lines = [ln async for ln in r.content if ln.strip()]
                return r.status, lines

            async def plain():
                async with s.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}) as r:
                    return r.status, await r.json()
            return await asyncio.gather(streamed(), plain())
    try:
        (st_status, lines), (status, body) = await run()
        assert st_status == 200 and lines[-1].strip() == b"data: [DONE]"
        event = json.loads(lines[-2][6:])
        assert event["error"]["type"] == "server_error" and "error id" in event["error"]["message"]
        # the error event says it: no chunk before it finishes with "error" (not an OpenAI reason)
        chunks = [json.loads(ln[6:]) for ln in lines[:-2]]
        assert all(c.get("finish_reason") != "error" for chunk in chunks for c in chunk.get("choices", []))
        assert status == 500 and body["error"]["type"] == "server_error"
        for text in (json.dumps(event), json.dumps(body)):
            assert "Traceback" not in text and ".py" not in text
        statuses = []
        for _ in range(6):             # every failed loop counts; the device goes down after a few
            req = urllib.request.Request(srv.url + "/v1/completions", method="POST", headers=AUTH | {
                "Content-Type": "application/json"}, data=json.dumps({"prompt": "a", "max_tokens": 2}).encode())
            try:
                urllib.request.urlopen(req, timeout=30)
                statuses.append(200)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
        assert 200 not in statuses and statuses[-1] == 503, statuses
        assert health(srv.url) == 503
        assert "injected policy bug" in srv.log.read_text(), "the traceback is logged"
    finally:
        stop_server(srv)


def test_a_batch_line_that_raises_is_recorded_and_the_batch_completes(tiny_chat_model, tmp_path, monkeypatch):
    srv = start_server(tiny_chat_model, tmp_path, inject=RAISING_LINE)
    try:
        from openai import OpenAI
        client = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY)
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": f"Fact {i}:", "max_tokens": 13 if i == 3 else 5}} for i in range(8)]
        f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                                purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while b.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            time.sleep(0.3)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed"
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        err = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
        ids = sorted(x["custom_id"] for x in out + err)
        assert ids == sorted(f"q{i}" for i in range(8)), "every custom_id exactly once"
        assert [x["custom_id"] for x in err] == ["q3"]
        assert err[0]["response"]["status_code"] == 500
        assert "Traceback" not in json.dumps(err[0])
        assert srv.log.read_text().count("injected failure for this line") >= 3, "tried, then recorded"
        assert health(srv.url) == 200
        # the same bug under an online request: a JSON 500 with an error id, nothing internal
        req = urllib.request.Request(srv.url + "/v1/completions", method="POST", headers=AUTH | {
            "Content-Type": "application/json"}, data=json.dumps({"prompt": "a", "max_tokens": 13}).encode())
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("the injected failure did not fail the request")
        except urllib.error.HTTPError as e:
            assert e.code == 500 and e.headers["Content-Type"].startswith("application/json")
            text = e.read().decode()
        err = json.loads(text)["error"]
        assert err["type"] == "server_error" and "error id" in err["message"]
        assert "Traceback" not in text and ".py" not in text and "injected" not in text
        assert err["message"].split("error id ")[1].rstrip(")") in srv.log.read_text(), "logged under its id"
    finally:
        stop_server(srv)


FILE_SIZE_LIMIT = """
import resource
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def test_an_upload_the_disk_refuses_is_a_507_and_leaves_nothing_behind(tiny_chat_model, tmp_path):
    """The server's files may be at most 4 MB (a file size limit, as a full disk refuses a
    write): a 5 MB upload was a 500 with a traceback in the log, and its part-written 4 MB stayed
    in the data dir for ever. It is a 507 saying the data dir refused the write; the next upload
    that fits is kept."""
    from openai import OpenAI
    srv = start_server(tiny_chat_model, tmp_path, inject=FILE_SIZE_LIMIT)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "x" * 1000, "max_tokens": 2}}) + "\n"
        with pytest.raises(Exception) as e:
            client.files.create(file=("big.jsonl", io.BytesIO(line.encode() * 5000)), purpose="batch")
        assert getattr(e.value, "status_code", None) == 507, e.value
        err = e.value.body
        assert err["type"] == "server_error" and "data dir refused the write" in err["message"], err
        assert not list((tmp_path / "data" / "files").iterdir()), "the refused upload left bytes behind"
        assert "Traceback" not in srv.log.read_text()
        kept = client.files.create(file=("small.jsonl", io.BytesIO(line.encode())), purpose="batch")
        assert client.files.content(kept.id).text == line and health(srv.url) == 200
    finally:
        stop_server(srv)


SLOW_PLANS = """
import time
import tandem.sched.scheduler as s
_make = s.make_policy
def _slow(cfg, cost):
    policy = _make(cfg, cost)
    def slow(snapshot):
        time.sleep(0.02)
        return policy(snapshot)
    return slow
s.make_policy = _slow
"""


def test_a_chat_is_not_refused_for_the_batch_work_waiting_behind_it(tiny_chat_model, tmp_path):
    """Three places in the queue, one request running at a time, three best-effort requests
    waiting: another best-effort request is refused, and so was a chat (the queue was full of work
    it runs before). A chat counts only the chats waiting, so it is served."""
    import threading
    srv = start_server(tiny_chat_model, tmp_path, "--max-waiting", "3", "--max-num-seqs", "1", "--policy", "fcfs",
                       inject=SLOW_PLANS)        # a step at least 20 ms: the requests wait long enough to be seen

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(srv.url + "/v1/completions", method="POST", data=json.dumps(body).encode(),
                                     headers=AUTH | {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def status() -> dict:
        req = urllib.request.Request(srv.url + "/status", headers=AUTH)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["devices"][0]["classes"]
    try:
        flex = {"prompt": "Fact:", "max_tokens": 100, "ignore_eos": True, "service_tier": "flex"}
        batch = [threading.Thread(target=post, args=(flex,)) for _ in range(4)]
        deadline = time.monotonic() + 120
        for i, t in enumerate(batch):        # the first running, then three waiting
            t.start()
            while status()["be"]["running" if i == 0 else "waiting"] < max(1, i) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert status()["be"] == {**status()["be"], "running": 1, "waiting": 3}, "the queue was meant to be full"
        code, more = post(flex)
        assert code == 429 and more["error"]["type"] == "rate_limit_error", more
        code, chat = post({"prompt": "Hi", "max_tokens": 2})
        assert code == 200 and chat["usage"]["completion_tokens"] == 2, chat
        for t in batch:
            t.join(300)
    finally:
        stop_server(srv)


def test_a_damaged_database_stops_the_start_with_a_line_saying_what_to_do(tiny_chat_model, tmp_path):
    """A data dir whose database is damaged (here its first bytes overwritten): the server
    stopped with sqlite's traceback, naming neither the file nor a way out. It exits with
    status 1 and one line naming both."""
    import subprocess
    import sys
    from tests.server.conftest import ROOT, free_port
    srv = start_server(tiny_chat_model, tmp_path)
    stop_server(srv)
    db = tmp_path / "data" / "tandem.sqlite3"
    db.write_bytes(b"\x00" * 100 + db.read_bytes()[100:])
    r = subprocess.run([sys.executable, "-m", "server", "--model", str(tiny_chat_model), "--port", str(free_port()),
                        "--data-dir", str(tmp_path / "data")], cwd=ROOT, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"tandem: the data dir's database {db} is damaged" in r.stderr and "move it aside" in r.stderr
