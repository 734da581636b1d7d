"""Files + Batches API: round trip with the openai client, validation, cancel, and SIGKILL resume."""
import io
import json
import signal
import sqlite3
import time

import jsonschema_rs
import openai
import pytest

from tests.server.conftest import API_KEY, call, start_server, stop_server


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


PICK = {"type": "object", "properties": {"pick": {"enum": ["alpha", "beta"]}}, "required": ["pick"],
        "additionalProperties": False}


def chat_line(i, max_tokens=6):
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "M", "messages": [{"role": "user", "content": f"Question {i}?"}],
                     "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def wait_batch(client, bid, statuses=("completed", "failed", "cancelled", "expired"), timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in statuses:
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {bid} stuck in {b.status}")


def fix_model(rows, model):
    for r in rows:
        r["body"]["model"] = model
    return rows


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_the_log_says_what_the_server_runs_with(server):
    """Once loaded, one line: the cache pool as /metrics exports it, and the limits (written
    before /health first answers 200, which start_server waited for)."""
    import re
    import urllib.request
    req = urllib.request.Request(server.url + "/metrics", headers=server.headers())
    text = urllib.request.urlopen(req, timeout=60).read().decode()
    blocks, size = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"[^}]*num_gpu_blocks="(\d+)"', text) \
        .group(2, 1)
    # a block holds one token block's K or its V: a KV cache takes two blocks per block_size tokens
    assert f"{int(blocks):,} cache blocks of {size} tokens (each K or V: {int(blocks) * int(size) // 2:,} tokens of " \
           "KV cache, float32) on cpu:1; policy tandem, max-model-len " in server.log.read_text()


def test_batch_round_trip(server, client):
    rows = fix_model([chat_line(i) for i in range(12)], server.model)
    rows[5]["body"] |= {"logprobs": True, "top_logprobs": 2}       # a line may ask what a request may
    rows[7]["body"] |= {"ignore_eos": False, "max_tokens": 12,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}}
    rows.append({"custom_id": "bad-temp", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": server.model, "messages": [{"role": "user", "content": "x"}],
                          "temperature": 7}})
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(jsonl(rows))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"job": "t1"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "t1"}
    b = wait_batch(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (13, 12, 1)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(12))
    assert b.id.startswith("batch_") and b.model == server.model
    used = [o["response"]["body"]["usage"] for o in out]         # the failed line used nothing
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.input_tokens_details.cached_tokens) == (
        sum(u["prompt_tokens"] for u in used), sum(u["completion_tokens"] for u in used),
        sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in used))
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens and b.usage.output_tokens >= 66
    direct = client.chat.completions.create(model=server.model, max_tokens=6, temperature=0,
                                            messages=[{"role": "user", "content": "Question 3?"}],
                                            extra_body={"ignore_eos": True})
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        if o["custom_id"] == "req-7":
            assert jsonschema_rs.validator_for(PICK).is_valid(json.loads(body["choices"][0]["message"]["content"]))
            assert body["choices"][0]["finish_reason"] == "stop"
            continue
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        if o["custom_id"] == "req-3":
            assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        if o["custom_id"] == "req-5":
            alone = client.chat.completions.create(
                model=server.model, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                messages=[{"role": "user", "content": "Question 5?"}], extra_body={"ignore_eos": True}).model_dump()
            got, want = body["choices"][0]["logprobs"]["content"], alone["choices"][0]["logprobs"]["content"]
            assert [(e["token"], [a["token"] for a in e["top_logprobs"]]) for e in got] == \
                [(e["token"], [a["token"] for a in e["top_logprobs"]]) for e in want] and len(got) == 6
            assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
        else:
            assert body["choices"][0]["logprobs"] is None
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errs] == ["bad-temp"]
    assert errs[0]["response"]["status_code"] == 400
    assert errs[0]["response"]["body"]["error"]["param"] == "temperature"
    listed = client.batches.list(limit=5)
    assert b.id in [x.id for x in listed.data]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_bad_lines_fail_the_batch_with_line_numbers(server, client):
    good = fix_model([chat_line(0)], server.model)[0]
    nested = b"[" * 5000 + b"]" * 5000 + b"\n"          # deeper than the JSON parser recurses
    lone = json.dumps(dict(good, custom_id="lone")).replace('"lone"', '"\\ud800"').encode() + b"\n"
    in_body = json.dumps(dict(good, custom_id="in-body")).replace('Question 0?', 'Question \\udfff?').encode() + b"\n"
    # a body nested deeper than a request's may be (129 levels: the body, its chat_template_kwargs, 127 lists)
    deep = json.dumps(dict(good, custom_id="deep", body=dict(good["body"], chat_template_kwargs={
        "x": json.loads("[" * 127 + "]" * 127)}))).encode() + b"\n"
    raw = jsonl([good]) + b"{not json}\n" + jsonl([dict(good, url="/v1/completions"), good]) + nested + lone + in_body \
        + deep
    f = client.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id, timeout=60)
    assert b.status == "failed"
    lines = {(e.line, e.param) for e in b.errors.data}
    assert (2, None) in lines and (3, "url") in lines and (4, "custom_id") in lines and (5, None) in lines
    # a lone surrogate's escape, which a request body may not hold either, in the id and in the body
    assert {e.line for e in b.errors.data if "surrogate" in e.message} == {6, 7}
    assert (8, "body") in lines


