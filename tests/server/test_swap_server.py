"""Swapping behind the server: with a pool too small for the concurrent requests, preempted
requests' caches go to host memory and come back; each reply is HF transformers' greedy one,
and /metrics counts the swaps and the bytes both ways, and every start and resumption."""
import asyncio

import pytest
import aiohttp

from tests.server.conftest import API_KEY, hf_texts, start_server, stop_server
from tests.server.test_load import metric

N, MAX_TOKENS = 8, 40


def prompt(i: int) -> str:
    return f"Tell me story number {i} about a cat and a dog in a garden:"


async def complete(session, url, i):
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        return (await r.json())["choices"][0]["text"]


@pytest.mark.asyncio
async def test_swapped_requests_reply_as_if_alone(tiny_chat_model, tmp_path):
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_chat_model)
    block_bytes = spec.num_layers * 16 * spec.unit * 4
    s = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs", "--preemption-mode", "swap",
                     "--swap-dtype", "auto",
                     "--kv-cache-bytes", str(16 * block_bytes), "--max-num-batched-tokens", "64")

    seen = []           # (requests swapped out, host memory in use) at each scrape while they run

    async def watch(session, done):
        while not done.is_set():
            async with session.get(s.url + "/metrics") as r:
                text = await r.text()
            seen.append((metric(text, "vllm:num_requests_swapped"), metric(text, "vllm:cpu_cache_usage_perc")))
            await asyncio.sleep(0.01)

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            done = asyncio.Event()
            watcher = asyncio.create_task(watch(session, done))
            together = await asyncio.gather(*(complete(session, s.url, i) for i in range(N)))
            done.set()
            await watcher
            # a chat whose context can never fit the small pool: refused, naming the messages
            async with session.post(s.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}) as r:
                refused = r.status, (await r.json())["error"]
            # no max_tokens: the rest of what the pool holds (16 blocks, K and V: 8 x 16 tokens)
            async with session.post(s.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}) as r:
                whole = r.status, await r.json()
            async with session.get(s.url + "/metrics") as r:
                return together, await r.text(), refused, whole
    try:
        together, text, refused, whole = await run()
    finally:
        assert stop_server(s) == 0
    assert metric(text, "vllm:num_preemptions_total") > 0, "the pool was meant to force preemption"
    # every preemption is counted once under the policy's reason for it
    assert metric(text, "tandem:preemptions_by_reason_total") == metric(text, "vllm:num_preemptions_total")
    # and each start, and each resumption after a preemption, once (the N stories and the whole chat;
    # the refused chat never started)
    assert metric(text, "tandem:starts_by_reason_total") == N + 1 + metric(text, "vllm:num_preemptions_total")
    out = metric(text, "tandem:swaps_total", event="out")
    assert out > 0 and metric(text, "tandem:swaps_total", event="in") == out
    moved = metric(text, "tandem:swap_bytes_total", direction="out")
    assert moved > 0 and metric(text, "tandem:swap_bytes_total", direction="in") == moved
    # vLLM's swap gauges: some request was seen swapped out, holding host memory; none at the end
    assert any(n >= 1 and 0 < used <= 1 for n, used in seen), seen
    assert all((n == 0) == (used == 0) for n, used in seen), seen
    assert (metric(text, "vllm:num_requests_swapped"), metric(text, "vllm:cpu_cache_usage_perc")) == (0, 0)
    assert "_created" not in text           # no creation-time series beside the counters, as vLLM's
    assert refused[0] == 400 and refused[1]["param"] == "messages" and "pool has" in refused[1]["message"]
    assert whole[0] == 200, whole[1]
    assert whole[1]["choices"][0]["finish_reason"] == "length" and whole[1]["usage"]["total_tokens"] == 8 * 16
    assert together == hf_texts(tiny_chat_model, [prompt(i) for i in range(N)], MAX_TOKENS)


@pytest.mark.asyncio
async def test_int8_cache_flag_reaches_the_pool(tiny_chat_model, tmp_path):
    """--kv-cache-dtype int8: the budget buys compressed blocks (values plus λ and lo per channel,
    after max_num_seqs requests' K and V open blocks at fp32), /metrics says so, and it serves."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_chat_model)
    budget, seqs, B = 4 << 20, 8, 16
    full = spec.num_layers * B * spec.num_kv_heads * spec.head_dim * 4
    int8 = spec.num_layers * spec.num_kv_heads * spec.head_dim * (B + 8)
    expect = (budget - 2 * seqs * full) // int8
    s = start_server(tiny_chat_model, tmp_path, "--kv-cache-dtype", "int8", "--kv-cache-bytes", str(budget),
                     "--max-num-seqs", str(seqs))

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            texts = await asyncio.gather(*(complete(session, s.url, i) for i in range(3)))
            async with session.get(s.url + "/metrics") as r:
                return texts, await r.text()
    try:
        texts, text = await run()
    finally:
        assert stop_server(s) == 0
    assert all(texts)
    assert metric(text, "vllm:cache_config_info", cache_dtype="int8", num_gpu_blocks=str(expect),
                  block_size=str(B)) == 1
