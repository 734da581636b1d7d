"""Triton paged decode attention: one query token per request over its paged context.

One program per (request, KV head) computes the ``G`` query heads that share the KV head
(grouped-query attention; G = 1 is multi-head), padded to 16 rows so that both products run
on the tensor cores, streaming the context in tiles of ``BLOCK_N`` tokens with an online
softmax in fp32::

    for each tile of context tokens t:            rows from engine.triton_paging
        s   = (q @ K[t]^T) * scale                [G, BLOCK_N]
        m'  = max(m, max s);  p = exp(s - m')
        acc = acc * exp(m - m') + p @ V[t];  l = l * exp(m - m') + sum p
    out = acc / l

K and V are read in place from the pool, through the block table with per-block direction
(bidirectional blocks need no gather) or through a per-token row table. Over the int8 pool of
engine.quantpool a row is ``lo + λ q`` of its block and channel, or the staged full-precision
copy while its block is open, at the model's dtype. Products are fp32 ("ieee") for fp32 models
and under the interpreter (its bf16 product is wrong). The torch reference is
engine.attention.decode_attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.quantpool import QuantLayer
from tandem.engine.triton_paging import Paging, next_pow2
from tandem.engine.triton_rows import interpreted, token_rows


@triton.jit
def _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, rows, valid, cols,
               s_pool_h, s_q_h, s_sc_h, s_stage_h,
               B: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr):
    """[BLOCK_N, D] values of pool rows ``rows`` of KV head h, at the model's dtype (a closed
    int8 block dequantized to it, as the torch path does)."""
    m2 = valid[:, None]
    if QUANT:
        blk = rows // B
        slot = tl.load(stage_of_ptr + blk, mask=valid, other=-1)
        staged = slot >= 0
        srow = slot * B + rows % B
        xs = tl.load(stage_ptr + h * s_stage_h + srow[:, None] * D + cols[None, :],
                     mask=m2 & staged[:, None], other=0.0).to(tl.float32)
        closed = m2 & (~staged[:, None])
        code = tl.load(qv_ptr + h * s_q_h + rows[:, None] * D + cols[None, :], mask=closed, other=0)
        lam = tl.load(sc_ptr + h * s_sc_h + blk[:, None] * D + cols[None, :], mask=closed, other=0.0)
        lo = tl.load(lo_ptr + h * s_sc_h + blk[:, None] * D + cols[None, :], mask=closed, other=0.0)
        # lo + λ q on halves (engine.kvquant): no overflow where a channel spans float32's range
        x = tl.where(staged[:, None], xs, (lo * 0.5 + (lam * 0.5) * code.to(tl.float32)) * 2.0)
        x = x.to(stage_ptr.dtype.element_ty)
    else:
        x = tl.load(pool_ptr + h * s_pool_h + rows[:, None] * D + cols[None, :], mask=m2, other=0.0)
    return x


@triton.jit
def _paged_decode(q_ptr, o_ptr, lens_ptr,
                  pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr,
                  kt_ptr, kd_ptr, vt_ptr, vd_ptr,
                  s_q_r, s_q_h, s_pool_h, s_qv_h, s_sc_h, s_stage_h, s_tab, s_dir,
                  scale,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + req)
    gi = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    qmask = (gi < G)[:, None]
    q = tl.load(q_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :], mask=qmask,
                other=0.0).to(tl.float32) * scale                                     # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(0, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < n
        krows = token_rows(kt_ptr, kd_ptr, req, t, valid, s_tab, s_dir, B, ROWS)
        vrows = token_rows(vt_ptr, vd_ptr, req, t, valid, s_tab, s_dir, B, ROWS)
        k = _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, krows, valid,
                       cols, s_pool_h, s_qv_h, s_sc_h, s_stage_h, B, D, QUANT)      # [BLOCK_N, D]
        v = _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, vrows, valid,
                       cols, s_pool_h, s_qv_h, s_sc_h, s_stage_h, B, D, QUANT)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")           # [G_PAD, BLOCK_N]
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask)


def paged_decode(qg: torch.Tensor, pool: torch.Tensor | QuantLayer, k_table: torch.Tensor,
                 v_table: torch.Tensor, lens: torch.Tensor, scale: float, block_size: int,
                 paging: Paging = Paging.BLOCKS, k_dirs: torch.Tensor | None = None,
                 v_dirs: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """qg [nd, Hkv, G, D] over ``pool`` [Hkv, S, D] (or an int8 QuantLayer) -> [nd, Hkv, G, D].

    BLOCKS: k_table/v_table int32 [nd, max_blocks] with k_dirs/v_dirs int8 of the same shape;
    ROWS: k_table/v_table int32 [nd, L] pool rows per token (dirs unused). lens [nd]: context
    length of each request, this token included (its K/V already written)."""
    nd, hkv, g, d = qg.shape
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton kernels")
    qg = qg.contiguous()
    out = torch.empty_like(qg)
    if nd == 0:
        return out
    quant = isinstance(pool, QuantLayer)
    if quant:
        arrays = (pool.stage, pool.q, pool.scale, pool.low, pool.stage, pool.stage_of)
        strides = (pool.stage.stride(0), pool.q.stride(0), pool.scale.stride(0), pool.stage.stride(0))
    else:
        arrays = (pool, pool, pool, pool, pool, lens)
        strides = (pool.stride(0), pool.stride(0), pool.stride(0), pool.stride(0))
    rows = paging is Paging.ROWS
    kd = k_table if rows else k_dirs
    vd = v_table if rows else v_dirs
    block_n = max(16, min(block_n, next_pow2(int(k_table.shape[1]) * (1 if rows else block_size))))
    _paged_decode[(nd, hkv)](
        qg, out, lens, *arrays, k_table, kd, v_table, vd,
        qg.stride(0), qg.stride(1), *strides, k_table.stride(0), kd.stride(0), scale,
        G=g, G_PAD=max(16, next_pow2(g)), D=d, B=block_size, BLOCK_N=block_n, ROWS=rows, QUANT=quant,
        IEEE=qg.dtype == torch.float32 or interpreted(_paged_decode))
    return out
