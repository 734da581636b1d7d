"""python -m bench kernels: the Triton paged decode attention's memory bandwidth against the
device's own copy bandwidth (CUDA), at batch x context, for the shapes of the served models.

Bytes counted per call: the K and V rows of every context token (what the kernel must read),
plus q and out; the copy's bytes: read + written. A decode kernel is memory-bound, so the
ratio says how close it gets to what the memory system can do.
"""
from __future__ import annotations

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


def decode_case(shape: str, batch: int, ctx: int, dtype: torch.dtype, block_size: int, int8: bool) -> dict:
    from triton.testing import do_bench

    from tandem.engine.quantpool import QuantPool
    from tandem.engine.triton_decode import paged_decode
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
                               dirs, dirs)
    ms = do_bench(run)
    kv_bytes = 2 * batch * ctx * hkv * d * elem
    if int8:                                     # lo and λ per block and channel, fp32
        kv_bytes += 2 * batch * nbt * hkv * d * 8
    total = kv_bytes + 2 * q.numel() * q.element_size()
    return {"shape": shape, "batch": batch, "ctx": ctx, "dtype": str(dtype).split(".")[-1],
            "kv": "int8" if int8 else "full", "ms": ms, "GB/s": total / (ms / 1e3) / 1e9}


def run(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels: needs a CUDA device (the kernels' correctness runs on the CPU in the tests)")
    copy = copy_bandwidth()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    rows = []
    for shape in args.shapes:
        for int8 in (False, True):
            r = decode_case(shape, args.batch, args.ctx, dtype, args.block_size, int8)
            r["of_copy"] = r["GB/s"] * 1e9 / copy
            rows.append(r)
    dev = torch.cuda.get_device_name()
    print(f"{dev}: device-to-device copy {copy / 1e9:.0f} GB/s (read + written)")
    print(f"{'shape':<9} {'kv':<5} {'batch x ctx':>12} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        print(f"{r['shape']:<9} {r['kv']:<5} {r['batch']:>5} x {r['ctx']:<5} {r['ms']:>8.3f} "
              f"{r['GB/s']:>8.0f} {r['of_copy']:>8.0%}")
    save_json(args.out, {"device": dev, "copy_GBps": copy / 1e9, "rows": rows})
