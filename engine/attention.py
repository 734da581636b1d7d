"""Paged attention, torch reference path.

Pool layout (one tensor per worker, in its own memory), head-major so
that gathered keys feed batched matmuls without a transposing copy::

    pool[layer] : [num_kv_heads, num_blocks * block_size, head_dim]
                   block b owns rows b*B .. b*B+B-1 of every head

A KV-cache request uses one block for K and one for V per block_size tokens.
A slot is addressed by (block, offset, direction): row ``b*B + offset`` for
Direction.LEFT, ``b*B + (B-1-offset)`` for RIGHT. The worker turns each
request's block table into per-token rows once, when blocks are appended, so
the per-step work here is pure tensor indexing.

A step's tokens are laid out prefills first, then decodes (one token each)::

    rows: [ prefill r0 (n0 tokens) | prefill r1 (n1) | ... | decode d0 | d1 | ... ]

Hidden-cache requests (Apt-Serve, SPEC §1.2) keep each layer's post-norm input
instead of K and V: ``m = d_model / unit`` rows per token, one in each of the
m blocks of a token-block. Their rows come after all KV-cache rows in a step::

    rows: [ KV prefills | KV decodes | hidden prefills | hidden decodes ]

Each step writes the new tokens' inputs, then takes the context's stored inputs
followed by the new ones, projects K and V from them (rotary embeddings at each token's own position) and
attends, so a context never mixes fresh and stale K/V.

With a sliding window W (``AttnBatch.window``) the token at position p attends to keys
p - W + 1 .. p only. The runner hands each request only the rows that window can reach (a
decode's last W, a prefill chunk's prefix from its first query's window on), so the decode
kernels need no change; prefill queries, which sit at different positions, take a band mask.
Where only some layers slide, a step carries both layouts (``AttnBatch.windowed``).

Decode attention reads each request's context through its per-token rows,
so a block filled right to left, or shared with another owner, reads
correctly. On the CPU a compiled kernel (engine/csrc/paged_decode.cpp) reads
those rows in place; the torch path below gathers them and is the reference.

With ``kv_cache_dtype="int8"`` a layer's store is an engine.quantpool.QuantLayer
instead of a tensor: the same rows, full blocks compressed to int8 and open
blocks in full precision. Writes and gathers go through ``pool_write`` and
``pool_gather``, and the compiled kernel reads int8 rows in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.engine.quantpool import QuantLayer


# A prompt chunk of n tokens over a cached prefix, b tokens in all with it, is attended by the
# compiled decode kernel, each of its tokens a query over its own context (the pool holds the
# chunk's K and V once the step wrote them), while n * b is at most this; past it, by SDPA over
# the gathered context. SDPA's path costs about 1 ms a layer for any chunk (the gather, the
# per-head copy for grouped queries, the mask), the kernel's grows with n * b. SmolLM2's heads
# (3 KV heads of 3 queries, dim 64) on a 2-core AMD EPYC, fp32, ms a layer, SDPA / kernel:
# n = 1 over 300 cached tokens 1.21 / 0.10, 16 over 300 1.34 / 0.68, 64 over 64 1.36 / 0.95,
# 16 over 1,000 3.72 / 2.94, 64 over 300 1.76 / 2.72 (kernel slower), 256 over 64 5.5 / 7.8.
# Steps of a few decodes and a 16-token chunk of a batch prompt took 130 ms against 49 ms
# without the chunk (bench mixed's step log), 30 layers of that fixed cost being about 36 ms.
PAGED_PREFILL_PAIRS = 8192


@dataclass(slots=True)
class PrefillSegment:
    start: int                       # first row of this request in the step
    end: int                         # one past its last row
    k_ctx: torch.Tensor | None       # [a] K rows of the cached prefix (tokens before this chunk), or None
    v_ctx: torch.Tensor | None       # [a] V rows
    # for the compiled kernel (PAGED_PREFILL_PAIRS): each token's K and V rows of its context,
    # chunk included, [n, b] long, and its context's length, [n] long
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class HiddenSegment:
    """One hidden-cache request in a step: rows [start, end) of the hidden part."""
    start: int
    end: int
    ctx_rows: torch.Tensor           # [ctx * m] long: pool rows of every context token, token-major
    first: int = 0                   # position of ctx_rows' first token (0 unless a sliding window cut it)
    adapter: object | None = None    # the request's LoRA adapter (engine.lora.Adapter): its K/V updates


@dataclass(slots=True)
class HiddenBatch:
    """The hidden-cache part of a step (rows ``start`` .. T-1 of the step)."""
    start: int                       # first hidden-cache row of the step
    m: int                           # pool rows per token: d_model / (num_kv_heads * head_dim)
    write_rows: torch.Tensor         # [(T - start) * m] long: pool rows for the new tokens' inputs
    segs: list[HiddenSegment]        # per request, prefills and decodes alike


@dataclass(slots=True)
class AttnBatch:
    """Per-step attention metadata, built once and used by every layer."""
    k_slots: torch.Tensor            # [T] long, pool row to write each new token's K
    v_slots: torch.Tensor            # [T] long, pool row for V
    prefills: list[PrefillSegment]   # one per prefill request
    decode_start: int                # first decode row (== T when there are none)
    dec_k_rows: torch.Tensor | None  # [nd, L] long, K row of each context token, padded past dec_lens
    dec_v_rows: torch.Tensor | None  # [nd, L] long
    dec_lens: torch.Tensor | None    # [nd] long, context length of each decode (this token included)
    kernel: object | None = None     # compiled CPU ops module, or None for the torch path
    hidden: HiddenBatch | None = None  # hidden-cache requests of this step, if any
    triton: object | None = None     # engine.triton_attention.TritonMeta: the Triton kernels serve
    window: int | None = None        # the model's sliding window; the context rows given are already cut to it
    windowed: AttnBatch | None = None  # the same step cut to the window, for the sliding layers of a model
                                       # whose other layers attend fully (ModelSpec.full_layers)


Pool = torch.Tensor | QuantLayer     # one layer's store: full precision, or int8 (engine.quantpool)


def pool_write(pool: Pool, rows: torch.Tensor, x: torch.Tensor) -> None:
    """x [Hkv, n, hd] into rows [n] of every head."""
    if isinstance(pool, QuantLayer):
        pool.write(rows, x)
    else:
        pool.index_copy_(1, rows, x)


def pool_gather(pool: Pool, rows: torch.Tensor) -> torch.Tensor:
    """[Hkv, *rows.shape, hd] at the model's dtype."""
    return pool.gather(rows) if isinstance(pool, QuantLayer) else pool[:, rows]


