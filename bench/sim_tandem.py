"""python -m bench sim-tandem: the tandem policy against each single policy, and its ablations,
at paper scale in the simulator.

OPT-13B-like cost model on one A100-40GB with its 12k-token pool, which can also hold hidden
caches (multi-head attention: half a KV cache; the device charges OPT_13B_A100_RHO per KV block
a hidden request re-projects). Swaps are priced at 25 GB/s over the bytes the host pool counts
(int8 where compressed), with 64 GiB of host memory; as the engine runs them on a GPU, a swap-out
is copied on a side link beside the steps that follow, and a swap-in waits for the link, then
copies before its step's forward. RT: held-out ShareGPT prompts, each forced
to its real reply length, Poisson arrivals, the mixed bench's SLOs (10x / 5x the unloaded TTFT /
TBT); BE: batch jobs of synthetic 512-1024 / 32-128 requests always pending (the next job when
one completes), as in ``bench sim-mixed``. Predicted lengths come from predictor/ (frozen during
the run) for the RT prompts; the BE prompts are random tokens, so their lengths are unknown to
every policy.

``--preset fitted`` runs the same at this CPU's scale instead: SmolLM2 (grouped-query
attention: a hidden cache would be larger than KV, so none is kept) with the cost model
``python -m bench profile`` fitted on the real engine (each step drawing one of the measured /
predicted step-time ratios, so steps spread as the engine's do), the server's default 2 GiB
pool, and swaps at an assumed host-copy speed, within the step (a CPU worker quantizes and
copies before its forward). There a decode step costs compute for every token in it, and a TBT
target is a few iterations long, as on the real engine.

Each system is compared on the metrics of the policy that owns them: RT attainment of TTFT and
TPOT (BROS), effective throughput = the highest rate with 90% of RT requests meeting TTFT and
their P99 TBT (Apt-Serve), mean RT normalized latency (ALISE), BE requests/s (FCFS).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from tandem.bench.metrics import attainment, meets_apt, meets_bros, summarize
from tandem.bench.sim_alise import OPT_13B_BLOCK_BYTES, capacity, predict_all, with_lengths
from tandem.bench.sim_cli import (RESULTS, SMOLLM2_BLOCK_BYTES, SMOLLM2_POOL_TOKENS, _tokenizer, known_systems,
                                   load_fitted, slos)
from tandem.bench.simulator import BeJobs, SimSetup, simulate
from tandem.bench.workloads import sharegpt_trace, synthetic_be
from tandem.cache import PoolGeometry
from tandem.sched.cost_model import OPT_13B_A100, OPT_13B_A100_KV_TOKENS, OPT_13B_A100_RHO, CostModel
from tandem.sched.scheduler import SchedConfig
from tandem.sched.tandem import STARTED

# name -> (SchedConfig fields, where RT lengths come from)
SYSTEMS = {
    "fcfs": (dict(policy="fcfs"), None),
    "bros": (dict(policy="bros"), None),
    "bros-bidir": (dict(policy="bros", bidirectional=True), None),
    "aptserve": (dict(policy="aptserve", mixed_batches=True), None),     # Apt-Serve-S: chunked, as the rest
    "alise": (dict(policy="alise"), "predictor"),
    "tandem": (dict(policy="tandem"), "predictor"),
    "tandem-no-slo": (dict(policy="tandem", tandem_off=("slo",)), "predictor"),
    "tandem-no-lengths": (dict(policy="tandem", tandem_off=("lengths",)), None),
    "tandem-no-predictor": (dict(policy="tandem"), None),     # what a server without a trained predictor runs
    "tandem-no-hidden": (dict(policy="tandem", hybrid_cache=False), "predictor"),
    "tandem-no-late": (dict(policy="tandem", tandem_off=("late",)), "predictor"),
    "tandem-no-overdue": (dict(policy="tandem", tandem_off=("overdue",)), "predictor"),
    "tandem-recompute": (dict(policy="tandem", preemption_mode="recompute"), "predictor"),
    "tandem-bidir": (dict(policy="tandem", bidirectional=True), "predictor"),
    "tandem-oracle": (dict(policy="tandem"), "oracle"),
    "tandem-tpot": (dict(policy="tandem", mean_tbt=True), "predictor"),
}
SINGLE = ("fcfs", "bros", "bros-bidir", "aptserve", "alise")
# metric -> (row key, higher is better, the single policy that owns it)
METRICS = {"RT TTFT & TPOT": ("attain_bros", True, "bros"),
           "RT mean norm. latency ms/tok": ("norm_latency_ms", False, "alise"),
           "BE req/s": ("be_rps", True, "fcfs")}


@dataclass(frozen=True)
class Device:
    """What the simulated device is: its cost model, its pool and how a swap is priced."""
    cost: CostModel
    kv_tokens: int
    hidden_blocks: int          # pool blocks per 16 tokens of a hidden cache (KV takes 2)
    rho: float                  # a hidden cache's recompute per KV block
    block_bytes: tuple[int, int]
    host_bw: float              # bytes/s of a swap
    noise: tuple[float, ...] = ()           # measured / predicted step times, one drawn per step
    noise_prefill: tuple[float, ...] = ()   # the same for steps with prefill work
    side_link: bool = False     # swap-outs copied beside the steps (a GPU worker's side stream); else serial


# [open choice] a swap on a CPU device is a copy within host memory: 5 GB/s assumed, not measured (with the
# default pool nothing was swapped in the runs bench/README.md reports)
CPU_COPY_BW = 5e9


def device(args) -> Device:
    """The device ``--preset`` names, with ``--kv-tokens``, ``--host-gbps`` and ``--slower`` where given."""
    if args.preset == "fitted":
        cost, ratios, ratios_prefill = load_fitted(args.fitted)
        dev = Device(cost, args.kv_tokens or SMOLLM2_POOL_TOKENS, 3, 0.0, SMOLLM2_BLOCK_BYTES,
                     args.host_gbps * 1e9 if args.host_gbps is not None else CPU_COPY_BW, ratios, ratios_prefill)
    else:
        dev = Device(OPT_13B_A100, args.kv_tokens or OPT_13B_A100_KV_TOKENS, 1, OPT_13B_A100_RHO,
                     OPT_13B_BLOCK_BYTES, (args.host_gbps if args.host_gbps is not None else 25.0) * 1e9,
                     side_link=True)
    return slowed(dev, getattr(args, "slower", 1.0))


def slowed(dev: Device, factor: float) -> Device:
    """``dev`` with every step ``factor`` times as long as its cost model says (a machine slower
    than when its profile ran); the policies still plan with the cost model and learn the overrun
    only from the steps they see, as the server's do."""
    if factor == 1.0:
        return dev
    return replace(dev, noise=tuple(x * factor for x in dev.noise or (1.0,)),
                   noise_prefill=tuple(x * factor for x in dev.noise_prefill))


