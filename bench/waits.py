"""Why chats waited: the server's /status polled during a bench run, and the reasons its policy
gave each RT request that was still without its first token past its TTFT target.

A run's summary says how many chats missed their targets; this says what held them. Each poll
keeps, per device, the iteration time, the free blocks, the BE requests running and waiting,
and every listed RT request's state, tokens, age and the policy's last reason for it (the
reason of the plan before the poll: a waiting request was left out of that iteration for it).
``late_waits`` then counts, over the polls, the seconds late chats spent under each reason.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import aiohttp

from tandem.sched.actor import reason_kind

NO_REASON = "no plan yet"        # a request that arrived after the device's last plan


def compact(status: dict, t: float) -> dict:
    """The part of one /status answer the analysis reads, at ``t`` seconds into the run."""
    devices = []
    for d in status.get("devices", []):
        rt = [[r["id"], r["state"], r["generated"], r["prompt_tokens"], r["age_s"], r["level"], r["why"]]
              for r in d.get("requests", []) if r["class"] == "rt"]
        be = d.get("classes", {}).get("be", {})
        devices.append({"index": d["index"], "iteration_s": d.get("iteration_s"), "steps": d.get("steps"),
                        "free": d.get("pool", {}).get("free"), "be_running": be.get("running", 0),
                        "be_waiting": be.get("waiting", 0), "rt": rt})
    return {"t": round(t, 3), "devices": devices}


async def poll_status(s: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[dict],
                      every_s: float = 1.0) -> None:
    """Append ``compact`` snapshots of ``url``/status to ``out`` every ``every_s`` until ``stop``.
    A poll that fails (the server busy past the timeout) is skipped, not retried."""
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            async with s.get(url + "/status", timeout=aiohttp.ClientTimeout(total=every_s * 5)) as r:
                if r.status == 200:
                    out.append(compact(await r.json(), time.monotonic() - t0))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def late_waits(trace: list[dict], ttft_s: float) -> dict:
    """Over the snapshots of ``trace``: the RT requests seen without a first token more than
    ``ttft_s`` after they arrived, the longest such age seen, and for each reason the policy gave
    them then, how many of them got it and for how many seconds (each snapshot counts the time
    to the next one, the last the median gap). Beside it, what the device held meanwhile: mean
    iteration time, decoding chats, BE requests running, free blocks, over those snapshots."""
    times = [s["t"] for s in trace]
    gaps = [b - a for a, b in zip(times, times[1:])]
    last = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    seconds: Counter = Counter()
    chats: dict[str, set] = defaultdict(set)
    late: set = set()
    longest = 0.0
    beside: list[tuple[float, int, int, int]] = []
    for i, snap in enumerate(trace):
        dt = gaps[i] if i < len(gaps) else last
        for d in snap["devices"]:
            held = [r for r in d["rt"] if r[2] == 0 and r[4] > ttft_s]
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
                       "rt_decoding": mean(1), "be_running": mean(2), "free_blocks": mean(3)}}


def print_late_waits(rows: list[dict]) -> None:
    """For each row with a status trace: what held its late chats, longest reasons first."""
    traced = [r for r in rows if r.get("late_waits")]
    if not traced:
        return
    print("\nWhy chats waited past their TTFT target (seconds summed over the chats, from /status each second):")
    print("| system | rate (req/s) | late chats | longest s | iteration ms | decoding chats | BE running | "
          "reason (state: the policy's last word) | chats | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in traced:
        w, b = r["late_waits"], r["late_waits"]["beside"]
        head = (f"| {r['system']} | {r['rate']} | {w['chats']} | {w['longest_s']:.1f} | "
                + ("- | - | - " if not b["snapshots"] else
                   f"{b['iteration_ms']:.0f} | {b['rt_decoding']:.1f} | {b['be_running']:.1f} "))
        for i, x in enumerate(w["reasons"] or [{"why": "-", "chats": 0, "seconds": 0.0}]):
            lead = head if i == 0 else "| " * 7
            print(f"{lead}| {x['why']} | {x['chats']} | {x['seconds']:.1f} |")
