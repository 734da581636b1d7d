"""python -m bench <subcommand>: benchmarks (never part of the tests)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from tandem.bench.peers import ServerStartError

# what a bad setting or a missing input raises inside a command: said in one line (with
# TANDEM_BENCH_TRACEBACK=1, the traceback too)
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, ZeroDivisionError, statistics.StatisticsError,
               ServerStartError)
OUT_HELP = "result file name, in the results dir (bench/results in a checkout, else ./tandem-bench-results)"
# what the commands that price steps by the fitted cost model read
FITTED_HELP = "cost_smollm2_cpu.json in the results dir, what `bench profile` writes by default (--fitted: another)"


def fitted_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fitted", default=None, metavar="FILE",
                   help="the fitted cost model to read, as `bench profile --out FILE` wrote it (a name in the "
                        "results dir, or a path); default: cost_smollm2_cpu.json there")


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (a rate, a burstiness)."""
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return v


def _whole(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
    return v


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (a count, a size, a number of tokens)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number, 0 or more (0: none)."""
    return _whole(text, 0)


# the --search-like ranges: (LO, HI) of rates or sizes, 0 < LO < HI
RANGES = ("search", "search_long")


def check_ranges(ap: argparse.ArgumentParser, args) -> None:
    """Refuse a search range that is empty or reaches 0, and --requests with --search (online)."""
    for name in RANGES:
        lo_hi = getattr(args, name, None)
        if lo_hi is not None and not 0 < lo_hi[0] < lo_hi[1]:
            ap.error(f"--{name.replace('_', '-')}: LO and HI must be 0 < LO < HI, got {lo_hi[0]:g} {lo_hi[1]:g}")
    if args.cmd == "online" and args.requests and args.search:
        ap.error("--requests runs each rate on a fresh server; --search probes one server")


def main(argv=None, prog: str = "python -m bench") -> None:
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    off = sub.add_parser("offline", help="offline throughput vs HF transformers and vLLM")
    off.add_argument("--num-prompts", type=positive_int, default=64)
    off.add_argument("--max-tokens", type=positive_int, default=128)
    off.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                     help="auto: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32")
    off.add_argument("--devices", default="cpu:1")
    off.add_argument("--skip", nargs="*", default=[], metavar="SYSTEM",
                     choices=["tandem", "tandem_logprobs", "tandem_json", "tandem_server", "hf_generate", "hf_cb",
                              "vllm_bfloat16", "vllm_float32", "llamacpp", "transformers"],
                     help="systems to skip: %(choices)s")
    off.add_argument("--out", default="offline.json",
                     help=OUT_HELP + "; each server's log beside it (<stem>_<system>.log)")
    on = sub.add_parser("online", help="a ShareGPT trace at several rates: SLO attainment and latencies")
    mx = sub.add_parser("mixed", help="RT ShareGPT online while BE work (batch jobs) is always pending")
    for p in (on, mx):
        p.add_argument("--systems", nargs="+", default=["tandem"],
                       help="tandem (our default policy), tandem-<policy> (tandem-fcfs, tandem-bros, ...; "
                            "tandem-no-slo etc.: the default with one mechanism off; -f32w: dense weights "
                            "alone, --no-weight-blocks), vllm, vllm-priority, "
                            "llamacpp, transformers")
        p.add_argument("--rates", nargs="+", type=positive_float, default=[1.0, 2.0])
        p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
        p.add_argument("--drain", type=float, default=120.0, help="seconds to wait after the last arrival")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-output", type=positive_int, default=512, help="cap on a request's output tokens")
        p.add_argument("--max-num-seqs", type=positive_int, default=64)
        p.add_argument("--ttft-factor", type=float, default=10.0, help="TTFT SLO = factor x unloaded TTFT")
        p.add_argument("--tbt-factor", type=float, default=5.0, help="TBT SLO = factor x unloaded TBT")
        p.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                       help="fix the SLOs instead of calibrating (with --slo-tbt-ms)")
        p.add_argument("--slo-tbt-ms", type=positive_float, default=None)
        p.add_argument("--out", default=f"{p.prog.split()[-1]}.json",
                       help=OUT_HELP + "; plots and each server's log beside it (<stem>_*)")
        p.add_argument("--model", default="smollm2",
                       choices=["smollm2", "opt125m-random", "opt13b-random", "llama8b-random", "smollm2-random"],
                       help="opt125m-random: an OPT-125m-shaped multi-head model, random weights (Apt-Serve); "
                            "the *-random paper shapes (for a GPU) draw prompts of ShareGPT's lengths from "
                            "bench/data/sharegpt_lengths.json when no tokenizer or dataset is installed")
        p.add_argument("--devices", default=None, help="our server's --devices (default: its own)")
        p.add_argument("--held-out", action="store_true",
                       help="draw RT prompts from ShareGPT's held-out records (those the length predictor never saw)")
        p.add_argument("--step-log", action="store_true",
                       help="our server: log every model step (<out>_<system>_steps.jsonl; with online "
                            "--requests, a log per rate: <out>_<system>@<rate>_steps.jsonl), keep its start-up "
                            "profile beside it (..._profile.json, for bench steps --profile) and print, per row, "
                            "where its device time went and how well its cost model priced the steps")
        p.add_argument("--kv-cache-gib", type=float, default=None,
                       help="KV cache size for our server and vLLM alike, may be a fraction (default: 2 GiB each)")
    mx.add_argument("--be-mode", default="auto", choices=["auto", "batches", "online"],
                    help="auto: Batch API jobs for tandem*, online low-priority requests for the others")
    mx.add_argument("--be-job-size", type=positive_int, default=16, help="requests per batch job")
    mx.add_argument("--be-concurrency", type=positive_int, default=16, help="BE requests outstanding (online mode)")
    mx.add_argument("--be-scale", type=float, default=1.0, help="scale of BROS's 512-1024 in / 32-128 out")
    mx.add_argument("--trace-status", action="store_true",
                    help="our server: poll /status each second and say why chats waited past their TTFT target "
                         "(<out>_status.json keeps the polls)")
    mx.add_argument("--server-slo-tbt-ms", type=float, default=None,
                    help="tell our server this TBT target instead of the one the run judges by (BROS then "
                         "sizes its iterations to it): traces RT latency against BE throughput")
    on.add_argument("--search", nargs=2, type=float, metavar=("LO", "HI"), default=None,
                    help="also search the effective throughput (90%% attainment) between these rates")
    on.add_argument("--search-metric", default="bros", choices=["apt", "bros"])
    on.add_argument("--requests", type=positive_int, default=None,
                    help="the same N prompts at every rate (arriving over N / rate seconds instead of "
                         "--duration), each rate on a fresh server, so rates differ only in arrival times")
    tb = sub.add_parser("table", help="the whole peers table: offline + online + effective throughput")
    tb.add_argument("--rates", nargs=2, type=positive_float, default=[1.0, 2.0])
    tb.add_argument("--duration", type=float, default=30.0)
    tb.add_argument("--drain", type=float, default=90.0)
    tb.add_argument("--search", nargs=2, type=float, default=[0.25, 3.0], metavar=("LO", "HI"))
    tb.add_argument("--skip-offline", action="store_true",
                    help="reuse offline.json in --out's folder (by default results/offline.json, what `bench "
                         "offline` writes) instead of running the offline bench into it")
    tb.add_argument("--out", default="peers_table.json",
                    help=OUT_HELP + "; the table in markdown beside it (<stem>.md), the online rows in "
                         "<stem>_online.json")
    st = sub.add_parser("streams", help="decode time per token at B concurrent streams, per system")
    st.add_argument("--systems", nargs="+", default=["tandem", "vllm"])
    st.add_argument("--batches", nargs="+", type=positive_int, default=[1, 2, 5, 8, 16, 32])
    st.add_argument("--max-tokens", type=positive_int, default=96)
    st.add_argument("--out", default="streams.json", help=OUT_HELP + "; each server's log beside it")
    sw = sub.add_parser("sliding-window", help="decode step time with full attention against sliding windows "
                        "(a random Mistral-shaped model at SmolLM2's width, long prompts)")
    sw.add_argument("--windows", type=positive_int, nargs="+", default=[256, 1024])
    sw.add_argument("--context", type=positive_int, default=3000)
    sw.add_argument("--requests", type=positive_int, default=4)
    sw.add_argument("--layers", type=positive_int, default=8)
    sw.add_argument("--steps", type=positive_int, default=64)
    sw.add_argument("--out", default="sliding_window.json", help=OUT_HELP)
    lo = sub.add_parser("lora", help="decode and prompt step time with requests on LoRA adapters against the "
                        "base model, and the cost model's price of them (SmolLM2, one worker)")
    lo.add_argument("--requests", type=positive_int, default=8)
    lo.add_argument("--adapters", type=positive_int, default=4)
    lo.add_argument("--rank", type=positive_int, default=16)
    lo.add_argument("--context", type=positive_int, default=64)
    lo.add_argument("--steps", type=positive_int, default=48)
    lo.add_argument("--prompt-tokens", type=positive_int, nargs="+", default=[32, 128, 256],
                    help="lengths of the prompts computed alone, on the base model and on one adapter")
    lo.add_argument("--repeats", type=positive_int, default=3, help="prompts of each length")
    lo.add_argument("--out", default="lora.json", help=OUT_HELP)
    sp = sub.add_parser("step-profile", help="where a decode step's time goes: GEMMs, attention, norms, "
                        "rotary, sampling, Python, IPC, the actor's phases")
    sp.add_argument("--batch", type=positive_int, default=64)
    sp.add_argument("--max-tokens", type=positive_int, default=64)
    sp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    sp.add_argument("--out", default="step_profile.json", help=OUT_HELP)
    cl = sub.add_parser("cpu-linear", help="the CPU projections over GGUF blocks and float32 panels (the compiled "
                        "kernels) against oneDNN's layout: SmolLM2's products by row count, and its decode steps "
                        "by batch (one thread)")
    cl.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512])
    cl.add_argument("--batches", type=positive_int, nargs="*", default=[1, 4, 8, 16, 32],
                    help="decode batches to time (none: the products only)")
    cl.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (the worker's)")
    cl.add_argument("--repeats", type=positive_int, default=3)
    cl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: dense weights with and without GGUF's blocks for thin products")
    cl.add_argument("--out", default="cpu_linear.json", help=OUT_HELP)
    su = sub.add_parser("startup-profile", help="the start-up profile's time, and its cost model's error on "
                        "measured serving steps (SmolLM2, cpu:1)")
    su.add_argument("--repeats", type=positive_int, default=2)
    su.add_argument("--no-weight-blocks", action="store_true", help="the server's --no-weight-blocks")
    su.add_argument("--steps", type=positive_int, default=240, help="measured serving steps to score the models on")
    su.add_argument("--near-threshold", type=non_negative_int, default=60, metavar="STEPS",
                    help="where the engine has a thin-product threshold, also score the models on serving steps "
                    "of about that many rows: STEPS at each of five step budgets (0: none)")
    su.add_argument("--out", default="startup_profile.json", help=OUT_HELP)
    stl = sub.add_parser("steps", help="where a server's device time went, from its step log (--step-log): steps "
                         "by the work they held, measured / predicted by the cost model")
    stl.add_argument("files", nargs="+", help="step logs (python -m server --step-log FILE, bench mixed --step-log)")
    stl.add_argument("--target-ms", type=positive_float, default=None,
                     help="a TBT target: count the steps holding RT decodes that took longer")
    stl.add_argument("--profile", default=None,
                     help="the start-up profile that server measured (bench mixed --step-log keeps it as "
                          "<out>_<system>_profile.json): price every step again from it, by the cost model with "
                          "and without its per-kind correction (one server's log per file)")
    stl.add_argument("--out", default="steps.json", help=OUT_HELP)
    ind = sub.add_parser("independence", help="cpu:2: does a busy device slow the other's short chats? "
                         "(device actors vs lock-step)")
    ind.add_argument("--chats", type=positive_int, default=8)
    ind.add_argument("--max-tokens", type=positive_int, default=64)
    ind.add_argument("--longs", type=positive_int, default=8)
    ind.add_argument("--long-tokens", type=positive_int, default=512)
    ind.add_argument("--out", default="independence.json", help=OUT_HELP)
    pr = sub.add_parser("profile", help="fit the iteration cost model from our engine's measured steps")
    pr.add_argument("--max-num-seqs", type=positive_int, default=64)
    pr.add_argument("--out", default="cost_smollm2_cpu.json",
                    help=OUT_HELP + " (the fitted preset, sim-tandem, sim-validate and bros-bound read the "
                         "default one; their --fitted names another)")
    sm = sub.add_parser("sim", help="simulated FCFS at paper scale (or with the fitted cost model)")
    sm.add_argument("--rates", nargs="+", type=positive_float, default=[1, 2, 3, 4, 5, 6, 7, 8])
    sx = sub.add_parser("sim-mixed", help="simulated RT + always-pending BE jobs per policy (paper scale)")
    sx.add_argument("--policies", nargs="+", default=["fcfs", "rr", "bros"])
    sx.add_argument("--rates", nargs="+", type=positive_float, default=[1, 2, 3, 4])
    sx.add_argument("--be-job-size", type=positive_int, default=32)
    sm.add_argument("--out", default=None, help=OUT_HELP + " (default: sim_<preset>_fcfs.json); its plot beside it")
    sx.add_argument("--out", default=None, help=OUT_HELP + " (default: sim_mixed_<preset>.json); its plots beside it")
    for p in (sm, sx):
        fitted_arg(p)
        p.add_argument("--preset", default="opt13b", choices=["opt13b", "fitted"],
                       help="opt13b: OPT-13B on an A100 (paper scale); fitted: SmolLM2 on this CPU, " + FITTED_HELP)
        p.add_argument("--num-requests", type=positive_int, default=1000)
        p.add_argument("--kv-tokens", type=positive_int, default=40000, help="pool size in tokens (fitted preset)")
        p.add_argument("--max-num-seqs", type=positive_int, default=256)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--ttft-factor", type=float, default=10.0)
        p.add_argument("--tbt-factor", type=float, default=5.0)
    sa = sub.add_parser("sim-apt", help="simulated Apt-Serve vs FCFS at paper scale: effective throughput, ablations")
    sa.add_argument("--systems", nargs="+", default=["fcfs", "fcfs-prefill-first", "aptserve", "aptserve-s",
                                                     "aptserve-s-kv", "aptserve-s-fcfs"])
    sa.add_argument("--out", default="sim_aptserve.json", help=OUT_HELP)
    sa.add_argument("--datasets", nargs="+", default=["sharegpt", "long"], choices=["sharegpt", "long"])
    sa.add_argument("--num-requests", type=positive_int, default=1000)
    sa.add_argument("--max-num-seqs", type=positive_int, default=256)
    sa.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    sa.add_argument("--slo-ttft-s", type=float, default=1.0,
                    help="ShareGPT TTFT SLO in seconds (the paper's Table 3 for OPT-13B: 1.0; long prompts 4x)")
    sa.add_argument("--slo-tbt-s", type=float, default=1.0, help="P99 TBT SLO in seconds (Table 3: 1.0)")
    sa.add_argument("--ttft-factor", type=float, default=None,
                    help="instead: ShareGPT TTFT SLO = factor x the unloaded TTFT (this bench's other runs: 10)")
    sa.add_argument("--tbt-factor", type=float, default=None, help="instead: P99 TBT SLO = factor x unloaded (5)")
    sa.add_argument("--target", type=float, default=0.9, help="attainment that defines effective throughput")
    sa.add_argument("--search", nargs=2, type=float, default=[1.0, 16.0], metavar=("LO", "HI"))
    sa.add_argument("--search-long", nargs=2, type=float, default=[0.125, 4.0], metavar=("LO", "HI"))
    sa.add_argument("--rel-tol", type=float, default=0.05)
    sa.add_argument("--ablation-systems", nargs="+", default=["aptserve-kv", "aptserve-fcfs", "aptserve",
                                                              "aptserve-s-kv", "aptserve-s-fcfs", "aptserve-s"])
    sa.add_argument("--ablation-rates", nargs="*", type=float, default=[3.0, 6.0])
    sa.add_argument("--ablation-rates-long", nargs="*", type=float, default=[0.5, 1.0])
    sa.add_argument("--cvs", nargs="+", type=positive_float, default=[1.0, 5.0, 10.0])
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--samples", type=positive_int, default=1,
                    help="traces per dataset: the first pairs, then random draws (seeds 1..) with arrival seeds seed+k")
    sl = sub.add_parser("sim-alise", help="simulated ALISE vs FCFS vs an oracle at paper scale: normalized "
                        "latency vs rate, swap vs recompute")
    sl.add_argument("--systems", nargs="+", default=["fcfs", "alise", "alise-oracle", "alise-recompute"])
    sl.add_argument("--rates", nargs="+", type=positive_float, default=[0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6])
    sl.add_argument("--num-requests", type=positive_int, default=1000)
    sl.add_argument("--max-num-seqs", type=positive_int, default=256)
    sl.add_argument("--host-gbps", type=float, default=25.0, help="device-host link for swaps, GB/s")
    sl.add_argument("--swap-gib", type=float, default=64.0, help="host memory for swapped caches")
    sl.add_argument("--bar", type=float, default=2.0,
                    help="latency bar = this x FCFS's normalized latency at the lowest rate")
    sl.add_argument("--noise", nargs="+", type=float, default=[0.25, 0.5, 0.75, 1.0],
                    help="log-normal σ of each alise-noise system (the true lengths times exp(σz))")
    sl.add_argument("--seed", type=int, default=0)
    sl.add_argument("--tuning-range", action="store_true",
                    help="draw the trace from records before 15,000 (the predictor's training range: oracle and "
                         "FCFS only make sense there), to check a scheduling choice without the held-out set")
    sl.add_argument("--out", default="sim_alise.json", help=OUT_HELP)
    stn = sub.add_parser("sim-tandem", help="simulated tandem vs each single policy and its ablations at paper "
                         "scale: RT attainment, effective throughput, RT normalized latency, BE requests/s")
    stn.add_argument("--systems", nargs="+", default=["fcfs", "bros", "aptserve", "alise", "tandem",
                                                      "tandem-no-slo", "tandem-no-lengths", "tandem-no-hidden",
                                                      "tandem-recompute"])
    stn.add_argument("--rates", nargs="+", type=positive_float, default=[1, 2, 3, 4])
    stn.add_argument("--num-requests", type=positive_int, default=1000)
    stn.add_argument("--max-num-seqs", type=positive_int, default=256)
    stn.add_argument("--be-job-size", type=positive_int, default=32)
    stn.add_argument("--ttft-factor", type=float, default=10.0)
    stn.add_argument("--tbt-factor", type=float, default=5.0)
    stn.add_argument("--host-gbps", type=float, default=None,
                     help="device-host link for swaps, GB/s (default: 25, a PCIe link; fitted: 5, a copy)")
    stn.add_argument("--swap-gib", type=float, default=64.0, help="host memory for swapped caches")
    stn.add_argument("--seed", type=int, default=0)
    stn.add_argument("--seeds", nargs="+", type=int, default=None, help="run each seed in turn (a table each)")
    stn.add_argument("--preset", default="opt13b", choices=["opt13b", "fitted"],
                     help="opt13b: OPT-13B on an A100 (paper scale); fitted: SmolLM2 on this CPU, the cost model "
                          "`python -m bench profile` fitted (its pool, KV bytes and slower host copies), "
                          + FITTED_HELP)
    fitted_arg(stn)
    stn.add_argument("--be-scale", type=float, default=1.0,
                     help="BE prompt and output lengths scaled by this (the mixed bench's --be-scale)")
    stn.add_argument("--kv-tokens", type=positive_int, default=None,
                     help="the device's KV pool in tokens (default: an A100-40GB's for OPT-13B, 12k)")
    stn.add_argument("--slower", type=positive_float, default=1.0,
                     help="every step takes this many times its cost model's time (a machine slower than its "
                          "profile; the policies learn it only from the steps they see)")
    stn.add_argument("--slo-ttft-s", type=float, default=None, help="TTFT target in seconds (default: --ttft-factor)")
    stn.add_argument("--slo-tbt-s", type=float, default=None, help="TBT target in seconds (default: --tbt-factor)")
    stn.add_argument("--max-output", type=positive_int, default=1024, help="RT replies are cut to this many tokens")
    stn.add_argument("--late-after", type=float, default=0.5,
                     help="tandem systems: the part of its TTFT target a chat's prompt waits before look-ahead "
                          "admission stops keeping it out")
    stn.add_argument("--out", default="sim_tandem.json", help=OUT_HELP)
    ia = sub.add_parser("int8-accuracy", help="perplexity and greedy agreement of SmolLM2 with int8 KV vs full "
                        "precision on held-out ShareGPT replies (HF transformers)")
    ia.add_argument("--num-pairs", type=positive_int, default=200)
    ia.add_argument("--max-prompt", type=positive_int, default=512)
    ia.add_argument("--max-reply", type=positive_int, default=256)
    ia.add_argument("--threads", type=positive_int, default=1)
    ia.add_argument("--out", default="int8_accuracy.json", help=OUT_HELP)
    ik = sub.add_parser("int8-kv", help="the resident int8 cache vs the model's dtype on SmolLM2: bytes per token, "
                        "decode step time, throughput of held-out ShareGPT prompts in a small pool")
    ik.add_argument("--batches", nargs="+", type=positive_int, default=[1, 16, 32])
    ik.add_argument("--contexts", nargs="+", type=positive_int, default=[256, 1024])
    ik.add_argument("--rounds", type=positive_int, default=6, help="alternating timed rounds per point")
    ik.add_argument("--steps", type=positive_int, default=5, help="decode steps per round")
    ik.add_argument("--num-prompts", type=positive_int, default=64, help="0: skip the memory-pressure run")
    ik.add_argument("--max-prompt", type=positive_int, default=512)
    ik.add_argument("--max-output", type=positive_int, default=256)
    ik.add_argument("--kv-cache-mib", type=float, default=128)
    ik.add_argument("--max-num-seqs", type=positive_int, default=32)
    ik.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    ik.add_argument("--out", default="int8_kv.json", help=OUT_HELP)
    stk = sub.add_parser("same-tokens", help="greedy replies of held-out ShareGPT prompts run together and each "
                         "alone, and alone again with the prompt cached, per dtype: how many change")
    stk.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    stk.add_argument("--num-prompts", type=positive_int, default=20)
    stk.add_argument("--max-prompt", type=positive_int, default=256)
    stk.add_argument("--max-tokens", type=positive_int, default=60)
    stk.add_argument("--out", default="same_tokens.json", help=OUT_HELP)
    pc = sub.add_parser("prefix-cache", help="prefix caching off vs on, SmolLM2: chats about one document "
                        "(held-out ShareGPT), time to first token one by one and a batch's throughput")
    pc.add_argument("--num-questions", type=positive_int, default=8, help="chats one by one, and as many in the batch")
    pc.add_argument("--doc-min", type=positive_int, default=600, help="the document's tokens, at least")
    pc.add_argument("--doc-max", type=positive_int, default=900, help="the document's tokens, at most")
    pc.add_argument("--max-question", type=positive_int, default=64, help="a question's tokens, at most")
    pc.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per chat in the batch")
    pc.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads in the worker (default: all cores)")
    pc.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                    help="a KV pool of this many tokens (default: the engine's default pool)")
    pc.add_argument("--out", default="prefix_cache.json", help=OUT_HELP)
    pr = sub.add_parser("prefix-routing", help="multi-turn chats on cpu:2, SmolLM2: prefix caching off, on with "
                        "placement by load, on with cache-aware routing")
    pr.add_argument("--num-chats", type=positive_int, default=12, help="held-out ShareGPT conversations")
    pr.add_argument("--turns", type=positive_int, default=4, help="user turns replayed per conversation")
    pr.add_argument("--max-prompt", type=positive_int, default=1200, help="the last turn's prompt tokens, at most")
    pr.add_argument("--max-tokens", type=positive_int, default=1, help="output tokens per turn")
    pr.add_argument("--repeats", type=positive_int, default=2, help="runs of each setting, in turn")
    pr.add_argument("--out", default="prefix_routing.json", help=OUT_HELP)
    ov = sub.add_parser("overhead", help="time per scheduling decision on random snapshots, and per step "
                        "with a queue of waiting requests (no model)")
    ov.add_argument("--candidates", nargs="+", type=positive_int, default=[50, 400, 1600])
    ov.add_argument("--repeats", type=positive_int, default=50)
    ov.add_argument("--waiting", nargs="+", type=positive_int, default=[10, 100, 1000],
                    help="queue lengths for the per-step planning of a device")
    ov.add_argument("--steps", type=positive_int, default=60, help="steps timed at each queue length")
    ov.add_argument("--out", default="sched_overhead.json", help=OUT_HELP)
    sv = sub.add_parser("sim-validate", help="simulate the trace of the last `online` run and compare")
    sv.add_argument("--max-num-seqs", type=positive_int, default=64)
    sv.add_argument("--max-output", type=positive_int, default=512)
    sv.add_argument("--real", default="online.json",
                    help="result file of the real run, in the results dir (`bench online`'s default --out); the "
                         "cost model: " + FITTED_HELP)
    fitted_arg(sv)
    sv.add_argument("--out", default="sim_validate.json", help=OUT_HELP)
    bb = sub.add_parser("bros-bound", help="the most BE throughput the cost model allows at an RT latency target")
    bb.add_argument("--real", default="mixed.json",
                    help="a `mixed` result file, in the results dir (`bench mixed`'s default --out); the cost "
                         "model: " + FITTED_HELP)
    fitted_arg(bb)
    bb.add_argument("--out", default="bros_bound.json", help=OUT_HELP)
    bb.add_argument("--duration", type=float, default=90.0, help="the mixed run's --duration")
    bb.add_argument("--max-output", type=positive_int, default=512)
    bb.add_argument("--be-pool", type=positive_int, default=256)
    bb.add_argument("--seed", type=int, default=0)
    ml = sub.add_parser("sim-mell", help="multi-device placement at paper scale: Mell vs BF / WF / LB")
    ml.add_argument("--policies", nargs="+", default=["mell", "lb", "bf", "wf"], choices=["mell", "lb", "bf", "wf"])
    ml.add_argument("--traces", nargs="+", default=["sharegpt", "long"], choices=["sharegpt", "long"])
    ml.add_argument("--rates", nargs="+", type=positive_float, default=[0.5, 0.8, 1.1],
                    help="ShareGPT x10 arrivals (req/s)")
    ml.add_argument("--rates-long", nargs="+", type=float, default=[0.1, 0.2], help="long-prompt arrivals (req/s)")
    ml.add_argument("--cvs", nargs="+", type=positive_float, default=[1.0, 3.0],
                    help="1: Poisson; >1: bursty Gamma gaps")
    ml.add_argument("--duration", type=float, default=1200.0, help="seconds of arrivals")
    ml.add_argument("--tbt-ms", type=positive_float, default=50.0, help="time per output token of every request")
    ml.add_argument("--seed", type=int, default=0)
    ml.add_argument("--out", default="sim_mell.json",
                    help=OUT_HELP + "; its timeline plot beside it (<stem>_timeline.png)")
    sk = sub.add_parser("skew", help="two devices: static placement vs migrating ones as request sizes diverge")
    sk.add_argument("--placements", nargs="*", default=["static", "lb", "mell"], choices=["static", "mell", "lb", "bf", "wf"],
                    help="none: the migration sweep alone")
    sk.add_argument("--devices", default="cpu:2", help="two workers: cpu:2, or cuda:0,0 (one GPU) / cuda:0,1")
    sk.add_argument("--model", default="smollm2", help="smollm2-random where the packaged model is not installed")
    sk.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    sk.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    sk.add_argument("--drain", type=float, default=180.0, help="seconds to wait after the last arrival")
    sk.add_argument("--long-share", type=float, default=0.35, help="fraction of requests with long outputs")
    sk.add_argument("--long", type=positive_int, default=320, help="output tokens of a long request")
    sk.add_argument("--short", type=positive_int, default=16, help="output tokens of a short request")
    sk.add_argument("--pool-tokens", type=positive_int, default=1536, help="KV cache per device, in tokens")
    sk.add_argument("--interval", type=float, default=0.5, help="rebalancer epoch, seconds")
    sk.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    sk.add_argument("--slo-tbt-ms", type=float, default=200.0, help="the re-prefill budget keeps decodes within it")
    sk.add_argument("--sweep", nargs="*", type=positive_int, default=[64, 256, 1024, 1792],
                    help="context lengths for the pause-per-migration table (none: skip it)")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--out", default="skew.json", help=OUT_HELP)
    cub = sub.add_parser("chat-under-batch", help="chat TTFT while a large batch job runs, per policy "
                         "(default: the server's default policy against fcfs)")
    cub.add_argument("--policies", nargs="+", default=["default", "fcfs"],
                     help="'default' starts the server with no --policy")
    cub.add_argument("--lines", type=positive_int, default=2000, help="batch job lines (ShareGPT prompts)")
    cub.add_argument("--line-tokens", type=positive_int, default=128,
                     help="cap on a line's output tokens (its reply length)")
    cub.add_argument("--idle", type=positive_int, default=5, help="chats on the idle server first")
    cub.add_argument("--chats", type=positive_int, default=20, help="chats while the job runs")
    cub.add_argument("--every", type=float, default=3.0, help="seconds between those chats")
    cub.add_argument("--chat-tokens", type=positive_int, default=8)
    cub.add_argument("--max-num-seqs", type=positive_int, default=64)
    cub.add_argument("--seed", type=int, default=0)
    cub.add_argument("--out", default="chat_under_batch.json",
                     help=OUT_HELP + "; each server's log beside it (<stem>_<policy>.log)")
    sk = sub.add_parser("soak", help="mixed load (streams, disconnects, batch jobs) for minutes: memory, "
                        "open files, pool and errors at the start and the end")
    sk.add_argument("--minutes", type=float, default=10.0)
    sk.add_argument("--rate", type=float, default=0.5, help="chat streams per second (Poisson)")
    sk.add_argument("--leave-every", type=positive_int, default=5, help="every n-th chat client leaves mid-stream")
    sk.add_argument("--job-lines", type=positive_int, default=20, help="lines per batch job (jobs run back to back)")
    sk.add_argument("--max-output", type=positive_int, default=128)
    sk.add_argument("--max-num-seqs", type=positive_int, default=64)
    sk.add_argument("--sample-s", type=float, default=30.0)
    sk.add_argument("--warmup-s", type=float, default=30.0)
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--out", default="soak.json", help=OUT_HELP + "; the server's log beside it")
    kn = sub.add_parser("kernels", help="the paged decode attention's GB/s against the device's copy (CUDA: Triton; "
                                        "--cpu: the compiled CPU kernel)")
    kn.add_argument("--shapes", nargs="+", default=["llama8b", "opt13b", "smollm2"],
                    choices=["llama8b", "opt13b", "smollm2"])
    kn.add_argument("--batch", type=positive_int, default=64)
    kn.add_argument("--ctx", type=positive_int, default=2048)
    kn.add_argument("--block-size", type=positive_int, default=16)
    kn.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    kn.add_argument("--cpu", action="store_true",
                    help="the compiled CPU kernel on one thread against one core's copy bandwidth instead (float32 and int8)")
    kn.add_argument("--prefill", action="store_true",
                    help="with --cpu: a prompt chunk over a cached prefix, SDPA over the gathered prefix against "
                         "the compiled kernel, per chunk size and prefix (<stem>_prefill.json)")
    kn.add_argument("--accuracy", action="store_true",
                    help="max abs error per kernel and dtype against float64 instead (CPU: under Triton's interpreter)")
    kn.add_argument("--hidden-batch", type=positive_int, default=8, help="requests of the hidden-cache decode case")
    kn.add_argument("--hidden-ctx", type=positive_int, default=1024, help="context of the hidden-cache decode case")
    kn.add_argument("--sweep", action="store_true",
                    help="time every launch setting of the decode kernel (tile, warps, context parts) instead")
    kn.add_argument("--sweep-batch", type=positive_int, default=16,
                    help="--sweep: the batch at which the parts are tried again with each shape's best tile")
    kn.add_argument("--out", default="kernels.json",
                    help=OUT_HELP + " (--sweep: <stem>_sweep.json; --accuracy: <stem>_accuracy.json)")
    go = sub.add_parser("gpu-offline", help="our engine vs HF generate on one device, random weights at real shapes")
    go.add_argument("--models", nargs="+", default=["smollm2-random", "llama8b-random"])
    go.add_argument("--devices", default="cuda:0")
    go.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    go.add_argument("--batch", type=positive_int, default=64)
    go.add_argument("--prompt-len", type=positive_int, default=128)
    go.add_argument("--max-tokens", type=positive_int, default=128)
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--out", default="gpu_offline.json", help=OUT_HELP)
    ln = sub.add_parser("lengths", help="write bench/data/sharegpt_lengths.json (ShareGPT's token lengths, "
                        "for traces where the dataset cannot go)")
    ln.add_argument("--n", type=positive_int, default=4000)
    args = ap.parse_args(argv)
    check_ranges(ap, args)
    try:
        _run(args)
    except USER_ERRORS as e:
        if os.environ.get("TANDEM_BENCH_TRACEBACK"):
            raise
        sys.exit(f"{prog} {args.cmd}: {type(e).__name__}: {e}")


def _run(args) -> None:
    """Run the subcommand ``args.cmd`` names."""
    if args.cmd == "offline":
        from tandem.bench.offline import main as offline
        offline(args)
    elif args.cmd in ("profile", "sim", "sim-validate", "sim-mixed"):
        from tandem.bench import sim_cli
        {"profile": sim_cli.profile, "sim": sim_cli.sim, "sim-validate": sim_cli.sim_validate,
         "sim-mixed": sim_cli.sim_mixed}[args.cmd](args)
    elif args.cmd == "online":
        from tandem.bench.online import main as online
        online(args)
    elif args.cmd == "table":
        from tandem.bench.table import run
        run(args)
    elif args.cmd == "sim-apt":
        from tandem.bench.sim_apt import run as sim_apt
        sim_apt(args)
    elif args.cmd == "sim-alise":
        from tandem.bench.sim_alise import run as sim_alise
        sim_alise(args)
    elif args.cmd == "sim-tandem":
        from tandem.bench.sim_tandem import run as sim_tandem
        sim_tandem(args)
    elif args.cmd == "int8-accuracy":
        from tandem.bench.int8_accuracy import run as int8_accuracy
        int8_accuracy(args)
    elif args.cmd == "same-tokens":
        from tandem.bench.same_tokens import run as same_tokens
        same_tokens(args)
    elif args.cmd == "prefix-routing":
        from tandem.bench.prefix_routing import run as prefix_routing
        prefix_routing(args)
    elif args.cmd == "prefix-cache":
        from tandem.bench.prefix_cache import run as prefix_cache
        prefix_cache(args)
    elif args.cmd == "int8-kv":
        from tandem.bench.int8_kv import run as int8_kv
        int8_kv(args)
    elif args.cmd == "independence":
        from tandem.bench import independence
        independence.main(args)
    elif args.cmd == "streams":
        from tandem.bench import streams
        streams.main(args)
    elif args.cmd == "steps":
        from tandem.bench import steps
        steps.main(args)
    elif args.cmd == "startup-profile":
        from tandem.bench import startup_profile
        startup_profile.main(args)
    elif args.cmd == "cpu-linear":
        from tandem.bench import cpu_linear
        cpu_linear.main(args)
    elif args.cmd == "sliding-window":
        from tandem.bench import sliding_window
        sliding_window.main(args)
    elif args.cmd == "lora":
        from tandem.bench import lora
        lora.main(args)
    elif args.cmd == "step-profile":
        from tandem.bench import step_profile
        step_profile.main(args)
    elif args.cmd == "overhead":
        from tandem.bench.overhead import run as overhead
        overhead(args)
    elif args.cmd == "bros-bound":
        from tandem.bench.bros_bound import run as bros_bound
        bros_bound(args)
    elif args.cmd == "sim-mell":
        from tandem.bench.sim_mell import run as sim_mell
        sim_mell(args)
    elif args.cmd == "skew":
        from tandem.bench import skew
        skew.main(args)
    elif args.cmd == "chat-under-batch":
        from tandem.bench.chat_under_batch import run as chat_under_batch
        chat_under_batch(args)
    elif args.cmd == "soak":
        from tandem.bench.soak import run as soak
        soak(args)
    elif args.cmd == "kernels":
        from tandem.bench.kernels import run as kernels
        kernels(args)
    elif args.cmd == "lengths":
        from tandem.bench.output import IN_CHECKOUT
        if not IN_CHECKOUT:
            raise ValueError("it rewrites the data file the package ships (bench/data): run it in a checkout")
        from tandem.bench.workloads import write_lengths
        from tandem.engine.models.loader import load_tokenizer, resolve_model
        from tandem.sched.llm import DEFAULT_CACHE_DIR
        print("wrote", write_lengths(load_tokenizer(resolve_model("smollm2", DEFAULT_CACHE_DIR)), args.n))
    elif args.cmd == "gpu-offline":
        from tandem.bench.gpu_offline import run as gpu_offline
        gpu_offline(args)
    elif args.cmd == "mixed":
        from tandem.bench.online import mixed
        mixed(args)


if __name__ == "__main__":
    main(prog=f"python -m {__spec__.parent}")        # bench, or tandem.bench when installed
