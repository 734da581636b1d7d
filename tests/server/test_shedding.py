"""A server past its capacity for chats (``--shed-chats-after``) says so at once: while a chat has
waited more than the given number of its TTFT targets for its first token, a new chat gets 429
(OpenAI's error JSON, Retry-After) and batch work is still taken; once the queue drains, chats
are taken again. Without the flag nothing is refused."""
import json
import threading
import time
import urllib.error
import urllib.request

from tests.server.conftest import start_server, stop_server
from tests.server.test_load import metric

TTFT_MS, AFTER = 20, 5


def post(server, max_tokens: int, tier: str | None = None) -> tuple[int, dict, dict]:
    """One chat completion: (status, headers, body)."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if tier:
        body["service_tier"] = tier
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **server.headers()})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def waiting_chats(server) -> list[dict]:
    with urllib.request.urlopen(server.url + "/status", timeout=10) as r:
        view = json.loads(r.read())
    return [q for d in view["devices"] for q in d["requests"]
            if q["class"] == "rt" and q["generated"] == 0 and q["state"] == "waiting"]


def queue_and_probe(server) -> tuple[tuple, tuple | None, list]:
    """Four long chats queued one at a time (FCFS, one sequence); once two of them have waited
    well past AFTER targets, a short chat and a batch-tier one are sent. Returns the short chat's
    answer, the batch-tier one's, and the long chats' answers."""
    post(server, 1)                                            # the first step's set-up out of the way
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(post(server, 450))) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = waiting_chats(server)
        if len(held) >= 2 and max(q["age_s"] for q in held) > 3 * AFTER * TTFT_MS / 1e3:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the long chats never queued")
    probe = post(server, 1)
    flex: list = []
    batch = threading.Thread(target=lambda: flex.append(post(server, 1, "flex")))
    batch.start()
    for t in threads + [batch]:
        t.join()
    return probe, flex[0], answers


def test_new_chats_are_refused_while_a_chat_waits_past_its_targets(tiny_chat_model, tmp_path):
    s = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs", "--max-num-seqs", "1",
                     "--slo-ttft-ms", str(TTFT_MS), "--shed-chats-after", str(AFTER))
    try:
        (status, headers, body), flex, answers = queue_and_probe(s)
        after = post(s, 1)                                     # the queue has drained
        with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
            refused = metric(r.read().decode(), "tandem:chats_refused_total")
    finally:
        assert stop_server(s) == 0
    assert status == 429, body
    assert body["error"]["type"] == "rate_limit_error" and "capacity for chats" in body["error"]["message"]
    assert body["error"]["code"] == "chats_past_capacity" and refused == 1
    assert int(headers["Retry-After"]) > 0
    assert flex[0] == 200 and flex[2]["usage"]["completion_tokens"] == 1      # batch work is taken
    assert [a[0] for a in answers] == [200] * 4 and all(a[2]["usage"]["completion_tokens"] == 450 for a in answers)
    assert after[0] == 200


def test_without_the_flag_no_chat_is_refused(tiny_chat_model, tmp_path):
    s = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs", "--max-num-seqs", "1",
                     "--slo-ttft-ms", str(TTFT_MS))
    try:
        (status, _, body), flex, answers = queue_and_probe(s)
    finally:
        assert stop_server(s) == 0
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert flex[0] == 200 and [a[0] for a in answers] == [200] * 4