def write_kv(pool: Pool, slots: torch.Tensor, x: torch.Tensor) -> None:
    """pool: [Hkv, S, hd]; x: [T, Hkv*hd] -> rows ``slots`` of every head."""
    h, _, hd = pool.shape
    pool_write(pool, slots, x.view(-1, h, hd).transpose(0, 1))


@dataclass(slots=True)
class HiddenProjection:
    """K and V of stored layer inputs x [n, d_model] at positions [n]: ``x @ w.T + b`` split
    into K and V, K rotated when ``cos``/``sin`` are given. ``project`` is the model's own
    computation of that (packed weights on the CPU); the Triton kernel reads the fields."""
    project: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    w: torch.Tensor                  # [2 * Hkv * D, d_model] dense: the K rows, then the V rows
    b: torch.Tensor | None = None    # [2 * Hkv * D]
    cos: torch.Tensor | None = None  # [max_len, D] rotary tables (HF layout), None: no rotary
    sin: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, adapter=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``adapter``: the request's LoRA adapter (engine.lora.Adapter), or None."""
        return self.project(x, pos) if adapter is None else self.project(x, pos, adapter)


KvFromHidden = HiddenProjection


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pool: Pool, batch: AttnBatch,
                    num_heads: int, num_kv_heads: int, head_dim: int,
                    scale: float, x: torch.Tensor | None = None,
                    kv_from_hidden: KvFromHidden | None = None) -> torch.Tensor:
    """Write this step's K/V (or layer inputs) into ``pool`` and attend.

    q: [T, num_heads*head_dim]; k, v: [T, num_kv_heads*head_dim];
    pool: [num_kv_heads, num_slots, head_dim] (this layer). Returns [T, num_heads*head_dim].
    With hidden-cache rows in the step: x [T, d_model] is the layer's post-norm input and
    ``kv_from_hidden(x_rows, positions)`` projects K (rotated) and V from stored inputs.
    """
    out = torch.empty_like(q)
    hb = batch.hidden
    kv_end = q.shape[0] if hb is None else hb.start
    if hb is not None:
        out[hb.start:] = hidden_attention(q[hb.start:], x[hb.start:], pool, hb, kv_from_hidden,
                                          num_heads, num_kv_heads, head_dim, scale, batch.triton, batch.window)
        if hb.start == 0:
            return out
        q, k, v = q[:hb.start], k[:hb.start], v[:hb.start]
    write_kv(pool, batch.k_slots, k)
    write_kv(pool, batch.v_slots, v)
    tm = batch.triton
    if tm is not None and tm.prefill is not None:
        out[:batch.decode_start] = tm.attend_prefill(q[:batch.decode_start], pool, num_heads, scale)
    else:
        _prefills(q, k, v, out, pool, batch, num_heads, num_kv_heads, head_dim, scale)
    if batch.dec_lens is not None:
        qd = q[batch.decode_start:]
        nd = qd.shape[0]
        qg = qd.reshape(nd, num_kv_heads, -1, head_dim)                  # [nd, Hkv, g, hd]
        if tm is not None:
            o = tm.attend_decode(qg, pool, scale)
        elif batch.kernel is not None and isinstance(pool, QuantLayer):
            o = batch.kernel.paged_decode_q8(qg.contiguous(), pool.stage, pool.q, pool.scale, pool.low,
                                             pool.stage_of, batch.dec_k_rows, batch.dec_v_rows,
                                             batch.dec_lens, pool.block_size, scale)
        elif batch.kernel is not None:
            o = batch.kernel.paged_decode(qg.contiguous(), pool, batch.dec_k_rows,
                                          batch.dec_v_rows, batch.dec_lens, scale)
        else:
            o = decode_attention(qg, pool, batch.dec_k_rows, batch.dec_v_rows, batch.dec_lens, scale)
        out[batch.decode_start:kv_end] = o.reshape(nd, -1)
    return out


