"""Multi-device placement at paper scale: Mell vs BF / WF / LB on simulated 80 GB devices.

The placement under test is ``sched.placement.place`` itself, called once per epoch (1 s) with
that epoch's arrivals, departures and grown KV sizes, exactly as the rebalancer calls it. What is
simulated is only time: every request decodes at a fixed time per token (``--tbt-ms``), its
prompt's KV is allocated on arrival, and it leaves after its output length. Devices are a
13B-class model (40 layers x 5120 wide, fp16 KV: 800 KiB per token) on 80 GB with 90% usable and
26 GB of weights, in 16-token blocks.

Traces: ShareGPT prompt and reply token lengths scaled x10 (as the Mell paper scales its chat
traces to long-context use), and a long-prompt trace (8k-48k-token prompts, replies x2).
Arrivals: Poisson at the paper's rates, and bursty (Gamma gaps, CV 3).

Per policy: peak and mean active devices, memory utilisation of the active devices, migrations
(and the KV bytes they move) and, for BF / WF, which cannot migrate, preemptions per second, most
item moves per operation.
Beside them the floor: in each epoch no placement can use fewer devices than the KV blocks in
use divided by a device's capacity, rounded up; its peak and mean bound every policy's.
A BF / WF preemption keeps its progress here (it is placed again at once), which flatters them.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.output import beside, save_json
from tandem.bench.plots import optional
from tandem.sched.placement import Cluster, Epoch, MoveKind, Placement, place

BLOCK_TOKENS = 16
KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2          # K and V, 40 layers, 5120 wide, fp16
DEVICE_BYTES = 80e9
WEIGHT_BYTES = 26e9
CAPACITY = int((0.9 * DEVICE_BYTES - WEIGHT_BYTES) // (BLOCK_TOKENS * KV_BYTES_PER_TOKEN))


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    prompt: int            # tokens
    output: int            # tokens


def lengths(kind: str, n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) token lengths: ShareGPT x10, or long prompts with ShareGPT replies x2."""
    from tandem.bench.sim_cli import _tokenizer
    from tandem.bench.workloads import chat_ids, iter_sharegpt
    tok = _tokenizer()
    pairs = []
    for p in iter_sharegpt():
        pairs.append((len(chat_ids(tok, p.prompt)), len(tok(p.reply, add_special_tokens=False)["input_ids"])))
        if len(pairs) >= 4 * n:
            break
    rng = random.Random(seed)
    picked = rng.sample(pairs, min(n, len(pairs)))
    max_tokens = CAPACITY * BLOCK_TOKENS
    if kind == "sharegpt":
        return [(min(10 * p, max_tokens // 2), min(10 * o, max_tokens // 2)) for p, o in picked]
    return [(rng.randint(8192, 49152), min(2 * o, 8192)) for _, o in picked]


def trace(kind: str, rate: float, duration_s: float, cv: float, seed: int) -> list[SimRequest]:
    from tandem.bench.workloads import arrivals
    n = max(1, round(rate * duration_s))
    times = arrivals(rate, n, seed, cv)
    return [SimRequest(t, p, o) for t, (p, o) in zip(times, lengths(kind, n, seed))]


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def simulate(reqs: list[SimRequest], policy: Placement, *, tbt_s: float, epoch_s: float = 1.0,
             capacity: int = CAPACITY) -> dict:
    """Replay ``reqs`` epoch by epoch through the placement; return the metrics and a timeline."""
    cl = Cluster(capacity)
    done: dict[str, int] = {}                      # live request -> tokens generated
    order = sorted(range(len(reqs)), key=lambda k: reqs[k].arrival_s)
    nxt, t, timeline = 0, 0.0, []
    migrations = preemptions = max_ops = moved_blocks = 0
    used_sum = active_sum = 0.0
    floor: list[int] = []
    per_epoch = epoch_s / tbt_s
    while nxt < len(order) or done:
        t += epoch_s
        arr = {}
        while nxt < len(order) and reqs[order[nxt]].arrival_s < t:
            k = order[nxt]
            arr[f"r{k}"] = blocks(reqs[k].prompt + 1)
            done[f"r{k}"] = 1
            nxt += 1
        gone, sizes = set(), {}
        for rid, n in list(done.items()):
            if rid in arr:
                continue
            r = reqs[int(rid[1:])]
            n = min(r.output, n + per_epoch)
            done[rid] = n
            if n >= r.output:
                gone.add(rid)
                del done[rid]
            elif blocks(r.prompt + int(n)) != cl.sizes[rid]:
                sizes[rid] = blocks(r.prompt + int(n))
        cl, dec = place(policy, cl, Epoch(arr, gone, sizes))
        migrated = [m.req_id for m in dec.moves if m.kind is MoveKind.MIGRATION]
        migrations += len(migrated)
        moved_blocks += sum(cl.sizes[r] for r in migrated)
        preemptions += sum(m.kind is MoveKind.PREEMPTION for m in dec.moves)
        max_ops = max([max_ops] + dec.item_moves)
        used = sum(cl.sizes.values())
        used_sum += used
        active_sum += len(cl.active)
        timeline.append(len(cl.active))
        floor.append(math.ceil(used / capacity))
    simulated_s = t                 # the trace's length in epochs of 1 s, not a clock
    return {"policy": policy.value, "peak_devices": max(timeline, default=0),
            "mean_devices": active_sum / max(1, len(timeline)),
            "memory_utilisation": used_sum / max(1.0, active_sum * capacity),
            "migrations_per_s": migrations / simulated_s, "preemptions_per_s": preemptions / simulated_s,
            "migrated_gb_per_s": moved_blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN / simulated_s / 1e9,
            "max_moves_per_op": max_ops, "simulated_s": simulated_s, "timeline": timeline, "floor": floor,
            "floor_peak": max(floor, default=0), "floor_mean": sum(floor) / max(1, len(floor))}


def run(args) -> None:
    print(f"device: {CAPACITY} blocks of {BLOCK_TOKENS} tokens ({CAPACITY * BLOCK_TOKENS} tokens of KV)")
    rows = []
    for kind in args.traces:
        for cv in args.cvs:
            for rate in (args.rates if kind == "sharegpt" else args.rates_long):
                reqs = trace(kind, rate, args.duration, cv, args.seed)
                for policy in args.policies:
                    t0 = time.perf_counter()
                    res = simulate(reqs, Placement(policy), tbt_s=args.tbt_ms / 1e3)
                    res.update(trace=kind, cv=cv, rate=rate, wall_s=round(time.perf_counter() - t0, 1))
                    rows.append(res)
                _print_group([r for r in rows if (r["trace"], r["cv"], r["rate"]) == (kind, cv, rate)])
    out = save_json(args.out, {"capacity_blocks": CAPACITY, "block_tokens": BLOCK_TOKENS, "tbt_ms": args.tbt_ms,
                               "duration_s": args.duration, "rows": rows})
    timeline(rows, beside(out, "timeline.png"))


def _print_group(rows: list[dict]) -> None:
    r0 = rows[0]
    base = {r["policy"]: r["peak_devices"] for r in rows}
    print(f"\n{r0['trace']}  cv={r0['cv']}  rate={r0['rate']} req/s  floor (KV in use / capacity): "
          f"peak {r0['floor_peak']}, mean {r0['floor_mean']:.1f}")
    print(f"{'policy':6} {'peak':>5} {'mean':>6} {'util':>6} {'migr/s':>7} {'GB/s':>6} {'preempt/s':>9} "
          f"{'moves/op':>8} {'peak/WF':>7} {'peak/BF':>7} {'peak/floor':>10}")
    for r in rows:
        print(f"{r['policy']:6} {r['peak_devices']:5d} {r['mean_devices']:6.1f} "
              f"{100 * r['memory_utilisation']:5.1f}% {r['migrations_per_s']:7.3f} {r['migrated_gb_per_s']:6.2f} "
              f"{r['preemptions_per_s']:9.3f} {r['max_moves_per_op']:8d} "
              f"{r['peak_devices'] / base.get('wf', math.nan):7.2f} {r['peak_devices'] / base.get('bf', math.nan):7.2f} "
              f"{r['peak_devices'] / max(1, r['floor_peak']):10.2f}")


@optional
def timeline(rows: list[dict], path: Path) -> None:
    """Active devices over time, per policy, for the highest-rate Poisson ShareGPT run."""
    from tandem.bench.plots import _plt, _save
    pick = [r for r in rows if r["trace"] == "sharegpt" and r["cv"] == 1.0]
    if not pick:
        return
    rate = max(r["rate"] for r in pick)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    mine = [r for r in pick if r["rate"] == rate]
    for r in mine:
        ax.plot(r["timeline"], label=r["policy"], linewidth=1)
    ax.plot(mine[0]["floor"], label="floor (KV / capacity)", color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("active devices")
    ax.set_title(f"ShareGPT x10, Poisson {rate} req/s, 80 GB devices, 13B-class KV")
    ax.legend()
    _save(fig, path)
