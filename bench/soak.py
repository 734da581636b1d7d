"""``python -m bench soak``: the server under mixed load for a long time, and whether anything
grows that should not. For ``--minutes``, chat streams arrive as a Poisson process at
``--rate``, and every ``--leave-every``-th client goes away mid-stream. Batch jobs of
``--job-lines`` lines run back to back. Every ``--sample-s`` seconds the bench reads the server's
/status and /metrics: resident memory and open files of the server and its workers, pool blocks
in use, connections, and errors on both sides. The table compares the first sample (after a
warm-up) with the last. Flat is the bar.
"""
from __future__ import annotations

import asyncio
import random
import re
import time

import aiohttp

from tandem.bench.client import completion_body, one_request
from tandem.bench.metrics import RequestRecord
from tandem.bench.mixed import run_batch_job
from tandem.bench.output import beside, result_path, save_json
from tandem.bench.workloads import TraceItem, sharegpt_trace


async def _stream(s, url: str, item: TraceItem, leave: bool, errors: dict) -> None:
    """One chat stream; ``leave``: the client closes it after its first token."""
    if not leave:
        rec = RequestRecord("rt", time.monotonic())
        await one_request(s, url, completion_body("smollm2", item, "tandem"), rec)
        errors["chat"] += rec.error is not None
        return
    try:
        async with s.post(url + "/v1/completions", json=completion_body("smollm2", item, "tandem")) as r:
            errors["chat"] += r.status != 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    break                      # the first token came: the client goes away
    except aiohttp.ClientError:
        errors["chat"] += 1


async def _sample(s, url: str, t0: float, errors: dict, lines: dict) -> dict:
    async with s.get(url + "/status") as r:
        st = await r.json()
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    server_errors = sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*finished_reason="error"[^}]*\} (\S+)$',
                                                    text, re.M))
    procs = st["processes"]
    workers = [w for w in procs["workers"] if w]
    pool = st["devices"][0]["pool"] if st["devices"] else {"total": 0, "free": 0}
    return {"t_s": round(time.monotonic() - t0), "server_rss_mib": procs["server"]["rss_mib"],
            "server_open_files": procs["server"]["open_files"], "server_threads": procs["server"]["threads"],
            "workers_rss_mib": sum(w["rss_mib"] for w in workers),
            "workers_open_files": sum(w["open_files"] for w in workers),
            "pool_used": pool["total"] - pool["free"], "connections": st.get("connections", {}).get("open"),
            "chat_errors": errors["chat"], "server_errors": server_errors,
            "lines_done": lines["done"], "lines_failed": lines["failed"]}


async def soak(url: str, chats: list[TraceItem], lines: list[TraceItem], args) -> list[dict]:
    rng = random.Random(args.seed)
    errors, done = {"chat": 0}, {"done": 0, "failed": 0}
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        async def jobs():
            k = 0
            while not stop.is_set():
                batch = [lines[(k + i) % len(lines)] for i in range(args.job_lines)]
                k += args.job_lines
                job = await run_batch_job(s, url, "smollm2", batch, "tandem", stop)
                done["done"] += job.completed
                done["failed"] += job.requests - job.completed if job.status == "completed" else 0

        async def arrivals():
            tasks, i = set(), 0
            while not stop.is_set():
                await asyncio.sleep(rng.expovariate(args.rate))
                item = chats[i % len(chats)]
                t = asyncio.create_task(_stream(s, url, item, i % args.leave_every == args.leave_every - 1, errors))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
            await asyncio.gather(*tasks, return_exceptions=True)

        t0 = time.monotonic()
        workers = [asyncio.create_task(jobs()), asyncio.create_task(arrivals())]
        samples = []
        end = t0 + 60 * args.minutes
        next_at = t0 + args.warmup_s
        while time.monotonic() < end:
            await asyncio.sleep(max(0.0, min(next_at, end) - time.monotonic()))
            samples.append(await _sample(s, url, t0, errors, done))
            print("  " + ", ".join(f"{k} {v}" for k, v in samples[-1].items()), flush=True)
            next_at += args.sample_s
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        await asyncio.sleep(5)                                   # let cancelled lines and streams settle
        samples.append(await _sample(s, url, t0, errors, done) | {"after_stop": True})
    return samples


def run(args) -> None:
    from tandem.bench.online import _setup, tandem_server
    _, tok = _setup(args)
    chats = sharegpt_trace(tok, 1.0, 400, args.seed, max_prompt_tokens=512, max_output_tokens=args.max_output,
                           held_out=True)
    lines = sharegpt_trace(tok, 1.0, 400, args.seed + 1, max_prompt_tokens=512, max_output_tokens=args.max_output,
                           service_class="be")
    with tandem_server("smollm2", args.max_num_seqs, [], log=beside(result_path(args.out), "tandem-server.log")) as url:
        samples = asyncio.run(soak(url, chats, lines, args))
    first, last = samples[0], samples[-1]
    keys = ["server_rss_mib", "workers_rss_mib", "server_open_files", "workers_open_files", "server_threads",
            "pool_used", "connections", "chat_errors", "server_errors", "lines_done", "lines_failed"]
    print(f"\nSoak: {args.minutes:g} min, chats at {args.rate:g} req/s (every {args.leave_every}th leaves "
          f"mid-stream), batch jobs of {args.job_lines} lines back to back; first sample at "
          f"{first['t_s']} s, last after the load stopped\n")
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in (("first", first), ("last", last)):
        print(f"| {name} ({row['t_s']} s) | " + " | ".join(str(row[k]) for k in keys) + " |")
    save_json(args.out, {"args": vars(args), "samples": samples})
