"""INT8 compression of cache rows, channel-wise and asymmetric per block (ALISE Eq. 8, SPEC §3.6).

A request's cache rows come as ``x [layers, heads, g * n, head_dim]``: g kinds of row per token
(K then V for a KV cache, the m rows of a hidden cache), each kind's n tokens in order. The
tokens of one kind are cut into groups of ``block_size`` (the pool's blocks); for every group
and channel c = (layer, head, dim)::

    lo = min_t x[t, c],  hi = max_t x[t, c],  λ = (hi - lo) / 255
    q  = clamp(round((x - lo) / λ), 0, 255)   (uint8)
    x̂  = lo + λ · q                           so |x - x̂| <= λ / 2

(computed in float32; returned in a 16-bit dtype, x̂ is rounded once more, by up to half a unit
in its last place, so there the bound is λ/2 + ulp(x̂)/2).

Both directions are computed on halves -- λ/2 = (hi/2 - lo/2) / 255 and x̂ = 2 (lo/2 + (λ/2) q)
-- because hi - lo, x - lo and λ q exceed float32's range when a channel spans more than half of
it (values of opposite sign above 1.7e38), which made λ infinite and x̂ NaN. Halving and
doubling are exact, so for normal numbers the results are those of the plain formulas bit for
bit; a subnormal lo may move by the smallest subnormal. The readers of the codes (the torch
paths here and in engine.quantpool, the Triton decode kernel) use the halved form; the C++
kernel a fused multiply-add where the CPU has one (λ q is never rounded there), else the halves.

[open choice] The zero point is kept as the float minimum ``lo`` instead of the paper's rounded
integer z = round(-lo / λ): the bound stays λ/2 with no extra rounding of z, and a constant
channel (λ = 0) comes back exact. Storage per group and channel: block_size bytes plus two fp32
numbers (λ and lo).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = 255


@dataclass(slots=True)
class Int8Rows:
    """Compressed rows of one request (see the module docstring for the layout)."""
    q: torch.Tensor           # uint8 [layers, heads, g, groups * block_size, head_dim] (padded)
    scale: torch.Tensor       # float32 [layers, heads, g, groups, head_dim]: λ per group and channel
    low: torch.Tensor         # float32 [layers, heads, g, groups, head_dim]: lo per group and channel
    num_tokens: int           # n: tokens of each kind actually held
    dtype: torch.dtype        # what dequantize returns

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.low))


def quantize_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g [..., block_size, D]`` -> (q uint8 [..., block_size, D], λ [..., D], lo [..., D]):
    each group of rows (dim -2) compressed channel by channel, on halves (module docstring)."""
    g = g.float()
    lo = g.amin(dim=-2)
    half_lo = lo * 0.5
    half_scale = (g.amax(dim=-2) * 0.5 - half_lo) / LEVELS
    safe = torch.where(half_scale > 0, half_scale, torch.ones_like(half_scale))
    q = ((g * 0.5 - half_lo.unsqueeze(-2)) / safe.unsqueeze(-2)).round_().clamp_(0, LEVELS)
    return q.to(torch.uint8), half_scale * 2, lo


def reconstruct(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x̂ = lo + λ q in float32, computed as 2 (lo/2 + (λ/2) q) (module docstring); the three
    broadcast together."""
    return (low * 0.5 + (scale * 0.5) * q.float()) * 2


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_groups``: q [..., rows, D] with λ, lo [..., D] -> rows in ``dtype``."""
    return reconstruct(q, scale.unsqueeze(-2), low.unsqueeze(-2)).to(dtype)


def quantize(x: torch.Tensor, kinds: int, block_size: int) -> Int8Rows:
    """Compress ``x [L, H, kinds * n, D]`` group by group (module docstring)."""
    L, H, R, D = x.shape
    if R % kinds:
        raise ValueError(f"{R} rows are not {kinds} kinds of rows per token")
    n = R // kinds
    groups = max(1, -(-n // block_size))
    xs = x.reshape(L, H, kinds, n, D)
    if groups * block_size > n:          # pad by repeating the last token: min and max unchanged
        pad = xs[:, :, :, -1:].expand(L, H, kinds, groups * block_size - n, D) if n else \
            torch.zeros(L, H, kinds, groups * block_size, D, dtype=x.dtype)
        xs = torch.cat([xs, pad], dim=3)
    q, scale, lo = quantize_groups(xs.reshape(L, H, kinds, groups, block_size, D))
    return Int8Rows(q.reshape(L, H, kinds, groups * block_size, D), scale, lo, n, x.dtype)


def dequantize(r: Int8Rows) -> torch.Tensor:
    """The rows back, ``[L, H, kinds * n, D]`` in the original dtype."""
    L, H, kinds, padded, D = r.q.shape
    groups = r.scale.shape[3]
    x = dequantize_groups(r.q.reshape(L, H, kinds, groups, padded // groups, D), r.scale, r.low, r.dtype)
    return x.reshape(L, H, kinds, padded, D)[:, :, :, :r.num_tokens].reshape(L, H, kinds * r.num_tokens, D)


def int8_block_bytes(layers: int, heads: int, head_dim: int, block_size: int) -> int:
    """Bytes one compressed pool block takes: its values plus λ and lo per channel."""
    return layers * heads * head_dim * (block_size + 2 * 4)
