"""python -m bench profile | sim | sim-validate."""
from __future__ import annotations

import json
from dataclasses import asdict

from tandem.bench.output import RESULTS, beside
from tandem.bench.metrics import attainment, meets_apt, meets_bros, summarize
from tandem.bench.simulator import SimSetup, simulate
from tandem.bench.workloads import sharegpt_trace
from tandem.cache import PoolGeometry
from tandem.engine.kvquant import int8_block_bytes
from tandem.sched.cost_model import OPT_13B_A100, OPT_13B_A100_KV_TOKENS, CostModel, StepShape
from tandem.sched.llm import DEFAULT_KV_CACHE_BYTES
from tandem.sched.scheduler import SchedConfig

# the fitted cost model: what `bench profile` writes by default, and what the fitted preset, sim-validate and
# bros-bound read
COST_FILE = RESULTS / "cost_smollm2_cpu.json"


def known_systems(names: list[str], systems) -> None:
    """--systems: each a name of ``systems``, before any work (an unknown one was a bare KeyError)."""
    unknown = [n for n in names if n not in systems]
    if unknown:
        raise SystemExit(f"--systems: {', '.join(unknown)} not one of {', '.join(systems)}")
# SmolLM2-135M: 30 layers, 3 KV heads of 64; one K (or V) block of 16 tokens in fp32, and in int8
SMOLLM2_BLOCK_BYTES = (30 * 16 * 3 * 64 * 4, int8_block_bytes(30, 3, 64, 16))
SMOLLM2_POOL_TOKENS = DEFAULT_KV_CACHE_BYTES // (2 * SMOLLM2_BLOCK_BYTES[0] // 16)    # the server's default pool


def _tokenizer():
    from tandem.predictor.data import length_tokenizer       # SmolLM2's: the traces' lengths are its tokens
    return length_tokenizer()


