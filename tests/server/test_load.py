"""Many concurrent streaming clients; metrics agree with what clients saw; no block leaks."""
import asyncio
import json
import re

import aiohttp

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


async def stream_one(session, url, i):
    body = {"prompt": f"Story number {i}:", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "service_tier": "flex" if i % 4 == 0 else None}
    usage, done = None, False
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.strip() == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                msg = json.loads(line[6:])
                usage = msg.get("usage") or usage
    assert done and usage["completion_tokens"] == 8
    return usage["completion_tokens"]


def test_200_concurrent_streams_and_metrics(server):
    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"},
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            before = await (await s.get(server.url + "/metrics")).text()
            got = await asyncio.gather(*(stream_one(s, server.url, i) for i in range(N_CLIENTS)))
            await asyncio.sleep(0.3)
            after = await (await s.get(server.url + "/metrics")).text()
            return got, before, after
    got, before, after = asyncio.run(run())
    assert sum(got) == 8 * N_CLIENTS
    gen = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert gen == 8 * N_CLIENTS
    be = (metric(after, "vllm:e2e_request_latency_seconds_count", service_class="be")
          - metric(before, "vllm:e2e_request_latency_seconds_count", service_class="be"))
    assert be == N_CLIENTS // 4, "flex requests are counted as BE"
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0, "all blocks are free afterwards"


def test_disconnect_mid_stream_frees_blocks(server):
    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            body = {"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True, "stream": True}
            r = await s.post(server.url + "/v1/completions", json=body)
            await r.content.readline()          # the stream has started
            r.close()                           # client goes away
            for _ in range(50):
                await asyncio.sleep(0.1)
                m = await (await s.get(server.url + "/metrics")).text()
                if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0:
                    return m
            return m
    m = asyncio.run(run())
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "vllm:kv_cache_usage_perc") == 0
    assert metric(m, "vllm:request_success_total", finished_reason="abort") >= 1