def _prefills(q, k, v, out, pool, batch: AttnBatch, num_heads, num_kv_heads, head_dim, scale) -> None:
    """Each prefill segment attends over its prefix and itself: a short chunk over a cached prefix
    through the compiled kernel (``PrefillSegment.paged``), the others by the torch path over
    the gathered prefix."""
    for seg in batch.prefills:
        if seg.paged is not None and batch.kernel is not None and not isinstance(pool, QuantLayer):
            n = seg.end - seg.start
            qg = q[seg.start:seg.end].reshape(n, num_kv_heads, -1, head_dim).contiguous()
            out[seg.start:seg.end] = batch.kernel.paged_decode(qg, pool, *seg.paged, scale).reshape(n, -1)
            continue
        out[seg.start:seg.end] = _prefill(q[seg.start:seg.end], k[seg.start:seg.end],
                                          v[seg.start:seg.end], pool, seg,
                                          num_heads, num_kv_heads, head_dim, scale, batch.window)


def _prefill(q, k, v, pool, seg: PrefillSegment, num_heads, num_kv_heads, head_dim, scale, window=None):
    """Causal attention of n new tokens over (cached prefix + themselves): the prefix as the
    pool holds it, the new tokens as computed (an int8 pool may already hold them compressed).

    Inputs are made 4-D with K/V repeated per query head: that is the shape
    SDPA's fused CPU kernel takes (2-3x faster than its enable_gqa path here).
    """
    n = q.shape[0]
    kh = k.view(n, num_kv_heads, head_dim).transpose(0, 1)            # [Hkv, n, hd]
    vh = v.view(n, num_kv_heads, head_dim).transpose(0, 1)
    ctx = n
    if seg.k_ctx is not None:
        ctx += seg.k_ctx.shape[0]
        kh = torch.cat([pool_gather(pool, seg.k_ctx), kh], dim=1)     # [Hkv, ctx, hd]
        vh = torch.cat([pool_gather(pool, seg.v_ctx), vh], dim=1)
    return _dense(q, kh, vh, n, ctx, num_heads, num_kv_heads, head_dim, scale, window)


