"""Many concurrent streaming clients, some of which go away mid-stream; metrics agree with what
clients saw; afterwards every pool block is free again, counted by owner (a block lost from the
free list shows here, where a usage fraction would not see it)."""
import asyncio
import json
import re

import aiohttp
import pytest

from tests.server.conftest import API_KEY

N_CLIENTS = 200


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)", line)
            if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
                total += float(m.group(3))
    return total


def pool_size(text: str) -> int:
    """The pool's block count as the cache config reports it (vLLM's num_gpu_blocks)."""
    return int(re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text).group(1))


async def stream_one(session, url, i, leave: bool = False):
    """One streamed completion; ``leave``: the client closes the connection after the first chunk."""
    body = {"prompt": f"Story number {i}:", "max_tokens": 8 if not leave else 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "service_tier": "flex" if i % 4 == 0 else None}
    usage, done = None, False
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if leave:
                r.close()
                return 0
            if line.strip() == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                msg = json.loads(line[6:])
                usage = msg.get("usage") or usage
    assert done and usage["completion_tokens"] == 8
    return usage["completion_tokens"]


async def settled(s, url: str) -> str:
    """/metrics once nothing runs or waits (at most 10 s)."""
    for _ in range(100):
        m = await (await s.get(url + "/metrics")).text()
        if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0:
            return m
        await asyncio.sleep(0.1)
    return m


@pytest.mark.asyncio
async def test_200_concurrent_streams_with_disconnects(server):
    leaving = set(range(3, N_CLIENTS, 10))                # 20 clients go away mid-stream
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"},
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        before = await (await s.get(server.url + "/metrics")).text()
        got = await asyncio.gather(*(stream_one(s, server.url, i, i in leaving) for i in range(N_CLIENTS)))
        after = await settled(s, server.url)
    stayed = N_CLIENTS - len(leaving)
    assert sum(got) == 8 * stayed
    done = lambda text, **kw: metric(text, "vllm:request_success_total", **kw)  # noqa: E731
    assert done(after, finished_reason="length") - done(before, finished_reason="length") == stayed
    assert done(after, finished_reason="abort") - done(before, finished_reason="abort") == len(leaving)
    be = (metric(after, "vllm:e2e_request_latency_seconds_count", service_class="be")
          - metric(before, "vllm:e2e_request_latency_seconds_count", service_class="be"))
    assert be == N_CLIENTS // 4, "flex requests are counted as BE"
    assert metric(after, "vllm:num_requests_running") == 0
    free = metric(after, "tandem:pool_blocks", owner="free")
    assert free == pool_size(after), f"{pool_size(after) - free} blocks not back on the free list"
    held = sum(metric(after, "tandem:pool_blocks", owner=o) for o in ("rt", "be", "shared", "checkpointed"))
    assert held == 0


@pytest.mark.asyncio
async def test_disconnect_mid_stream_frees_blocks(server):
    """The blocks come back, and the aborted request's phases that happened are in vLLM's
    histograms: its wait in the queue and its prefill (it had its first token)."""
    phases = ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        before = await settled(s, server.url)
        body = {"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True, "stream": True}
        r = await s.post(server.url + "/v1/completions", json=body)
        await r.content.readline()          # the stream has started
        mid = await (await s.get(server.url + "/metrics")).text()
        r.close()                           # client goes away
        m = await settled(s, server.url)
    assert metric(mid, "tandem:pool_blocks", owner="free") < pool_size(mid), "the stream held blocks"
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "tandem:pool_blocks", owner="free") == pool_size(m)
    assert metric(m, "vllm:request_success_total", finished_reason="abort") >= 1
    assert [metric(m, n, service_class="rt") - metric(before, n, service_class="rt") for n in phases] == [1, 1]
