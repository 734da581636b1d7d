"""Do devices wait for each other? Two CPU devices (one thread each): device 0 gets a load of
long prompts, device 1 short chats; the short chats' time per output token is measured with
device 0 idle and with it busy, once with the device actors (each device steps on its own) and
once in lock-step (every step of every device waits for the slowest, as ``Scheduler.step``
drives them). With actors the short chats' TPOT should not move."""
from __future__ import annotations

import statistics
import threading
import time

from tandem.bench.output import save_json


def _requests(scheduler, prompts, max_tokens, tag):
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request
    now = time.monotonic()
    return [scheduler.new_state(Request(f"{tag}{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                         ignore_eos=True), arrival_time=now))
            for i, ids in enumerate(prompts)]


def _tpot(times: dict[str, list[float]]) -> float:
    """Median over requests of the mean gap between output tokens, ms."""
    per = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return 1e3 * statistics.median(per)


def run_actors(llm, chats, longs, max_tokens, busy: bool) -> float:
    runtime = llm.start_runtime()
    times: dict[str, list[float]] = {}
    done = threading.Event()
    short = _requests(llm.scheduler, chats, max_tokens, "s")
    load = _requests(llm.scheduler, longs, 4, "l") if busy else []
    left = [len(short)]

    def sink(ups):
        now = time.monotonic()
        for u in ups:
            if u.req_id.startswith("s"):
                times.setdefault(u.req_id, []).extend([now] * len(u.new_token_ids))
                if u.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
    llm.subscribe([st.req_id for st in short + load], sink)
    for st in load:
        runtime.add(st, device=0)
    for st in short:
        runtime.add(st, device=1)
    done.wait()
    while any(a.has_work() for a in llm.scheduler.actors):     # let the long load drain
        time.sleep(0.05)
    llm.unsubscribe([st.req_id for st in short + load])
    return _tpot(times)


def run_lockstep(llm, chats, longs, max_tokens, busy: bool) -> float:
    sched = llm.scheduler
    times: dict[str, list[float]] = {}
    for st in _requests(sched, longs, 4, "l") if busy else []:
        sched.actors[0].add(st)
    for st in _requests(sched, chats, max_tokens, "s"):
        sched.actors[1].add(st)
    while any(a.has_work() for a in sched.actors):
        ups = sched.step()
        now = time.monotonic()
        for u in ups:
            if u.req_id.startswith("s"):
                times.setdefault(u.req_id, []).extend([now] * len(u.new_token_ids))
    return _tpot(times)


def main(args) -> None:
    from tandem.bench.workloads import chat_ids, sharegpt_prompts
    from tandem import LLM
    rows = []
    for mode, fn in (("lock-step", run_lockstep), ("actors", run_actors)):
        with LLM("smollm2", "cpu:2", threads_per_worker=1, max_num_batched_tokens=args.long_tokens) as llm:
            tok = llm.tokenizer
            chats = [chat_ids(tok, p.prompt) for p in sharegpt_prompts(args.chats, tok, max_prompt_tokens=128)]
            longs = [chat_ids(tok, p.prompt) for p in sharegpt_prompts(args.longs, tok, min_prompt_tokens=300,
                                                                          max_prompt_tokens=args.long_tokens)]
            idle = fn(llm, chats, longs, args.max_tokens, busy=False)
            busy = fn(llm, chats, longs, args.max_tokens, busy=True)
        rows.append({"mode": mode, "tpot_idle_ms": idle, "tpot_busy_ms": busy, "ratio": busy / idle})
        print(f"  {mode}: short chats' TPOT {idle:.1f} ms with device 0 idle, {busy:.1f} ms with it busy",
              flush=True)
    print(f"\n{args.chats} short chats x {args.max_tokens} tokens on device 1; {len(longs)} long prompts "
          f"(300-{args.long_tokens} tokens, one prefill chunk a step) on device 0; cpu:2, one thread each")
    print("\n| mode | short chats' TPOT, device 0 idle | device 0 busy | busy / idle |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tpot_idle_ms']:.1f} ms | {r['tpot_busy_ms']:.1f} ms | {r['ratio']:.2f}x |")
    save_json(args.out, rows)
