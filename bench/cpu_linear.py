"""The CPU worker's projections in its weight layouts, on one thread (``--threads``). In float32:
GGUF's blocks in panels (engine/csrc/qlinear.cpp, the default for SmolLM2), float32 panels
(engine/csrc/linear.cpp; ``--no-weight-blocks``) and oneDNN's blocked layout (the layout
without a compiler). With ``--dtype bfloat16``: dense bfloat16 weights with GGUF's blocks
beside them for products of at most ``engine.linear.thin_rows()`` rows (the default where the
CPU computes bfloat16 natively), and dense bfloat16 alone (``--no-weight-blocks``).

1. Products: every projection and the LM head of SmolLM2 (its real weights), at ``--rows``
   rows, each layout in turn, ``--repeats`` rounds; the time to read a layout's weights once
   at the read bandwidth of that many threads is the floor of a small product.
2. Decode steps: SmolLM2 on an in-process device (the compiled attention in every case),
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
    kernels.cpu_ops = (lambda: _WithoutPanels(ops)) if name == "oneDNN" else (lambda: ops)
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


LAYOUTS = {"float32": ("blocks", "panels", "oneDNN"), "bfloat16": ("bf16+blocks", "bf16")}


def _weights(hf, spec) -> list[torch.Tensor]:
    """SmolLM2's projections as the worker fuses them (QKV, O, gate-up, down per layer), then
    the LM head (the tied embedding table)."""
    from tandem.engine.models.loader import load_state_dict
    sd = load_state_dict(hf)
    out = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out += [torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]), sd[p + "self_attn.o_proj.weight"],
                torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
                sd[p + "mlp.down_proj.weight"]]
    return out + [sd.get("lm_head.weight", sd["model.embed_tokens.weight"])]


def _nbytes(w) -> int:
    """Bytes a product of a few rows reads: the blocks of a :class:`Thin`, all of the others."""
    from tandem.engine.linear import Panels, Thin
    w = w.blocks if isinstance(w, Thin) else w
    return w.data.numel() * w.data.element_size() if isinstance(w, Panels) else w.numel() * w.element_size()


def _packed(dense: list[torch.Tensor], ops, dtype: str) -> dict[str, list]:
    from tandem.engine.linear import pack
    if dtype == "bfloat16":
        thin = [pack(w, ops, dtype=torch.bfloat16) for w in dense]
        return {"bf16+blocks": thin, "bf16": [pack(w, ops, blocks=False, dtype=torch.bfloat16) for w in dense],
                "blocks alone": [getattr(w, "blocks", w) for w in thin]}
    return {"blocks": [pack(w, ops) for w in dense], "panels": [pack(w, ops, blocks=False) for w in dense],
            "oneDNN": [pack(w) for w in dense]}


def product_times(hf, spec, ops, rows: list[int], repeats: int, dtype: str = "float32") -> dict:
    """ms per sweep over the model's projections and LM head, per layout and row count. In bfloat16,
    "blocks alone" times the blocks of every weight at every row count (the rows in the dtype their
    kernel takes, as a thin product hands them over), so where they stop paying
    (engine.linear.thin_rows) can be read off."""
    from tandem.engine.linear import linear
    dense = _weights(hf, spec)
    weights = _packed(dense, ops, dtype)
    ins = [w.shape[1] for w in dense]
    out: dict = {name: {m: [] for m in rows} for name in weights}
    for r in range(repeats):
        for m in rows:
            xs = {k: torch.randn(m, k).to(getattr(torch, dtype)) for k in set(ins)}
            for name in _order(list(weights), r):
                ws = weights[name]
                for w, k in zip(ws, ins):
                    linear(xs[k], w)                        # warm
                t = time.perf_counter()
                for w, k in zip(ws, ins):
                    linear(xs[k], w)
                out[name][m].append(1e3 * (time.perf_counter() - t))
    nbytes = {name: sum(_nbytes(w) for w in ws) for name, ws in weights.items()}
    if dtype == "float32":
        nbytes["oneDNN"] = nbytes["panels"] = sum(w.numel() * 4 for w in dense)
    return {"bytes": nbytes, "ms": out}


def step_times(hf, spec, ops, batches: list[int], repeats: int, threads: int, steps: int = 20,
               dtype: str = "float32") -> dict:
    """Median decode-step ms per layout and batch, and each run's first greedy tokens."""
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.profiling import dummy_request, random_ids
    from tandem.sched.scheduler import SchedConfig, Scheduler
    layouts = LAYOUTS[dtype]
    out: dict = {name: {b: [] for b in batches} for name in layouts}
    tokens: dict = {}
    for r in range(repeats):
        for name in _order(list(out), r):
            with _layout(name, ops):
                dev = InProcessDevice("cpu", WorkerConfig(str(hf), spec, dtype, "cpu", 16, 512 << 20, None,
                                                          1, threads, False, True,
                                                          weight_blocks=name.endswith("blocks")))
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
    same = {b: all(t[name] == t[layouts[-1]] for name in layouts) for b, t in tokens.items()}
    return {"ms": out, "same_tokens": same}


