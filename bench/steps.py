"""Where a server's device time went, from its step log (``python -m server --step-log FILE``, or
``bench mixed --step-log``, which gives each of our servers one): its steps by the work they held,
and how well the cost model priced them -- measured / predicted overall, and for steps with a
prompt chunk by the longest context a chunk reached (the attention a chunk computes grows with
it). With ``--target-ms`` (a TBT target), the steps holding RT decodes that took longer. With
``--profile`` (the start-up profile that server measured; ``bench mixed --step-log`` keeps it as
``<out>_<system>_profile.json``), every step priced again from it by the cost model with and
without its per-kind correction.

    python -m bench steps results/mixed_tandem_steps.jsonl --target-ms 171
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.bench.output import save_json
from tandem.sched.steplog import StepRecord, read_steps

CONTEXT_BINS = (0, 150, 300, 450, 600, 1000, 2000)       # tokens: the longest context a prompt chunk reached


def _kind(r: StepRecord) -> str:
    if r.be_prompt_tokens:
        return "BE prompt tokens"
    if r.be_decodes:
        return "BE decodes, no BE prompt"
    return "no BE work"


def _quantiles(x: np.ndarray) -> dict:
    return {f"p{q}": float(np.percentile(x, q)) for q in (10, 50, 90)} if len(x) else {}


def summarize(records: list[StepRecord], target_s: float | None = None) -> dict:
    """The table's numbers for one log (or the part of one that a caller picked)."""
    if not records:
        return {"steps": 0}
    sec = np.array([r.seconds for r in records])
    out: dict = {"steps": len(records), "busy_s": float(sec.sum()), "step_ms_mean": float(sec.mean() * 1e3),
                 "kinds": {}}
    for kind in ("BE prompt tokens", "BE decodes, no BE prompt", "no BE work"):
        rs = [r for r in records if _kind(r) == kind]
        if rs:
            n = len(rs)
            out["kinds"][kind] = {"steps": n, "seconds": sum(r.seconds for r in rs),
                                  "step_ms_mean": 1e3 * sum(r.seconds for r in rs) / n,
                                  "rt_decodes": sum(r.rt_decodes for r in rs) / n,
                                  "be_decodes": sum(r.be_decodes for r in rs) / n,
                                  "rt_prompt_tokens": sum(r.rt_prompt_tokens for r in rs) / n,
                                  "be_prompt_tokens": sum(r.be_prompt_tokens for r in rs) / n}
    priced = [r for r in records if r.predicted]
    if priced:
        ratio = np.array([r.seconds / r.predicted for r in priced])
        chunk = np.array([r.prompt_chunks > 0 for r in priced])
        ctx = np.array([r.chunk_context for r in priced])
        out["measured_over_predicted"] = {"all": _quantiles(ratio), "with a prompt chunk": _quantiles(ratio[chunk]),
                                          "decodes only": _quantiles(ratio[~chunk])}
        out["by_chunk_context"] = [
            {"context": [lo, hi], "steps": int(m.sum()), **_quantiles(ratio[m])}
            for lo, hi in zip(CONTEXT_BINS, CONTEXT_BINS[1:]) if (m := chunk & (ctx >= lo) & (ctx < hi)).any()]
    if target_s is not None:
        held = [r for r in records if r.rt_decodes]
        over = sum(r.seconds > target_s for r in held)
        out["target"] = {"target_s": target_s, "steps_with_rt_decodes": len(held),
                         "over": over, "share_over": over / len(held) if held else 0.0}
    return out


def print_summary(label: str, s: dict) -> None:
    if not s["steps"]:
        print(f"\n{label}: no steps")
        return
    print(f"\n{label}: {s['steps']} steps, {s['busy_s']:.1f} s busy, {s['step_ms_mean']:.0f} ms a step")
    print("\n| steps holding | steps | seconds | ms a step | RT / BE decodes a step | RT / BE prompt tokens a step |")
    print("|---|---|---|---|---|---|")
    for kind, k in s["kinds"].items():
        print(f"| {kind} | {k['steps']} | {k['seconds']:.1f} | {k['step_ms_mean']:.0f} | {k['rt_decodes']:.1f} / "
              f"{k['be_decodes']:.1f} | {k['rt_prompt_tokens']:.1f} / {k['be_prompt_tokens']:.1f} |")
    if "measured_over_predicted" in s:
        print("\n| measured / predicted | p10 | p50 | p90 |\n|---|---|---|---|")
        rows = list(s["measured_over_predicted"].items()) + [
            (f"prompt chunk, context {b['context'][0]}-{b['context'][1]} ({b['steps']} steps)", b)
            for b in s["by_chunk_context"]]
        for name, q in rows:
            if q and "p50" in q:
                print(f"| {name} | {q['p10']:.2f} | {q['p50']:.2f} | {q['p90']:.2f} |")
    if "target" in s:
        t = s["target"]
        print(f"\nsteps holding RT decodes over {t['target_s'] * 1e3:g} ms: {t['over']} of "
              f"{t['steps_with_rt_decodes']} ({t['share_over']:.1%})")


