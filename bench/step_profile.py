"""Where a decode step's time goes at batch B, inside the worker and around it.

Two measurements on SmolLM2 (the dtype ``LLM`` picks unless told):

1. Serving core, real worker process: B prompts decode together through ``LLM.generate``; each
   of the actor's steps that is all decodes at batch B is timed in its phases -- plan (snapshot,
   policy, block books), submit (pickling the StepInput and writing the pipe), the wait for the
   StepOutput (the worker's forward and sampling, which the worker times itself, plus the IPC
   and the worker's own bookkeeping around them) and account (tokens, stops, updates).
2. Inside the forward, in this process: the same decode batch on an in-process device under
   torch.profiler, each op's own time put in one bucket: GEMMs (the projections and the LM
   head), attention, RMSNorm, rotary embeddings, sampling, other tensor ops; what the profiler
   does not see is Python (metadata building, op dispatch).
"""
from __future__ import annotations

import statistics
import time

from tandem.bench.output import save_json

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm", "mkldnn::_linear_pointwise"}
LABELS = ("GEMMs", "attention", "rms_norm", "rotary", "sampling")   # GEMMs: engine.linear's calls


def _prompts(n: int):
    from tandem.bench.workloads import chat_ids, sharegpt_prompts
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    tok = load_tokenizer(resolve_model("smollm2", DEFAULT_CACHE_DIR))
    return [chat_ids(tok, p.prompt) for p in sharegpt_prompts(n, tok)]


def serving_phases(batch: int, max_tokens: int, dtype: str) -> tuple[dict, str]:
    """Mean ms per all-decode step at ``batch`` in each phase of the actor loop."""
    from tandem import LLM, SamplingParams
    rows: list[dict] = []
    with LLM("smollm2", "cpu:1", dtype=dtype, max_num_seqs=batch) as llm:
        actor, dev = llm.scheduler.actors[0], llm._workers[0]
        cur: dict = {}

        def timed(name, fn):
            def run(*a):
                t = time.perf_counter()
                out = fn(*a)
                cur[name] = time.perf_counter() - t
                if name == "plan":
                    cur["decodes"] = (len(out.inp.scheduled) if out is not None and all(
                        s.phase.value == "decode" for s in out.inp.scheduled) else 0)
                if name == "collect":
                    cur["forward"], cur["sample"] = out.forward_s, out.sample_s
                if name == "account":
                    if cur.get("decodes") == batch:
                        rows.append(dict(cur))
                    cur.clear()
                return out
            return run
        actor.plan, actor.account = timed("plan", actor.plan), timed("account", actor.account)
        dev.submit, dev.collect = timed("submit", dev.submit), timed("collect", dev.collect)
        llm.generate(_prompts(batch), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        used = llm.dtype
    ms = {k: 1e3 * statistics.mean(r[k] for r in rows) for k in ("plan", "submit", "collect", "account",
                                                                  "forward", "sample")}
    ms["ipc_and_worker_bookkeeping"] = ms["collect"] - ms["forward"] - ms["sample"]
    ms["steps"] = len(rows)
    return ms, used


def forward_buckets(batch: int, dtype: str, steps: int = 8) -> dict:
    """ms per decode step at ``batch`` in each bucket (in-process device under torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import tandem.engine.lora as lora
    import tandem.engine.models.llama as llama
    import tandem.engine.runner as runner
    from tandem.engine.dtype import resolve_dtype
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.engine.params import SamplingParams
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    from tandem.sched.request import Request
    from tandem.sched.scheduler import SchedConfig, Scheduler

    def labelled(name, fn):
        def run(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return run
    hf_dir = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    spec = load_spec(hf_dir)
    dtype, _ = resolve_dtype(dtype, "cpu")
    import os
    threads = os.cpu_count() or 1
    dev = InProcessDevice("cpu", WorkerConfig(str(hf_dir), spec, dtype, "cpu", 16, 1 << 30, None, 1, threads,
                                              False, True))
    sched = Scheduler(SchedConfig(max_num_seqs=batch), [dev], spec.eos_token_ids, spec.max_model_len)
    for i, ids in enumerate(_prompts(batch)):
        sched.add(Request(f"p{i}", ids, SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True)))
    while any(a.waiting for a in sched.actors) or any(
            st.num_computed < len(st.request.prompt_token_ids) for st in sched.states.values()):
        sched.step()
    for _ in range(3):
        sched.step()                                 # warm, all decodes now
    # the compiled kernels' calls are no torch ops, so the profiler sees them only through a label;
    # the projections are engine.linear's, called from the model and from engine.lora's wrapper
    spots = [(llama, "paged_attention", "attention"), (llama, "rms_norm", "rms_norm"), (llama, "apply_rope", "rotary"),
             (runner, "sample", "sampling"), (llama, "linear", "GEMMs"), (lora, "linear", "GEMMs")]
    saved = [getattr(mod, name) for mod, name, _ in spots]
    for (mod, name, label), fn in zip(spots, saved):
        setattr(mod, name, labelled(label, fn))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                sched.step()
            wall = time.perf_counter() - t
    finally:
        for (mod, name, _), fn in zip(spots, saved):
            setattr(mod, name, fn)
    buckets = dict.fromkeys((*LABELS, "other tensor ops"), 0.0)
    for ev in prof.events():
        label, p = None, ev
        while p is not None:
            if p.name in LABELS:
                label = p.name
                break
            p = p.cpu_parent
        key = label or ("GEMMs" if ev.name in GEMM_OPS else "other tensor ops")
        buckets[key] += ev.self_cpu_time_total / 1e3      # us -> ms
    out = {k: v / steps for k, v in buckets.items()}
    out["python and dispatch (unprofiled)"] = max(0.0, 1e3 * wall / steps - sum(out.values()))
    out["step wall"] = 1e3 * wall / steps
    return out


def main(args) -> None:
    phases, dtype = serving_phases(args.batch, args.max_tokens, args.dtype)
    inside = forward_buckets(args.batch, args.dtype)
    print(f"\nDecode step at batch {args.batch}, SmolLM2, {dtype}, one CPU worker "
          f"({phases['steps']} steps timed in the worker process)")
    print("\n| inside the forward (in-process, torch.profiler) | ms/step | share |\n|---|---|---|")
    for k, v in inside.items():
        if k != "step wall":
            print(f"| {k} | {v:.2f} | {v / inside['step wall']:.0%} |")
    print(f"| step wall | {inside['step wall']:.2f} | |")
    loop = sum(phases[k] for k in ("plan", "submit", "collect", "account"))
    print("\n| the serving core around it (worker process) | ms/step | share |\n|---|---|---|")
    for k, label in (("forward", "worker: forward"), ("sample", "worker: sampling"),
                     ("ipc_and_worker_bookkeeping", "pipe, pickling and worker bookkeeping"),
                     ("plan", "actor: plan (snapshot, policy, blocks)"),
                     ("submit", "actor: submit (pickle, write)"), ("account", "actor: account (tokens, stops)")):
        print(f"| {label} | {phases[k]:.2f} | {phases[k] / loop:.0%} |")
    print(f"| actor loop total | {loop:.2f} | |")
    save_json(args.out, {"batch": args.batch, "dtype": dtype, "serving": phases, "forward": inside})
