"""Triton hidden-cache decode (Apt-Serve's hidden path) in one kernel.

A hidden-cache request stores each layer's post-norm input ``x [d_model]`` per token instead
of K and V: ``m = d_model / (Hkv * D)`` pool rows per token, row j of token t in the j-th
block of its token-block, holding ``x[t, j*Hkv*D : (j+1)*Hkv*D]`` as ``[Hkv, D]`` (the
layout engine.attention's ``write_hidden`` uses). For one decode token the kernel rebuilds
K and V of the whole context and attends, without writing K or V anywhere::

    program (request r, KV head h), for each tile of BLOCK_N context tokens t:
        X[t]  = the m rows of t, gathered from the pool          [BLOCK_N, d_model]
        K     = X @ Wk[h]^T + bk[h],  V = X @ Wv[h]^T + bv[h]    [BLOCK_N, D]  (fp32 accumulate)
        K     = rotary(K, position t)                            (Llama; none for OPT)
        s     = q @ K^T * scale;  online softmax;  acc += p @ V  (G query heads of KV head h,
                                                                  padded to 16 rows; fp32)

The rotation pairs channel c with c + D/2 (HF's rotate_half), so K is computed as its two
halves: K1 = X Wk1^T, K2 = X Wk2^T, and the rotated key is (K1 cos - K2 sin, K2 cos + K1 sin).
One kernel, because every intermediate (X, K, V of a tile) lives in registers only: the
cost that remains is the projection's FLOPs, ctx * d_model * 2D per KV head, which is the
memory-for-compute trade a hidden cache makes. The torch reference is
engine.attention.hidden_attention for a decode row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.triton_paging import Paging, next_pow2
from tandem.engine.triton_rows import interpreted, token_rows


@triton.jit
def _proj(x, w_ptr, row0, e0, s_w, D_OUT: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """x [BLOCK_N, D] @ W[row0 : row0 + D_OUT, e0 : e0 + D]^T -> [BLOCK_N, D_OUT] fp32."""
    ro = tl.arange(0, D_OUT)
    ci = tl.arange(0, D)
    wt = tl.load(w_ptr + (row0 + ro)[None, :] * s_w + (e0 + ci)[:, None])         # [D, D_OUT]
    if IEEE:
        return tl.dot(x.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
    return tl.dot(x, wt)


@triton.jit
def _hidden_decode(q_ptr, o_ptr, lens_ptr, pool_ptr, tab_ptr, dir_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr,
                   s_q_r, s_q_h, s_pool_h, s_tab, s_dir, s_w, s_cs, scale,
                   HKV: tl.constexpr, M: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                   D: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                   ROPE: tl.constexpr, BIAS: tl.constexpr, IEEE: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + req)
    HALF: tl.constexpr = D // 2
    gi = tl.arange(0, G_PAD)
    qmask = (gi < G)[:, None]
    c1 = tl.arange(0, HALF)
    qbase = q_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D
    q1 = tl.load(qbase + c1[None, :], mask=qmask, other=0.0).to(tl.float32) * scale   # [G_PAD, D/2]
    q2 = tl.load(qbase + HALF + c1[None, :], mask=qmask, other=0.0).to(tl.float32) * scale
    cols = tl.arange(0, D)
    v_row0 = HKV * D + h * D                         # Wv[h] starts after all K rows
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(0, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < n
        k1 = tl.zeros([BLOCK_N, HALF], tl.float32)
        k2 = tl.zeros([BLOCK_N, HALF], tl.float32)
        v = tl.zeros([BLOCK_N, D], tl.float32)
        for j in tl.static_range(M):
            rows = token_rows(tab_ptr, dir_ptr, req, t, valid, s_tab, s_dir, B, ROWS, j, M)
            for hh in range(HKV):        # a loop, not unrolled: unrolled, the compiler hoists
                #                            every head's weight tiles out of the context loop
                x = tl.load(pool_ptr + hh * s_pool_h + rows[:, None] * D + cols[None, :],
                            mask=valid[:, None], other=0.0)                          # [BLOCK_N, D]
                e0 = (j * HKV + hh) * D                  # x's columns in d_model
                k1 += _proj(x, w_ptr, h * D, e0, s_w, HALF, D, IEEE)
                k2 += _proj(x, w_ptr, h * D + HALF, e0, s_w, HALF, D, IEEE)
                v += _proj(x, w_ptr, v_row0, e0, s_w, D, D, IEEE)
        if BIAS:
            k1 += tl.load(b_ptr + h * D + c1).to(tl.float32)[None, :]
            k2 += tl.load(b_ptr + h * D + HALF + c1).to(tl.float32)[None, :]
            v += tl.load(b_ptr + v_row0 + cols).to(tl.float32)[None, :]
        if ROPE:
            cs = t[:, None] * s_cs + c1[None, :]
            cos = tl.load(cos_ptr + cs, mask=valid[:, None], other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + cs, mask=valid[:, None], other=0.0).to(tl.float32)
            k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        s = (tl.dot(q1, tl.trans(k1), input_precision="ieee")
             + tl.dot(q2, tl.trans(k2), input_precision="ieee"))                  # [G_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask)


def hidden_decode(qg: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                  w_kv: torch.Tensor, b_kv: torch.Tensor | None, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, scale: float, block_size: int,
                  paging: Paging = Paging.BLOCKS, dirs: torch.Tensor | None = None,
                  block_n: int = 16) -> torch.Tensor:
    """qg [nd, Hkv, G, D] (rotated queries) over hidden-cache contexts -> [nd, Hkv, G, D].

    pool [Hkv, S, D]: the layer's pool, this token's input already written.
    table: BLOCKS int32 [nd, max_blocks, m] with dirs int8 [nd, max_blocks]; ROWS int32
    [nd, L, m] (engine.triton_paging). lens [nd]: context tokens, this one included (positions
    0 .. lens-1). w_kv [2 * Hkv * D, d_model]: the K rows then the V rows of the layer's
    projection; b_kv [2 * Hkv * D] or None; cos, sin [max_len, D] (HF layout, halves equal) or
    None for models without rotary embeddings."""
    nd, hkv, g, d = qg.shape
    m = table.shape[2]
    if d & (d - 1) or d < 32:
        raise ValueError(f"head_dim {d} must be a power of two >= 32 for the Triton hidden kernel")
    if w_kv.shape != (2 * hkv * d, m * hkv * d):
        raise ValueError(f"w_kv {tuple(w_kv.shape)} is not [2 * Hkv * D, d_model] = "
                         f"[{2 * hkv * d}, {m * hkv * d}]")
    qg = qg.contiguous()
    out = torch.empty_like(qg)
    if nd == 0:
        return out
    w_kv = w_kv.contiguous()
    rows = paging is Paging.ROWS
    rope = cos is not None
    cs = cos if rope else w_kv
    _hidden_decode[(nd, hkv)](
        qg, out, lens, pool, table, table if rows else dirs, w_kv,
        b_kv if b_kv is not None else w_kv, cs, sin if rope else w_kv,
        qg.stride(0), qg.stride(1), pool.stride(0), table.stride(0),
        table.stride(0) if rows else dirs.stride(0), w_kv.stride(0), cs.stride(0), scale,
        HKV=hkv, M=m, G=g, G_PAD=max(16, next_pow2(g)), D=d, B=block_size, BLOCK_N=block_n, ROWS=rows,
        ROPE=rope, BIAS=b_kv is not None, IEEE=qg.dtype == torch.float32 or interpreted(_hidden_decode))
    return out
