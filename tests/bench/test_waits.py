"""Why chats waited (bench/waits.py): the reasons counted over a hand-written trace against a
count by hand, and the poller against a real server, where the chats it saw late must be the
ones a streaming client saw get their first token late.

The hand-written traces read no clock: their times ("t"), ages and the seconds counted from
them are the traces' own numbers, so those assertions are arithmetic, not timing. The real
server's test compares the poller's view with the client's, never with a fixed duration."""
import asyncio
import json
import time

import aiohttp
import pytest

from tandem.bench.waits import NO_REASON, compact, late_waits, poll_status
from tandem.server.metrics import STATUS_EVERY_S
from tests.server.conftest import start_server, stop_server

DUE = "waiting: chats whose next token is due take this iteration's time"
NO_BLOCK = "waiting: no block can be found or preempted"


def device(rt, iteration_s=0.1, free=7, be_running=2):
    return {"index": 0, "iteration_s": iteration_s, "steps": 1, "free": free, "be_running": be_running,
            "be_waiting": 0, "rt": rt}


def counters(steps, rt_prefill, be_prefill, rt_decode, be_decode):
    return {"steps": steps, "tokens_rt_prefill": rt_prefill, "tokens_be_prefill": be_prefill,
            "tokens_rt_decode": rt_decode, "tokens_be_decode": be_decode}


def test_reasons_are_counted_in_seconds_over_the_late_chats():
    # [id, state, generated, prompt tokens, age s, level, why]
    trace = [
        {"t": 0.0, "devices": [device([["a", "waiting", 0, 9, 0.5, 1, None],           # not late yet
                                       ["b", "waiting", 0, 9, 1.5, 2, DUE + " (level 2, RT)"],
                                       ["c", "running", 3, 9, 4.0, 0, "scheduled (RT)"]], 0.1, 7, 2)],
         "counters": counters(10, 0, 100, 0, 0)},
        {"t": 1.0, "devices": [device([["a", "waiting", 0, 9, 1.5, 1, None],
                                       ["b", "running", 0, 9, 2.5, 2, "scheduled (RT)"],
                                       ["c", "running", 4, 9, 5.0, 0, "scheduled (RT)"]], 0.3, 5, 0)],
         "counters": counters(14, 40, 120, 5, 1)},
        {"t": 3.0, "devices": [device([["a", "waiting", 0, 9, 3.5, 1, NO_BLOCK],
                                       ["b", "running", 1, 9, 4.5, 2, "scheduled (RT)"]], 0.2, 3, 1)],
         "counters": counters(20, 40, 220, 17, 3)},
        {"t": 4.0, "devices": [device([["b", "running", 2, 9, 5.5, 2, "scheduled (RT)"]])],   # nobody late
         "counters": counters(25, 90, 220, 22, 3)},
        {"t": 5.0, "devices": [device([["b", "running", 3, 9, 6.5, 2, "scheduled (RT)"]])],
         "counters": counters(40, 90, 1000, 30, 10)},
    ]
    w = late_waits(trace, ttft_s=1.0)
    assert w["chats"] == 2 and w["longest_s"] == 3.5
    # b: 1 s under DUE (t 0 -> 1), 2 s scheduled (t 1 -> 3); a: 2 s with no reason, 1 s without a block
    assert w["reasons"] == [{"why": f"waiting: {NO_REASON}", "chats": 1, "seconds": 2.0},
                            {"why": "running: scheduled (RT)", "chats": 1, "seconds": 2.0},
                            {"why": "waiting: " + DUE, "chats": 1, "seconds": 1.0},
                            {"why": "waiting: " + NO_BLOCK, "chats": 1, "seconds": 1.0}]
    b = w["beside"]
    assert b["snapshots"] == 3
    assert b["iteration_ms"] == pytest.approx(200.0)          # (0.1 + 0.3 + 0.2) / 3
    assert b["rt_decoding"] == pytest.approx(1.0)             # c, c, b
    assert b["be_running"] == pytest.approx(1.0) and b["free_blocks"] == pytest.approx(5.0)
    # the steps from t 0 to t 4 (each interval starts with a late chat; t 4 -> 5 does not):
    # 15 steps, 90 RT and 120 BE prompt tokens, 22 RT and 3 BE decodes
    assert w["steps"] == {"steps": 15, "rt_prefill_per_step": 6.0, "be_prefill_per_step": 8.0,
                          "rt_decodes_per_step": pytest.approx(22 / 15), "be_decodes_per_step": 0.2}


def test_nobody_late_gives_no_reasons():
    trace = [{"t": 0.0, "devices": [device([["a", "waiting", 0, 9, 0.2, 1, DUE]])]}]
    w = late_waits(trace, ttft_s=1.0)
    assert w == {"chats": 0, "longest_s": 0.0, "reasons": [],
                 "beside": {"snapshots": 0, "iteration_ms": None, "rt_decoding": None, "be_running": None,
                            "free_blocks": None},
                 "steps": {"steps": 0.0, "rt_prefill_per_step": None, "be_prefill_per_step": None,
                           "rt_decodes_per_step": None, "be_decodes_per_step": None}}


