"""Two devices, one placement each run: what migrations buy when request sizes diverge.

The trace: ShareGPT prompts at ``rate`` req/s (Poisson), each one either long (``--long``
output tokens, a ``--long-share`` of them) or short (``--short``), EOS ignored, so the devices'
memory use drifts apart as the long ones grow. Small pools (``--pool-tokens`` per device) make
that drift matter. Per placement: preemptions (caches discarded), TTFT and its attainment,
TPOT, migrations by kind and the pause each saw.

The second table (``--sweep``) measures the pause of one migration against the request's size:
a request with a prompt of n tokens is moved to the other device after its second token, once
as its cache (KV) and once as its tokens, with both devices otherwise idle.

    python -m bench skew [--placements static lb mell] [--rate 1.2] [--duration 60]

Two CPU workers by default. ``--devices cuda:0,0 --model smollm2-random`` runs the same between
two workers sharing one GPU, the cache going through CUDA IPC handles; where the ShareGPT
dataset is not installed, the prompts are random ids of its shipped prompt lengths.
``--placements`` with no value runs the sweep alone.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time

from tandem.bench.metrics import percentile
from tandem.bench.output import save_json


def _llm(placement: str, pool_tokens: int, interval: float, slo_tbt_s: float, model: str, devices: str):
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR, LLM
    spec = load_spec(resolve_model(model, DEFAULT_CACHE_DIR))
    block = 16
    dtype = "float32" if devices.startswith("cpu") else "bfloat16"
    pool_bytes = (pool_tokens // block) * 2 * spec.num_layers * block * spec.unit * (4 if dtype == "float32" else 2)
    return LLM(model, devices, dtype=dtype, threads_per_worker=1, kv_cache_bytes=pool_bytes,
               max_num_batched_tokens=256, placement=placement, rebalance_interval_s=interval,
               slo_tbt_s=slo_tbt_s)


def trace(tokenizer, n: int, rate: float, seed: int, long_share: float, long: int, short: int,
          vocab_size: int = 0):
    """n (arrival, prompt ids, output tokens). Without a tokenizer (a random-weight model where
    the dataset is not installed): random ids of the shipped ShareGPT prompt lengths that fit."""
    from tandem.bench.workloads import LENGTHS_FILE, arrivals, chat_ids, sharegpt_prompts
    rng = random.Random(seed)
    if tokenizer is None:
        ids = random.Random(seed + 1)
        fit = [p for p, _ in json.loads(LENGTHS_FILE.read_text())["prompt_reply_tokens"] if 4 <= p <= 256]
        prompts = [[ids.randrange(3, vocab_size) for _ in range(fit[i % len(fit)])] for i in range(n)]
    else:
        prompts = [chat_ids(tokenizer, p.prompt) for p in sharegpt_prompts(n, tokenizer, max_prompt_tokens=256)]
    return [(t, p, long if rng.random() < long_share else short) for t, p in zip(arrivals(rate, n, seed), prompts)]


def run_trace(llm, items, drain_s: float) -> dict:
    """Submit at the trace's times; token times per request; the devices' counters after."""
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request
    rt = llm.start_runtime()
    times: dict[str, list[float]] = {}
    arrival: dict[str, float] = {}
    left, errors = [len(items)], []
    done = threading.Event()

    def sink(ups):
        now = time.monotonic()
        for u in ups:
            times.setdefault(u.req_id, []).extend([now] * len(u.new_token_ids))
            if u.finish_reason is not None:
                left[0] -= 1
                if u.error:
                    errors.append(u.error)
                if left[0] == 0:
                    done.set()
    ids = [f"s{i}" for i in range(len(items))]
    llm.subscribe(ids, sink)
    t0 = time.monotonic()
    for rid, (at, prompt, out) in zip(ids, items):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        now = time.monotonic()
        arrival[rid] = now
        st = llm.scheduler.new_state(Request(rid, prompt, SamplingParams(max_tokens=out, temperature=0,
                                                                          ignore_eos=True), arrival_time=now))
        rt.add(st)
    done.wait(timeout=drain_s)
    llm.unsubscribe(ids)
    acts = llm.scheduler.actors
    moves = [m for a in acts for m in a.moves]
    return {"times": times, "arrival": arrival, "unfinished": left[0], "errors": len(errors),
            "preemptions": sum(a.num_preemptions for a in acts),
            "moves": [{"kind": m.kind.value, "tokens": m.tokens, "bytes": m.cache_bytes,
                       "pause_s": m.pause_s, "reason": m.reason} for m in moves],
            "deferred": llm.rebalancer.deferred_total if llm.rebalancer else 0,
            "max_active": llm.rebalancer.max_active if llm.rebalancer else len(acts)}


def summarize(placement: str, res: dict, ttft_slo: float) -> dict:
    ttfts = [ts[0] - res["arrival"][r] for r, ts in res["times"].items() if ts]
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in res["times"].values() if len(ts) > 1]
    n = len(res["arrival"])
    row = {"placement": placement, "requests": n, "unfinished": res["unfinished"], "errors": res["errors"],
           "preemptions": res["preemptions"],
           "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
           "ttft_attainment": sum(t <= ttft_slo for t in ttfts) / max(1, n),
           "tpot_p50": percentile(tpots, 50), "deferred": res["deferred"]}
    for kind in ("kv", "token"):
        ms = [m for m in res["moves"] if m["kind"] == kind]
        row[f"{kind}_moves"] = len(ms)
        row[f"{kind}_pause_p50"] = percentile([m["pause_s"] for m in ms], 50) if ms else None
    return row


def sweep(sizes: list[int], model: str = "smollm2", devices: str = "cpu:2") -> list[dict]:
    """Pause of one forced migration per kind against the request's context length."""
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request, Transfer
    llm = _llm("static", max(sizes) * 2 + 256, 1.0, 0.2, model, devices)
    rng = random.Random(0)
    rows = []
    try:
        rt = llm.start_runtime()
        for n in sizes:
            for kind in (Transfer.KV, Transfer.TOKEN):
                for rep in range(3):
                    rid = f"w{n}-{kind.value}-{rep}"
                    prompt = [rng.randrange(100, 40000) for _ in range(n)]
                    st = llm.scheduler.new_state(Request(rid, prompt, SamplingParams(
                        max_tokens=6, temperature=0, ignore_eos=True), arrival_time=time.monotonic()))
                    done = threading.Event()

                    def sink(ups, rid=rid, kind=kind, st=st, done=done):
                        for u in ups:
                            if u.new_token_ids and len(st.output_token_ids) == 2:
                                rt.migrate(rid, 0, 1, kind, "sweep")
                            if u.finish_reason is not None:
                                done.set()
                    llm.subscribe([rid], sink)
                    rt.add(st, device=0)
                    done.wait(120)
                    llm.unsubscribe([rid])
                m = [m for m in llm.scheduler.actors[1].moves if m.reason == "sweep" and m.kind is kind
                     and m.tokens >= n]
                if not m:
                    raise RuntimeError(f"no {n}-token request moved as {kind.value} (the log says why)")
                pauses = [x.pause_s for x in m[-3:]]
                rows.append({"tokens": n, "kind": kind.value, "pause_ms": 1e3 * statistics.median(pauses),
                             "bytes": m[-1].cache_bytes})
                print(f"  {n:5d} tokens  {kind.value:5s}  pause {rows[-1]['pause_ms']:7.1f} ms"
                      f"  {rows[-1]['bytes'] / 2**20:6.1f} MiB", flush=True)
    finally:
        llm.shutdown()
    return rows


