"""How long the start-up profile takes, and how well the cost model it fits predicts serving steps.

SmolLM2 on one CPU worker, FCFS. Each profile plan (the one a server runs at start-up, and the
rebalancer's shorter one) is run ``--repeats`` times, alternating, on one engine; between the
first and the second round, a held-out stream of serving steps is measured: requests of 16-700
prompt tokens and 8-80 output tokens arriving at random, so steps mix decodes with prefill
chunks as under load. Each fitted model is scored on those steps: the mean |measured -
predicted| / measured, and the 10th / 50th / 90th percentile of measured / predicted. The
machine's own noise shows as the spread between repeats of one plan.
"""
from __future__ import annotations

import random
import statistics
import time

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


def score(model, steps: list) -> dict:
    """The model's error on ``steps``; where the engine has a thin-product threshold, also the
    median measured / predicted of the steps at most that many rows (thin) and of the others."""
    from tandem.bench.metrics import percentile
    ratios = model.ratios(steps)
    out = {"mean_abs_error": model.mean_abs_error(steps), **{f"p{q}": percentile(ratios, q) for q in (10, 50, 90)}}
    if model.thin_rows:
        thin, thick = [], []
        for x in steps:
            (thin if x[0].prefill_tokens + x[0].decode_tokens <= model.thin_rows else thick).append(x)
        out.update(thin_steps=len(thin), thin_p50=percentile(model.ratios(thin), 50),
                   thick_p50=percentile(model.ratios(thick), 50))
    return out


def main(args) -> None:
    from tandem import LLM
    from tandem.sched.profiling import PLAN, SHORT_PLAN, profile_cost
    plans = {"start-up (PLAN)": PLAN, "rebalancer (SHORT_PLAN)": SHORT_PLAN}
    runs, held_out = [], None
    with LLM("smollm2", "cpu:1", policy="fcfs", weight_blocks=not args.no_weight_blocks) as llm:
        vocab = llm.spec.vocab_size
        for r in range(args.repeats):
            for name, plan in plans.items():
                t0 = time.monotonic()
                model = profile_cost(llm.scheduler, vocab, plan=plan).model
                runs.append({"plan": name, "repeat": r, "seconds": time.monotonic() - t0, "model": model})
            if held_out is None:
                held_out = serving_steps(llm.scheduler, vocab, args.steps)
    print(f"\nStart-up profile plans, SmolLM2 on cpu:1 ({llm.dtype}), scored on {len(held_out)} "
          f"measured serving steps\n")
    print("| plan | run | seconds | mean abs error | measured / predicted p10 / p50 / p90 | p50 thin / thick steps |")
    print("|---|---|---|---|---|---|")
    rows = []
    for run in runs:
        s = score(run["model"], held_out)
        rows.append({"plan": run["plan"], "repeat": run["repeat"], "seconds": run["seconds"], **s})
        print(f"| {run['plan']} | {run['repeat'] + 1} | {run['seconds']:.1f} | {s['mean_abs_error']:.1%} | "
              f"{s['p10']:.2f} / {s['p50']:.2f} / {s['p90']:.2f} | "
              + (f"{s['thin_p50']:.2f} / {s['thick_p50']:.2f} ({s['thin_steps']} thin) |" if "thin_p50" in s else "|"))
    for name in plans:
        secs = [r["seconds"] for r in rows if r["plan"] == name]
        print(f"{name}: {statistics.mean(secs):.1f} s on average")
    save_json(args.out, {"steps": len(held_out), "rows": rows})