def profile(args) -> CostModel:
    """Fit the cost model from our engine's measured steps (SmolLM2, cpu:1, fp32)."""
    from tandem.bench.workloads import chat_ids, sharegpt_prompts
    from tandem import LLM, SamplingParams
    out = RESULTS / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    with LLM("smollm2", "cpu:1", max_num_seqs=args.max_num_seqs) as llm:
        prompts = [chat_ids(llm.tokenizer, p.prompt) for p in sharegpt_prompts(96, llm.tokenizer)]
        llm.scheduler.step_log = log = []
        # batch sizes and output lengths varied independently, so per-request and per-context
        # decode costs are not collinear; long outputs reach the contexts of real traffic
        for n, out in ((1, 96), (2, 320), (8, 400), (16, 160), (32, 240), (64, 64), (96, 24)):
            llm.generate(prompts[:n], SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
        products = llm.scheduler.products()
    cost = CostModel.fit(log, products)
    err = cost.mean_abs_error(log)
    decode = [x for x in log if not x[0].prefill_tokens]
    prefill = [x for x in log if x[0].prefill_tokens]
    out.write_text(json.dumps({"cost": asdict(cost), "steps": len(log), "mean_abs_error": err,
                               "ratios": [round(x, 4) for x in cost.ratios(decode)],
                               "ratios_prefill": [round(x, 4) for x in cost.ratios(prefill)]}, indent=2))
    print(f"fitted on {len(log)} steps, mean |error| {err:.1%}: {cost}\nwrote {out}")
    return cost


def load_fitted(name: str | None = None) -> tuple[CostModel, tuple[float, ...], tuple[float, ...]]:
    """The fitted cost model and its measured/predicted step-time ratios (decode-only steps,
    steps with prefill work), from ``name`` (``bench profile --out``'s: in the results dir, or a
    path) or the default file."""
    path = COST_FILE if name is None else RESULTS / name
    if not path.is_file():
        how = "`python -m bench profile` first (its default --out)" if name is None else \
            f"`python -m bench profile --out {name}` first"
        raise SystemExit(f"{path} is missing: run {how}")
    d = json.loads(path.read_text())
    return CostModel(**d["cost"]), tuple(d.get("ratios", ())), tuple(d.get("ratios_prefill", ()))


def slos(cost: CostModel, ttft_factor: float, tbt_factor: float, prompt: int = 128, ctx: int = 192):
    """Unloaded TTFT/TBT predicted by the cost model for a typical request, times the factors."""
    ttft0 = cost.predict(StepShape().add(prompt, prompt, decode=False))
    tbt0 = cost.predict(StepShape().add(1, ctx, decode=True))
    return ttft0 * ttft_factor, tbt0 * tbt_factor, ttft0, tbt0


def run_rates(trace_for, setup: SimSetup, rates, ttft_slo, tbt_slo) -> list[dict]:
    rows = []
    for rate in rates:
        recs, makespan = simulate(trace_for(rate), setup)
        rows.append({"rate": rate, "requests": len(recs), "makespan_s": makespan,
                     "attain_apt": attainment(recs, lambda r: meets_apt(r, ttft_slo, tbt_slo)),
                     "attain_bros": attainment(recs, lambda r: meets_bros(r, ttft_slo, tbt_slo)),
                     "summary": summarize(recs, makespan)})
        s = rows[-1]["summary"]["rt"]
        print(f"  rate {rate:>5}: attainment {rows[-1]['attain_apt']:.0%} (TTFT & P99 TBT), "
              f"{rows[-1]['attain_bros']:.0%} (TTFT & TPOT); TTFT p50 {s['ttft_s'][50]:.3f} s, "
              f"p99 {s['ttft_s'][99]:.3f} s; TPOT p50 {s['tpot_s'][50] * 1e3:.1f} ms", flush=True)
    return rows


def sim(args) -> None:
    """Paper-scale FCFS: OPT-13B-like cost model on one A100-40GB, ShareGPT arrivals."""
    out = RESULTS / (args.out or f"sim_{args.preset}_fcfs.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    cost = OPT_13B_A100 if args.preset == "opt13b" else load_fitted(args.fitted)[0]
    kv_tokens = OPT_13B_A100_KV_TOKENS if args.preset == "opt13b" else args.kv_tokens
    setup = SimSetup(cost, PoolGeometry(2 * kv_tokens // 16, 16),
                     SchedConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048), 2048)
    ttft_slo, tbt_slo, ttft0, tbt0 = slos(cost, args.ttft_factor, args.tbt_factor)
    print(f"cost model {args.preset}: {cost}\nSLOs: TTFT {ttft_slo:.3f} s (= {args.ttft_factor} x {ttft0:.3f}), "
          f"TBT {tbt_slo:.3f} s (= {args.tbt_factor} x {tbt0:.3f}); {args.num_requests} ShareGPT requests per rate")
    trace_for = lambda rate: sharegpt_trace(tok, rate, args.num_requests / rate, args.seed,  # noqa: E731
                                            max_context=2048, max_output_tokens=1024)
    rows = run_rates(trace_for, setup, args.rates, ttft_slo, tbt_slo)
    out.write_text(json.dumps({"preset": args.preset, "cost": asdict(cost), "kv_tokens": kv_tokens,
                               "slo": {"ttft_s": ttft_slo, "tbt_s": tbt_slo}, "rows": rows}, indent=2))
    from tandem.bench.plots import attainment_vs_rate
    attainment_vs_rate([r | {"system": "FCFS"} for r in rows], beside(out, "attainment.png"),
                       f"{args.preset}: SLO attainment vs rate (simulated)")
    print(f"wrote {out}")


def sim_mixed(args) -> None:
    """RT ShareGPT at each rate with BE batch jobs always pending, per policy, at paper scale."""
    from tandem.bench.plots import attainment_vs_rate, rt_latency_vs_be_throughput
    from tandem.bench.simulator import BeJobs
    from tandem.bench.workloads import synthetic_be
    out = RESULTS / (args.out or f"sim_mixed_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    cost = OPT_13B_A100 if args.preset == "opt13b" else load_fitted(args.fitted)[0]
    kv_tokens = OPT_13B_A100_KV_TOKENS if args.preset == "opt13b" else args.kv_tokens
    ttft_slo, tbt_slo, ttft0, tbt0 = slos(cost, args.ttft_factor, args.tbt_factor)
    print(f"cost model {args.preset}; SLOs TTFT {ttft_slo:.3f} s, TBT {tbt_slo:.3f} s; {args.num_requests} RT "
          f"ShareGPT requests per rate; BE: jobs of {args.be_job_size} synthetic requests (512-1024 in, "
          f"32-128 out), the next when one completes")
    be_items = synthetic_be(256, args.seed + 1, len(tok))
    rows = []
    for policy in args.policies:
        setup = SimSetup(cost, PoolGeometry(2 * kv_tokens // 16, 16),
                         SchedConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, policy=policy),
                         2048, slo_ttft_s=ttft_slo, slo_tbt_s=tbt_slo)
        for rate in args.rates:
            trace = sharegpt_trace(tok, rate, args.num_requests / rate, args.seed, max_context=2048,
                                   max_output_tokens=1024)
            be = BeJobs(be_items, args.be_job_size)
            recs, makespan = simulate(trace, setup, be)
            row = {"system": policy, "rate": rate, "requests": len(recs), "makespan_s": makespan,
                   "attain_apt": attainment(recs, lambda r: meets_apt(r, ttft_slo, tbt_slo)),
                   "attain_bros": attainment(recs, lambda r: meets_bros(r, ttft_slo, tbt_slo)),
                   "summary": summarize(recs, makespan),
                   "be": {"completed": be.completed, "output_tokens": be.output_tokens,
                          "tokens_per_s": be.output_tokens / makespan, "requests_per_s": be.completed / makespan}}
            rows.append(row)
            s = row["summary"]["rt"]
            print(f"  {policy:>5} @ {rate:g} req/s: RT attainment {row['attain_bros']:.0%} (TTFT & TPOT), "
                  f"{row['attain_apt']:.0%} (TTFT & P99 TBT); RT norm. latency p50 "
                  f"{s['normalized_latency_s'][50] * 1e3:.1f} ms/tok; BE {row['be']['tokens_per_s']:.0f} tok/s",
                  flush=True)
    out.write_text(json.dumps({"preset": args.preset, "slo": {"ttft_s": ttft_slo, "tbt_s": tbt_slo},
                               "be_job_size": args.be_job_size, "rows": rows}, indent=2))
    attainment_vs_rate(rows, beside(out, "attainment.png"),
                       f"{args.preset}: RT attainment with BE always pending (simulated)")
    rt_latency_vs_be_throughput(rows, beside(out, "rt_vs_be.png"),
                                f"{args.preset}: RT latency vs BE throughput (simulated)")
    print_mixed_table(rows)
    print(f"wrote {out}")


def print_mixed_table(rows: list[dict]) -> None:
    print("\n| policy | RT rate | RT TTFT & TPOT | RT TTFT & P99 TBT | RT norm. latency p50 / mean ms/tok "
          "| BE tok/s | BE req/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"]["rt"]
        print(f"| {r['system']} | {r['rate']:g} | {r['attain_bros']:.0%} | {r['attain_apt']:.0%} | "
              f"{s['normalized_latency_s'][50] * 1e3:.1f} / {s['normalized_latency_mean_s'] * 1e3:.1f} | "
              f"{r['be']['tokens_per_s']:.0f} | {r['be']['requests_per_s']:.2f} |")


def sim_validate(args) -> None:
    """Replay the traces of a `bench online` run (its tandem-fcfs rows) in the simulator with the fitted cost
    model, with and without the measured step-time spread, and compare attainment with the real one."""
    real = json.loads((RESULTS / args.real).read_text())
    if not any(x.get("system") == "tandem-fcfs" for x in real.get("rows", ())):
        raise ValueError(f"{args.real} holds no tandem-fcfs rows: the simulator is checked against FCFS runs "
                         "(`bench online --systems tandem-fcfs ...`)")
    tok = _tokenizer()
    cost, ratios, ratios_prefill = load_fitted(args.fitted)
    slo, tr = real["slo"], real["trace"]
    setups = {"mean": SimSetup(cost, PoolGeometry(2 * SMOLLM2_POOL_TOKENS // 16, 16),
                               SchedConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048), 8192)}
    if ratios:
        setups["spread"] = SimSetup(**{**setups["mean"].__dict__, "noise": ratios,
                                       "noise_prefill": ratios_prefill})
    print(f"SLOs TTFT {slo['ttft_s'] * 1e3:.0f} ms, TBT {slo['tbt_s'] * 1e3:.0f} ms; simulated with the mean "
          f"cost model, and with measured step-time ratios drawn per step ({len(ratios)} decode-only, "
          f"{len(ratios_prefill)} with prefill)\n")
    print("| rate | TTFT & P99 TBT: real | sim (mean) | sim (spread) | TTFT & TPOT: real | sim (mean) "
          "| sim (spread) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for r in sorted((x for x in real["rows"] if x["system"] == "tandem-fcfs"), key=lambda x: x["rate"]):
        trace = sharegpt_trace(tok, r["rate"], tr["duration_s"], tr["seed"], max_output_tokens=args.max_output)
        row = {"rate": r["rate"], "real_apt": r["attain_apt"], "real_bros": r["attain_bros"]}
        for name, setup in setups.items():
            recs, _ = simulate(trace, setup)
            row[f"sim_apt_{name}"] = attainment(recs, lambda x: meets_apt(x, slo["ttft_s"], slo["tbt_s"]))
            row[f"sim_bros_{name}"] = attainment(recs, lambda x: meets_bros(x, slo["ttft_s"], slo["tbt_s"]))
        rows.append(row)
        f = lambda k: f"{row[k]:.1%}" if k in row else "-"  # noqa: E731
        print(f"| {r['rate']} | {f('real_apt')} | {f('sim_apt_mean')} | {f('sim_apt_spread')} | "
              f"{f('real_bros')} | {f('sim_bros_mean')} | {f('sim_bros_spread')} |")
    out = RESULTS / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")
