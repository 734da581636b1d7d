"""Two CPU workers behind the server with a migrating placement: streams stay whole across
migrations, and /metrics and the log show what moved, how, why and how long it paused."""
import asyncio
import json

import aiohttp
import pytest

from tests.server.conftest import API_KEY, hf_texts, start_server, stop_server
from tests.server.test_load import metric

N, MAX_TOKENS = 10, 40


@pytest.fixture(scope="module")
def two_devices(tiny_chat_model, tmp_path_factory):
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_chat_model)
    block_bytes = spec.num_layers * 16 * spec.unit * 4
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("placement"), "--devices", "cpu:2",
                     "--placement", "lb", "--rebalance-interval", "0.05", "--threads-per-worker", "1",
                     "--kv-cache-bytes", str(24 * block_bytes), "--max-num-batched-tokens", "64",
                     # FCFS admits what fits now, so caches outgrow the small pools and must move (the
                     # default policy's look-ahead admission may keep them from outgrowing at all)
                     "--policy", "fcfs")
    yield s
    stop_server(s)


def prompt(i: int) -> str:
    """Prompts of 15 to about 100 tokens: caches of unequal sizes, so the two devices' loads
    drift apart by more than one request's cache and balancing has a request worth moving
    (equal caches would never do: moving one only flips which device holds more)."""
    return f"Tell me story number {i} about a cat and a dog in a garden" + " and then" * (5 * i) + ":"


async def stream(session, url, i):
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


async def whole(session, url, i):
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return (await r.json())["choices"][0]["text"]


@pytest.mark.asyncio
async def test_streams_survive_migrations_and_metrics_show_them(two_devices, tiny_chat_model):
    url = two_devices.url

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            streamed = []
            for _ in range(2):                   # two waves: twice the chances for loads to drift apart
                streamed += await asyncio.gather(*(stream(s, url, i) for i in range(N)))
            await asyncio.sleep(0.3)
            text = await (await s.get(url + "/metrics")).text()
            alone = [await whole(s, url, i) for i in range(N)]   # one at a time: nothing moves
            after = await (await s.get(url + "/metrics")).text()
            return streamed, text, alone, after
    streamed, text, alone, after = await run()
    moved = metric(text, "tandem:migrations_total")
    assert moved > 0, "the small pools were meant to make the rebalancer migrate"
    # a pause for each move whose request went on to a token where it went (one moved again first has none)
    assert 0 < metric(text, "tandem:migration_pause_seconds_count") <= moved
    assert 'tandem:device_pool_usage_perc{device="cpu#1"' in text.replace("model_name=\"" + two_devices.model + "\",", "")
    assert "tandem:devices_active" in text
    assert metric(after, "tandem:migrations_total") == moved, "a request alone was moved"
    assert alone == hf_texts(tiny_chat_model, [prompt(i) for i in range(N)], MAX_TOKENS)
    assert streamed == alone * 2, "a stream that crossed devices differs from the same request run alone"
    assert "migrating" in two_devices.log.read_text()


@pytest.mark.asyncio
async def test_a_repeated_prompt_goes_to_its_cache_and_metrics_count_it(two_devices):
    """A prompt no device has seen is placed by load; sent again, it goes to the device holding
    its blocks (counted once in /metrics) and reuses their whole 16-token blocks, short of its
    last token."""
    url = two_devices.url
    body = {"prompt": "Describe a quiet morning in a mountain village" + " slowly" * 30, "max_tokens": 4,
            "temperature": 0}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        before = metric(await (await s.get(url + "/metrics")).text(), "tandem:prefix_routed_requests_total")
        usages = []
        for _ in range(2):
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                usages.append((await r.json())["usage"])
        after = metric(await (await s.get(url + "/metrics")).text(), "tandem:prefix_routed_requests_total")
    n = usages[1]["prompt_tokens"]
    assert n > 32
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, (n - 1) // 16 * 16]
    assert after - before == 1