def main(args) -> None:
    from tandem.bench.online import _no_dataset
    from tandem.engine.models.loader import load_spec, load_tokenizer, resolve_model
    from tandem.engine.models.paper import CONFIGS
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    rows, items = [], []
    if args.placements:
        hf_dir = resolve_model(args.model, DEFAULT_CACHE_DIR)
        tok = None if args.model in CONFIGS and _no_dataset() else load_tokenizer(hf_dir)
        n = max(1, round(args.rate * args.duration))
        items = trace(tok, n, args.rate, args.seed, args.long_share, args.long, args.short,
                      load_spec(hf_dir).vocab_size)
    for placement in args.placements:
        llm = _llm(placement, args.pool_tokens, args.interval, args.slo_tbt_ms / 1000, args.model, args.devices)
        try:
            res = run_trace(llm, items, args.duration + args.drain)
        finally:
            llm.shutdown()
        rows.append(summarize(placement, res, args.slo_ttft_ms / 1000))
        rows[-1]["moves"] = res["moves"]
        print_row(rows[-1])
    table = sweep(args.sweep, args.model, args.devices) if args.sweep else []
    save_json(args.out, {"args": vars(args), "rows": rows, "sweep": table})


def print_row(r: dict) -> None:
    def ms(v):
        return "-" if v is None else f"{1e3 * v:.0f}"
    print(f"{r['placement']:7s} req {r['requests']:3d} left {r['unfinished']:2d} errors {r['errors']}  preempt {r['preemptions']:4d}  "
          f"TTFT p50/p90 {ms(r['ttft_p50'])}/{ms(r['ttft_p90'])} ms  attain {100 * r['ttft_attainment']:5.1f}%  "
          f"TPOT p50 {ms(r['tpot_p50'])} ms  moves kv {r['kv_moves']} ({ms(r['kv_pause_p50'])} ms) "
          f"token {r['token_moves']} ({ms(r['token_pause_p50'])} ms)  deferred {r['deferred']}", flush=True)
