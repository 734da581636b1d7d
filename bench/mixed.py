"""Mixed traces: RT requests arrive online while BE work is always pending.

BE work reaches a server the way its users would send it:
  - ``batches``: OpenAI Batch API jobs (upload a JSONL file to /v1/files, create a
    /v1/batches job, poll it); the next job is submitted when the previous one
    completes, so exactly one job is in flight (our server; BROS's setting);
  - ``online``: ``be_concurrency`` streaming requests kept outstanding, marked BE
    the way the server understands (vLLM: ``priority``; ours: ``service_tier=flex``;
    others: not at all). For servers without a Batch API.

The run's window is from the first RT arrival until every RT request has finished
(or the drain time ran out). BE throughput counts the BE requests *completed*
inside the window: at its end the running batch job is cancelled (its output file
then holds exactly the lines that completed) and online BE requests are aborted.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import aiohttp

from tandem.bench.client import completion_body, fire_trace, one_request
from tandem.bench.metrics import RequestRecord
from tandem.bench.waits import poll_status
from tandem.bench.workloads import TraceItem

TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class BatchJob:
    submitted: float                # client monotonic seconds
    requests: int
    batch_id: str = ""
    finished: float | None = None
    status: str = ""
    completed: int = 0              # lines with a 200 response
    output_tokens: int = 0


@dataclass
class BeResult:
    mode: str
    window_s: float = 0.0
    jobs: list[BatchJob] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)   # online mode

    @property
    def completed(self) -> int:
        if self.mode == "batches":
            return sum(j.completed for j in self.jobs)
        return sum(r.ok for r in self.records)

    @property
    def output_tokens(self) -> int:
        if self.mode == "batches":
            return sum(j.output_tokens for j in self.jobs)
        return sum(r.output_tokens for r in self.records if r.ok)

    def summary(self) -> dict:
        w = self.window_s or float("nan")
        return {"mode": self.mode, "window_s": self.window_s, "completed": self.completed,
                "output_tokens": self.output_tokens, "requests_per_s": self.completed / w,
                "tokens_per_s": self.output_tokens / w, "jobs": len(self.jobs)}


def batch_jsonl(model: str, items: list[TraceItem], system: str) -> bytes:
    lines = [{"custom_id": f"be-{i}", "method": "POST", "url": "/v1/completions",
              "body": completion_body(model, it, system, stream=False)} for i, it in enumerate(items)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def _json(resp: aiohttp.ClientResponse) -> dict:
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
    return await resp.json()


async def run_batch_job(s: aiohttp.ClientSession, url: str, model: str, items: list[TraceItem],
                        system: str, stop: asyncio.Event, poll_s: float = 0.25) -> BatchJob:
    """Upload, create, poll until terminal; cancel when ``stop`` is set; count completed lines."""
    job = BatchJob(time.monotonic(), len(items))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", batch_jsonl(model, items, system), filename="be.jsonl",
                   content_type="application/jsonl")
    async with s.post(url + "/v1/files", data=form) as r:
        fid = (await _json(r))["id"]
    async with s.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}) as r:
        b = await _json(r)
    job.batch_id = b["id"]
    cancelled = False
    while b["status"] not in TERMINAL:
        if stop.is_set() and not cancelled:
            async with s.post(f"{url}/v1/batches/{job.batch_id}/cancel") as r:
                await _json(r)
            cancelled = True
        await asyncio.sleep(poll_s)
        async with s.get(f"{url}/v1/batches/{job.batch_id}") as r:
            b = await _json(r)
    job.finished, job.status = time.monotonic(), b["status"]
    if b.get("output_file_id"):
        async with s.get(f"{url}/v1/files/{b['output_file_id']}/content") as r:
            text = await r.text()
        for line in text.splitlines():
            resp = json.loads(line)["response"]
            if resp and resp["status_code"] == 200:
                job.completed += 1
                job.output_tokens += resp["body"]["usage"]["completion_tokens"]
    return job


async def drive_batches(s, url, model, be: Iterator[TraceItem], job_size: int, system: str,
                        stop: asyncio.Event, out: BeResult) -> None:
    """One job in flight at a time, the next submitted when the previous one ends."""
    while not stop.is_set():
        out.jobs.append(await run_batch_job(s, url, model, list(itertools.islice(be, job_size)), system, stop))


async def drive_online(s, url, model, be: Iterator[TraceItem], concurrency: int, system: str,
                       stop: asyncio.Event, out: BeResult) -> None:
    """``concurrency`` loops, each streaming one BE request after another until ``stop``."""
    async def loop():
        while not stop.is_set():
            it = next(be)
            rec = RequestRecord("be", time.monotonic())
            out.records.append(rec)
            await one_request(s, url, completion_body(model, it, system), rec)
    tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    out.records = [r for r in out.records if r.ok]       # aborted at the window's end: not completed


async def run_mixed(url: str, model: str, rt: list[TraceItem], be_items: Iterable[TraceItem], system: str, *,
                    be_mode: str = "batches", job_size: int = 16, be_concurrency: int = 16,
                    drain_s: float = 120.0, api_key: str | None = None,
                    status_trace: list[dict] | None = None) -> tuple[list[RequestRecord], BeResult]:
    """RT items at their arrival offsets while BE work is kept pending; see the module doc. ``be_items``
    are cycled: an endless iterator sends none twice. With ``status_trace``, the server's /status
    is polled each second meanwhile and appended to it (bench/waits.py)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    be = itertools.cycle(be_items)
    result = BeResult(be_mode)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as s:
        driver = drive_batches(s, url, model, be, job_size, system, stop, result) if be_mode == "batches" \
            else drive_online(s, url, model, be, be_concurrency, system, stop, result)
        be_task = asyncio.create_task(driver)
        poller = asyncio.create_task(poll_status(s, url, stop, status_trace)) if status_trace is not None else None
        t0 = time.monotonic()
        recs = await fire_trace(s, url, model, rt, system, t0, drain_s=drain_s)
        result.window_s = time.monotonic() - t0
        stop.set()
        await be_task
        if poller is not None:
            await poller
    return recs, result


