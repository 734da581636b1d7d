"""python -m bench sim-apt: Apt-Serve against FCFS at paper scale, in the simulator.

OPT-13B-like cost model on one A100-40GB (sched/cost_model.py), a 12k-token pool that can
also hold hidden caches (multi-head attention: half a KV cache), the device charging
OPT_13B_A100_RHO per KV block of context a hidden request re-projects at each step, and the
scheduler given the same ρ (as if profiled exactly). Two traces: ShareGPT (1,000 requests) and a
long-prompt set (ShareGPT prompts of 768-1,536 tokens, as LongBench's are long; the paper's
LongBench itself is not on this machine), Poisson or Gamma arrivals, the paper's Table 3 SLOs
(TTFT 1 s, 4 s for long prompts; P99 TBT 1 s) unless told otherwise. Prints effective
throughput (highest rate with 90% of requests meeting TTFT and their own P99 TBT), attainment
per rate, and the ablations of the paper's Tables 4 (KV-only vs hybrid) and 5 (FCFS vs adaptive).
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace

from tandem.bench.metrics import attainment, effective_throughput, meets_apt, rate_text, search_bound
from tandem.bench.sim_cli import RESULTS, _tokenizer, slos
from tandem.bench.simulator import SimSetup, simulate
from tandem.bench.workloads import TraceItem, arrivals, sharegpt_trace
from tandem.cache import PoolGeometry
from tandem.sched.cost_model import OPT_13B_A100, OPT_13B_A100_KV_TOKENS, OPT_13B_A100_RHO
from tandem.sched.scheduler import SchedConfig

# name -> SchedConfig fields; "-s": Apt-Serve-S (prefill and decode coalesced in one iteration)
SYSTEMS = {
    "fcfs": dict(policy="fcfs"),
    # the paper's baseline, vLLM 0.5: prefill-only iterations of whole prompts first (no chunking)
    "fcfs-prefill-first": dict(policy="fcfs-prefill-first", chunked_prefill=False, max_num_batched_tokens=2048),
    "aptserve": dict(policy="aptserve"),
    "aptserve-kv": dict(policy="aptserve", hybrid_cache=False),
    "aptserve-fcfs": dict(policy="aptserve", adaptive=False),
    "aptserve-s": dict(policy="aptserve", mixed_batches=True),
    "aptserve-s-kv": dict(policy="aptserve", mixed_batches=True, hybrid_cache=False),
    "aptserve-s-fcfs": dict(policy="aptserve", mixed_batches=True, adaptive=False),
}
# (prompt tokens min, max), TTFT SLO multiplier (the paper: LongBench 4 s vs ShareGPT 1 s)
DATASETS = {"sharegpt": ((4, 1024), 1.0), "long": ((768, 1536), 4.0)}


def _items(tok, name: str, n: int, sample: int | None = None) -> list[TraceItem]:
    """The first n fitting pairs, or with ``sample`` n drawn at random with that seed."""
    (lo, hi), _ = DATASETS[name]
    return sharegpt_trace(tok, 1.0, n, 0, max_context=2048, max_output_tokens=1024,
                          min_prompt_tokens=lo, max_prompt_tokens=hi, sample=sample)


def _setup(system: str, args, ttft: float, tbt: float) -> SimSetup:
    cfg = SchedConfig(**{"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "rho": OPT_13B_A100_RHO, **SYSTEMS[system]})
    return SimSetup(OPT_13B_A100, PoolGeometry(2 * OPT_13B_A100_KV_TOKENS // 16, 16, hidden_blocks=1), cfg,
                    2048, slo_ttft_s=ttft, slo_tbt_s=tbt, rho=OPT_13B_A100_RHO)


def _attain(items, setup: SimSetup, rate: float, cv: float, seed: int, ttft: float, tbt: float,
            stats: dict | None = None) -> float:
    trace = [replace(it, arrival_s=a) for it, a in zip(items, arrivals(rate, len(items), seed, cv))]
    recs, _ = simulate(trace, setup, stats=stats)
    return attainment(recs, lambda r: meets_apt(r, ttft, tbt))


def run(args) -> None:
    RESULTS.mkdir(exist_ok=True)
    tok = _tokenizer()
    *_, ttft_unloaded, tbt_unloaded = slos(OPT_13B_A100, 1.0, 1.0)
    ttft0 = args.ttft_factor * ttft_unloaded if args.ttft_factor else args.slo_ttft_s
    tbt = args.tbt_factor * tbt_unloaded if args.tbt_factor else args.slo_tbt_s
    out = {"cost": asdict(OPT_13B_A100), "rho": OPT_13B_A100_RHO, "kv_tokens": OPT_13B_A100_KV_TOKENS,
           "max_num_batched_tokens": args.max_num_batched_tokens, "target": args.target, "datasets": {}}
    for name in args.datasets:
        items = _items(tok, name, args.num_requests)
        ttft = ttft0 * DATASETS[name][1]
        print(f"\n## {name}: {len(items)} requests, SLOs TTFT {ttft:.3f} s, P99 TBT {tbt:.3f} s; "
              f"token budget {args.max_num_batched_tokens}/iteration; effective throughput at "
              f"{args.target:.0%} attainment", flush=True)
        d = out["datasets"][name] = {"requests": len(items), "slo": {"ttft_s": ttft, "tbt_s": tbt},
                                     "effective": {}, "ablation": []}
        lo, hi = (args.search_long if name == "long" else args.search)
        d["samples"] = []
        for k in range(args.samples):    # trace 0: the first pairs; then random draws, own arrivals
            trace = items if k == 0 else _items(tok, name, args.num_requests, sample=k)
            row = {"sample": k or None, "seed": args.seed + k, "requests": len(trace), "rates": {}}
            for system in args.systems:
                rate, probes, counts = _effective(trace, _setup(system, args, ttft, tbt), args, args.seed + k,
                                                  lo, hi, ttft, tbt)
                row["rates"][system] = rate
                if k == 0:
                    d["effective"][system] = {"rate": rate, "bound": search_bound(rate, lo, hi), "probes": probes,
                                              "counts": counts}
                    print(f"  {system:>16}: effective throughput {rate_text(rate, lo, hi)} req/s  "
                          f"(probes: {', '.join(f'{r:.2f}->{a:.0%}' for r, a in probes)}); there: "
                          f"{_counts_text(counts)}", flush=True)
            d["samples"].append(row)
            if k:
                print(f"  sample {k} (random draw, arrival seed {args.seed + k}): "
                      + ", ".join(f"{s} {r:.2f}" for s, r in row["rates"].items()), flush=True)
        rates = args.ablation_rates_long if name == "long" else args.ablation_rates
        for rate in rates:
            for cv in args.cvs:
                row = {"rate": rate, "cv": cv}
                for system in args.ablation_systems:
                    row[system] = _attain(items, _setup(system, args, ttft, tbt), rate, cv, args.seed, ttft, tbt)
                d["ablation"].append(row)
                print("  ablation " + ", ".join(f"{k} {v:.1%}" if isinstance(v, float) and k not in ("rate", "cv")
                                                else f"{k} {v:g}" for k, v in row.items()), flush=True)
    path = RESULTS / args.out
    path.write_text(json.dumps(out, indent=2))
    print_tables(out)
    print(f"wrote {path}")


def _effective(items, setup: SimSetup, args, seed: int, lo: float, hi: float, ttft: float, tbt: float):
    """(effective throughput, probes, the scheduler's counts at that rate) of one system on one trace."""
    stats_at: dict[float, dict] = {}   # per probed rate: preemptions, cache-type switches
    rate, probes = effective_throughput(
        lambda r: _attain(items, setup, r, 1.0, seed, ttft, tbt, stats_at.setdefault(r, {})),
        lo, hi, target=args.target, rel_tol=args.rel_tol)
    return rate, probes, stats_at.get(rate, {})    # the rate found is one of the probes (or 0)


def _counts_text(counts: dict) -> str:
    """Preemptions, cache-type switches and the hidden caches' share of the computed tokens."""
    if not counts:
        return "-"
    tokens = counts["tokens"]
    hidden = tokens.get("hidden", 0) / max(1, sum(tokens.values()))
    switches = ", ".join(f"{n} to {t}" for t, n in sorted(counts["switches"].items())) or "0"
    return f"{counts['preemptions']} preemptions, switches {switches}, {hidden:.0%} of tokens hidden"


def _print_samples(samples: list[dict]) -> None:
    """Effective throughput per trace sample, and the ratio to FCFS over the samples (mean, min-max)."""
    systems = list(samples[0]["rates"])
    print(f"\nover {len(samples)} traces (the first pairs, then random draws with their own arrival seeds)\n\n"
          "| system | " + " | ".join(f"trace {i}" for i in range(len(samples))) + " | mean | vs FCFS mean (min-max) "
          "| vs prefill-first mean (min-max) |\n|---|" + "---|" * (len(samples) + 3))
    for system in systems:
        rates = [s["rates"][system] for s in samples]
        cells = []
        for base in ("fcfs", "fcfs-prefill-first"):
            ratios = [s["rates"][system] / s["rates"][base] for s in samples if s["rates"].get(base)]
            cells.append(f"{sum(ratios) / len(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        print(f"| {system} | " + " | ".join(f"{r:.2f}" for r in rates) + f" | {sum(rates) / len(rates):.2f} | "
              + " | ".join(cells) + " |")


def print_tables(out: dict) -> None:
    for name, d in out["datasets"].items():
        bases = [d["effective"].get(b, {}).get("rate") for b in ("fcfs", "fcfs-prefill-first")]
        print(f"\n{name}: effective throughput ({out.get('target', 0.9):.0%} TTFT & P99 TBT, SLOs "
              f"{d['slo']['ttft_s']:.3g} / {d['slo']['tbt_s']:.3g} s)\n\n| system | req/s | vs FCFS "
              "| vs FCFS prefill-first | at that rate |\n|---|---|---|---|---|")
        for system, e in d["effective"].items():
            ratios = [f"{e['rate'] / b:.2f}x" if b else "-" for b in bases]
            shown = {"at_least": ">= ", "below": "< "}.get(e.get("bound"), "") + f"{e['rate']:.2f}"
            print(f"| {system} | {shown} | {' | '.join(ratios)} | {_counts_text(e.get('counts', {}))} |")
        if len(d.get("samples", [])) > 1:
            _print_samples(d["samples"])
        if d["ablation"]:
            systems = [k for k in d["ablation"][0] if k not in ("rate", "cv")]
            print(f"\n{name}: attainment by rate and burstiness (CV)\n\n| rate | CV | " + " | ".join(systems)
                  + " |\n|---|---|" + "---|" * len(systems))
            for row in d["ablation"]:
                print(f"| {row['rate']:g} | {row['cv']:g} | " + " | ".join(f"{row[s]:.1%}" for s in systems) + " |")