def replay(records: list[StepRecord], startup: list) -> dict:
    """Each step of one device's log priced again as a server's cost model would have priced it:
    fitted on the start-up profile's steps (``startup``), then refined from the log's steps
    before it; once by the fitted model alone and once with its per-kind correction
    (sched.cost_model.OnlineCostModel). The policy's choices stay those of the logged run. Exact
    where the engine measures no thin products (sched.cost_model's P(R), a bfloat16 GGUF worker's,
    measured at each start and not kept in the profile): there it prices without them."""
    from tandem.sched.cost_model import CostModel, OnlineCostModel
    out = {}
    for name, correct in (("fitted alone", False), ("with the per-kind correction", True)):
        cost = OnlineCostModel(CostModel.fit(startup), startup=startup, kind_correction=correct)
        ratio = []
        for r in records:
            ratio.append(r.seconds / cost(r.shape))
            cost.observe(r.shape, r.seconds)
        out[name] = _accuracy(np.array(ratio), np.array([r.shape.prefill_tokens > 0 for r in records]))
    return out


def _accuracy(ratio: np.ndarray, prompt: np.ndarray) -> dict:
    """How measured / predicted spread: mean |log|, the shares under 0.85 and over 1.1 (in the
    first 256 steps too), the medians by kind and the 90th percentile (the policy's margin)."""
    return {"mean_abs_log": float(np.abs(np.log(ratio)).mean()), "under_0.85": float((ratio < 0.85).mean()),
            "over_1.1": float((ratio > 1.1).mean()), "first_256_over_1.1": float((ratio[:256] > 1.1).mean()),
            "p50_decodes_only": float(np.median(ratio[~prompt])) if (~prompt).any() else None,
            "p50_with_a_prompt_chunk": float(np.median(ratio[prompt])) if prompt.any() else None,
            "p90": float(np.percentile(ratio, 90))}


def print_replay(label: str, rows: dict) -> None:
    print(f"\n{label}, priced again from its start-up profile:\n")
    print("| cost model | mean abs log | under 0.85 | over 1.1 | first 256 over 1.1 | p50 decodes only "
          "| p50 with a prompt chunk | p90 |\n|---|---|---|---|---|---|---|---|")
    for name, a in rows.items():
        med = [f"{x:.2f}" if x is not None else "-" for x in (a["p50_decodes_only"], a["p50_with_a_prompt_chunk"])]
        print(f"| {name} | {a['mean_abs_log']:.1%} | {a['under_0.85']:.1%} | {a['over_1.1']:.1%} | "
              f"{a['first_256_over_1.1']:.1%} | {med[0]} | {med[1]} | {a['p90']:.3f} |")


def main(args) -> None:
    import json

    from tandem.sched.profile_store import samples_of
    target = None if args.target_ms is None else args.target_ms / 1e3
    profile = json.loads(Path(args.profile).read_text()) if args.profile else None
    if profile is not None and "samples" not in profile:
        raise SystemExit(f"--profile: {args.profile} is not a start-up profile (it holds no 'samples'; "
                         "bench mixed --step-log keeps the server's beside its step log)")
    startup = samples_of(profile) if profile is not None else None
    out = {}
    for f in args.files:
        records = read_steps(f)
        devices = sorted({r.device for r in records})
        for dev in devices if len(devices) > 1 else [None]:
            part = records if dev is None else [r for r in records if r.device == dev]
            label = str(f) + ("" if dev is None else f" ({dev})")     # as given: two logs of one name stay two
            out[label] = summarize(part, target)
            print_summary(label, out[label])
            if startup is not None and part:
                out[label]["replay"] = replay(part, startup)
                print_replay(label, out[label]["replay"])
    save_json(args.out, out)


def window(path: str | Path, start: float, end: float) -> list[StepRecord]:
    """The records of a log whose results came back between ``start`` and ``end`` (the
    monotonic clock, which the server's processes and the bench share)."""
    return [r for r in read_steps(path) if start <= r.t <= end]