def test_a_failed_batch_lists_its_first_thousand_errors(server, client):
    """Each of 300 lines that are no requests has four errors: the first thousand are listed,
    then how many more there were (a batch's JSON stays small)."""
    f = client.files.create(file=("junk.jsonl", io.BytesIO(b'{"a": 1}\n' * 300)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id, timeout=60)
    assert b.status == "failed" and len(b.errors.data) == 1001
    assert {e.line for e in b.errors.data[:1000]} == set(range(1, 251))
    assert (b.errors.data[-1].code, b.errors.data[-1].message) == ("too_many_errors", "200 more errors are not listed")


def test_a_byte_order_mark_before_the_first_line_is_skipped(server, client):
    """Editors on Windows begin UTF-8 files with one."""
    raw = "\ufeff".encode() + jsonl(fix_model([chat_line(0, max_tokens=2)], server.model))
    f = client.files.create(file=("bom.jsonl", io.BytesIO(raw)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 1, b.errors


def test_files_are_listed_in_pages_either_way(server, client):
    """OpenAI's list of files: newest first by default, ``order=asc`` the other way, ``limit``
    pages that the openai client follows with ``after``."""
    new = [client.files.create(file=(f"p{i}.jsonl", io.BytesIO(b"{}\n")), purpose="user_data").id
           for i in range(3)]
    newest_first = [f.id for f in client.files.list()]
    assert newest_first[:3] == new[::-1]
    assert [f.id for f in client.files.list(order="asc")] == newest_first[::-1]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == new[:0:-1] and first.has_more
    assert [f.id for f in client.files.list(limit=2)] == newest_first       # every page, in order
    assert [f.id for f in client.files.list(purpose="user_data", after=new[2], limit=1).data] == [new[1]]
    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")


def test_files_expire_when_asked(server, client):
    """``expires_after`` on an upload (as the openai client sends it: form parts) and
    ``output_expires_after`` on a batch set the files' ``expires_at``; bounds outside one hour
    to 30 days are refused naming the field."""
    f = client.files.create(file=("e.jsonl", io.BytesIO(jsonl(fix_model([chat_line(0, 2)], server.model)))),
                            purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600 and client.files.retrieve(f.id).expires_at == f.expires_at
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 86_400})
    out = client.files.retrieve(wait_batch(client, b.id).output_file_id)
    assert out.expires_at == out.created_at + 86_400
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_used", "seconds": 3600}):
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("e.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=bad)
        assert e.value.body["param"] == "expires_after"
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  output_expires_after=bad)
        assert e.value.body["param"] == "output_expires_after"
    form = {**server.headers(), "Content-Type": "multipart/form-data; boundary=B"}
    for part, status in (('{"anchor": "created_at", "seconds": 7200}', 200), ("7200", 400), ("{", 400)):
        body = ('--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'     # as JSON text
                f'--B\r\nContent-Disposition: form-data; name="expires_after"\r\n\r\n{part}\r\n'
                '--B\r\nContent-Disposition: form-data; name="file"; filename="j.jsonl"\r\n\r\n{}\r\n--B--\r\n')
        status_got, made = call(server, "POST", "/v1/files", body.encode(), form)
        assert status_got == status, made
        assert status == 400 or made["expires_at"] == made["created_at"] + 7200


def test_a_line_separator_inside_a_string_does_not_split_the_line(server, client):
    """U+2028 / U+0085 are legal unescaped in a JSON string; the line must stay one request."""
    line = fix_model([chat_line(0)], server.model)[0]
    content = "Question\u2028 zero\x85?"
    line["body"]["messages"][0]["content"] = content
    raw = (json.dumps(line, ensure_ascii=False) + "\n").encode()
    assert "\u2028".encode() in raw
    f = client.files.create(file=("sep.jsonl", io.BytesIO(raw)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed", b.errors
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    direct = client.chat.completions.create(model=server.model, max_tokens=6, temperature=0,
                                            messages=[{"role": "user", "content": content}],
                                            extra_body={"ignore_eos": True})
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == \
        [direct.choices[0].message.content]


def test_batch_request_validation(server, client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    f = client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-nope")


def test_cancel(server, client):
    rows = fix_model([chat_line(i, max_tokens=60) for i in range(300)], server.model)
    f = client.files.create(file=("big.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, b.id, statuses=("in_progress",))
    client.batches.cancel(b.id)
    b = wait_batch(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = client.files.content(b.output_file_id).text.splitlines() if b.output_file_id else []
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert len(done) + len(errs) == 300 and len(done) < 300
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"}


def pending_lines(data_dir, bid: str) -> int:
    """Lines of a batch with no recorded result, read from the server's SQLite file directly."""
    with sqlite3.connect(data_dir / "tandem.sqlite3") as db:
        return db.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id=? AND status='pending'",
                          (bid,)).fetchone()[0]


def kill_after_progress(srv, bid: str, at_least: int) -> None:
    """SIGKILL the server once ``at_least`` lines of the batch have completed."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    deadline = time.monotonic() + 120
    while c.batches.retrieve(bid).request_counts.completed < at_least:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait()


def test_sigkill_twice_mid_batch_then_resume(tiny_chat_model, tmp_path):
    """Killed twice while the batch is provably unfinished (the store still holds pending lines
    after each kill, fewer the second time), the batch completes with every custom_id exactly once."""
    n, data = 150, tmp_path / "data"
    srv = start_server(tiny_chat_model, tmp_path)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    rows = fix_model([chat_line(i, max_tokens=48) for i in range(n)], srv.model)
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    kill_after_progress(srv, b.id, 10)
    first = pending_lines(data, b.id)
    assert 0 < first <= n - 10, first
    srv = start_server(tiny_chat_model, tmp_path)            # same data dir
    kill_after_progress(srv, b.id, n - first + 10)
    second = pending_lines(data, b.id)
    assert 0 < second <= first - 10, (first, second)
    srv = start_server(tiny_chat_model, tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        done = wait_batch(c, b.id)
        assert done.status == "completed"
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        ids = [o["custom_id"] for o in out]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(n)), "every custom_id exactly once"
        assert done.request_counts.completed == n and pending_lines(data, b.id) == 0
    finally:
        stop_server(srv)
