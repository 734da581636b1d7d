"""python -m bench sliding-window: what applying a model's sliding window saves per decode step.

A random Mistral-shaped model at SmolLM2's width (d_model 576, 9 query and 3 KV heads of 64)
is written once with full attention and once per window; each serves the same requests of
``--context`` prompt tokens through ``LLM`` (one CPU worker). The prompts are generated once
first, so the timed run finds them in the prefix cache and its time is decode steps: the
table gives the mean step, and how many context rows each decode reads.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tandem.bench.output import save_json


def decode_step_ms(llm, prompts: list[list[int]], steps: int, **generate_kw) -> float:
    """Mean ms of a decode step of ``prompts`` together: generated once first, so the timed runs
    find them in the prefix cache, then the time of ``steps`` more tokens beyond the first two
    (``generate_kw``: more of generate's arguments)."""
    from tandem import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), **generate_kw)
        return time.perf_counter() - t0
    run(2)                                          # prefill once: later runs find the prompts cached
    first = run(2)
    return (run(steps + 2) - first) / steps * 1000


def _step_ms(model_dir: Path, requests: int, context: int, steps: int) -> float:
    from tandem import LLM
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(context)] for i in range(requests)]
    with LLM(str(model_dir), "cpu", dtype="float32", threads_per_worker=1, policy="fcfs",
             max_num_seqs=requests) as llm:
        return decode_step_ms(llm, prompts, steps)


def main(args) -> None:
    from tandem.engine.models.tiny import write_tiny_model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for window in [None, *args.windows]:
            d = write_tiny_model(Path(tmp) / f"w{window}", "mistral", seed=1, vocab_size=4096, d_model=576,
                                 num_layers=args.layers, num_heads=9, num_kv_heads=3,
                                 max_len=args.context + args.steps + 8, config={"sliding_window": window})
            ms = _step_ms(d, args.requests, args.context, args.steps)
            rows.append({"window": window, "rows_read": min(window or args.context, args.context), "step_ms": ms})
            print(f"window {window or 'none'}: {ms:.1f} ms per decode step", flush=True)
    base = rows[0]["step_ms"]
    print(f"\n{args.requests} requests of {args.context} prompt tokens, {args.layers} layers, float32, one worker\n")
    print("| window | context rows each decode reads | decode step ms | vs full attention |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['window'] or 'none'} | {r['rows_read']:,} | {r['step_ms']:.1f} | {base / r['step_ms']:.2f}x |")
    save_json(args.out, {"requests": args.requests, "context": args.context, "layers": args.layers,
                         "steps": args.steps, "rows": rows})
