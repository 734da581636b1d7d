"""The default policy behind the server: while requests queue, /metrics says why each waits
(by class and reason, the same count as the waiting gauge) and /status gives each its level."""
import threading
import urllib.request

from tests.server.conftest import API_KEY, start_server, stop_server
from tests.server.test_alise_server import chat, status
from tests.server.test_load import metric


def scrape(server) -> str:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def test_waiting_requests_are_counted_by_reason(tiny_chat_model, tmp_path):
    s = start_server(tiny_chat_model, tmp_path, "--length-predictor", "max_tokens", "--max-num-seqs", "2")
    lengths = [120, 90, 100, 110, 80, 130]
    try:
        threads = [threading.Thread(target=chat, args=(s, f"Question {n}", n)) for n in lengths]
        for t in threads:
            t.start()
        seen = None
        for _ in range(300):
            text, view = scrape(s), status(s)
            waiting = metric(text, "vllm:num_requests_waiting")
            by_reason = metric(text, "tandem:requests_waiting_by_reason")
            listed = sum(row["requests"] for d in view["devices"] for row in d["waiting_reasons"])
            if waiting > 0 and by_reason == waiting == listed:
                seen = (text, view)
                break
        for t in threads:
            t.join()
        after = scrape(s)
    finally:
        assert stop_server(s) == 0
    assert seen is not None, "never caught requests waiting with their reasons counted"
    text, view = seen
    reasons = {row["why"] for d in view["devices"] for row in d["waiting_reasons"]}
    assert all(r.startswith(("waiting", "pending")) for r in reasons), reasons
    for why in reasons:
        assert f'reason="{why}"' in text
    listed = [r for d in view["devices"] for r in d["requests"]]
    assert listed and all(isinstance(r["level"], int) for r in listed)
    assert metric(after, "tandem:requests_waiting_by_reason") == 0     # all served: every reason back to 0
