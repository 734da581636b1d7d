"""The CPU worker's projections in its two weight layouts: panels (engine/csrc/linear.cpp) and
oneDNN's blocked layout (the layout without a compiler), on one thread (``--threads``).

1. Products: every projection and the LM head of SmolLM2 (random weights at its shapes), at
   ``--rows`` rows, each layout in turn, ``--repeats`` rounds; the time to read the weights
   once at one core's read bandwidth is the floor of a small product.
2. Decode steps: SmolLM2 on an in-process device (the compiled attention in both cases),
   ``b`` prompts of 300 tokens decoding together for each of ``--batches``, the median step,
   each layout in turn, ``--repeats`` rounds; the first greedy tokens of each are compared.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch

from tandem.bench.output import save_json


class _WithoutPanels:
    """The compiled kernels with the panel product hidden: the worker then packs for oneDNN."""

    def __init__(self, ops):
        self.paged_decode, self.paged_decode_q8 = ops.paged_decode, ops.paged_decode_q8


@contextlib.contextmanager
def _layout(name: str, ops):
    """engine.kernels.cpu_ops() as the worker sees it while building a device in ``name``'s layout."""
    import tandem.engine.kernels as kernels
    saved = kernels.cpu_ops
    kernels.cpu_ops = (lambda: ops) if name == "panels" else (lambda: _WithoutPanels(ops))
    try:
        yield
    finally:
        kernels.cpu_ops = saved


def _order(names: list[str], round_: int) -> list[str]:
    """Each layout first in every other round, so neither always runs on a machine the other warmed."""
    return names if round_ % 2 == 0 else names[::-1]


def read_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second torch's threads read (summing a buffer larger than the caches)."""
    from tandem.bench.kernels import _median_s
    buf = torch.ones(nbytes // 4)
    return nbytes / _median_s(lambda: buf.sum(), repeats)


def _smollm2():
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    hf = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    return hf, load_spec(hf)


def product_times(spec, ops, rows: list[int], repeats: int) -> dict:
    """ms per sweep over the model's projections and LM head, per layout and row count."""
    from tandem.engine.linear import linear, pack
    d, hd = spec.d_model, spec.head_dim
    layer = [((spec.num_heads + 2 * spec.num_kv_heads) * hd, d), (d, spec.num_heads * hd),
             (2 * spec.intermediate_size, d), (d, spec.intermediate_size)]
    shapes = layer * spec.num_layers + [(spec.vocab_size, d)]
    dense = [torch.randn(o, i) for o, i in shapes]
    weights = {"panels": [pack(w, ops) for w in dense], "oneDNN": [pack(w) for w in dense]}
    ins = [w.shape[1] for w in dense]
    out: dict = {name: {m: [] for m in rows} for name in weights}
    for r in range(repeats):
        for m in rows:
            xs = {k: torch.randn(m, k) for k in set(ins)}
            for name in _order(list(weights), r):
                ws = weights[name]
                for w, k in zip(ws, ins):
                    linear(xs[k], w)                        # warm
                t = time.perf_counter()
                for w, k in zip(ws, ins):
                    linear(xs[k], w)
                out[name][m].append(1e3 * (time.perf_counter() - t))
    return {"bytes": sum(w.numel() * 4 for w in dense), "ms": out}


def step_times(hf, spec, ops, batches: list[int], repeats: int, threads: int, steps: int = 20) -> dict:
    """Median decode-step ms per layout and batch, and each run's first greedy tokens."""
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.profiling import dummy_request, random_ids
    from tandem.sched.scheduler import SchedConfig, Scheduler
    out: dict = {name: {b: [] for b in batches} for name in ("panels", "oneDNN")}
    tokens: dict = {}
    for r in range(repeats):
        for name in _order(list(out), r):
            with _layout(name, ops):
                dev = InProcessDevice("cpu", WorkerConfig(str(hf), spec, "float32", "cpu", 16, 512 << 20, None,
                                                          1, threads, False, True))
            sched = Scheduler(SchedConfig(max_num_batched_tokens=512), [dev], spec.eos_token_ids,
                              spec.max_model_len)
            for b in batches:
                rng = random.Random(b)
                states = [sched.add(dummy_request(f"{r}-{b}-{i}", random_ids(rng, 300, spec.vocab_size), steps + 8))
                          for i in range(b)]
                while any(not s.output_token_ids for s in states):
                    sched.step()
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    sched.step()
                    times.append(1e3 * (time.perf_counter() - t))
                while sched.has_unfinished():
                    sched.step()
                out[name][b].append(statistics.median(times))
                tokens.setdefault(b, {})[name] = [s.output_token_ids[:8] for s in states]
            del sched, dev
    same = {b: t["panels"] == t["oneDNN"] for b, t in tokens.items()}
    return {"ms": out, "same_tokens": same}


def _cell(xs: list[float]) -> str:
    return f"{min(xs):.0f}-{max(xs):.0f}" if len(xs) > 1 else f"{xs[0]:.0f}"


def main(args) -> None:
    from tandem.engine.kernels import cpu_ops
    ops = cpu_ops()
    if ops is None or not hasattr(ops, "panel_linear"):
        raise SystemExit("bench cpu-linear: the CPU kernels could not be built (no compiler)")
    torch.set_num_threads(args.threads)
    hf, spec = _smollm2()
    read = read_bandwidth()
    prod = product_times(spec, ops, args.rows, args.repeats)
    floor = prod["bytes"] / read * 1e3
    print(f"\nSmolLM2's projections and LM head ({prod['bytes'] / 1e6:.0f} MB of float32), {args.threads} thread(s), "
          f"ms per sweep ({args.repeats} rounds, min-max); reading them once at the {read / 1e9:.1f} GB/s "
          f"that many threads read: {floor:.0f} ms\n")
    print("| rows | " + " | ".join(str(m) for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, by_rows in prod["ms"].items():
        print(f"| {name} | " + " | ".join(_cell(by_rows[m]) for m in args.rows) + " |")
    if not args.batches:
        save_json(args.out, {"threads": args.threads, "read_GBps": read / 1e9, "products": prod})
        return
    steps = step_times(hf, spec, ops, args.batches, args.repeats, args.threads)
    print(f"\nSmolLM2 decode steps (300-token prompts), in-process, {args.threads} thread(s), median ms per step "
          f"({args.repeats} rounds, min-max)\n")
    print("| requests | " + " | ".join(str(b) for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for name, by_b in steps["ms"].items():
        print(f"| {name} | " + " | ".join(_cell(by_b[b]) for b in args.batches) + " |")
    print("\nsame first 8 greedy tokens in both layouts: "
          + ", ".join(f"{b} requests: {'yes' if s else 'no'}" for b, s in steps["same_tokens"].items()))
    save_json(args.out, {"threads": args.threads, "read_GBps": read / 1e9, "products": prod, "steps": steps})