def crossover(ms: dict, rows: list[int]) -> str:
    """Up to which of ``rows`` the blocks alone beat dense bfloat16 (medians over the rounds), against
    the threshold the engine takes on this CPU with its kernels (engine.linear.thin_rows)."""
    from tandem.engine.kernels import cpu_ops
    from tandem.engine.linear import thin_rows
    engine = thin_rows(native=hasattr(cpu_ops(), "q4_1_bf16_linear"))
    pays = 0
    for m in sorted(rows):
        if statistics.median(ms["blocks alone"][m]) >= statistics.median(ms["bf16"][m]):
            break
        pays = m
    return (f"the blocks alone beat dense bfloat16 up to {pays} of the rows timed; the engine takes them up to "
            f"{engine} rows on this CPU (engine.linear.thin_rows)")


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
    prod = product_times(hf, spec, ops, args.rows, args.repeats, args.dtype)
    print(f"\nSmolLM2's projections and LM head, {args.dtype}, {args.threads} thread(s), ms per sweep "
          f"({args.repeats} rounds, "
          f"min-max); the floor: reading the layout's weights once at the {read / 1e9:.1f} GB/s that many "
          f"threads read\n")
    print("| layout | MB | floor ms | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|---|---|" + "---|" * len(args.rows))
    for name, by_rows in prod["ms"].items():
        nb = prod["bytes"][name]
        print(f"| {name} | {nb / 1e6:.0f} | {nb / read * 1e3:.0f} | "
              + " | ".join(_cell(by_rows[m]) for m in args.rows) + " |")
    if args.dtype == "bfloat16":
        print(f"\n{crossover(prod['ms'], args.rows)}")
    if not args.batches:
        save_json(args.out, {"threads": args.threads, "dtype": args.dtype, "read_GBps": read / 1e9,
                             "products": prod})
        return
    steps = step_times(hf, spec, ops, args.batches, args.repeats, args.threads, dtype=args.dtype)
    print(f"\nSmolLM2 decode steps (300-token prompts), in-process, {args.dtype}, {args.threads} thread(s), "
          f"median ms per step ({args.repeats} rounds, min-max)\n")
    print("| requests | " + " | ".join(str(b) for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for name, by_b in steps["ms"].items():
        print(f"| {name} | " + " | ".join(_cell(by_b[b]) for b in args.batches) + " |")
    print("\nsame first 8 greedy tokens in every layout: "
          + ", ".join(f"{b} requests: {'yes' if s else 'no'}" for b, s in steps["same_tokens"].items()))
    save_json(args.out, {"threads": args.threads, "dtype": args.dtype, "read_GBps": read / 1e9, "products": prod,
                         "steps": steps})
