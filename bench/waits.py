"""Why chats waited: the server's /status polled during a bench run, and the reasons its policy
gave each RT request that was still without its first token past its TTFT target.

A run's summary says how many chats missed their targets; this says what held them. Each poll
keeps, per device, the iteration time, the free blocks, the BE requests running and waiting,
and every listed RT request's state, tokens, age and the policy's last reason for it (the
reason of the plan before the poll: a waiting request was left out of that iteration for it),
and the server's step counters from /metrics (steps, tokens by class and phase). ``late_waits``
then counts, over the polls, the seconds late chats spent under each reason, and what the
steps computed meanwhile.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import aiohttp

from tandem.bench.online import counters_of
from tandem.sched.actor import reason_kind

NO_REASON = "no plan yet"        # a request that arrived after the device's last plan
COUNTERS = ("steps", "tokens_rt_prefill", "tokens_be_prefill", "tokens_rt_decode", "tokens_be_decode")


def compact(status: dict, t: float, counters: dict[str, float] | None = None) -> dict:
    """The part of one /status answer the analysis reads, at ``t`` seconds into the run, with the
    step counters of /metrics (``counters_of``) read right after it."""
    devices = []
    for d in status.get("devices", []):
        rt = [[r["id"], r["state"], r["generated"], r["prompt_tokens"], r["age_s"], r["level"], r["why"]]
              for r in d.get("requests", []) if r["class"] == "rt"]
        be = d.get("classes", {}).get("be", {})
        devices.append({"index": d["index"], "iteration_s": d.get("iteration_s"), "steps": d.get("steps"),
                        "free": d.get("pool", {}).get("free"), "be_running": be.get("running", 0),
                        "be_waiting": be.get("waiting", 0), "rt": rt})
    out = {"t": round(t, 3), "devices": devices}
    if counters is not None:
        out["counters"] = {k: counters.get(k, 0.0) for k in COUNTERS}
    return out


async def poll_status(s: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[dict],
                      every_s: float = 1.0) -> None:
    """Append ``compact`` snapshots of ``url``/status and /metrics to ``out`` every ``every_s``
    until ``stop``, and one more then (the run's end). A poll that fails (the server busy past the
    timeout) is skipped, not retried."""
    t0 = time.monotonic()
    limit = aiohttp.ClientTimeout(total=every_s * 5)
    last = False
    while not last:
        last = stop.is_set()
        try:
            async with s.get(url + "/status", timeout=limit) as r:
                status = await r.json() if r.status == 200 else None
            t = time.monotonic() - t0
            async with s.get(url + "/metrics", timeout=limit) as r:
                counters = counters_of(await r.text()) if r.status == 200 else None
            if status is not None:
                out.append(compact(status, t, counters))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if not last:
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass


def late_waits(trace: list[dict], ttft_s: float) -> dict:
    """Over the snapshots of ``trace``: the RT requests seen without a first token more than
    ``ttft_s`` after they arrived, the longest such age seen, and for each reason the policy gave
    them then, how many of them got it and for how many seconds (each snapshot counts the time
    to the next one, the last the median gap). Beside it, what the device held meanwhile: mean
    iteration time, decoding chats, BE requests running, free blocks, over those snapshots; and,
    from the step counters, the steps run from each such snapshot to the next and the prompt
    tokens per step they computed for each class (None without counters)."""
    times = [s["t"] for s in trace]
    gaps = [b - a for a, b in zip(times, times[1:])]
    last = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    seconds: Counter = Counter()
    chats: dict[str, set] = defaultdict(set)
    late: set = set()
    longest = 0.0
    beside: list[tuple[float, int, int, int]] = []
    ran: Counter = Counter()            # counters' growth over the intervals that start with a late chat
    for i, snap in enumerate(trace):
        dt = gaps[i] if i < len(gaps) else last
        helds = [(d, [r for r in d["rt"] if r[2] == 0 and r[4] > ttft_s]) for d in snap["devices"]]
        if i + 1 < len(trace) and "counters" in snap and "counters" in trace[i + 1] and any(h for _, h in helds):
            ran.update({k: trace[i + 1]["counters"][k] - snap["counters"][k] for k in COUNTERS})
        for d, held in helds:
            if not held:
                continue
            decoding = sum(1 for r in d["rt"] if r[2] > 0)
            beside.append((d["iteration_s"] or 0.0, decoding, d["be_running"], d["free"] or 0))
            for rid, state, _, _, age, _, why in held:
                key = f"{state}: {reason_kind(why)}" if why else f"{state}: {NO_REASON}"
                seconds[key] += dt
                chats[key].add((d["index"], rid))
                late.add((d["index"], rid))
                longest = max(longest, age)
    n = len(beside)
    mean = (lambda k: sum(b[k] for b in beside) / n) if n else (lambda k: None)
    return {"chats": len(late), "longest_s": longest,
            "reasons": [{"why": k, "chats": len(chats[k]), "seconds": round(v, 3)} for k, v in seconds.most_common()],
            "beside": {"snapshots": n, "iteration_ms": None if not n else mean(0) * 1e3,
                       "rt_decoding": mean(1), "be_running": mean(2), "free_blocks": mean(3)},
            "steps": _per_step(ran)}


def _per_step(ran: Counter) -> dict:
    """Steps counted and prompt tokens per step by class, from the counters' growth."""
    steps = ran.get("steps", 0.0)
    per = (lambda k: ran[k] / steps) if steps else (lambda k: None)
    return {"steps": steps, "rt_prefill_per_step": per("tokens_rt_prefill"),
            "be_prefill_per_step": per("tokens_be_prefill"), "rt_decodes_per_step": per("tokens_rt_decode"),
            "be_decodes_per_step": per("tokens_be_decode")}


def print_late_waits(rows: list[dict]) -> None:
    """For each row with a status trace: what held its late chats, longest reasons first."""
    traced = [r for r in rows if r.get("late_waits")]
    if not traced:
        return
    print("\nWhy chats waited past their TTFT target (seconds summed over the chats, from /status each second):")
    print("| system | rate (req/s) | late chats | longest s | iteration ms | decoding chats | BE running | "
          "prompt tokens / step (RT / BE) | reason (state: the policy's last word) | chats | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in traced:
        w, b, st = r["late_waits"], r["late_waits"]["beside"], r["late_waits"].get("steps") or {}
        head = (f"| {r['system']} | {r['rate']} | {w['chats']} | {w['longest_s']:.1f} | "
                + ("- | - | - " if not b["snapshots"] else
                   f"{b['iteration_ms']:.0f} | {b['rt_decoding']:.1f} | {b['be_running']:.1f} ")
                + ("| - " if st.get("rt_prefill_per_step") is None else
                   f"| {st['rt_prefill_per_step']:.1f} / {st['be_prefill_per_step']:.1f} "))
        for i, x in enumerate(w["reasons"] or [{"why": "-", "chats": 0, "seconds": 0.0}]):
            lead = head if i == 0 else "| " * 8
            print(f"{lead}| {x['why']} | {x['chats']} | {x['seconds']:.1f} |")