def _setup(system: str, args, dev: Device, ttft: float, tbt: float) -> SimSetup:
    fields, _ = SYSTEMS[system]
    if fields["policy"] == "tandem":
        fields = fields | {"late_after": args.late_after}
    cfg = SchedConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, rho=dev.rho,
                      swap_space_bytes=int(args.swap_gib * 2**30), **fields)
    return SimSetup(dev.cost, PoolGeometry(2 * dev.kv_tokens // 16, 16, hidden_blocks=dev.hidden_blocks), cfg,
                    2048, slo_ttft_s=ttft, slo_tbt_s=tbt, rho=dev.rho, block_bytes=dev.block_bytes,
                    host_bw=dev.host_bw, seed=args.seed, noise=dev.noise, noise_prefill=dev.noise_prefill,
                    side_link=dev.side_link)


def run_one(system: str, rate: float, trace, be_items, args, dev: Device, ttft: float, tbt: float) -> dict:
    be = BeJobs(be_items, args.be_job_size)
    stats: dict = {}
    recs, makespan = simulate(trace, _setup(system, args, dev, ttft, tbt), be, stats=stats)
    s = summarize(recs, makespan)["rt"]
    return {"system": system, "rate": rate, "requests": len(recs), "makespan_s": makespan,
            "attain_bros": attainment(recs, lambda r: meets_bros(r, ttft, tbt)),
            "attain_apt": attainment(recs, lambda r: meets_apt(r, ttft, tbt)),
            "norm_latency_ms": s["normalized_latency_mean_s"] * 1e3,
            "ttft_p99_ms": s["ttft_s"].get(99, math.nan) * 1e3,
            "ttft_max_ms": max((r.ttft for r in recs if r.ok), default=math.nan) * 1e3,
            "gap_max_ms": max((g for r in recs if r.ok and r.service_class == "rt" for g in r.gaps),
                              default=math.nan) * 1e3,
            "be_rps": be.completed / makespan, "be_tok_s": be.output_tokens / makespan,
            "preemptions": stats["preemptions"], "swaps": stats["swaps"], "tokens": stats["tokens"],
            **{f"starts_{k}": stats["starts"].get(why, 0) for k, why in STARTED.items()}}


def run(args) -> dict:
    """Every system at every rate, for each seed (``--seeds``; else ``--seed``): the trace's
    arrivals and the BE jobs are drawn from it. One table per seed."""
    known_systems(args.systems, SYSTEMS)
    RESULTS.mkdir(exist_ok=True)
    tok = _tokenizer()
    dev = device(args)
    ttft, tbt, *_ = slos(dev.cost, args.ttft_factor, args.tbt_factor)
    ttft = args.slo_ttft_s if args.slo_ttft_s is not None else ttft
    tbt = args.slo_tbt_s if args.slo_tbt_s is not None else tbt
    where = "SmolLM2 on this CPU (fitted)" if args.preset == "fitted" else "OPT-13B on an A100"
    if args.slower != 1.0:
        where += f", every step {args.slower:g}x its cost model's time"
    print(f"{args.num_requests} held-out ShareGPT RT requests per rate (replies up to {args.max_output} tokens) "
          f"with BE jobs of {args.be_job_size} always pending; {where} (simulated), a pool of "
          f"{dev.kv_tokens} tokens; SLOs TTFT {ttft:.3f} s, TBT {tbt:.3f} s", flush=True)
    rows, eff = [], {}
    for seed in args.seeds or [args.seed]:
        args.seed = seed
        mine = _rows_of_seed(args, tok, dev, ttft, tbt)
        eff[seed] = effective(mine, args)
        if len(args.seeds or []) > 1:
            print(f"\nseed {seed}:")
        print_tables(mine, args, eff[seed])
        rows += mine
    out = {"slo": {"ttft_s": ttft, "tbt_s": tbt}, "args": vars(args), "kv_tokens": dev.kv_tokens, "rows": rows,
           "effective_throughput": eff[args.seed] if len(eff) == 1 else eff}
    (RESULTS / args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {RESULTS / args.out}")
    return out


def _rows_of_seed(args, tok, dev: Device, ttft: float, tbt: float) -> list[dict]:
    traces = {rate: sharegpt_trace(tok, rate, args.num_requests / rate, args.seed, max_context=2048,
                                   max_output_tokens=args.max_output, held_out=True) for rate in args.rates}
    need = any(SYSTEMS[s][1] == "predictor" for s in args.systems)
    predicted = predict_all(list(traces.values())) if need else {}
    be_items = synthetic_be(256, args.seed + 1, len(tok), scale=args.be_scale)
    rows = []
    for system in args.systems:
        for rate in args.rates:
            row = run_one(system, rate, with_lengths(traces[rate], SYSTEMS[system][1], predicted), be_items,
                          args, dev, ttft, tbt) | {"seed": args.seed}
            rows.append(row)
            print(f"  {system:>19} @ {rate:g}: TTFT&TPOT {row['attain_bros']:.0%}, TTFT&P99TBT "
                  f"{row['attain_apt']:.0%}, norm. latency {row['norm_latency_ms']:.1f} ms/tok, TTFT p99 / max "
                  f"{row['ttft_p99_ms']:,.0f} / {row['ttft_max_ms']:,.0f} ms, longest gap {row['gap_max_ms']:,.0f} "
                  f"ms, BE {row['be_rps']:.2f} req/s, {row['preemptions']} preemptions, chats started late / ahead "
                  f"{row['starts_late']} / {row['starts_ahead']}", flush=True)
    return rows


def effective(rows: list[dict], args) -> dict[str, tuple[float, bool]]:
    """Per system: the highest rate with 90% TTFT & P99-TBT attainment (linear between the rates
    run) and whether it was reached within them."""
    out = {}
    for system in args.systems:
        mine = [{"rate": r["rate"], "miss": -r["attain_apt"]} for r in rows if r["system"] == system]
        out[system] = capacity([{**m, "norm_latency_s": m["miss"]} for m in mine], -0.9)
    return out


def print_tables(rows: list[dict], args, eff: dict) -> None:
    systems = args.systems
    for title, (key, higher, _) in METRICS.items():
        print(f"\n{title} ({'higher' if higher else 'lower'} is better)\n")
        print("| rate | " + " | ".join(systems) + " |")
        print("|---|" + "---|" * len(systems))
        for rate in args.rates:
            cells = []
            for s in systems:
                r = next((x for x in rows if x["system"] == s and x["rate"] == rate), None)
                cells.append("-" if r is None else f"{r[key]:.0%}" if key.startswith("attain") else f"{r[key]:.2f}")
            print(f"| {rate:g} | " + " | ".join(cells) + " |")
    print("\neffective throughput (RT req/s with 90% meeting TTFT & P99 TBT, BE pending)\n")
    print("| system | req/s |\n|---|---|")
    for s in systems:
        c, reached = eff[s]
        print(f"| {s} | {'' if reached else '>= '}{c:.2f} |")
