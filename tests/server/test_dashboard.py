"""The dashboard, in a real headless Chromium, against a server under load.

The page is plain HTML with a script that polls /status. Chromium runs the script and dumps
the rendered DOM. Its numbers are checked against the server's Prometheus /metrics, a separate
code path. A screenshot goes into the test's temp dir.
"""
from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from html.parser import HTMLParser

import openai
import pytest

from tests.conftest import write_adapter
from tests.server.conftest import API_KEY, start_server, stop_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it)")


class Fields(HTMLParser):
    """Text of every element carrying data-field, keyed by (data-device or data-class, field),
    the ids of the listed requests and batches, and the listed requests' adapters."""

    def __init__(self):
        super().__init__()
        self.values: dict[tuple[str | None, str], str] = {}
        self.requests: list[str] = []
        self.adapters: list[str] = []
        self.batches: list[str] = []
        self._open: tuple | None = None
        self._row: str | None = None
        self.loaded = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body" and a.get("data-loaded") == "1":
            self.loaded = True
        if tag == "tr":
            self._row = a.get("data-class")
            if "data-request" in a:
                self.requests.append(a["data-request"])
            if "data-batch" in a:
                self.batches.append(a["data-batch"])
        if "data-field" in a:
            self._open = (a.get("data-device", self._row), a["data-field"])

    def handle_data(self, data):
        if self._open is not None:
            self.values[self._open] = data.strip()
            if self._open[1] == "adapter":
                self.adapters.append(data.strip())
            self._open = None


def rendered(url: str, screenshot=None) -> Fields:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000"]
    if screenshot is not None:
        subprocess.run(args + ["--hide-scrollbars", "--window-size=1280,1500", f"--screenshot={screenshot}",
                               url + "/dashboard"], capture_output=True, timeout=120, check=True)
    dom = subprocess.run(args + ["--dump-dom", url + "/dashboard"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    page = Fields()
    page.feed(dom)
    assert page.loaded, "the page's script never rendered /status"
    return page


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+\{[^}]*\}|\S+) (\S+)$", text, re.M)}


def metric(values: dict, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for key, v in values.items():
        head, _, rest = key.partition("{")
        if head == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def pool_size(values: dict) -> int:
    """The pool's blocks, from the labels of /metrics' cache config."""
    info = "".join(k for k in values if k.startswith("vllm:cache_config_info"))
    return int(re.search(r'num_gpu_blocks="(\d+)"', info).group(1))


@pytest.fixture(scope="module")
def busy_server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    adapter = write_adapter(tiny_chat_model, tmp / "sql", ["q_proj", "v_proj"])
    s = start_server(tiny_chat_model, tmp, "--max-num-seqs", "4", "--lora-modules", f"sql={adapter}")
    yield s
    stop_server(s)


def test_a_fresh_idle_server_shows_its_device(busy_server):
    """Before any request (so before any step) the page lists the device with its whole pool
    free, as /metrics counts it."""
    m = metrics(busy_server.url)
    blocks = pool_size(m)
    assert metric(m, "vllm:request_success_total") == 0 and blocks > 0
    assert metric(m, "tandem:pool_blocks", owner="free") == blocks
    page = rendered(busy_server.url)
    assert page.values[("0", "pool-free")] == page.values[("0", "pool-total")] == str(blocks)
    assert page.values[("0", "rt-running")] == page.values[("0", "be-waiting")] == "0"


def test_dashboard_under_load_matches_metrics(busy_server, tmp_path):
    url, model = busy_server.url, busy_server.model
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",        # half on an adapter
              "body": {"model": "sql" if i % 2 else model, "messages": [{"role": "user", "content": f"Item {i}"}],
                       "max_tokens": 120, "ignore_eos": True}} for i in range(24)]
    f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    generating = threading.Event()             # a step has produced a token: the load is running

    def chat():
        for chunk in client.chat.completions.create(model=model, max_tokens=150, stream=True,
                                                    extra_body={"ignore_eos": True, "return_token_ids": True},
                                                    messages=[{"role": "user", "content": "Tell me a story"}]):
            if chunk.choices and getattr(chunk.choices[0], "token_ids", None):
                generating.set()
    streams = [threading.Thread(target=chat) for _ in range(6)]
    for t in streams:
        t.start()
    assert generating.wait(120), "no chat produced a token"
    shot = tmp_path / "dashboard.png"
    busy = rendered(url, screenshot=shot)                         # under load
    assert shot.stat().st_size > 10_000
    for t in streams:
        t.join()
    deadline = time.monotonic() + 240
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline, "batch did not finish"
        time.sleep(0.3)

    m = metrics(url)
    blocks = pool_size(m)
    assert busy.values[("0", "pool-total")] == str(blocks)
    held = sum(int(busy.values[("0", f"pool-{o}")]) for o in ("rt", "be", "shared", "checkpointed"))
    assert held > 0, "the page showed no block in use under load"
    assert int(busy.values[("0", "pool-free")]) + held == blocks
    # by cache type each block counts once, though the chats share their prompt's blocks
    by_type = sum(int(v) for (dev, f), v in busy.values.items() if dev == "0" and f.startswith("cache-"))
    used = blocks - int(busy.values[("0", "pool-free")])
    assert 0 < by_type <= used, (by_type, used)
    assert busy.requests, "no request listed under load"
    assert {"sql", "–"} <= set(busy.adapters), busy.adapters       # requests on the adapter and on the model
    assert batch.id in busy.batches

    time.sleep(1.5)                                                # let a step report the idle pool
    idle = rendered(url)
    m = metrics(url)
    assert int(idle.values[("0", "pool-free")]) == metric(m, "tandem:pool_blocks", owner="free") == blocks
    for cls in ("rt", "be"):
        assert int(idle.values[("0", f"{cls}-running")]) == metric(m, "vllm:num_requests_running", service_class=cls)
    rt_done = metric(m, "tandem:slo_requests_total", service_class="rt", slo="both")
    assert int(idle.values[("rt", "finished")]) == rt_done == 6
    met = metric(m, "tandem:slo_requests_total", service_class="rt", slo="both", met="true")
    assert idle.values[("rt", "both")] == f"{100 * met / rt_done:.1f}%"
    assert int(idle.values[("be", "finished")]) == 0, "batch lines have no SLO unless they ask for one"
