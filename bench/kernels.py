"""python -m bench kernels: the Triton paged decode attention's memory bandwidth against the
device's own copy bandwidth (CUDA), at batch x context, for the shapes of the served models;
with ``--cpu``, the same for the compiled CPU kernel (engine/csrc) on one thread against one
core's copy bandwidth.

Bytes counted per call: the K and V rows of every context token (what the kernel must read),
plus q and out; the copy's bytes: read + written. A decode kernel is memory-bound, so the
ratio says how close it gets to what the memory system can do.
"""
from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace

import torch

from tandem.bench.output import save_json

SHAPES = {                      # kv heads, query heads per kv head, head_dim
    "llama8b": (8, 4, 128),
    "opt13b": (40, 1, 128),
    "smollm2": (3, 3, 64),
}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    from triton.testing import do_bench
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def decode_case(shape: str, batch: int, ctx: int, dtype: torch.dtype, block_size: int, int8: bool,
                launch=None) -> dict:
    """One timed launch setting (engine.triton_decode.Launch; None: the kernel's own choice)."""
    from triton.testing import do_bench

    from tandem.engine.quantpool import QuantPool
    from tandem.engine.triton_decode import choose_launch, cut, paged_decode
    from tandem.engine.triton_paging import Paging
    hkv, g, d = SHAPES[shape]
    nbt = -(-ctx // block_size)
    num_blocks = 2 * batch * nbt
    gen = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    k_tab, v_tab = perm[:batch * nbt].view(batch, nbt), perm[batch * nbt:].view(batch, nbt)
    dirs = torch.zeros(batch, nbt, dtype=torch.int8, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.long, device="cuda")
    if int8:
        qp = QuantPool(1, hkv, num_blocks, block_size, d, dtype, "cuda", open_capacity=batch)
        qp.q.random_(0, 256, generator=gen)
        qp.scale.uniform_(0, 0.01, generator=gen)
        pool, elem = qp[0], 1
    else:
        pool = torch.randn(hkv, num_blocks * block_size, d, dtype=dtype, device="cuda", generator=gen)
        elem = pool.element_size()
    q = torch.randn(batch, hkv, g, d, dtype=dtype, device="cuda", generator=gen)
    run = lambda: paged_decode(q, pool, k_tab, v_tab, lens, d ** -0.5, block_size, Paging.BLOCKS,  # noqa: E731
                               dirs, dirs, launch=launch)
    ms = do_bench(run)
    kv_bytes = 2 * batch * ctx * hkv * d * elem
    if int8:                                     # lo and λ per block and channel, fp32
        kv_bytes += 2 * batch * nbt * hkv * d * 8
    total = kv_bytes + 2 * q.numel() * q.element_size()
    used = cut(launch or choose_launch(batch, hkv, d, nbt * block_size, int8, q.device), nbt * block_size)
    return {"shape": shape, "batch": batch, "ctx": ctx, "dtype": str(dtype).split(".")[-1],
            "kv": "int8" if int8 else "full", "ms": ms, "GB/s": total / (ms / 1e3) / 1e9,
            "launch": dataclasses.asdict(used)}


HIDDEN_SHAPES = {              # kv heads, query heads per kv head, head_dim, rows per token, rotary, bias
    "llama8b": (8, 4, 128, 4, True, False),
    "opt13b": (40, 1, 128, 1, False, True),
}


def hidden_case(shape: str, batch: int, ctx: int, dtype: torch.dtype, block_size: int) -> dict:
    """The hidden-cache decode kernel at a paper model's shape: its time, the projection FLOP/s
    it reaches (ctx x d_model x 2 D x 2 per request and KV head), and its max abs error on two
    requests against float64 attention over K and V projected here from the same stored inputs."""
    from triton.testing import do_bench

    from tandem.engine.attention import read_hidden
    from tandem.engine.models.llama import apply_rope, rope_tables
    from tandem.engine.triton_hidden import hidden_decode
    hkv, g, d, m, rope, bias = HIDDEN_SHAPES[shape]
    dm = m * hkv * d
    nbt = -(-ctx // block_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(batch * nbt * m, device="cuda", generator=gen).to(torch.int32)
    table = perm.view(batch, nbt, m)
    dirs = torch.zeros(batch, nbt, dtype=torch.int8, device="cuda")
    pool = torch.randn(hkv, batch * nbt * m * block_size, d, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(2 * hkv * d, dm, device="cuda", generator=gen) / dm ** 0.5).to(dtype)
    b = torch.randn(2 * hkv * d, device="cuda", generator=gen).to(dtype) if bias else None
    spec = SimpleNamespace(head_dim=d, rope_theta=10000.0, max_model_len=ctx)
    cos, sin = (t.to("cuda") for t in rope_tables(spec, torch.float64))
    q = torch.randn(batch, hkv, g, d, device="cuda", generator=gen).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.long, device="cuda")
    scale = d ** -0.5
    run = lambda: hidden_decode(q, pool, table, lens, w, b, cos.to(dtype) if rope else None,  # noqa: E731
                                sin.to(dtype) if rope else None, scale, block_size, dirs=dirs)
    got = run()
    err = 0.0
    for r in (0, batch - 1):
        offs = torch.arange(ctx, device="cuda")
        rows = (table[r, offs // block_size].long() * block_size + (offs % block_size)[:, None]).reshape(-1)
        x = read_hidden(pool, rows, ctx).double()                              # [ctx, d_model]
        k, v = (x @ w.double().T + (b.double() if bias else 0)).reshape(ctx, 2, hkv, d).unbind(1)
        if rope:
            k = apply_rope(k, cos, sin)
        for h in range(hkv):
            p = torch.softmax(q[r, h].double() @ k[:, h].T * scale, -1)
            err = max(err, (got[r, h].double() - p @ v[:, h]).abs().max().item())
    ms = do_bench(run)
    flops = batch * hkv * ctx * dm * 2 * d * 2
    return {"shape": shape, "batch": batch, "ctx": ctx, "dtype": str(dtype).split(".")[-1], "ms": ms,
            "TFLOP/s": flops / (ms / 1e3) / 1e12, "max_abs_err": err}


SWAP_LAYERS = {"llama8b": 32, "opt13b": 40, "smollm2": 30}


def swap_case(shape: str, ctx: int, dtype: torch.dtype, batch: int, block_size: int, repeats: int = 5) -> dict:
    """One request's swap-out (its K and V rows over every layer, gathered from scattered pool
    rows, copied into page-locked host memory; engine.hostcopy) at a served model's shape: how
    long the host is blocked when it waits for the copy and when the copy goes on a side stream,
    the link's GB/s, and a batch's paged decode kernel alone and while the copy runs beside it."""
    from tandem.engine.hostcopy import HostCopier
    from tandem.engine.triton_decode import paged_decode
    from tandem.engine.triton_paging import Paging
    hkv, g, d = SHAPES[shape]
    layers = SWAP_LAYERS[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(layers, hkv, 4 * ctx, d, device="cuda", generator=gen).to(dtype)
    rows = torch.randperm(4 * ctx, device="cuda", generator=gen)[:2 * ctx]
    copier = HostCopier(torch.device("cuda"))
    nbt = -(-ctx // block_size)
    flat = torch.randn(hkv, 2 * batch * nbt * block_size, d, device="cuda", generator=gen).to(dtype)
    tab = torch.randperm(2 * batch * nbt, device="cuda", generator=gen).to(torch.int32).view(2, batch, nbt)
    dirs = torch.zeros(batch, nbt, dtype=torch.int8, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.long, device="cuda")
    q = torch.randn(batch, hkv, g, d, device="cuda", generator=gen).to(dtype)
    decode = lambda: paged_decode(q, flat, tab[0], tab[1], lens, d ** -0.5, block_size,  # noqa: E731
                                  Paging.BLOCKS, dirs, dirs)

    def swap_out(wait: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copier.to_host(pool[:, :, rows, :], wait=wait)
        return (time.perf_counter() - t0) * 1e3

    def decodes_ms(n: int = 20) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            decode()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / n

    decode()
    swap_out(True)
    waited = sorted(swap_out(True) for _ in range(repeats))[repeats // 2]
    alone = decodes_ms()
    queued, beside = [], []
    for _ in range(repeats):
        queued.append(swap_out(False))
        beside.append(decodes_ms())
        copier.sync()
    nbytes = 2 * ctx * layers * hkv * d * pool.element_size()
    return {"shape": shape, "ctx": ctx, "MB": nbytes / 1e6, "host_ms_waiting": waited,
            "host_ms_side_stream": sorted(queued)[repeats // 2], "link_GBps": nbytes / (waited / 1e3) / 1e9,
            "decode_ms_alone": alone, "decode_ms_beside_copy": sorted(beside)[repeats // 2], "batch": batch}


def cpu_copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second (read + written) of one thread copying a buffer larger than the caches."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_s(lambda: dst.copy_(src), repeats)


def _median_s(fn, repeats: int) -> float:
    """The median wall time of ``fn`` over ``repeats`` calls after one warm-up call."""
    import statistics
    import time
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_decode_case(shape: str, batch: int, ctx: int, block_size: int, int8: bool, repeats: int = 7) -> dict:
    """The CPU kernel over one layer of fp32 K/V (or the int8 pool, every block closed), each
    request's blocks scattered over the pool as a long-running server leaves them."""
    from tandem.engine.kernels import cpu_ops
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("bench kernels --cpu: the CPU kernel could not be built (no compiler)")
    hkv, g, d = SHAPES[shape]
    nbt = -(-ctx // block_size)
    num_blocks = 2 * batch * nbt
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=gen)
    offs = torch.arange(ctx)
    rows = [(perm[i * nbt:(i + 1) * nbt][offs // block_size] * block_size + offs % block_size) for i in range(2 * batch)]
    k_rows, v_rows = torch.stack(rows[:batch]), torch.stack(rows[batch:])
    lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, hkv, g, d, generator=gen)
    if int8:
        codes = torch.randint(0, 256, (hkv, num_blocks * block_size, d), dtype=torch.uint8, generator=gen)
        scale, low = torch.rand(hkv, num_blocks, d, generator=gen) * 0.01, torch.randn(hkv, num_blocks, d, generator=gen)
        stage, stage_of = torch.zeros(hkv, block_size, d), torch.full((num_blocks,), -1, dtype=torch.long)
        run = lambda: ops.paged_decode_q8(q, stage, codes, scale, low, stage_of, k_rows, v_rows, lens,  # noqa: E731
                                          block_size, d ** -0.5)
        kv_bytes = 2 * batch * ctx * hkv * d + 2 * batch * nbt * hkv * d * 8
    else:
        pool = torch.randn(hkv, num_blocks * block_size, d, generator=gen)
        run = lambda: ops.paged_decode(q, pool, k_rows, v_rows, lens, d ** -0.5)  # noqa: E731
        kv_bytes = 2 * batch * ctx * hkv * d * 4
    sec = _median_s(run, repeats)
    total = kv_bytes + 2 * q.numel() * q.element_size()
    return {"shape": shape, "batch": batch, "ctx": ctx, "dtype": "float32", "kv": "int8" if int8 else "full",
            "ms": sec * 1e3, "GB/s": total / sec / 1e9}


def run_cpu(args) -> None:
    torch.set_num_threads(1)
    copy = cpu_copy_bandwidth()
    rows = []
    for shape in args.shapes:
        for int8 in (False, True):
            r = cpu_decode_case(shape, args.batch, args.ctx, args.block_size, int8)
            r["of_copy"] = r["GB/s"] * 1e9 / copy
            rows.append(r)
    _print(f"one CPU thread: copy {copy / 1e9:.1f} GB/s (read + written)", rows)
    save_json(args.out, {"device": "cpu, one thread", "copy_GBps": copy / 1e9, "rows": rows})

PREFILL_CHUNKS = (1, 4, 16, 64, 256)
PREFILL_PREFIXES = (64, 300, 1000)


def cpu_prefill_case(shape: str, n: int, prefix: int, repeats: int = 15) -> dict:
    """One layer's attention for a prompt chunk of ``n`` tokens over ``prefix`` cached ones, the
    context's rows scattered over the pool: SDPA over the gathered context (the torch path) and
    the compiled kernel with each chunk token a query over its own context; the larger error
    of the two against float64."""
    from tandem.engine.attention import PAGED_PREFILL_PAIRS, PrefillSegment, _prefill
    from tandem.engine.kernels import cpu_ops
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("bench kernels --cpu --prefill: the CPU kernel could not be built (no compiler)")
    hkv, g, d = SHAPES[shape]
    b, gen = prefix + n, torch.Generator().manual_seed(0)
    pool = torch.randn(hkv, 4 * b, d, generator=gen)
    rows = torch.randperm(2 * b, generator=gen)[:b] * 2
    k_rows, v_rows = rows, rows + 1
    q = torch.randn(n, hkv * g * d, generator=gen)
    k = pool[:, k_rows[prefix:]].transpose(0, 1).reshape(n, -1)
    v = pool[:, v_rows[prefix:]].transpose(0, 1).reshape(n, -1)
    seg, scale = PrefillSegment(0, n, k_rows[:prefix], v_rows[:prefix]), d ** -0.5
    kr, vr, lens = k_rows.expand(n, b).contiguous(), v_rows.expand(n, b).contiguous(), torch.arange(prefix + 1, b + 1)
    sdpa = lambda: _prefill(q, k, v, pool, seg, hkv * g, hkv, d, scale)  # noqa: E731
    kernel = lambda: ops.paged_decode(q.view(n, hkv, g, d).contiguous(), pool, kr, vr, lens, scale)  # noqa: E731
    keys, vals = pool[:, k_rows].double(), pool[:, v_rows].double()            # [hkv, b, d]
    qh = q.double().view(n, hkv, g, d).permute(1, 0, 2, 3)                       # [hkv, n, g, d]
    s = torch.einsum("hngd,hbd->hngb", qh, keys) * scale
    s = s.masked_fill(torch.arange(b)[None, None, None, :] > (prefix + torch.arange(n))[None, :, None, None], -math.inf)
    ref = torch.einsum("hngb,hbd->hngd", torch.softmax(s, dim=-1), vals).permute(1, 0, 2, 3).reshape(n, -1)
    err = max((sdpa().double() - ref).abs().max().item(), (kernel().double().reshape(n, -1) - ref).abs().max().item())
    return {"shape": shape, "chunk": n, "prefix": prefix, "sdpa_ms": _median_s(sdpa, repeats) * 1e3,
            "kernel_ms": _median_s(kernel, repeats) * 1e3, "kernel_serves": n * b <= PAGED_PREFILL_PAIRS,
            "max_abs_error": err}


def run_cpu_prefill(args) -> None:
    """``cpu_prefill_case`` for each shape, chunk and prefix, on this process's torch threads."""
    rows = [cpu_prefill_case(shape, n, prefix) for shape in args.shapes
            for prefix in PREFILL_PREFIXES for n in PREFILL_CHUNKS]
    print(f"one layer, {torch.get_num_threads()} threads, ms: SDPA over the gathered prefix / the compiled kernel")
    print(f"{'shape':<9} {'chunk':>6} {'prefix':>7} {'SDPA':>8} {'kernel':>8}  served by")
    for r in rows:
        print(f"{r['shape']:<9} {r['chunk']:>6} {r['prefix']:>7} {r['sdpa_ms']:>8.3f} {r['kernel_ms']:>8.3f}  "
              f"{'kernel' if r['kernel_serves'] else 'SDPA'}")
    print(f"largest error of either against float64: {max(r['max_abs_error'] for r in rows):.1e}")
    save_json(args.out.replace(".json", "_prefill.json"), {"threads": torch.get_num_threads(), "rows": rows})


def _print(head: str, rows: list[dict]) -> None:
    print(head)
    print(f"{'shape':<9} {'kv':<5} {'batch x ctx':>12} {'ms':>8} {'GB/s':>8} {'of copy':>8}  launch")
    for r in rows:
        how = " ".join(f"{k}={v}" for k, v in r["launch"].items()) if "launch" in r else ""
        print(f"{r['shape']:<9} {r['kv']:<5} {r['batch']:>5} x {r['ctx']:<5} {r['ms']:>8.3f} "
              f"{r['GB/s']:>8.1f} {r['of_copy']:>8.0%}  {how}")


# launch settings --sweep tries: (tokens per tile, warps) that compile for sm_90 without spilling
# registers (bf16 at 64 x 4 warps spills, int8 at 32 x 4), each with the context cut in 1-8 parts
SWEEP_TILES = {False: [(16, 4), (16, 8), (32, 4), (32, 8), (64, 8)], True: [(16, 4), (16, 8), (32, 8)]}
SWEEP_PARTS = [1, 2, 4, 8]


def sweep(args, dtype: torch.dtype, copy: float) -> list[dict]:
    """Every launch setting at batch x ctx, then the parts again at ``--sweep-batch`` requests
    with the best tile of each shape and cache: the table choose_launch is read from."""
    from tandem.engine.triton_decode import Launch
    rows = []
    for shape in args.shapes:
        for int8 in (False, True):
            tried = []
            for (bn, warps) in SWEEP_TILES[int8]:
                for parts in SWEEP_PARTS:
                    launch = Launch(block_n=bn, parts=parts, num_warps=warps, num_stages=2)
                    tried.append(decode_case(shape, args.batch, args.ctx, dtype, args.block_size, int8, launch))
            best = min(tried, key=lambda r: r["ms"])
            for parts in SWEEP_PARTS + [16]:
                launch = Launch(**{**best["launch"], "parts": parts})
                tried.append(decode_case(shape, args.sweep_batch, args.ctx, dtype, args.block_size, int8, launch))
            for r in tried:
                r["of_copy"] = r["GB/s"] * 1e9 / copy
                print(f"{shape:<9} {r['kv']:<5} {r['batch']:>4} x {r['ctx']:<5} tile {r['launch']['block_n']:>3} "
                      f"warps {r['launch']['num_warps']} parts {r['launch']['parts']:>2}: {r['ms']:8.3f} ms "
                      f"{r['of_copy']:5.0%}", flush=True)
            rows += tried
    return rows


def run(args) -> None:
    if args.accuracy:
        return accuracy(args)
    if args.cpu:
        return run_cpu_prefill(args) if args.prefill else run_cpu(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels: the bandwidth needs a CUDA device (--accuracy runs anywhere)")
    copy = copy_bandwidth()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if args.sweep:
        rows = sweep(args, dtype, copy)
        save_json(args.out.replace(".json", "_sweep.json"),
                  {"device": torch.cuda.get_device_name(), "copy_GBps": copy / 1e9, "rows": rows})
        return
    rows = []
    for shape in args.shapes:
        for int8 in (False, True):
            r = decode_case(shape, args.batch, args.ctx, dtype, args.block_size, int8)
            r["of_copy"] = r["GB/s"] * 1e9 / copy
            rows.append(r)
    dev = torch.cuda.get_device_name()
    _print(f"{dev}: device-to-device copy {copy / 1e9:.0f} GB/s (read + written)", rows)
    hidden = [hidden_case(shape, args.hidden_batch, args.hidden_ctx, dtype, args.block_size)
              for shape in HIDDEN_SHAPES if shape in args.shapes]
    print("hidden-cache decode (K and V projected from the stored inputs inside the kernel):")
    for r in hidden:
        print(f"{r['shape']:<9} {r['batch']:>5} x {r['ctx']:<5} {r['ms']:>8.3f} ms {r['TFLOP/s']:>7.1f} TFLOP/s "
              f"max abs err {r['max_abs_err']:.1e}")
    swaps = [swap_case(shape, args.ctx, dtype, args.batch, args.block_size) for shape in args.shapes]
    print(f"swap-out of one {args.ctx}-token request into page-locked host memory (host blocked: waiting for "
          f"the copy / the copy on a side stream), and a batch of {args.batch}'s decode kernel alone / beside it:")
    for r in swaps:
        print(f"{r['shape']:<9} {r['MB']:>7.0f} MB  host {r['host_ms_waiting']:>7.2f} / "
              f"{r['host_ms_side_stream']:>5.2f} ms  link {r['link_GBps']:>5.1f} GB/s  "
              f"decode {r['decode_ms_alone']:.3f} / {r['decode_ms_beside_copy']:.3f} ms")
    save_json(args.out, {"device": dev, "copy_GBps": copy / 1e9, "rows": rows, "hidden": hidden, "swap": swaps})


def accuracy(args) -> None:
    """Max abs error of each Triton kernel against float64 attention computed from the same
    pool values, per dtype, on random requests with blocks filled from either end. Runs on
    CUDA, or on the CPU under Triton's interpreter (tiny shapes)."""
    import os
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before Triton is first imported
    from tandem.engine.triton_decode import paged_decode
    from tandem.engine.triton_hidden import hidden_decode
    from tandem.engine.triton_paging import Paging, tables_from_rows
    from tandem.engine.triton_prefill import paged_prefill
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, hkv, g, d, nb, scale = 16, 2, 4, 64, 64, 0.125
    lens = [5, 37, 64, 100]
    gen = torch.Generator().manual_seed(0)
    free = torch.randperm(nb * 2, generator=gen).tolist()

    def rows(kinds=1):
        out = []
        for n in lens:
            parts = []
            for _ in range(-(-n // B)):
                offs = torch.arange(B) if torch.rand(1, generator=gen) < 0.5 or kinds > 1 else torch.arange(B).flip(0)
                parts.append(torch.stack([free.pop() * B + offs for _ in range(kinds)], 1))
            r = torch.cat(parts)[:n]
            out.append(r[:, 0] if kinds == 1 else r)
        return out

    kr, vr, hr = rows(), rows(), rows(kinds=2)
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = torch.randn(hkv, 2 * nb * B, d, generator=gen).to(dtype)
        (kt, kd), (vt, vd), (ht, hd_) = (tables_from_rows(r, B) for r in (kr, vr, hr))
        to = lambda t: t.to(dev)  # noqa: E731
        lt = torch.tensor(lens)
        q = torch.randn(len(lens), hkv, g, d, generator=gen).to(dtype)
        err = {}
        got = paged_decode(to(q), to(pool), to(kt), to(vt), to(lt), scale, B, Paging.BLOCKS, to(kd), to(vd)).cpu()
        err["decode"] = max((got[r, h].double() - _attend64(q[r, h], pool[h, kr[r]], pool[h, vr[r]], scale)).abs().max().item()
                            for r in range(len(lens)) for h in range(hkv))
        qp = torch.randn(sum(lens), hkv * g * d, generator=gen).to(dtype)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        got = paged_prefill(to(qp), to(pool), to(kt), to(vt), starts, lens, lens, hkv * g, scale, B,
                            Paging.BLOCKS, to(kd), to(vd)).cpu()
        e = 0.0
        for s, n, k_, v_ in zip(starts, lens, kr, vr):
            for hq in range(hkv * g):
                qh = qp[s:s + n, hq * d:(hq + 1) * d]
                ref = _attend64(qh, pool[hq // g, k_], pool[hq // g, v_], scale, causal=True)
                e = max(e, (got[s:s + n, hq * d:(hq + 1) * d].double() - ref).abs().max().item())
        err["prefill"] = e
        w = (torch.randn(2 * hkv * d, 2 * hkv * d, generator=gen) / (2 * hkv * d) ** 0.5).to(dtype)
        got = hidden_decode(to(q), to(pool), to(ht), to(lt), to(w), None, None, None, scale, B,
                            Paging.BLOCKS, to(hd_)).cpu()
        e = 0.0
        for r, n in enumerate(lens):
            x = pool[:, hr[r].reshape(-1)].transpose(0, 1).reshape(n, -1).double()
            k, v = (x @ w.double().T).reshape(n, 2, hkv, d).unbind(1)
            for h in range(hkv):
                e = max(e, (got[r, h].double() - _attend64(q[r, h], k[:, h], v[:, h], scale)).abs().max().item())
        err["hidden"] = e
        out.append({"dtype": str(dtype).split(".")[-1], **err})
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter"
    print(f"max abs error against float64 ({where}; contexts {lens}, head_dim {d}, GQA {g}:1)")
    print("| dtype | paged decode | paged prefill | hidden decode |\n|---|---|---|---|")
    for r in out:
        print(f"| {r['dtype']} | {r['decode']:.1e} | {r['prefill']:.1e} | {r['hidden']:.1e} |")
    save_json(args.out.replace(".json", "_accuracy.json"), {"device": where, "rows": out})


def _attend64(q, k, v, scale, causal=False):
    """float64 softmax attention of q [m, D] over k, v [n, D]; causal: q's rows are the last m."""
    s = q.double() @ k.double().T * scale
    if causal:
        m, n = s.shape
        s = s.masked_fill(~torch.ones(m, n, dtype=torch.bool).tril(n - m), float("-inf"))
    return torch.softmax(s, -1) @ v.double()
