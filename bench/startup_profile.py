"""How long the start-up profile takes, and how well the cost model it fits predicts serving steps.

SmolLM2 on one CPU worker, FCFS, its threads waiting as a server's do. Each profile plan (the
one a server runs at start-up, and the rebalancer's shorter one) is run ``--repeats`` times,
alternating, on one engine; between the first and the second round, a held-out stream of
serving steps is measured: requests of 16-700 prompt tokens and 8-80 output tokens arriving
at random, so steps mix decodes with prefill chunks as under load. Each fitted model is scored
on those steps: the mean |measured - predicted| / measured, and the 10th / 50th / 90th
percentile of measured / predicted. The machine's own noise shows as the spread between
repeats of one plan.

Where the engine multiplies thin steps over a GGUF's blocks (bfloat16; engine.linear.Thin), a
second held-out stream has steps of about that threshold's rows (``--near-threshold``), and
each model is scored again fitted on the same profile without the products the engine measured
(sched.cost_model's P(R)).
"""
from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import replace

from tandem.bench.output import save_json


def serving_steps(scheduler, vocab_size: int, steps: int, seed: int = 1) -> list:
    """(shape, seconds) of ``steps`` measured steps of random traffic (FCFS, chunked prompts)."""
    from tandem.sched.profiling import dummy_request, random_ids
    rng = random.Random(seed)
    log = scheduler.step_log = []
    try:
        for i in range(steps):
            if rng.random() < 0.35 or not scheduler.has_unfinished():
                ids = random_ids(rng, rng.choice([16, 48, 100, 200, 400, 700]), vocab_size)
                scheduler.add(dummy_request(f"serve-{i}", ids, rng.randrange(8, 80)))
            scheduler.step()
    finally:
        scheduler.step_log = None
    while scheduler.has_unfinished():
        scheduler.step()
    return log


def score(model, steps: list, thin: int = 0) -> dict:
    """The model's error on ``steps``; with the engine's thin-product threshold ``thin``, also the
    median measured / predicted of the steps of at most that many rows (thin) and of the others."""
    from tandem.bench.metrics import percentile
    ratios = model.ratios(steps)
    out = {"mean_abs_error": model.mean_abs_error(steps), **{f"p{q}": percentile(ratios, q) for q in (10, 50, 90)}}
    if thin:
        parts = ([], [])
        for x in steps:
            parts[x[0].prefill_tokens + x[0].decode_tokens > thin].append(x)
        out.update(thin_steps=len(parts[0]), thin_p50=percentile(model.ratios(parts[0]), 50),
                   thick_p50=percentile(model.ratios(parts[1]), 50))
    return out


def near_threshold_steps(scheduler, vocab_size: int, thin: int, steps: int) -> list:
    """Serving steps of about ``thin`` rows: the random traffic of :func:`serving_steps` with at most
    3/4, 1, 9/8, 3/2 and 2 times ``thin`` tokens a step, ``steps`` steps each."""
    cfg = scheduler.cfg
    out = []
    try:
        for budget in sorted({3 * thin // 4, thin, thin + thin // 8, 3 * thin // 2, 2 * thin}):
            scheduler.use_config(replace(cfg, max_num_batched_tokens=budget))
            out += serving_steps(scheduler, vocab_size, steps, seed=budget)
    finally:
        scheduler.use_config(cfg)
    return out


def _table(title: str, runs: list, steps: list, thin: int) -> list[dict]:
    """Print each run's model, with and without the products the engine measured, scored on ``steps``."""
    from tandem.sched.cost_model import CostModel
    print(f"\n{title}\n")
    print("| plan | run | seconds | P(R) | mean abs error | measured / predicted p10 / p50 / p90 "
          "| p50 thin / thick steps |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for run in runs:
        model = run["model"]
        for with_p in (True, False) if model.projections else (True,):
            m = model if with_p else CostModel.fit(run["samples"])
            s = score(m, steps, thin)
            rows.append({"plan": run["plan"], "repeat": run["repeat"], "seconds": run["seconds"],
                         "projections": with_p and bool(model.projections), **s})
            print(f"| {run['plan']} | {run['repeat'] + 1} | {run['seconds']:.1f} | "
                  f"{'measured' if rows[-1]['projections'] else '-'} | {s['mean_abs_error']:.1%} | "
                  f"{s['p10']:.2f} / {s['p50']:.2f} / {s['p90']:.2f} | "
                  + (f"{s['thin_p50']:.2f} / {s['thick_p50']:.2f} ({s['thin_steps']} thin) |" if thin else "|"))
    return rows


def main(args) -> None:
    from tandem import LLM
    from tandem.engine.worker import serving_wait_policy
    from tandem.sched.profiling import PLAN, SHORT_PLAN, profile_cost, thin_rows
    plans = {"start-up (PLAN)": PLAN, "rebalancer (SHORT_PLAN)": SHORT_PLAN}
    runs, held_out, near = [], None, []
    with LLM("smollm2", "cpu:1", policy="fcfs", weight_blocks=not args.no_weight_blocks,
             omp_wait_policy=serving_wait_policy(os.environ)) as llm:
        vocab = llm.spec.vocab_size
        thin = thin_rows(llm.scheduler)
        for r in range(args.repeats):
            for name, plan in plans.items():
                t0 = time.monotonic()
                cost = profile_cost(llm.scheduler, vocab, plan=plan)
                runs.append({"plan": name, "repeat": r, "seconds": time.monotonic() - t0, "model": cost.model,
                             "samples": cost.startup})
            if held_out is None:
                held_out = serving_steps(llm.scheduler, vocab, args.steps)
                if thin and args.near_threshold:
                    near = near_threshold_steps(llm.scheduler, vocab, thin, args.near_threshold)
    head = f"SmolLM2 on cpu:1 ({llm.dtype}), the engine's products past {thin} rows dense" if thin else ""
    rows = _table(f"Start-up profile plans, {head or 'SmolLM2 on cpu:1 (' + llm.dtype + ')'}, scored on "
                  f"{len(held_out)} measured serving steps", runs, held_out, thin)
    near_rows = _table(f"The same models on {len(near)} serving steps of {3 * thin // 4}-{2 * thin} token rows",
                       runs, near, thin) if near else []
    for name in plans:
        secs = [r["seconds"] for r in runs if r["plan"] == name]
        print(f"{name}: {statistics.mean(secs):.1f} s on average")
    save_json(args.out, {"steps": len(held_out), "rows": rows, "near_threshold_steps": len(near),
                         "near_threshold_rows": near_rows})
