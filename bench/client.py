"""Drive any OpenAI-compatible server over SSE and record per-request timings."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tandem.bench.metrics import RequestRecord
from tandem.bench.workloads import TraceItem


# transformers serve has no ignore_eos; an EOS id no token has fixes the length the same way
NEVER_EOS = json.dumps({"eos_token_id": -1, "do_sample": False})


def completion_body(model: str, item: TraceItem, system: str, stream: bool = True) -> dict:
    """/v1/completions body fixing the output length; BE marked the way each server understands."""
    body = {"model": model, "prompt": item.prompt_ids, "max_tokens": item.max_tokens, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if system == "transformers":
        del body["ignore_eos"]
        body["prompt"] = item.prompt_text
        body["generation_config"] = NEVER_EOS
    if system.startswith("tandem") and not item.prompt_text:
        body["return_token_ids"] = True   # random ids of a model without a tokenizer: no text to time
    if item.service_class == "be":
        if system.startswith("tandem"):
            body["service_tier"] = "flex"
        elif system == "vllm-priority":
            body["priority"] = 1          # vLLM: lower runs first; RT keeps the default 0
    return body


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord) -> None:
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                now = time.monotonic()
                if msg.get("usage"):
                    rec.output_tokens = msg["usage"]["completion_tokens"]
                for c in msg.get("choices") or []:
                    if c.get("text") or c.get("token_ids"):
                        rec.token_times.append(now)
                if "error" in msg:
                    rec.error = str(msg["error"])[:200]
            rec.end = time.monotonic()
            rec.output_tokens = rec.output_tokens or len(rec.token_times)   # servers without usage
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def fire_trace(s: aiohttp.ClientSession, url: str, model: str, items: list[TraceItem], system: str,
                     t0: float, *, drain_s: float = 120.0, progress: bool = True) -> list[RequestRecord]:
    """Send each item at ``t0`` + its arrival offset; wait at most ``drain_s`` after the last arrival.

    Unfinished requests are aborted and marked as errors. Token times are the
    arrival times of SSE chunks that carry text (or token ids: a model without a tokenizer).
    """
    recs = [RequestRecord(it.service_class, 0.0) for it in items]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(items), desc=f"{system}", unit="req", leave=False)

    async def fire(it: TraceItem, rec: RequestRecord):
        await asyncio.sleep(max(0.0, t0 + it.arrival_s - time.monotonic()))
        rec.arrival = time.monotonic()
        await one_request(s, url, completion_body(model, it, system), rec)
        if bar is not None:
            bar.update(1)
    tasks = [asyncio.create_task(fire(it, r)) for it, r in zip(items, recs)]
    last = max((it.arrival_s for it in items), default=0.0)
    _done, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + last + drain_s - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if bar is not None:
        bar.close()
    for r in recs:
        if r.end is None and r.error is None:
            r.error = "not finished within the drain time"
    return recs


async def run_trace(url: str, model: str, items: list[TraceItem], system: str, *,
                    api_key: str | None = None, drain_s: float = 120.0,
                    progress: bool = True) -> tuple[list[RequestRecord], float]:
    """The trace alone on one client session: (records, the run's duration in seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as s:
        t0 = time.monotonic()
        recs = await fire_trace(s, url, model, items, system, t0, drain_s=drain_s, progress=progress)
        return recs, time.monotonic() - t0