async def _stream(s: aiohttp.ClientSession, url: str, model: str, n: int, out: dict) -> None:
    """One streaming completion; ``out`` gets its request id and the seconds to its first token
    (token ids: a token whose text is empty still counts)."""
    body = {"model": model, "prompt": f"Count to {n}", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.monotonic()
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            msg = json.loads(line[6:])
            out.setdefault("id", msg["id"])
            if any(c.get("text") or c.get("token_ids") for c in msg["choices"]):
                out.setdefault("ttft", time.monotonic() - t0)


async def _drive(server, every_s: float, lengths: list[int]) -> tuple[list[dict], list[dict]]:
    trace, chats, stop = [], [{} for _ in lengths], asyncio.Event()
    async with aiohttp.ClientSession(headers=server.headers()) as s:
        await _stream(s, server.url, server.model, 2, {})          # the first step's set-up out of the way
        poller = asyncio.create_task(poll_status(s, server.url, stop, trace, every_s=every_s))
        await asyncio.gather(*(_stream(s, server.url, server.model, n, c) for n, c in zip(lengths, chats)))
        stop.set()
        await poller
    return trace, chats


def test_the_poller_sees_late_the_chats_a_client_saw_late(tiny_chat_model, tmp_path):
    """FCFS with one request at a time: the chats queue behind each other, each for a whole
    reply. Every chat the poller counts late got its first token after the target at the
    client, and every chat that got it later than the target plus the status's refresh time
    and a poll was counted (the server's id is the response's id with the choice's index)."""
    target, every = 0.05, 0.05          # a short target: queueing alone makes chats late
    server = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs", "--max-num-seqs", "1",
                          "--slo-ttft-ms", str(target * 1e3))
    try:
        trace, chats = asyncio.run(_drive(server, every, [300] * 4))
    finally:
        assert stop_server(server) == 0
    assert len(trace) > 10
    w = late_waits(trace, ttft_s=target)
    seen = {rid for x in w["reasons"] for rid in _ids(trace, target, x["why"])}
    late = {c["id"] + "-0" for c in chats if c["ttft"] > target + STATUS_EVERY_S + 2 * every}
    on_time = {c["id"] + "-0" for c in chats if c["ttft"] <= target}
    assert len(late) >= 2, [c["ttft"] for c in chats]        # the queue made chats late
    assert late <= seen and not seen & on_time
    assert w["chats"] == len(seen)
    assert max(c["ttft"] for c in chats) >= w["longest_s"] > target
    assert any(x["why"].startswith("waiting: ") and x["chats"] >= 2 for x in w["reasons"]), w["reasons"]
    # the server's step counters: steps ran while chats were late, prompts computed, no BE work
    st = w["steps"]
    assert st["steps"] > 0 and st["rt_prefill_per_step"] > 0 and st["be_prefill_per_step"] == 0
    # the last poll comes after the run: the warm-up's one decode and 299 of each chat, counted
    assert trace[-1]["counters"]["tokens_rt_decode"] == 1 + 4 * 299


def _ids(trace: list[dict], ttft_s: float, key: str) -> set[str]:
    """The ids the trace holds under ``key`` (state: reason) while late, found independently of
    late_waits' own bookkeeping."""
    state, why = key.split(": ", 1)
    return {r[0] for snap in trace for d in snap["devices"] for r in d["rt"]
            if r[2] == 0 and r[4] > ttft_s and r[1] == state and (r[6] or NO_REASON).startswith(why)}


def test_compact_keeps_what_the_analysis_reads():
    status = {"devices": [{"index": 1, "iteration_s": 0.12, "steps": 40, "pool": {"free": 9, "total": 20},
                           "classes": {"rt": {"running": 1, "waiting": 1, "blocks": 3},
                                       "be": {"running": 2, "waiting": 5, "blocks": 8}},
                           "requests": [{"id": "x-0", "class": "rt", "state": "waiting", "generated": 0,
                                         "prompt_tokens": 30, "age_s": 2.0, "level": 3, "why": DUE},
                                        {"id": "y-0", "class": "be", "state": "running", "generated": 4,
                                         "prompt_tokens": 50, "age_s": 9.0, "level": 5, "why": "scheduled (BE)"}]}]}
    assert compact(status, 1.23456) == {"t": 1.235, "devices": [
        {"index": 1, "iteration_s": 0.12, "steps": 40, "free": 9, "be_running": 2, "be_waiting": 5,
         "rt": [["x-0", "waiting", 0, 30, 2.0, 3, DUE]]}]}
    with_counters = compact(status, 1.0, {"steps": 7.0, "tokens_rt_prefill": 30.0, "preemptions": 2.0})
    assert with_counters["counters"] == counters(7.0, 30.0, 0.0, 0.0, 0.0)
