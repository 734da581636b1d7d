"""Online serving: the same seeded ShareGPT trace at several request rates, against each system.

SLOs come from a calibration on our engine, unloaded (median TTFT and TBT of a
few sequential requests), times stated factors; every system is judged by the
same SLOs. Reported per system and rate: SLO attainment (Apt-Serve: TTFT and
P99 TBT; BROS: TTFT and TPOT), TTFT/TBT/TPOT percentiles, normalized latency,
throughput.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

from bench.client import run_trace
from bench.metrics import attainment, effective_throughput, meets_apt, meets_bros, summarize
from bench.peers import free_port, serve, vllm_server
from bench.workloads import TraceItem, chat_text, sharegpt_trace

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def tandem_server(model: str, max_num_seqs: int, extra: list[str] = ()):
    """Our server (python -m server) on loopback, stopped with SIGTERM afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", model, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--data-dir", str(RESULTS / "tandem-data"),
           "--watch-parent", str(os.getpid()), *extra]
    return serve(cmd, port, log_path=RESULTS / "tandem-server.log", cwd=ROOT)


def start(system: str, hf_dir: Path, max_num_seqs: int):
    if system == "tandem":
        return tandem_server("smollm2", max_num_seqs)
    if system == "vllm":
        return vllm_server(hf_dir, dtype="float32", max_num_seqs=max_num_seqs,
                           log_path=RESULTS / "vllm-online.log")
    if system == "llamacpp":
        from bench.peers import llama_server
        from engine.models.loader import packaged_smollm2
        return llama_server(packaged_smollm2(), slots=16, ctx_per_slot=2048,
                            log_path=RESULTS / "llamacpp-online.log")
    if system == "transformers":
        from bench.peers import transformers_server
        return transformers_server(hf_dir, log_path=RESULTS / "transformers-online.log")
    if system == "vllm-priority":
        return vllm_server(hf_dir, dtype="float32", max_num_seqs=max_num_seqs,
                           extra=["--scheduling-policy", "priority"], log_path=RESULTS / "vllm-online.log")
    raise ValueError(f"unknown system {system!r}")


def calibrate(url: str, tokenizer, n: int = 5) -> tuple[float, float]:
    """Unloaded median TTFT and median TBT of n sequential 64-token requests."""
    text = chat_text(tokenizer, "Write a short paragraph about the history of tea in three sentences.")
    items = [TraceItem(0.0, tokenizer(text, add_special_tokens=False)["input_ids"], 64, "rt", text)]
    ttfts, gaps = [], []
    for _ in range(n):
        recs, _ = asyncio.run(run_trace(url, "smollm2", items, "tandem", progress=False))
        r = recs[0]
        if r.ok:
            ttfts.append(r.ttft)
            gaps.extend(r.gaps)
    return statistics.median(ttfts), statistics.median(gaps)


def main(args) -> None:
    from engine.llm import DEFAULT_CACHE_DIR
    from engine.models.loader import load_tokenizer, resolve_model
    RESULTS.mkdir(exist_ok=True)
    hf_dir = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    tok = load_tokenizer(hf_dir)
    traces = {rate: sharegpt_trace(tok, rate, args.duration, args.seed, max_output_tokens=args.max_output)
              for rate in args.rates}
    slo = None
    rows, searches = [], []
    for system in args.systems:
        with start(system, hf_dir, args.max_num_seqs) as url:
            if slo is None:
                with start("tandem", hf_dir, args.max_num_seqs) if system != "tandem" else \
                        contextlib.nullcontext(url) as cal_url:
                    ttft0, tbt0 = calibrate(cal_url, tok)
                slo = {"ttft_s": ttft0 * args.ttft_factor, "tbt_s": tbt0 * args.tbt_factor,
                       "unloaded_ttft_s": ttft0, "unloaded_tbt_s": tbt0,
                       "ttft_factor": args.ttft_factor, "tbt_factor": args.tbt_factor}
                print(f"SLOs: TTFT {slo['ttft_s'] * 1e3:.0f} ms (= {args.ttft_factor} x unloaded "
                      f"{ttft0 * 1e3:.0f} ms), TBT {slo['tbt_s'] * 1e3:.0f} ms (= {args.tbt_factor} x "
                      f"unloaded {tbt0 * 1e3:.1f} ms)", flush=True)
            def run_at(rate: float) -> dict:
                if rate not in traces:
                    traces[rate] = sharegpt_trace(tok, rate, args.duration, args.seed,
                                                  max_output_tokens=args.max_output)
                recs, dur = asyncio.run(run_trace(url, "smollm2", traces[rate], system, drain_s=args.drain))
                row = {"system": system, "rate": rate, "requests": len(recs), "duration_s": dur,
                       "attain_apt": attainment(recs, lambda r: meets_apt(r, slo["ttft_s"], slo["tbt_s"])),
                       "attain_bros": attainment(recs, lambda r: meets_bros(r, slo["ttft_s"], slo["tbt_s"])),
                       "summary": summarize(recs, dur)}
                print_row(row, flush=True)
                return row
            for rate in args.rates:
                rows.append(run_at(rate))
            if args.search:
                key = "attain_apt" if args.search_metric == "apt" else "attain_bros"
                eff, probes = effective_throughput(lambda r: run_at(r)[key], *args.search, rel_tol=0.15)
                searches.append({"system": system, "metric": args.search_metric,
                                 "effective_rps": eff, "probes": probes})
                print(f"  {system}: effective throughput {eff:.2f} req/s (90% attainment, "
                      f"{args.search_metric})", flush=True)
    out = RESULTS / "online.json"
    out.write_text(json.dumps({"slo": slo, "trace": {"dataset": "sharegpt", "seed": args.seed,
                                                     "duration_s": args.duration, "rates": args.rates},
                               "rows": rows, "effective_throughput": searches}, indent=2))
    print_table(rows)
    print(f"wrote {out}")


def _ms(d: dict, p: int) -> str:
    v = d.get(p)
    return f"{v * 1e3:.0f}" if v is not None and v == v else "-"


def print_row(r: dict, flush=False) -> None:
    s = r["summary"].get("rt", {})
    print(f"  {r['system']} @ {r['rate']} req/s: attainment apt {r['attain_apt']:.0%} bros "
          f"{r['attain_bros']:.0%}, TTFT p50/p99 {_ms(s.get('ttft_s', {}), 50)}/{_ms(s.get('ttft_s', {}), 99)} ms, "
          f"TPOT p50 {_ms(s.get('tpot_s', {}), 50)} ms, failed {s.get('failed', 0)}", flush=flush)


def print_table(rows: list[dict]) -> None:
    print("\n| system | rate (req/s) | SLO attainment (TTFT & P99 TBT) | (TTFT & TPOT) | TTFT p50 / p99 ms "
          "| TBT p50 / p99 ms | TPOT p50 ms | norm. latency p50 ms/tok | tok/s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"].get("rt", {})
        print(f"| {r['system']} | {r['rate']} | {r['attain_apt']:.0%} | {r['attain_bros']:.0%} | "
              f"{_ms(s.get('ttft_s', {}), 50)} / {_ms(s.get('ttft_s', {}), 99)} | "
              f"{_ms(s.get('tbt_s', {}), 50)} / {_ms(s.get('tbt_s', {}), 99)} | {_ms(s.get('tpot_s', {}), 50)} | "
              f"{_ms(s.get('normalized_latency_s', {}), 50)} | {s.get('tokens_per_s', 0):.0f} | {s.get('failed', 0)} |")
