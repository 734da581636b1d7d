"""Per-token time at a fixed number of concurrent streams, each system in turn.

B chat streams start at once (the offline workload's ShareGPT prompts, a fixed output length, EOS
ignored); the decode inter-token time is taken over the stretch where every stream has its first
token, so it is a decode step at batch B as a client sees it, prefills excluded. Small B is where
an online trace at a moderate rate spends its time.
"""
from __future__ import annotations

import asyncio
import statistics
from types import SimpleNamespace

from tandem.bench.output import beside, result_path, save_json


def decode_tbt_s(recs) -> list[float]:
    """Gaps between a stream's tokens once every stream has its first one."""
    start = max(r.token_times[0] for r in recs)
    return [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:]) if a >= start]


def main(args) -> None:
    from tandem.bench.client import run_trace
    from tandem.bench.online import _setup, start
    from tandem.bench.workloads import TraceItem, chat_ids, sharegpt_prompts
    hf_dir, tok = _setup(SimpleNamespace(model="smollm2"))
    prompts = [chat_ids(tok, p.prompt) for p in sharegpt_prompts(max(args.batches), tok)]
    rows = []
    for system in args.systems:
        with start(system, hf_dir, max(args.batches), log=beside(result_path(args.out), f"{system}.log")) as url:
            for b in args.batches:
                items = [TraceItem(0.0, prompts[i], args.max_tokens, "rt") for i in range(b)]
                recs, dur = asyncio.run(run_trace(url, "smollm2", items, system, drain_s=600, progress=False))
                if not all(r.ok for r in recs):
                    raise RuntimeError(f"{system}: {sum(not r.ok for r in recs)} of {b} streams failed")
                gaps = decode_tbt_s(recs)
                rows.append({"system": system, "streams": b, "tbt_p50_ms": 1e3 * statistics.median(gaps),
                             "tbt_mean_ms": 1e3 * statistics.mean(gaps),
                             "tok_s": sum(len(r.token_times) for r in recs) / dur})
                print(f"  {system} x{b}: decode TBT p50 {rows[-1]['tbt_p50_ms']:.1f} ms", flush=True)
    print("\n| system | streams | decode TBT p50 ms | mean ms | tok/s (prefills included) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['streams']} | {r['tbt_p50_ms']:.1f} | {r['tbt_mean_ms']:.1f} | {r['tok_s']:.1f} |")
    save_json(args.out, {"max_tokens": args.max_tokens, "rows": rows})