def _dense(q, kh, vh, n, ctx, num_heads, num_kv_heads, head_dim, scale, window=None):
    """n queries (the last n of ctx positions) over kh, vh [Hkv, ctx, hd], causal; with a
    sliding ``window`` W, query i sees only the W keys ending at its own position."""
    group = num_heads // num_kv_heads
    qh = q.view(n, num_heads, head_dim).transpose(0, 1)[None]        # [1, H, n, hd]
    banded = window is not None and window < ctx
    if ctx == n and not banded:
        mask, causal = None, True
    else:
        # query i sits at position ctx-n+i and sees keys 0..ctx-n+i (window: from ctx-n+i-W+1)
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
        if banded:
            mask &= ~torch.ones_like(mask).tril(diagonal=ctx - n - window)
        causal = False
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    o = F.scaled_dot_product_attention(qh, kh[None], vh[None], attn_mask=mask, is_causal=causal,
                                       scale=scale)
    return o[0].transpose(0, 1).reshape(n, num_heads * head_dim)


def write_hidden(pool: Pool, rows: torch.Tensor, x: torch.Tensor) -> None:
    """pool: [Hkv, S, hd]; x: [n, m * Hkv * hd] -> rows [n * m] (token-major) of every head."""
    h, _, hd = pool.shape
    pool_write(pool, rows, x.reshape(-1, h, hd).transpose(0, 1))


def read_hidden(pool: Pool, rows: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of write_hidden: rows [n * m] -> [n, m * Hkv * hd]."""
    return pool_gather(pool, rows).transpose(0, 1).reshape(n, -1)


def hidden_attention(q, x, pool, hb: HiddenBatch, kv_from_hidden: KvFromHidden,
                     num_heads, num_kv_heads, head_dim, scale, triton=None, window=None) -> torch.Tensor:
    """Attention of hidden-cache requests: store the new inputs, rebuild each context's K and V
    from the stored prefix and the new inputs (positions first..first+ctx-1), attend causally.
    q, x: the hidden rows only. With Triton metadata, its single-token segments go to the fused
    kernel."""
    write_hidden(pool, hb.write_rows, x)
    out = torch.empty_like(q)
    segs = hb.segs
    if triton is not None and triton.hidden is not None:
        starts = torch.tensor([segs[i].start for i in triton.hidden_segs], device=q.device)
        qg = q[starts].reshape(starts.shape[0], num_kv_heads, -1, head_dim)
        out[starts] = triton.attend_hidden(qg, pool, kv_from_hidden, scale).reshape(starts.shape[0], -1)
        done = set(triton.hidden_segs)
        segs = [s for i, s in enumerate(segs) if i not in done]
    for seg in segs:
        n = seg.end - seg.start
        ctx = seg.ctx_rows.shape[0] // hb.m
        xs = x[seg.start:seg.end]
        if ctx > n:
            xs = torch.cat([read_hidden(pool, seg.ctx_rows[:(ctx - n) * hb.m], ctx - n), xs])
        k, v = kv_from_hidden(xs, torch.arange(seg.first, seg.first + ctx, device=q.device), seg.adapter)
        kh = k.reshape(ctx, num_kv_heads, head_dim).transpose(0, 1)     # [Hkv, ctx, hd]
        vh = v.reshape(ctx, num_kv_heads, head_dim).transpose(0, 1)
        out[seg.start:seg.end] = _dense(q[seg.start:seg.end], kh, vh, n, ctx, num_heads,
                                        num_kv_heads, head_dim, scale, window)
    return out


def decode_attention(qg: torch.Tensor, pool: Pool, k_rows: torch.Tensor,
                     v_rows: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference: one query token per request over its gathered context.

    Grouped-query attention without repeating K/V: the ``g`` query heads
    sharing a KV head form a [g, hd] matrix against that head's keys.
    qg: [nd, Hkv, g, hd]; pool: [Hkv, S, hd]; k_rows, v_rows: [nd, L]; lens: [nd].
    """
    kk = pool_gather(pool, k_rows)                                        # [Hkv, nd, L, hd]
    vv = pool_gather(pool, v_rows)
    qh = qg.transpose(0, 1)                                               # [Hkv, nd, g, hd]
    scores = torch.matmul(qh, kk.transpose(-1, -2)) * scale              # [Hkv, nd, g, L]
    pad = torch.arange(k_rows.shape[1], device=k_rows.device) >= lens[:, None]   # [nd, L]
    scores = scores.masked_fill(pad[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(qg.dtype)
    return torch.matmul(probs, vv).transpose(0, 1)                        # [nd, Hkv, g, hd]
