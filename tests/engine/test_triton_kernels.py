"""The Triton kernels against independent references: float64 attention computed here from the
values the pool holds, and the engine's torch reference path. On a machine without a GPU they
run under Triton's interpreter (tiny shapes); with one, on CUDA."""
import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.attention import _dense, decode_attention, read_hidden
from tandem.engine.messages import Direction
from tandem.engine.models.llama import apply_rope, rope_tables
from tandem.engine.runner import block_offsets
from tests.conftest import int8_blocks_as_read

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels():
    """The kernel modules: compiled for CUDA, or interpreted on the CPU (tests/conftest.py)."""
    names = ("triton_paging", "triton_decode", "triton_prefill", "triton_hidden")
    return SimpleNamespace(**{n: importlib.import_module(f"tandem.engine.{n}") for n in names})


def random_rows(lens, block_size, free_blocks, kinds=1, directions=(Direction.LEFT, Direction.RIGHT)):
    """Per-token pool rows of requests whose token-blocks take random free blocks, each filled
    from a random end (bidirectional blocks): [n] per request, or [n, kinds]."""
    gen = torch.Generator().manual_seed(len(lens) * 7 + block_size)
    out = []
    for n in lens:
        parts = []
        for _ in range(-(-n // block_size)):
            d = directions[int(torch.randint(len(directions), (1,), generator=gen))]
            offs = block_offsets(block_size, d)
            parts.append(torch.stack([free_blocks.pop() * block_size + offs for _ in range(kinds)], 1))
        rows = torch.cat(parts)[:n]
        out.append(rows[:, 0] if kinds == 1 else rows)
    return out


def attend64(q, k, v, scale):
    """float64 softmax attention: q [G, n_q, D] (or [G, D]), k, v [n_k, D] -> like q."""
    p = torch.softmax(q.double() @ k.double().T * scale, dim=-1)
    return p @ v.double()


# how the decode kernel cuts its work: the default (one program per request and head under the
# interpreter), and contexts cut into 3 parts of 16 tokens merged by a second kernel (part 2 of
# the 1- and 9-token requests is empty)
LAUNCHES = {"whole": None, "parts": dict(block_n=16, parts=3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv, g", [(2, 3), (4, 1)])
@pytest.mark.parametrize("paging", ["BLOCKS", "ROWS"])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_paged_decode(kernels, dtype, hkv, g, paging, launch):
    torch.manual_seed(0)
    B, nb, hd, scale = 8, 64, 32, 0.2
    lens = [1, 9, 30, 17, 40]
    free = torch.randperm(nb).tolist()
    k_rows, v_rows = random_rows(lens, B, free), random_rows(lens, B, free)
    pool = torch.randn(hkv, nb * B, hd).to(dtype)
    q = torch.randn(len(lens), hkv, g, hd).to(dtype)
    P = kernels.triton_paging
    mode = P.Paging[paging]
    if mode is P.Paging.BLOCKS:
        (kt, kd), (vt, vd) = P.tables_from_rows(k_rows, B), P.tables_from_rows(v_rows, B)
    else:
        kt, kd, vt, vd = P.row_table(k_rows), None, P.row_table(v_rows), None
    lens_t = torch.tensor(lens)
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = kernels.triton_decode.paged_decode(to(q), to(pool), to(kt), to(vt), to(lens_t), scale, B,
                                             mode, to(kd), to(vd), launch=launch_of(kernels, launch)).cpu()
    for r, n in enumerate(lens):
        for h in range(hkv):
            ref = attend64(q[r, h], pool[h, k_rows[r]], pool[h, v_rows[r]], scale)
            torch.testing.assert_close(got[r, h].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # noqa: E731
    ref = decode_attention(q, pool, pad(k_rows), pad(v_rows), lens_t, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def launch_of(kernels, name):
    spec = LAUNCHES[name]
    return None if spec is None else kernels.triton_decode.Launch(**spec)


# wide: the kernel pads the query heads to 16 rows of zeros, which weight every V row alike and
# overflow (under the interpreter numpy says so); those rows are never written out
@pytest.mark.filterwarnings("ignore:overflow encountered in matmul", "ignore:invalid value encountered in matmul",
                            "ignore:invalid value encountered in add")
@pytest.mark.parametrize("dtype, wide", [(d, False) for d in DTYPES] +
                         [(d, True) for d in DTYPES if d != torch.float16])
@pytest.mark.parametrize("paging", ["BLOCKS", "ROWS"])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_paged_decode_int8_pool(kernels, dtype, wide, paging, launch):
    """Closed blocks read as lo + λ·q (numpy's rounding of the written values), open blocks
    from their full-precision staging copy. ``wide``: one channel spans ±2e38, past float32's
    range for hi - lo and λ·q; the query ignores it, so only V carries it to the output."""
    from tandem.engine.quantpool import QuantPool
    torch.manual_seed(1)
    hkv, g, hd, B, nb, scale = 2, 2, 32, 8, 40, 0.125
    # wide: the kernel normalizes its sum of p·v at the end, so a softmax spread over many rows
    # would overflow it whatever the cache; a sharp one (a large query) keeps that sum near one V
    qp = QuantPool(1, hkv, nb, B, hd, dtype, open_capacity=2, device=DEV)
    qp.open(torch.arange(nb, device=DEV))
    values = torch.randn(1, hkv, nb * B, hd)
    unit = torch.ones(hd, dtype=torch.float64)      # each output channel compared in its own unit
    if wide:
        values[..., 5] = (torch.rand(1, hkv, nb * B) * 2 - 1) * 2e38
        unit[5] = 2e38
    values = values.to(dtype)
    qp.write(torch.arange(nb * B, device=DEV), values.to(DEV))
    closed = torch.arange(0, nb, 3)
    qp.close(closed.to(DEV))
    expect = int8_blocks_as_read(values[0], closed.tolist(), B)
    lens = [3, 24, 33, 50]
    free = torch.randperm(nb).tolist()
    k_rows, v_rows = random_rows(lens, B, free), random_rows(lens, B, free)
    P = kernels.triton_paging
    mode = P.Paging[paging]
    if mode is P.Paging.BLOCKS:
        (kt, kd), (vt, vd) = P.tables_from_rows(k_rows, B), P.tables_from_rows(v_rows, B)
    else:
        kt, kd, vt, vd = P.row_table(k_rows), None, P.row_table(v_rows), None
    q = torch.randn(len(lens), hkv, g, hd)
    if wide:
        q[..., 5] = 0
        q *= 100
    q = q.to(dtype)
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = kernels.triton_decode.paged_decode(q.to(DEV), qp[0], kt.to(DEV), vt.to(DEV),
                                             torch.tensor(lens, device=DEV), scale, B, mode, to(kd), to(vd),
                                             launch=launch_of(kernels, launch)).cpu()
    assert torch.isfinite(got).all()
    for r in range(len(lens)):
        for h in range(hkv):
            ref = attend64(q[r, h], expect[h, k_rows[r]], expect[h, v_rows[r]], scale)
            torch.testing.assert_close(got[r, h].double() / unit, ref / unit, atol=max(TOL[dtype], 1e-4),
                                       rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv, g, window", [(2, 2, 0), (4, 1, 0), (2, 2, 6)])
def test_paged_prefill_chunked(kernels, dtype, hkv, g, window):
    """Three segments: a whole prompt, and two chunks whose prefix came from earlier steps;
    with a sliding window, each query sees the ``window`` keys ending at its position (key tiles
    of 8, so whole tiles before a chunk's first window are skipped)."""
    torch.manual_seed(2)
    B, nb, hd, scale = 8, 64, 16, 0.25
    ctx, new = [5, 20, 37], [5, 7, 18]
    free = torch.randperm(nb).tolist()
    k_rows, v_rows = random_rows(ctx, B, free), random_rows(ctx, B, free)
    pool = torch.randn(hkv, nb * B, hd).to(dtype)
    H = hkv * g
    starts = [0, 5, 12]
    q = torch.randn(sum(new), H * hd).to(dtype)
    P = kernels.triton_paging
    (kt, kd), (vt, vd) = P.tables_from_rows(k_rows, B), P.tables_from_rows(v_rows, B)
    for mode, tabs in ((P.Paging.BLOCKS, (kt, vt, kd, vd)),
                       (P.Paging.ROWS, (P.row_table(k_rows), P.row_table(v_rows), None, None))):
        k_t, v_t, k_d, v_d = (None if t is None else t.to(DEV) for t in tabs)
        got = kernels.triton_prefill.paged_prefill(q.to(DEV), pool.to(DEV), k_t, v_t, starts, new, ctx,
                                                   H, scale, B, mode, k_d, v_d, block_n=8 if window else 32,
                                                   window=window).cpu()
        for s, n, c, kr, vr in zip(starts, new, ctx, k_rows, v_rows):
            for hq in range(H):
                h = hq // g
                qh = q[s:s + n, hq * hd:(hq + 1) * hd].double()
                scores = qh @ pool[h, kr].double().T * scale
                qpos, kpos = torch.arange(c - n, c)[:, None], torch.arange(c)[None, :]
                seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
                scores = scores.masked_fill(~seen, float("-inf"))
                ref = torch.softmax(scores, -1) @ pool[h, vr].double()
                torch.testing.assert_close(got[s:s + n, hq * hd:(hq + 1) * hd].double(), ref,
                                           atol=TOL[dtype], rtol=TOL[dtype])
            ref = _dense(q[s:s + n], pool[:, kr], pool[:, vr], n, c, H, hkv, hd, scale, window or None)
            torch.testing.assert_close(got[s:s + n].float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope, bias, hkv, g", [(True, False, 2, 2), (False, True, 2, 1), (True, True, 2, 2)])
def test_hidden_decode(kernels, dtype, rope, bias, hkv, g):
    """K and V rebuilt from stored layer inputs (Llama: rotary; OPT: bias, no rotary; Qwen2:
    both, the bias added before the rotation), then attention; the reference projects in float64
    from the same stored inputs."""
    torch.manual_seed(3)
    B, nb, hd, m, scale = 8, 96, 32, 2, 0.2
    dm = m * hkv * hd
    pool = torch.randn(hkv, nb * B, hd).to(dtype)
    w = (torch.randn(2 * hkv * hd, dm) / dm ** 0.5).to(dtype)
    b = torch.randn(2 * hkv * hd).to(dtype) if bias else None
    cos, sin = rope_tables(SimpleNamespace(head_dim=hd, rope_theta=10000.0, max_model_len=64), torch.float64)
    lens = [1, 9, 30]
    free = torch.randperm(nb).tolist()
    rows = random_rows(lens, B, free, kinds=m, directions=(Direction.LEFT,))
    q = torch.randn(len(lens), hkv, g, hd).to(dtype)
    P = kernels.triton_paging
    tab, dirs = P.tables_from_rows(rows, B)
    dev_cs = (cos.to(DEV, dtype), sin.to(DEV, dtype)) if rope else (None, None)
    for mode, t, d in ((P.Paging.BLOCKS, tab, dirs), (P.Paging.ROWS, P.row_table(rows), None)):
        got = kernels.triton_hidden.hidden_decode(
            q.to(DEV), pool.to(DEV), t.to(DEV), torch.tensor(lens, device=DEV), w.to(DEV),
            None if b is None else b.to(DEV), *dev_cs, scale, B, mode,
            None if d is None else d.to(DEV)).cpu()
        for r, c in enumerate(lens):
            x = read_hidden(pool, rows[r].reshape(-1), c).double()            # [c, d_model]
            kv = x @ w.double().T + (b.double() if bias else 0)
            k, v = kv.reshape(c, 2, hkv, hd).unbind(1)
            if rope:
                k = apply_rope(k, cos[:c], sin[:c])
            for h in range(hkv):
                ref = attend64(q[r, h], k[:, h], v[:, h], scale)
                torch.testing.assert_close(got[r, h].double(), ref, atol=3 * TOL[dtype], rtol=3 * TOL[dtype])


def test_tables_from_rows_refuses_irregular_rows(kernels):
    """A token swapped back into another block's free slot breaks the block order: the row
    table must serve that batch."""
    P = kernels.triton_paging
    B = 4
    regular = torch.cat([2 * B + torch.arange(B), 5 * B + torch.arange(B).flip(0)])
    table, dirs = P.tables_from_rows([regular], B)
    assert table.tolist() == [[2, 5]] and dirs.tolist() == [[0, 1]]
    moved = regular.clone()
    moved[5] = 7 * B + 3
    assert P.tables_from_rows([moved], B) is None


def test_cuda_devices_say_when_attention_leaves_the_kernels(caplog):
    """On CUDA devices the Triton kernels serve by default; a head the kernels cannot take keeps
    torch's attention, and the log says why. CPU devices keep theirs without a word."""
    import logging
    from tandem.sched.llm import _triton_choice
    with caplog.at_level(logging.WARNING, logger="tandem.sched.llm"):
        assert _triton_choice(None, ["cuda:0", "cuda:1"], 64) is True
        assert _triton_choice(None, ["cpu:0"], 96) is False
        assert not caplog.records
        assert _triton_choice(None, ["cuda:0"], 96) is False      # Phi-3 mini's heads
    assert "head_dim 96 is not a power of two" in caplog.text


# Compiles a kernel for a Hopper GPU (sm_90) without one: Triton's own compiler and its bundled
# ptxas, outside the interpreter. Prints the shared memory one block needs and the bytes of
# local memory (register spills) each thread uses, as cuobjdump reads them off the binary.
_COMPILE = """
import inspect, importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, const, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
kernel = getattr(importlib.import_module(module), name)
ptrs = {"lens_ptr": "*i32", "tab_ptr": "*i32", "dir_ptr": "*i8", "kt_ptr": "*i32", "vt_ptr": "*i32",
        "kd_ptr": "*i8", "vd_ptr": "*i8", "qv_ptr": "*u8", "sc_ptr": "*fp32", "lo_ptr": "*fp32",
        "stage_of_ptr": "*i64", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
sig = {p: "constexpr" if p in const else ptrs.get(p, "*bf16") if p.endswith("_ptr")
       else "fp32" if p == "scale" else "i32" for p in inspect.signature(kernel.fn).parameters}
k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(k.asm["cubin"])
    f.flush()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
print(json.dumps({"shared": k.metadata.shared, "spill": int(re.search(r"STACK:(\\d+)", usage).group(1))}))
"""
HOPPER_SHARED = 232448        # bytes of shared memory one block may use on an H100 or H200


def compile_for_hopper(module: str, kernel: str, const: dict, **options) -> dict:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, module, kernel, json.dumps(const), json.dumps(options)],
                         env=env, timeout=240, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("shape, quant", [
    (dict(G=4, D=128), False),          # Llama-3-8B's heads
    (dict(G=3, D=64), False),           # SmolLM2's
    (dict(G=4, D=256), False),          # Gemma 3 1B's
    (dict(G=4, D=128), True),           # the int8 pool
])
def test_decode_launch_keeps_registers_on_hopper(shape, quant):
    """The decode kernel, as choose_launch sets it up, spills no registers to local memory on
    sm_90. The setting it replaced (64-token tiles, 4 warps) spilled in bf16 and, holding
    the codes, λ, lo and the staged copy, about 7 KB per thread in int8, at 7% of the copy
    bandwidth on an H200."""
    from tandem.engine.triton_decode import choose_launch
    launch = choose_launch(64, 8, shape["D"], 2048, quant, torch.device("cpu"))
    const = dict(shape, G_PAD=16, B=16, BLOCK_N=launch.block_n, ROWS=False, QUANT=quant, IEEE=False,
                 WHOLE=True, SPLIT=False)
    got = compile_for_hopper("tandem.engine.triton_decode", "_paged_decode", const,
                             num_warps=launch.num_warps, num_stages=launch.num_stages)
    assert got["spill"] == 0, f"{launch}: {got['spill']} bytes of local memory per thread"


@pytest.mark.parametrize("model, shape", [
    ("opt13b", dict(HKV=40, M=1, G=1, ROPE=False, BIAS=True)),       # d_model 5120, 40 heads of 128
    ("llama8b", dict(HKV=8, M=4, G=4, ROPE=True, BIAS=False))])      # 8 KV heads of 128, d_model 4096
def test_hidden_decode_fits_hopper_shared_memory(model, shape):
    """At the paper models' shapes the hidden-cache kernel fits one block's shared memory on an
    H100/H200, however many KV heads it loops over (unrolled, the compiler kept every head's
    weight tiles in shared memory: 2.8 MB at OPT-13B's shape, and the launch failed)."""
    const = dict(shape, G_PAD=16, D=128, B=16, BLOCK_N=16, ROWS=False, IEEE=False)
    shared = compile_for_hopper("tandem.engine.triton_hidden", "_hidden_decode", const)["shared"]
    assert shared <= HOPPER_SHARED, f"{model}: {shared} bytes of shared memory"
