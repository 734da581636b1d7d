"""Where a server's device time went, from its step log (``python -m server --step-log FILE``, or
``bench mixed --step-log``, which gives each of our servers one): its steps by the work they held,
and how well the cost model priced them -- measured / predicted overall, and for steps with a
prompt chunk by the longest context a chunk reached (the attention a chunk computes grows with
it). With ``--target-ms`` (a TBT target), the steps holding RT decodes that took longer.

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


def main(args) -> None:
    target = None if args.target_ms is None else args.target_ms / 1e3
    out = {}
    for f in args.files:
        records = read_steps(f)
        devices = sorted({r.device for r in records})
        for dev in devices if len(devices) > 1 else [None]:
            part = records if dev is None else [r for r in records if r.device == dev]
            label = Path(f).name + ("" if dev is None else f" ({dev})")
            out[label] = summarize(part, target)
            print_summary(label, out[label])
    save_json(args.out, out)


def window(path: str | Path, start: float, end: float) -> list[StepRecord]:
    """The records of a log whose results came back between ``start`` and ``end`` (the
    monotonic clock, which the server's processes and the bench share)."""
    return [r for r in read_steps(path) if start <= r.t <= end]
