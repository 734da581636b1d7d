"""python -m bench int8-kv: what the resident int8 cache (``--kv-cache-dtype int8``) buys and
costs on the real engine, SmolLM2 on this CPU, against the cache at the model's dtype.

1. Memory: bytes per cached token, and the tokens a fixed budget holds once the open blocks'
   full-precision staging (max_num_seqs requests' worth) is reserved out of it.
2. Decode step time at fixed batch sizes and context lengths, with memory to spare: the cost
   of reading int8 rows and compressing blocks as they fill.
3. Throughput under memory pressure: held-out ShareGPT prompts with their real reply lengths,
   all submitted at once to a small pool; int8 fits more requests per step and preempts less.

Both configurations run in this process (one engine, no server), on the same prompts.
"""
from __future__ import annotations

import os
import time

import torch

from tandem.bench.output import save_json

DTYPES = ("auto", "int8")


def _engine(kv_dtype: str, budget: int, max_num_seqs: int, threads: int):
    from tandem.engine.dtype import resolve_dtype
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    from tandem.sched.scheduler import SchedConfig, Scheduler
    hf_dir = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    spec = load_spec(hf_dir)
    dtype, _ = resolve_dtype("auto", "cpu")
    dev = InProcessDevice("cpu", WorkerConfig(str(hf_dir), spec, dtype, "cpu", 16, budget, None, 1, threads,
                                              False, True, None, kv_dtype, max_num_seqs))
    sched = Scheduler(SchedConfig(max_num_seqs=max_num_seqs, kv_cache_dtype=kv_dtype), [dev],
                      spec.eos_token_ids, spec.max_model_len)
    return dev, sched


def _full_block_bytes(dev) -> int:
    L, H, _, D = dev.runner.pool.shape
    return L * H * D * dev.runner.block_size * torch.empty((), dtype=dev.runner.pool.dtype).element_size()


def _staging_blocks(dev) -> int:
    pool = dev.runner.pool
    return pool.stage.shape[2] // pool.block_size if dev.runner.int8 else 0


def _decode_engine(kv_dtype: str, batch: int, context: int, new_tokens: int, threads: int):
    """An engine holding ``batch`` requests of ``context`` random prompt tokens, prefilled."""
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.engine.params import SamplingParams
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    from tandem.sched.request import Request
    spec = load_spec(resolve_model("smollm2", DEFAULT_CACHE_DIR))
    fp32_per_token = 2 * spec.num_layers * spec.unit * 4
    budget = int(1.2 * batch * (context + new_tokens + 32) * fp32_per_token) + (64 << 20)
    dev, sched = _engine(kv_dtype, budget, batch, threads)
    g = torch.Generator().manual_seed(batch * 7919 + context)
    for i in range(batch):
        ids = torch.randint(100, 40000, (context,), generator=g).tolist()
        sched.add(Request(f"d{i}", ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)))
    while any(st.num_computed < len(st.request.prompt_token_ids) for st in sched.states.values()):
        sched.step()
    return sched


def decode_steps(batch: int, context: int, rounds: int, steps: int, threads: int) -> dict[str, float]:
    """Median seconds per decode step of ``batch`` requests at about ``context`` tokens, per KV
    dtype: both engines are loaded at once and timed in alternating rounds of ``steps`` steps,
    so the machine's drift falls on both alike."""
    import statistics
    # requests decode while the others' prompts are chunked in: room for those tokens too
    new_tokens = (rounds + 1) * steps + 16 + batch * context // 1024
    scheds = {d: _decode_engine(d, batch, context, new_tokens, threads) for d in DTYPES}
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for r in range(rounds + 1):
        for d, sched in scheds.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                sched.step()
            if r:                                        # round 0 warms up
                times[d].append((time.perf_counter() - t0) / steps)
    for d, sched in scheds.items():
        if sched.queues[0].num_preemptions or len(sched.actors[0].running) != batch:
            raise RuntimeError(f"batch {batch} x {context} tokens did not stay resident ({d})")
    return {d: statistics.median(t) for d, t in times.items()}


def pressure(kv_dtype: str, pairs, budget: int, max_num_seqs: int, threads: int) -> dict:
    """Run every prompt to its real reply length in a pool of ``budget`` bytes."""
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request
    dev, sched = _engine(kv_dtype, budget, max_num_seqs, threads)
    for i, (ids, n) in enumerate(pairs):
        sched.add(Request(f"p{i}", ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
    steps, batch_sum, t0 = 0, 0, time.perf_counter()
    while sched.has_unfinished():
        sched.step()
        steps += 1
        batch_sum += len(sched.actors[0].running)
    wall = time.perf_counter() - t0
    out_tokens = sum(n for _, n in pairs)
    info = dev.pool_info
    return {"kv_cache_dtype": kv_dtype, "pool_blocks": info.num_blocks,
            "pool_tokens": info.num_blocks * info.block_size // 2, "block_bytes": info.block_bytes,
            "staging_reserved_bytes": _staging_blocks(dev) * _full_block_bytes(dev),
            "staging_peak_bytes": getattr(dev.runner.pool, "peak_open", 0) * _full_block_bytes(dev),
            "wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "mean_running": batch_sum / max(1, steps), "steps": steps,
            "preemptions": sum(q.num_preemptions for q in sched.queues)}


def run(args) -> dict:
    from tandem.bench.workloads import chat_ids, sharegpt_prompts
    from tandem.predictor.data import length_tokenizer
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    res: dict = {"threads": threads, "decode": [], "pressure": []}
    print(f"SmolLM2, {threads} threads, block 16 tokens\n\n"
          "| batch | context | step ms (auto) | step ms (int8) | int8 / auto |\n|---|---|---|---|---|")
    for batch in args.batches:
        for ctx in args.contexts:
            t = decode_steps(batch, ctx, args.rounds, args.steps, threads)
            res["decode"].append({"batch": batch, "context": ctx, **{f"step_s_{d}": t[d] for d in DTYPES}})
            print(f"| {batch} | {ctx} | {t['auto'] * 1e3:.1f} | {t['int8'] * 1e3:.1f} | "
                  f"{t['int8'] / t['auto']:.2f} |", flush=True)
    if not args.num_prompts:
        return _save(res, args.out)
    tok = length_tokenizer()
    pairs = []
    for p in sharegpt_prompts(args.num_prompts, tok, max_prompt_tokens=args.max_prompt, held_out=True):
        n = min(args.max_output, len(tok(p.reply, add_special_tokens=False)["input_ids"]))
        if n:
            pairs.append((chat_ids(tok, p.prompt), n))
    budget = int(args.kv_cache_mib * 2**20)
    print(f"\n{len(pairs)} held-out ShareGPT prompts, real reply lengths up to {args.max_output}, all at once, "
          f"{args.kv_cache_mib:g} MiB budget, max {args.max_num_seqs} requests at once\n\n"
          "| KV | bytes/token | pool tokens | open-block staging (in the budget) | mean batch | preemptions | "
          "output tok/s | wall s |\n|---|---|---|---|---|---|---|---|")
    for d in DTYPES:
        r = pressure(d, pairs, budget, args.max_num_seqs, threads)
        res["pressure"].append(r)
        print(f"| {d} | {2 * r['block_bytes'] // 16} | {r['pool_tokens']} | "
              f"{r['staging_reserved_bytes'] / 2**20:.1f} MiB (peak {r['staging_peak_bytes'] / 2**20:.1f}) "
              f"| {r['mean_running']:.1f} | {r['preemptions']} | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} |",
              flush=True)
    return _save(res, args.out)


def _save(res: dict, name: str) -> dict:
    save_json(name, res)
    return res
