"""Triton paged decode attention: one query token per request over its paged context.

One program per (request, KV head, part of the context) computes the ``G`` query heads that
share the KV head (grouped-query attention; G = 1 is multi-head), padded to 16 rows so that
both products run on the tensor cores, streaming the context in tiles of ``BLOCK_N`` tokens
with an online softmax in fp32::

    for each tile of context tokens t:            rows from engine.triton_paging
        s   = (q @ K[t]^T) * scale                [G, BLOCK_N]
        m'  = max(m, max s);  p = exp(s - m')
        acc = acc * exp(m - m') + p @ V[t];  l = l * exp(m - m') + sum p
    out = acc / l

When there are too few (request, KV head) pairs to fill the GPU, each context is cut into
parts (flash-decoding): each part's program keeps its (acc, m, l) and a second kernel merges
the parts' softmaxes. K and V are read in place from the pool, through the block table with
per-block direction (bidirectional blocks need no gather) or through a per-token row table.
Over the int8 pool of engine.quantpool a row is ``lo + λ q`` of its block and channel, or the
staged full-precision copy while its block is open, at the model's dtype. Products are fp32
("ieee") for fp32 models and under the interpreter (its bf16 product is wrong). The torch
reference is engine.attention.decode_attention.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.quantpool import QuantLayer
from tandem.engine.triton_paging import Paging, next_pow2
from tandem.engine.triton_rows import interpreted, token_rows


@triton.jit
def _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, rows, valid, cols,
               s_pool_h, s_q_h, s_sc_h, s_stage_h,
               B: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
               WHOLE_BLOCKS: tl.constexpr):
    """[BLOCK_N, D] values of pool rows ``rows`` of KV head h, at the model's dtype (a closed
    int8 block dequantized to it, as the torch path does). WHOLE_BLOCKS: the tile's rows are
    whole blocks in token order (B consecutive tokens share a block), so λ and lo are read once
    per block and broadcast over its rows."""
    m2 = valid[:, None]
    if QUANT:
        blk = rows // B
        if WHOLE_BLOCKS:
            NB: tl.constexpr = BLOCK_N // B
            first = tl.max(tl.reshape(blk, [NB, B]), axis=1)        # masked rows read block 0
            at = h * s_sc_h + first[:, None] * D + cols[None, :]
            lam = tl.reshape(tl.broadcast_to(tl.load(sc_ptr + at)[:, None, :], [NB, B, D]), [BLOCK_N, D])
            lo = tl.reshape(tl.broadcast_to(tl.load(lo_ptr + at)[:, None, :], [NB, B, D]), [BLOCK_N, D])
        else:
            lam = tl.load(sc_ptr + h * s_sc_h + blk[:, None] * D + cols[None, :], mask=m2, other=0.0)
            lo = tl.load(lo_ptr + h * s_sc_h + blk[:, None] * D + cols[None, :], mask=m2, other=0.0)
        slot = tl.load(stage_of_ptr + blk, mask=valid, other=-1)
        staged = slot >= 0
        closed = m2 & (~staged[:, None])
        code = tl.load(qv_ptr + h * s_q_h + rows[:, None] * D + cols[None, :], mask=closed, other=0)
        # lo + λ q on halves (engine.kvquant): no overflow where a channel spans float32's range
        x = tl.where(closed, (lo * 0.5 + (lam * 0.5) * code.to(tl.float32)) * 2.0, 0.0)
        if tl.max(staged.to(tl.int32)) > 0:                 # an open block: its staged copy
            srow = slot * B + rows % B
            xs = tl.load(stage_ptr + h * s_stage_h + srow[:, None] * D + cols[None, :],
                         mask=m2 & staged[:, None], other=0.0).to(tl.float32)
            x = tl.where(staged[:, None], xs, x)
        x = x.to(stage_ptr.dtype.element_ty)
    else:
        x = tl.load(pool_ptr + h * s_pool_h + rows[:, None] * D + cols[None, :], mask=m2, other=0.0)
    return x


@triton.jit
def _paged_decode(q_ptr, o_ptr, lens_ptr,
                  pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr,
                  kt_ptr, kd_ptr, vt_ptr, vd_ptr, acc_ptr, ml_ptr,
                  s_q_r, s_q_h, s_pool_h, s_qv_h, s_sc_h, s_stage_h, s_tab, s_dir,
                  scale, chunk,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr,
                  WHOLE: tl.constexpr, SPLIT: tl.constexpr):
    """Program (request, KV head, part): the part's ``chunk`` context tokens. SPLIT: write the
    part's unnormalized sum, max and denominator for _combine_parts; else the output. WHOLE:
    tiles are whole blocks (block table, BLOCK_N a multiple of B, parts start on tiles)."""
    req = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    n = tl.load(lens_ptr + req)
    lo_t = part * chunk
    hi_t = tl.minimum(n, lo_t + chunk)
    gi = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    qmask = (gi < G)[:, None]
    q = tl.load(q_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :], mask=qmask,
                other=0.0).to(tl.float32) * scale                                     # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(lo_t, hi_t, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < hi_t
        krows = token_rows(kt_ptr, kd_ptr, req, t, valid, s_tab, s_dir, B, ROWS)
        vrows = token_rows(vt_ptr, vd_ptr, req, t, valid, s_tab, s_dir, B, ROWS)
        k = _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, krows, valid,
                       cols, s_pool_h, s_qv_h, s_sc_h, s_stage_h, B, D, BLOCK_N, QUANT, WHOLE)  # [BLOCK_N, D]
        v = _load_rows(pool_ptr, qv_ptr, sc_ptr, lo_ptr, stage_ptr, stage_of_ptr, h, vrows, valid,
                       cols, s_pool_h, s_qv_h, s_sc_h, s_stage_h, B, D, BLOCK_N, QUANT, WHOLE)
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
    if SPLIT:
        # parts of (request, head) are contiguous: acc [.., parts, G, D], ml [.., parts, 2, G]
        row = (req * tl.num_programs(1) + h) * tl.num_programs(2) + part
        tl.store(acc_ptr + row * G * D + gi[:, None] * D + cols[None, :], acc, mask=qmask)
        tl.store(ml_ptr + row * 2 * G + gi, m_i, mask=gi < G)
        tl.store(ml_ptr + row * 2 * G + G + gi, l_i, mask=gi < G)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _combine_parts(acc_ptr, ml_ptr, o_ptr, s_q_r, s_q_h, parts,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    """One program per (request, KV head): the parts' partial softmaxes merged in order,
    ``M = max(m_p)``, ``out = Σ acc_p e^(m_p - M) / Σ l_p e^(m_p - M)``. Part 0 is never empty
    (a context holds at least the new token), so M is finite from the first part on."""
    req = tl.program_id(0)
    h = tl.program_id(1)
    gi = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    base = (req * tl.num_programs(1) + h) * parts
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    real = gi < G
    for p in range(parts):
        row = base + p
        m_p = tl.load(ml_ptr + row * 2 * G + gi, mask=real, other=0.0)
        l_p = tl.load(ml_ptr + row * 2 * G + G + gi, mask=real, other=1.0)
        a_p = tl.load(acc_ptr + row * G * D + gi[:, None] * D + cols[None, :], mask=real[:, None], other=0.0)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_p - m_new)
        acc = acc * alpha[:, None] + a_p * beta[:, None]
        den = den * alpha + l_p * beta
        m = m_new
    tl.store(o_ptr + req * s_q_r + h * s_q_h + gi[:, None] * D + cols[None, :],
             (acc / den[:, None]).to(o_ptr.dtype.element_ty), mask=real[:, None])


@dataclass(frozen=True, slots=True)
class Launch:
    """How paged_decode cuts its work: ``parts`` pieces of each context (one program each),
    ``block_n`` tokens per tile, and the GPU's warps and pipeline stages per program."""
    block_n: int = 32
    parts: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def chunk(self, max_len: int) -> int:
        """Context tokens per part: whole tiles, so parts start on tile and block bounds."""
        return -(-(-(-max_len // self.parts)) // self.block_n) * self.block_n


def choose_launch(nd: int, hkv: int, head_dim: int, max_len: int, quant: bool, device: torch.device) -> Launch:
    """The setting `python -m bench kernels --sweep` found fastest on an H100 (bf16, 16 and 64
    requests of 2,048 tokens, Llama-3-8B's, OPT-13B's and SmolLM2's heads):

    * 4 warps; tiles of 4,096 values (32 tokens of 128 channels, 64 of 64): at 8 warps or 16
      tokens the same work took 10-60% longer. The int8 pool reads 16-token tiles, the one
      setting where its codes, λ and lo fit the registers without spilling at 4 warps.
    * about 3 programs per SM: a context is cut into parts (of at least 256 tokens) only when
      there are fewer (request, KV head) pairs than that. 512 pairs of 2,048 tokens ran best
      uncut (88% of the copy bandwidth), 128 pairs in 4 parts (67%, against 35% uncut), 192
      SmolLM2 pairs in 2 (57% against 43%).
    """
    sms = _multiprocessors(device)
    parts = 1
    if sms and nd * hkv < 3 * sms:
        parts = max(1, min(-(-3 * sms // (nd * hkv)), max_len // 256))
    block_n = 16 if quant else max(16, 4096 // head_dim)
    return Launch(block_n=block_n, parts=parts, num_warps=4, num_stages=2)


def cut(launch: Launch, max_len: int) -> Launch:
    """The launch as run on contexts of up to ``max_len`` tokens: tiles no longer than the
    context (at least 16, a tensor-core product), parts whole tiles long (so they start on tile
    and block bounds), no empty part at the end."""
    launch = dataclasses.replace(launch, block_n=max(16, min(launch.block_n, next_pow2(max_len))))
    return dataclasses.replace(launch, parts=-(-max_len // launch.chunk(max_len)))


@functools.lru_cache(maxsize=256)
def _launch_for(nd: int, hkv: int, head_dim: int, max_len: int, quant: bool, device: torch.device) -> Launch:
    """choose_launch, cut: worked out once per step's shape, not again for each layer."""
    return cut(choose_launch(nd, hkv, head_dim, max_len, quant, device), max_len)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode(qg: torch.Tensor, pool: torch.Tensor | QuantLayer, k_table: torch.Tensor,
                 v_table: torch.Tensor, lens: torch.Tensor, scale: float, block_size: int,
                 paging: Paging = Paging.BLOCKS, k_dirs: torch.Tensor | None = None,
                 v_dirs: torch.Tensor | None = None, launch: Launch | None = None) -> torch.Tensor:
    """qg [nd, Hkv, G, D] over ``pool`` [Hkv, S, D] (or an int8 QuantLayer) -> [nd, Hkv, G, D].

    BLOCKS: k_table/v_table int32 [nd, max_blocks] with k_dirs/v_dirs int8 of the same shape;
    ROWS: k_table/v_table int32 [nd, L] pool rows per token (dirs unused). lens [nd]: context
    length of each request, this token included (its K/V already written). ``launch``: how the
    work is cut (default: choose_launch)."""
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
    max_len = int(k_table.shape[1]) * (1 if rows else block_size)
    launch = cut(launch, max_len) if launch else _launch_for(nd, hkv, d, max_len, quant, qg.device)
    block_n, parts = launch.block_n, launch.parts
    g_pad = max(16, next_pow2(g))
    split = parts > 1
    acc = ml = out                                      # unread unless split
    if split:
        acc = torch.empty((nd * hkv * parts, g, d), dtype=torch.float32, device=qg.device)
        ml = torch.empty((nd * hkv * parts, 2, g), dtype=torch.float32, device=qg.device)
    ieee = qg.dtype == torch.float32 or interpreted(_paged_decode)
    _paged_decode[(nd, hkv, parts)](
        qg, out, lens, *arrays, k_table, kd, v_table, vd, acc, ml,
        qg.stride(0), qg.stride(1), *strides, k_table.stride(0), kd.stride(0), scale, launch.chunk(max_len),
        G=g, G_PAD=g_pad, D=d, B=block_size, BLOCK_N=block_n, ROWS=rows, QUANT=quant, IEEE=ieee,
        WHOLE=not rows and block_n % block_size == 0, SPLIT=split,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if split:
        _combine_parts[(nd, hkv)](acc, ml, out, qg.stride(0), qg.stride(1), parts, G=g, G_PAD=g_pad, D=d)
    return out
