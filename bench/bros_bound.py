"""python -m bench bros-bound: the most BE throughput any schedule can keep on this machine while
RT requests get a token every T seconds, from the fitted cost model (BROS's targets ask for
RT normalized latency 50% below FCFS's *and* 85% of FCFS's BE throughput; this says whether
the machine allows both).

Fluid model, one step every T seconds, every step carrying a token of every decoding RT
request (the cheapest way to give each a token per T: a step without them pays the per-step
cost again for nothing RT needs):

    N       = λ · E[out_rt] · T                  RT requests decoding at once (Little's law)
    busy    = (base + N · (a_d + c_d · ctx_rt)) / T + λ · E[a_p·P + c_p·P(P+1)/2]     (per second)
    BE tok/s = (1 - busy) / E[a_p·P + c_p·P(P+1)/2 + out · (a_d + c_d · (P + out/2))] · E[out_be]

ctx_rt: the context of a decoding RT request, averaged over its decode steps (prompt + out/2,
weighted by out). Everything else a real schedule pays (model error margins, preemptions,
unused room at the end of a step) only lowers BE throughput, so under the linear cost model this
bounds any schedule -- as long as the RT load is what Little's law says: past capacity RT
requests queue instead of decoding, fewer decode per step than N, and the estimate turns
pessimistic (the table prints it beside measured runs to show where it holds). The structure is
the point: N / T = λ · E[out_rt] does not depend on T, so the RT decode work per second is fixed
and only the per-step cost (base / T) grows as steps shorten. RT normalized latency (end-to-end /
output tokens) is at least about T for every request, so a latency target L -- on the median or on
the mean, BROS's own metric -- needs T <= L.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.sched.cost_model import CostModel, attn_pairs


@dataclass(frozen=True, slots=True)
class Load:
    rt_rate: float                 # RT requests per second
    rt_out: float                  # E[output tokens] of an RT request
    rt_ctx: float                  # context of a decoding RT request, averaged over its decode steps
    rt_prefill_s: float            # E[seconds of prefill work] per RT request
    be_out: float                  # E[output tokens] of a BE request
    be_request_s: float            # E[seconds of work] per BE request (prefill and its decode tokens)


def prefill_s(cost: CostModel, prompt: int) -> float:
    """Work of one prompt in the cost model, computed whole (its attention's pairs at their fewest)."""
    return cost.per_prefill_token * prompt + cost.per_prefill_attn * attn_pairs(prompt, prompt)


def load_of(cost: CostModel, rate: float, rt: list[tuple[int, int]], be: list[tuple[int, int]]) -> Load:
    """Means over (prompt, output) pairs of the RT trace and of the BE pool."""
    out_rt = sum(o for _, o in rt)
    ctx = sum(o * (p + o / 2) for p, o in rt) / out_rt
    per_dec = lambda p, o: o * (cost.per_decode_token + cost.per_decode_ctx * (p + o / 2))  # noqa: E731
    return Load(rate, out_rt / len(rt), ctx, sum(prefill_s(cost, p) for p, _ in rt) / len(rt),
                sum(o for _, o in be) / len(be), sum(prefill_s(cost, p) + per_dec(p, o) for p, o in be) / len(be))


def be_bound(cost: CostModel, load: Load, step_s: float) -> float:
    """Upper bound on BE output tokens per second with RT decoding at one token per ``step_s``."""
    n_rt = load.rt_rate * load.rt_out * step_s
    step = cost.base + n_rt * (cost.per_decode_token + cost.per_decode_ctx * load.rt_ctx)
    busy = step / step_s + load.rt_rate * load.rt_prefill_s
    return max(0.0, 1.0 - busy) / load.be_request_s * load.be_out


def run(args) -> None:
    from tandem.bench.online import RESULTS, _setup
    from tandem.bench.sim_cli import load_fitted
    from tandem.bench.workloads import sharegpt_trace, synthetic_be
    cost, *_ = load_fitted(args.fitted)
    real = json.loads(Path(RESULTS / args.real).read_text())
    if "be" not in real:
        raise SystemExit(f"--real: {args.real} is not a `bench mixed` result (it has no batch work)")
    args.model = "smollm2"
    _, tok = _setup(args)
    scale = real["be"]["scale"]
    be = [(len(it.prompt_ids), it.max_tokens) for it in synthetic_be(args.be_pool, args.seed + 1, len(tok), scale=scale)]
    by = {(r["system"], r["rate"]): r for r in real["rows"]}
    rows = []
    for rate in sorted({r["rate"] for r in real["rows"]}):
        trace = sharegpt_trace(tok, rate, args.duration, args.seed, max_output_tokens=args.max_output)
        load = load_of(cost, rate, [(len(it.prompt_ids), it.max_tokens) for it in trace], be)
        fcfs = by.get(("tandem-fcfs", rate))
        if fcfs is None:
            continue
        lat = fcfs["summary"]["rt"]["normalized_latency_s"]["50"]
        mean = fcfs["summary"]["rt"]["normalized_latency_mean_s"]
        row = {"rate": rate, "fcfs_norm_latency_s": lat, "fcfs_norm_latency_mean_s": mean,
               "fcfs_be_tok_s": fcfs["be"]["tokens_per_s"],
               "target_step_s": lat / 2, "be_bound_at_target": be_bound(cost, load, lat / 2),
               "target_step_mean_s": mean / 2, "be_bound_at_mean_target": be_bound(cost, load, mean / 2),
               "be_bound_at_fcfs": be_bound(cost, load, fcfs["summary"]["rt"]["tpot_s"]["50"])}
        for system in ("tandem-bros", "tandem-bros-bidir"):
            if (r := by.get((system, rate))) is not None:
                row[system] = {"norm_latency_s": r["summary"]["rt"]["normalized_latency_s"]["50"],
                               "be_tok_s": r["be"]["tokens_per_s"],
                               "be_bound": be_bound(cost, load, r["summary"]["rt"]["tpot_s"]["50"])}
        rows.append(row)
    print("| RT rate | FCFS norm. latency p50 / mean ms/tok | T for -50% (p50 / mean) | BE bound at that T tok/s "
          "(p50 / mean) | FCFS BE tok/s (model at its TPOT) | 85% of it | BROS norm. latency p50 / BE tok/s "
          "(model at its TPOT) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        b = r.get("tandem-bros")
        bros = f"{b['norm_latency_s'] * 1e3:.0f} / {b['be_tok_s']:.0f} ({b['be_bound']:.0f})" if b else "-"
        print(f"| {r['rate']} | {r['fcfs_norm_latency_s'] * 1e3:.0f} / {r['fcfs_norm_latency_mean_s'] * 1e3:.0f} | "
              f"{r['target_step_s'] * 1e3:.0f} / {r['target_step_mean_s'] * 1e3:.0f} | "
              f"{r['be_bound_at_target']:.0f} / {r['be_bound_at_mean_target']:.0f} | {r['fcfs_be_tok_s']:.0f} "
              f"({r['be_bound_at_fcfs']:.0f}) | {0.85 * r['fcfs_be_tok_s']:.0f} | {bros} |")
    out = RESULTS / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cost": asdict(cost), "from": args.real, "rows": rows}, indent=2))
    print(f"wrote {out}")
