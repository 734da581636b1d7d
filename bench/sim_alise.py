"""python -m bench sim-alise: ALISE against FCFS and an oracle at paper scale, in the simulator.

OPT-13B-like cost model on one A100-40GB (sched/cost_model.py) with its 12k-token pool, swaps
priced at PCIe speed (25 GB/s) over the bytes the host pool counts (a swap-out on a side link
beside the steps that follow, as the engine copies it on a GPU; a swap-in waits for the link),
64 GiB of host memory for them (a small part of such a server's RAM). ShareGPT prompts from the
held-out records (never seen by the predictor's training), each forced to its real reply length,
Poisson arrivals; all requests interactive with no SLO, as in the paper. Systems:

    fcfs             vLLM-like: first come first served, preempted requests recompute
    alise            predicted lengths and their spread (predictor/), swapping with int8 compression
    alise-point      predicted lengths without their spread (ranked by L̂ - g, doubled when outlived)
    alise-oracle     the true lengths, swapping with int8 compression
    alise-recompute  predicted lengths, preempted requests recompute
    fcfs-swap        FCFS with swapping (what swapping alone buys)
    alise-noise      the true lengths times log-normal noise, one system per ``--noise`` σ
                     (``alise-noise0.5``, ...): what a predictor of that error would buy

The noisy systems measure how good a predictor the policy needs: each request's length is
L·exp(σz) (z standard normal, one draw per prompt), with the spread a predictor calibrated
to that error would give, so they differ from the oracle only in the predictor's accuracy.

Normalized latency = mean over requests of end-to-end latency / output tokens. Capacity at a
latency bar = the highest rate at which a system stays under the bar (linear between the rates
run); the bar is FCFS's latency at its knee, taken as ``bar`` times its latency at the lowest rate.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, replace
from statistics import NormalDist

from tandem.bench.sim_cli import RESULTS, _tokenizer, known_systems
from tandem.bench.simulator import SimSetup, simulate
from tandem.bench.workloads import TraceItem, sharegpt_trace
from tandem.cache import PoolGeometry
from tandem.engine.kvquant import int8_block_bytes
from tandem.sched.cost_model import OPT_13B_A100, OPT_13B_A100_KV_TOKENS
from tandem.sched.scheduler import SchedConfig

# name -> (SchedConfig fields, where lengths come from)
SYSTEMS = {
    "fcfs": (dict(policy="fcfs", preemption_mode="recompute"), None),
    "alise": (dict(policy="alise", preemption_mode="swap"), "predictor"),
    "alise-point": (dict(policy="alise", preemption_mode="swap"), "point"),
    "alise-oracle": (dict(policy="alise", preemption_mode="swap"), "oracle"),
    "alise-recompute": (dict(policy="alise", preemption_mode="recompute"), "predictor"),
    "fcfs-swap": (dict(policy="fcfs", preemption_mode="swap"), None),
    "alise-noise": (dict(policy="alise", preemption_mode="swap"), "predictor"),
}
# OPT-13B in fp16: 40 layers, 40 heads of 128; one pool block holds K or V of 16 tokens
OPT_13B_BLOCK_BYTES = (40 * 16 * 5120 * 2, int8_block_bytes(40, 40, 128, 16))


def with_lengths(trace: list[TraceItem], source: str | None, predicted: dict) -> list[TraceItem]:
    """The trace with the lengths ``source`` gives: None, "oracle" (the truth), "predictor"
    (L̂ and its spread) or "point" (L̂ alone)."""
    if source is None:
        return trace
    if source == "oracle":
        return [replace(it, predicted=it.max_tokens) for it in trace]
    return [replace(it, predicted=predicted[it.user_text].length,
                    spread=predicted[it.user_text].spread if source == "predictor" else ()) for it in trace]


def predict_all(traces: list[list[TraceItem]]) -> dict:
    """The predictor's Prediction for every distinct prompt of the traces (frozen: it does not
    learn during the run, which only handicaps it)."""
    from tandem.predictor import LengthPredictor
    texts = sorted({it.user_text for tr in traces for it in tr})
    p = LengthPredictor.load()
    return dict(zip(texts, p.predict_detailed(texts)))


def noisy_predictions(truth: dict[str, int], sigma: float, seed: int) -> dict:
    """A Prediction for every prompt of ``truth`` (prompt -> true length): the length times
    exp(σz), z standard normal drawn per prompt in sorted order from ``seed``, and the spread
    that error implies, the prediction times exp(σ Φ⁻¹((j + ½)/SPREAD)), j = 0..SPREAD-1 (its
    quantiles: calibrated, by construction)."""
    from tandem.predictor.model import SPREAD, Prediction
    rng = random.Random(seed)
    levels = [NormalDist().inv_cdf((j + 0.5) / SPREAD) for j in range(SPREAD)]
    out = {}
    for text in sorted(truth):
        guess = truth[text] * math.exp(sigma * rng.gauss(0.0, 1.0))
        out[text] = Prediction(max(1, round(guess)), False, 0.0,
                               tuple(max(1, round(guess * math.exp(sigma * q))) for q in levels))
    return out


def rank_correlation(truth: dict[str, int], guess: dict) -> float:
    """Spearman's rho between the predicted and the true lengths (``python -m predictor eval``'s)."""
    import numpy as np
    from tandem.predictor.evaluate import spearman
    keys = sorted(truth)
    return spearman(np.array([guess[k].length for k in keys], float), np.array([truth[k] for k in keys], float))


def expand(systems: list[str], noise: list[float]) -> list[tuple[str, str, float | None]]:
    """(label, system, σ): ``alise-noise`` once per σ, every other system once."""
    out = []
    for s in systems:
        if s == "alise-noise":
            out += [(f"alise-noise{x:g}", s, x) for x in noise]
        else:
            out.append((s, s, None))
    return out


def capacity(rows: list[dict], bar: float) -> tuple[float, bool]:
    """(highest rate under ``bar``, whether it was reached within the rates run)."""
    rows = sorted(rows, key=lambda r: r["rate"])
    if rows[0]["norm_latency_s"] > bar:
        return 0.0, True
    for lo, hi in zip(rows, rows[1:]):
        if hi["norm_latency_s"] > bar:
            f = (bar - lo["norm_latency_s"]) / (hi["norm_latency_s"] - lo["norm_latency_s"])
            return lo["rate"] + f * (hi["rate"] - lo["rate"]), True
    return rows[-1]["rate"], False


def run(args) -> dict:
    known_systems(args.systems, SYSTEMS)
    RESULTS.mkdir(exist_ok=True)
    tok = _tokenizer()
    traces = {rate: sharegpt_trace(tok, rate, args.num_requests / rate, args.seed, max_context=2048,
                                   max_output_tokens=1024, held_out=not args.tuning_range) for rate in args.rates}
    runs = expand(args.systems, args.noise)
    needs = any(SYSTEMS[s][1] in ("predictor", "point") for _, s, x in runs if x is None)
    predicted = predict_all(list(traces.values())) if needs else {}
    truth = {it.user_text: it.max_tokens for tr in traces.values() for it in tr}
    noisy = {label: noisy_predictions(truth, sigma, args.seed) for label, _, sigma in runs if sigma is not None}
    rows = []
    print(f"{args.num_requests} held-out ShareGPT requests per rate, OPT-13B on an A100 (simulated), "
          f"{OPT_13B_A100_KV_TOKENS} KV tokens, host link {args.host_gbps:g} GB/s")
    for label, system, _ in runs:
        fields, source = SYSTEMS[system]
        lengths = noisy.get(label, predicted)
        setup = SimSetup(OPT_13B_A100, PoolGeometry(2 * OPT_13B_A100_KV_TOKENS // 16, 16),
                         SchedConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                                     swap_space_bytes=int(args.swap_gib * 2**30), **fields),
                         2048, block_bytes=OPT_13B_BLOCK_BYTES, host_bw=args.host_gbps * 1e9, side_link=True)
        for rate in args.rates:
            stats: dict = {}
            recs, makespan = simulate(with_lengths(traces[rate], source, lengths), setup, stats=stats)
            ok = [r for r in recs if r.ok]
            norm = sum(r.normalized_latency for r in ok) / len(ok)
            rows.append({"system": label, "rate": rate, "requests": len(recs), "makespan_s": makespan,
                         "norm_latency_s": norm, "preemptions": stats["preemptions"],
                         "swaps": stats["swaps"], "swap_gb": {k: v / 1e9 for k, v in stats["swap_bytes"].items()}})
            print(f"  {label:>16} @ {rate:g} req/s: normalized latency {norm * 1e3:.1f} ms/token, "
                  f"{stats['preemptions']} preemptions, swaps {dict(stats['swaps'])}", flush=True)
    rho = {label: rank_correlation(truth, guess) for label, guess in noisy.items()}
    if predicted:
        rho["predictor"] = rank_correlation(truth, predicted)
    for label, x in rho.items():
        print(f"  {label}: rank correlation with the true lengths {x:.2f}")
    return summarize(rows, [label for label, _, _ in runs], args, {"rank_correlation": rho})


def summarize(rows: list[dict], systems: list[str], args, extra: dict | None = None) -> dict:
    base = sorted((r for r in rows if r["system"] == "fcfs"), key=lambda r: r["rate"])
    bar = args.bar * base[0]["norm_latency_s"] if base else None
    caps = {}
    if bar is not None:
        for system in systems:
            caps[system] = capacity([r for r in rows if r["system"] == system], bar)
    print(f"\nnormalized latency (ms/token), mean over requests; bar = {args.bar:g} x FCFS at "
          f"{base[0]['rate']:g} req/s = {bar * 1e3:.1f} ms/token\n" if bar else "")
    print("| rate | " + " | ".join(systems) + " |")
    print("|---|" + "---|" * len(systems))
    for rate in args.rates:
        cells = [next((f"{r['norm_latency_s'] * 1e3:.1f}" for r in rows if r["system"] == s and r["rate"] == rate), "-")
                 for s in systems]
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    if caps and caps.get("fcfs", (0,))[0] > 0:
        f = caps["fcfs"][0]
        print("\n| system | rate under the bar (req/s) | vs fcfs |\n|---|---|---|")
        for s, (c, reached) in caps.items():
            print(f"| {s} | {'' if reached else '>= '}{c:.2f} | {c / f:.2f}x |")
    out = {"preset": "opt13b", "cost": asdict(OPT_13B_A100), "kv_tokens": OPT_13B_A100_KV_TOKENS,
           "bar_s": bar, "bar_factor": args.bar, "capacity": caps, "rows": rows, **(extra or {})}
    path = RESULTS / args.out
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return out
