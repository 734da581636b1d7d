"""The server under --policy alise with a real length predictor: every request gets a
prediction (counted by path in /metrics), finished requests teach it their real length
(the error histogram counts them), and what it learned is saved in the data dir."""
import json
import urllib.request

import numpy as np
import pytest

from tandem.predictor import LengthPredictor, Settings
from tandem.predictor.data import Examples
from tandem.predictor.train import train
from tests.server.conftest import API_KEY, start_server, stop_server
from tests.server.test_load import metric

SEED = ["Write a poem about rivers", "Translate to French: good morning", "Fix this Python bug: x = = 1",
        "Summarize the history of Rome", "What is 2 + 2?", "List three colours"]


def seed_predictor(out) -> None:
    """A small trained length predictor in ``out``: SEED's prompts and their lengths."""
    ex = Examples(SEED, np.array([40, 12, 30, 60, 3, 8]), np.full(len(SEED), 8), np.arange(len(SEED)))
    train(ex, Settings(k=3, threshold=0.95, hidden=16), epochs=2, out=out, log=lambda _: None)


def chat(server, text, n):
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_alise_predicts_learns_and_saves(tiny_chat_model, tmp_path):
    seed_dir = tmp_path / "seed"
    seed_predictor(seed_dir)
    s = start_server(tiny_chat_model, tmp_path, "--policy", "alise", "--length-predictor", str(seed_dir))
    try:
        asks = [("What is 2 + 2?", 5), ("Write a story about a dragon and a knight", 9), ("List three colours", 7)]
        for text, n in asks:
            out = chat(s, text, n)
            assert out["usage"]["completion_tokens"] == n
        req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        text = urllib.request.urlopen(req).read().decode()
        assert metric(text, "tandem:length_predictions_total", path="retrieval") == 2   # seen before
        assert metric(text, "tandem:length_predictions_total", path="mlp") == 1
        assert metric(text, "tandem:length_prediction_abs_error_tokens_count") == 3
    finally:
        assert stop_server(s) == 0
    saved = LengthPredictor.load(tmp_path / "data" / "predictor")
    assert len(saved.index) == len(SEED) + 3
    assert saved.predict(["Write a story about a dragon and a knight"]) == [9]


@pytest.mark.parametrize("damage", ["index cut short", "pointer emptied"])
def test_a_damaged_learned_predictor_does_not_stop_the_server(damage, tiny_chat_model, tmp_path):
    """The data dir's predictor was damaged on disk (a file cut short; the pointer to its last
    save emptied, which started from the trained one without a word): the server starts from
    the trained one (tandem runs without predictions when there is none), serves, says so, and
    keeps the damaged files aside, as they were, for a person to look at."""
    own = tmp_path / "data" / "predictor"
    seed_predictor(own)
    if damage == "index cut short":
        index = next(own.glob("gen-*/index.bin"))
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    else:
        (own / "CURRENT").write_text("")
    files = {str(p.relative_to(own)): p.stat().st_size for p in own.rglob("*") if p.is_file()}
    s = start_server(tiny_chat_model, tmp_path, "--policy", "tandem")
    try:
        assert chat(s, "What is 2 + 2?", 4)["usage"]["completion_tokens"] == 4
    finally:
        assert stop_server(s) == 0
    aside = list((tmp_path / "data").glob("predictor.unreadable-*"))
    assert len(aside) == 1 and {str(p.relative_to(aside[0])): p.stat().st_size
                                for p in aside[0].rglob("*") if p.is_file()} == files
    assert "could not be loaded" in s.log.read_text()


def test_a_save_that_fails_at_shutdown_still_shuts_down_cleanly(tiny_chat_model, tmp_path):
    """The data dir cannot take the learned lengths (a file where the predictor's folder goes):
    the failure is logged, and the server still stops its engine and exits 0."""
    seed_dir = tmp_path / "seed"
    seed_predictor(seed_dir)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "predictor").write_text("not a folder")
    s = start_server(tiny_chat_model, tmp_path, "--policy", "alise", "--length-predictor", str(seed_dir))
    try:
        chat(s, "What is 2 + 2?", 5)
    finally:
        rc = stop_server(s)
    log = s.log.read_text()
    assert rc == 0, log[-2000:]
    assert "saving the learned output lengths" in log and "Traceback" in log


def status(server) -> dict:
    with urllib.request.urlopen(server.url + "/status", timeout=10) as r:
        return json.loads(r.read())


def test_status_lists_each_queued_requests_level(tiny_chat_model, tmp_path):
    """Under alise the status endpoint (the dashboard's data) gives every queued request its
    level. With true lengths (the max_tokens oracle) and no time to age, a longer request never
    sits on a lower level than a shorter one that has the same progress."""
    import threading
    s = start_server(tiny_chat_model, tmp_path, "--policy", "alise", "--length-predictor", "max_tokens",
                     "--max-num-seqs", "1")
    lengths = [200, 8, 100, 16, 50, 32]
    try:
        threads = [threading.Thread(target=chat, args=(s, f"Question {n}", n)) for n in lengths]
        for t in threads:
            t.start()
        best = []
        for _ in range(200):
            reqs = [r for d in status(s)["devices"] for r in d["requests"]]
            if len(reqs) > len(best):
                best = reqs
            if len(best) == len(lengths):
                break
        for t in threads:
            t.join()
    finally:
        stop_server(s)
    assert len(best) >= 4, best
    assert all(isinstance(r["level"], int) and r["level"] >= 0 for r in best), best
    assert all(r["predicted_len"] in lengths for r in best)
    fresh = sorted((r for r in best if r["generated"] == 0), key=lambda r: r["predicted_len"])
    assert len(fresh) >= 3
    assert [r["level"] for r in fresh] == sorted(r["level"] for r in fresh), fresh
    assert len({r["level"] for r in fresh}) > 1, "lengths 8 to 200 were meant to span levels"


def test_the_predictor_keeps_only_the_newest_learned_lengths(tiny_chat_model, tmp_path):
    """--length-learned-max 2: after three requests the saved predictor holds its trained
    prompts and the two lengths learned last; the first one learned gave its place up."""
    seed_dir = tmp_path / "seed"
    seed_predictor(seed_dir)
    s = start_server(tiny_chat_model, tmp_path, "--policy", "alise", "--length-predictor", str(seed_dir),
                     "--length-learned-max", "2")
    asks = [("Write a story about a dragon and a knight", 9), ("Name a large ocean please", 6),
            ("Describe a quiet morning in spring", 11)]
    try:
        for text, n in asks:
            assert chat(s, text, n)["usage"]["completion_tokens"] == n
    finally:
        assert stop_server(s) == 0
    saved = LengthPredictor.load(tmp_path / "data" / "predictor")
    assert len(saved.index) == len(SEED) + 2
    assert saved.index.lengths.tolist()[len(SEED):] == [11, 6]     # the third took the first one's place
    assert saved.predict([asks[1][0], asks[2][0]]) == [6, 11]
