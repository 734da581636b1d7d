"""Paged attention, torch reference path.

Pool layout (one tensor per worker, shared memory on the CPU)::

    pool[layer] : [num_blocks * block_size, unit]      unit = num_kv_heads * head_dim
                   └ block b owns rows b*B .. b*B+B-1

A KV-cache request uses one block for K and one for V per block_size tokens.
A slot is addressed by (block, offset, direction): physical row
``b*B + offset`` for Direction.LEFT, ``b*B + (B-1-offset)`` for RIGHT. The
worker turns each request's block table into flat per-token slot lists once,
when blocks are appended, so the per-step work here is pure tensor indexing.

A step's tokens are laid out prefills first, then decodes (one token each)::

    rows: [ prefill r0 (n0 tokens) | prefill r1 (n1) | ... | decode d0 | d1 | ... ]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    start: int                       # first row of this request in the step
    end: int                         # one past its last row
    k_ctx: torch.Tensor | None       # [ctx] K slots of the full context, None if no cached prefix
    v_ctx: torch.Tensor | None       # [ctx] V slots


@dataclass(slots=True)
class AttnBatch:
    """Per-step attention metadata, built once and used by every layer."""
    k_slots: torch.Tensor            # [T] long, pool row to write each new token's K
    v_slots: torch.Tensor            # [T] long, pool row for V
    prefills: list[PrefillSegment]   # one per prefill request
    decode_start: int                # first decode row (== T when there are none)
    dec_k: torch.Tensor | None       # [nd, Lmax] long, K rows of each decode's context (padded)
    dec_v: torch.Tensor | None       # [nd, Lmax] long
    dec_mask: torch.Tensor | None    # [nd, 1, 1, Lmax] float, 0 for real keys, -inf for padding


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pool: torch.Tensor, batch: AttnBatch,
                    num_heads: int, num_kv_heads: int, head_dim: int,
                    scale: float) -> torch.Tensor:
    """Write this step's K/V into ``pool`` and attend.

    q: [T, num_heads*head_dim]; k, v: [T, num_kv_heads*head_dim];
    pool: [num_slots, num_kv_heads*head_dim] (this layer). Returns [T, num_heads*head_dim].
    """
    pool.index_copy_(0, batch.k_slots, k)
    pool.index_copy_(0, batch.v_slots, v)
    out = torch.empty_like(q)
    for seg in batch.prefills:
        out[seg.start:seg.end] = _prefill(q[seg.start:seg.end], k[seg.start:seg.end],
                                          v[seg.start:seg.end], pool, seg,
                                          num_heads, num_kv_heads, head_dim, scale)
    if batch.dec_k is not None:
        out[batch.decode_start:] = _decode(q[batch.decode_start:], pool, batch,
                                           num_kv_heads, head_dim, scale)
    return out


def _prefill(q, k, v, pool, seg: PrefillSegment, num_heads, num_kv_heads, head_dim, scale):
    """Causal attention of n new tokens over (cached prefix + themselves)."""
    n = q.shape[0]
    qh = q.view(n, num_heads, head_dim).transpose(0, 1)               # [H, n, hd]
    if seg.k_ctx is None:
        kh = k.view(n, num_kv_heads, head_dim).transpose(0, 1)        # [Hkv, n, hd]
        vh = v.view(n, num_kv_heads, head_dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
    else:
        ctx = seg.k_ctx.shape[0]
        kh = pool[seg.k_ctx].view(ctx, num_kv_heads, head_dim).transpose(0, 1)
        vh = pool[seg.v_ctx].view(ctx, num_kv_heads, head_dim).transpose(0, 1)
        # query i sits at position ctx-n+i and sees keys 0..ctx-n+i
        mask = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=ctx - n)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
    return o.transpose(0, 1).reshape(n, num_heads * head_dim)


def _decode(q, pool, batch: AttnBatch, num_kv_heads, head_dim, scale):
    """One query token per request over its padded, gathered context.

    Grouped-query attention without repeating K/V: the query heads of a group
    are a matrix [group, hd] multiplied against that group's K [hd, L].
    """
    nd, lmax = batch.dec_k.shape
    group = q.shape[1] // (num_kv_heads * head_dim)
    qg = q.view(nd, num_kv_heads, group, head_dim)
    kk = pool[batch.dec_k].view(nd, lmax, num_kv_heads, head_dim).permute(0, 2, 3, 1)  # [nd,Hkv,hd,L]
    scores = torch.matmul(qg, kk) * scale                                # [nd, Hkv, group, L]
    scores = scores + batch.dec_mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    vv = pool[batch.dec_v].view(nd, lmax, num_kv_heads, head_dim).transpose(1, 2)      # [nd,Hkv,L,hd]
    return torch.matmul(probs, vv).reshape(nd, -1)