def co_serving_targets(rows: list[dict], baseline: str = "tandem-fcfs", peer: str = "vllm-priority") -> list[dict]:
    """Each co-serving system against FCFS (``baseline``) and ``peer`` at every rate, in BROS's terms.

    BROS (§7.1) reports RT normalized latency as the *mean* over requests of end-to-end latency /
    output tokens, and BE throughput in requests per second; both are here, beside the p50 latency
    and BE output tokens per second. Ratios are system / baseline, so latency 0.5 means 50% lower.
    """
    by = {(r["system"], r["rate"]): r for r in rows}
    out = []
    for r in rows:
        base, other = by.get((baseline, r["rate"])), by.get((peer, r["rate"]))
        if r["system"] in (baseline, peer) or base is None or "be" not in r or "be" not in base:
            continue
        rt, brt = r["summary"]["rt"], base["summary"]["rt"]
        row = {"system": r["system"], "rate": r["rate"],
               "attainment_ratio": _ratio(r["attain_bros"], base["attain_bros"]),
               "norm_latency_mean_ratio": _ratio(rt["normalized_latency_mean_s"], brt["normalized_latency_mean_s"]),
               "norm_latency_p50_ratio": _ratio(_p50(rt), _p50(brt)),
               "be_requests_ratio": _ratio(r["be"]["requests_per_s"], base["be"]["requests_per_s"]),
               "be_tokens_ratio": _ratio(r["be"]["tokens_per_s"], base["be"]["tokens_per_s"])}
        if other is not None:
            row["norm_latency_mean_vs_peer"] = _ratio(rt["normalized_latency_mean_s"],
                                                      other["summary"]["rt"]["normalized_latency_mean_s"])
        out.append(row)
    return out


def _p50(summary: dict) -> float:
    d = summary["normalized_latency_s"]
    return d.get(50, d.get("50", float("nan")))          # int keys live, str keys from JSON


def _ratio(a: float, b: float) -> float:
    return a / b if b else (float("inf") if a else float("nan"))


def print_targets(targets: list[dict]) -> None:
    """BROS's targets: attainment >= 2x FCFS, mean normalized latency <= 0.5x FCFS and < the
    peer's, BE throughput >= 0.85x FCFS."""
    print("\n| system | RT rate | TTFT & TPOT vs FCFS | norm. latency mean vs FCFS (p50) | mean vs vLLM-priority "
          "| BE req/s vs FCFS (tok/s) |\n|---|---|---|---|---|---|")
    for t in targets:
        peer = t.get("norm_latency_mean_vs_peer")
        print(f"| {t['system']} | {t['rate']} | {t['attainment_ratio']:.1f}x | "
              f"{t['norm_latency_mean_ratio']:.2f}x ({t['norm_latency_p50_ratio']:.2f}x) | "
              f"{'-' if peer is None else f'{peer:.2f}x'} | {t['be_requests_ratio']:.0%} ({t['be_tokens_ratio']:.0%}) |")
