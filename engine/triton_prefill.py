"""Triton prefill attention over the paged pool (FlashAttention-style, varlen, chunked).

A step's prefill segments are written into the pool first (``pool_write``, the paged write);
then each segment's ``n`` queries, at positions ``ctx - n .. ctx - 1``, attend causally over
the segment's whole context ``0 .. ctx - 1`` read in place through its block table (or row
table, engine.triton_paging). A chunk of a long prompt is just a segment whose cached prefix
(``ctx - n`` tokens) came from earlier steps.

Grid: one program per (query tile of ``BLOCK_M`` rows of one segment, query head)::

    for each key tile from the tile's first query's window start up to its last position:
        s = q @ K^T * scale, masked where key position > query position
                            (or, with a sliding window W, <= query position - W)
        online softmax (fp32), acc += p @ V
    out = acc / l

Matrix products run on the tensor cores at bf16/fp16 and in full fp32 ("ieee") for fp32;
under the interpreter (tests on the CPU) always in fp32, since its bf16 product is wrong.
The torch reference is engine.attention's ``_prefill`` path (SDPA over the gathered
prefix and the new rows). Full-precision pools only: over an int8 pool the new tokens must
attend to each other as computed, which the torch path does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.triton_paging import Paging
from tandem.engine.triton_rows import interpreted, token_rows


NO_WINDOW = 1 << 30           # a window no context reaches: plain causal attention


@triton.jit
def _paged_prefill(q_ptr, o_ptr, pool_ptr, kt_ptr, kd_ptr, vt_ptr, vd_ptr,
                   tile_seg_ptr, tile_m0_ptr, seg_start_ptr, seg_n_ptr, seg_ctx_ptr,
                   s_q_t, s_pool_h, s_tab, s_dir, scale, window,
                   G: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                   IEEE: tl.constexpr):
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    seg = tl.load(tile_seg_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    start = tl.load(seg_start_ptr + seg)
    n = tl.load(seg_n_ptr + seg)
    ctx = tl.load(seg_ctx_ptr + seg)
    mi = m0 + tl.arange(0, BLOCK_M)
    mvalid = mi < n
    qpos = ctx - n + mi
    cols = tl.arange(0, D)
    q_off = (start + mi)[:, None] * s_q_t + hq * D + cols[None, :]
    q = tl.load(q_ptr + q_off, mask=mvalid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum(ctx, ctx - n + m0 + BLOCK_M)           # keys past the tile's last query: unseen
    lo = tl.maximum(ctx - n + m0 - window + 1, 0) // BLOCK_N * BLOCK_N     # before the first query's window
    for k0 in range(lo, end, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        valid = t < ctx
        krows = token_rows(kt_ptr, kd_ptr, seg, t, valid, s_tab, s_dir, B, ROWS)
        vrows = token_rows(vt_ptr, vd_ptr, seg, t, valid, s_tab, s_dir, B, ROWS)
        k = tl.load(pool_ptr + h * s_pool_h + krows[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(pool_ptr + h * s_pool_h + vrows[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        see = (t[None, :] <= qpos[:, None]) & (t[None, :] > qpos[:, None] - window) & valid[None, :]
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # padded query rows see nothing
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=mvalid[:, None])


def paged_prefill(q: torch.Tensor, pool: torch.Tensor, k_table: torch.Tensor, v_table: torch.Tensor,
                  seg_start: list[int], seg_n: list[int], seg_ctx: list[int], num_heads: int,
                  scale: float, block_size: int, paging: Paging = Paging.BLOCKS,
                  k_dirs: torch.Tensor | None = None, v_dirs: torch.Tensor | None = None,
                  block_m: int = 16, block_n: int = 32, window: int = 0) -> torch.Tensor:
    """q [T, num_heads * D]: the prefill rows of a step (segment i: rows seg_start[i] ..
    + seg_n[i]), whose K/V are already in ``pool`` [Hkv, S, D]. Segment i's context is
    seg_ctx[i] tokens (its cached prefix, then its seg_n[i] new tokens), addressed by row i of
    the tables (engine.triton_paging). With a sliding ``window`` W > 0 the query at position p
    sees keys p - W + 1 .. p. Returns [T, num_heads * D]."""
    hkv, _, d = pool.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16 for the Triton prefill")
    out = torch.zeros_like(q)
    tiles = [(i, m0) for i, n in enumerate(seg_n) for m0 in range(0, n, block_m)]
    if not tiles:
        return out
    dev = q.device
    tile_seg = torch.tensor([t[0] for t in tiles], dtype=torch.int32, device=dev)
    tile_m0 = torch.tensor([t[1] for t in tiles], dtype=torch.int32, device=dev)
    segs = [torch.tensor(x, dtype=torch.int32, device=dev) for x in (seg_start, seg_n, seg_ctx)]
    rows = paging is Paging.ROWS
    kd = k_table if rows else k_dirs
    vd = v_table if rows else v_dirs
    q = q.contiguous()
    _paged_prefill[(len(tiles), num_heads)](
        q, out, pool, k_table, kd, v_table, vd, tile_seg, tile_m0, *segs,
        q.stride(0), pool.stride(0), k_table.stride(0), kd.stride(0), scale, window or NO_WINDOW,
        G=num_heads // hkv, D=d, B=block_size, BLOCK_M=block_m, BLOCK_N=block_n, ROWS=rows,
        IEEE=q.dtype == torch.float32 or interpreted(_paged_prefill))
    return out
