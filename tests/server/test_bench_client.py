"""The bench's mixed-trace client against the real server: RT online, BE as Batch API jobs or online."""
from __future__ import annotations

import re
import urllib.request

import pytest

from tandem.bench.mixed import run_mixed
from tandem.bench.workloads import TraceItem
from tests.server.conftest import API_KEY


def rt_items(n: int, spread_s: float) -> list[TraceItem]:
    return [TraceItem(spread_s * i / max(1, n - 1), [5 + i, 17, 33, 99], 12, "rt") for i in range(n)]


def be_items(n: int) -> list[TraceItem]:
    return [TraceItem(0.0, list(range(40, 70 + i)), 7, "be") for i in range(n)]


def be_tokens_served(server) -> float:
    """BE generation tokens as the server's own /metrics counts them (independent of the client)."""
    req = urllib.request.Request(server.url + "/metrics", headers=server.headers())
    text = urllib.request.urlopen(req).read().decode()
    m = re.search(r'^vllm:generation_tokens_total\{[^}]*service_class="be"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.asyncio
async def test_rt_with_batch_jobs(server):
    before = be_tokens_served(server)
    rt = rt_items(4, 3.0)
    recs, be = await run_mixed(server.url, server.model, rt, be_items(6), "tandem",
                                     be_mode="batches", job_size=3, drain_s=60, api_key=API_KEY)
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert [r.output_tokens for r in recs] == [12] * 4          # ignore_eos + max_tokens honoured
    assert be.window_s >= rt[-1].arrival_s          # the window spans the RT trace (not a speed goal)
    assert be.jobs and all(j.status in ("completed", "cancelled") for j in be.jobs)
    assert all(j.status == "completed" for j in be.jobs[:-1])   # only the one running at the end is cut
    assert be.completed >= 3                                     # at least one whole job inside the window
    assert be.output_tokens == 7 * be.completed                  # each BE line made exactly 7 tokens
    # every token the client counts, the server generated as BE (it may have made more: aborted lines)
    assert be_tokens_served(server) - before >= be.output_tokens
    s = be.summary()
    assert s["tokens_per_s"] == be.output_tokens / be.window_s     # the summary's arithmetic


@pytest.mark.asyncio
async def test_rt_with_online_be(server):
    recs, be = await run_mixed(server.url, server.model, rt_items(3, 1.0), be_items(4), "tandem",
                                     be_mode="online", be_concurrency=2, drain_s=60, api_key=API_KEY)
    assert all(r.ok for r in recs)
    assert be.records and all(r.ok and r.service_class == "be" and r.output_tokens == 7 for r in be.records)
    assert be.output_tokens == 7 * be.completed


@pytest.mark.asyncio
async def test_cpu_seconds_of_the_server_and_its_workers(server):
    """bench's CPU reads: each process's seconds as psutil counts them, and grown by a run."""
    import psutil
    from tandem.bench.online import cpu_used, process_cpu
    from tests.server.test_process_stats import between
    before = process_cpu(server.url)
    recs, _ = await run_mixed(server.url, server.model, rt_items(3, 0.5), be_items(2), "tandem",
                              be_mode="online", be_concurrency=1, drain_s=60, api_key=API_KEY)
    assert all(r.ok for r in recs)
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    low = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    after = process_cpu(server.url)
    high = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    assert after["workers"] and set(after["workers"]) <= set(low)     # the server's own children
    # CPU time only grows: each read lies between psutil's counts just before and just after it
    for pid, cpu_read in [(server.proc.pid, after["server"]), *after["workers"].items()]:
        assert between(low[pid], cpu_read, high[pid])
    used = cpu_used(before, after)
    assert used["workers"] > 0 and used["server"] > 0 and used["client"] > 0
