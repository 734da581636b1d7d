"""``python -m bench chat-under-batch``: what a chat user sees while a large batch job runs.

Our server starts with its defaults (or the policy given). First, chat requests on an idle
server give the idle TTFT. Then a batch job of ``--lines`` ShareGPT prompts starts, and once its
lines are running, one chat request goes out every ``--every`` seconds. Each is a
streamed, real-time completion with ``--chat-tokens`` tokens. For every policy the bench
reports chat TTFT against the idle TTFT and the server's TTFT target, and the batch lines
finished per second meanwhile.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp

from tandem.bench.client import completion_body, one_request
from tandem.bench.metrics import RequestRecord
from tandem.bench.mixed import TERMINAL, batch_jsonl
from tandem.bench.output import beside, result_path, save_json
from tandem.bench.workloads import TraceItem, sharegpt_trace


async def _chat(s, url: str, model: str, item: TraceItem) -> RequestRecord:
    rec = RequestRecord("rt", time.monotonic())
    await one_request(s, url, completion_body(model, item, "tandem"), rec)
    return rec


async def _batch(s, url: str, model: str, items: list[TraceItem]) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", batch_jsonl(model, items, "tandem"), filename="job.jsonl", content_type="application/jsonl")
    async with s.post(url + "/v1/files", data=form) as r:
        fid = (await r.json())["id"]
    async with s.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}) as r:
        return (await r.json())["id"]


async def _counts(s, url: str, bid: str) -> dict:
    async with s.get(f"{url}/v1/batches/{bid}") as r:
        b = await r.json()
    return b["request_counts"] | {"status": b["status"]}


async def measure(url: str, model: str, chat: list[TraceItem], job: list[TraceItem], idle_n: int,
                  every_s: float) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        async with s.get(url + "/status") as r:
            target = (await r.json())["slo_targets_ms"]["ttft"] / 1000      # the server's own RT target
        idle = [await _chat(s, url, model, it) for it in chat[:idle_n]]
        bid = await _batch(s, url, model, job)
        while (c := await _counts(s, url, bid))["completed"] < 1:      # the job's lines are running
            await asyncio.sleep(0.2)
        t0, done0 = time.monotonic(), c["completed"]
        busy = []
        for it in chat[idle_n:]:
            busy.append(asyncio.create_task(_chat(s, url, model, it)))
            await asyncio.sleep(every_s)
        busy = await asyncio.gather(*busy)
        c = await _counts(s, url, bid)
        window = time.monotonic() - t0
        async with s.post(f"{url}/v1/batches/{bid}/cancel") as r:
            await r.read()
        while (await _counts(s, url, bid))["status"] not in TERMINAL:
            await asyncio.sleep(0.5)
    return {"idle": idle, "busy": busy, "lines_done": c["completed"] - done0, "window_s": window, "target": target,
            "job_unfinished": c["completed"] < len(job)}


def _ms(x: float) -> str:
    return f"{1000 * x:.0f}"


def run(args) -> None:
    from tandem.bench.online import _setup, tandem_server
    _, tok = _setup(args)
    n_chat = args.idle + args.chats
    chat = sharegpt_trace(tok, 1.0, n_chat, args.seed, max_prompt_tokens=256, held_out=True)
    chat = [TraceItem(0.0, it.prompt_ids, args.chat_tokens, "rt", it.prompt_text) for it in chat[:n_chat]]
    job = sharegpt_trace(tok, 1.0, args.lines, args.seed + 1, max_prompt_tokens=512,
                         max_output_tokens=args.line_tokens, service_class="be")
    rows = []
    for policy in args.policies:
        extra = ["--policy", policy] if policy != "default" else []
        log = beside(result_path(args.out), f"{policy}.log")
        with tandem_server("smollm2", args.max_num_seqs, extra, log=log) as url:
            res = asyncio.run(measure(url, "smollm2", chat, job, args.idle, args.every))
        idle = [r.ttft for r in res["idle"] if r.ok]
        busy = [r.ttft for r in res["busy"] if r.ok]
        q = statistics.quantiles(busy, n=10, method="inclusive") if len(busy) >= 2 else busy * 9
        rows.append({"policy": policy, "idle_ttft_p50_s": statistics.median(idle),
                     "ttft_p50_s": statistics.median(busy), "ttft_p90_s": q[8], "ttft_max_s": max(busy),
                     "slo_ttft_s": res["target"], "within_slo": sum(t <= res["target"] for t in busy) / len(busy),
                     "chat_failed": sum(not r.ok for r in res["idle"] + res["busy"]),
                     "batch_lines_per_s": res["lines_done"] / res["window_s"],
                     "job_unfinished_at_end": res["job_unfinished"]})
    print(f"\nChat TTFT while a {args.lines}-line batch job runs (SmolLM2, {args.chats} chats of "
          f"{args.chat_tokens} tokens, one every {args.every:g} s; idle TTFT from {args.idle} chats first)\n")
    print("| policy | idle TTFT p50 ms | TTFT p50 / p90 / max ms | within the TTFT target | batch lines/s | chat failures |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {_ms(r['idle_ttft_p50_s'])} | {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} / "
              f"{_ms(r['ttft_max_s'])} | {100 * r['within_slo']:.0f}% (of {_ms(r['slo_ttft_s'])} ms) | "
              f"{r['batch_lines_per_s']:.2f} | {r['chat_failed']} |")
    save_json(args.out, {"args": vars(args), "rows": rows})
