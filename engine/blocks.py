"""Weights kept in GGUF's 4- and 8-bit blocks, found again in the dequantized float32 model.

A GGUF model (SmolLM2's ships as Q4_1, with its embedding table in Q8_0) is dequantized once
to float32 for transformers and for us. Each of its blocks holds 32 consecutive weights of one
row of W:

- Q4_1: w = d q + m with q in 0..15 and d, m half floats (llama.cpp's quantizer maps the
  block's minimum to q = 0 and its maximum to q = 15);
- Q8_0: w = d q with q in -128..127 and d a half float (the largest |w| maps to q = ±127).

So the blocks can be read back from the float32 weights: m is the block's minimum and d its
range over 15 (Q4_1), or d is its largest |w| over 127 (Q8_0), both rounded to half floats,
and q = (w - m) / d rounded. :func:`find_blocks` keeps them only when d q + m gives back every
weight bit for bit (d q is exact in float32, so the product is what the dequantizer computed),
so a projection over the blocks multiplies by exactly the weights the float32 model holds:
nothing is lost, and the weights take 0.75 or 1.125 bytes each instead of 4. Weights that
were never quantized (random test models, safetensors checkpoints) fail the check and stay
float32.

:func:`pack_blocks` lays the blocks out in column panels of 16 output features for
``engine/csrc/qlinear.cpp`` (its header has the byte layout); :func:`pack_bf16_pairs` lays them
out for ``engine/csrc/qlinear_bf16.cpp``, which multiplies bfloat16 rows by them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

QB = 32        # weights per GGUF block
PANEL = 16     # output features per panel (engine/csrc/panel_tile.h's NR)
SAMPLE_ROWS = 16   # rows tried first (find_blocks)


class BlockKind(enum.Enum):
    Q4_1 = "q4_1"
    Q8_0 = "q8_0"


@dataclass(frozen=True, slots=True)
class Blocks:
    """W [n, k] as blocks: w[i, 32 b + t] = d[i, b] q[i, b, t] + m[i, b] (m = 0 for Q8_0)."""
    kind: BlockKind
    q: torch.Tensor        # [n, k/32, 32] uint8 (Q4_1) or int8 (Q8_0)
    d: torch.Tensor        # [n, k/32] float32 (half-float values)
    m: torch.Tensor        # [n, k/32] float32 (half-float values; zeros for Q8_0)


def _exact_half(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and torch.equal(t.half().float(), t)


def _divisor(d: torch.Tensor) -> torch.Tensor:
    """d with zeros made ones: a block with d = 0 holds one value, and its q are all 0."""
    return torch.where(d > 0, d, 1)[..., None]


def _q4_1(b: torch.Tensor) -> Blocks | None:
    lo = b.amin(-1)
    if not _exact_half(lo):          # most tensors that are not Q4_1 stop here, after one pass
        return None
    d = ((b.amax(-1) - lo) / 15).half().float()
    q = (b - lo[..., None]).div_(_divisor(d)).round_().clamp_(0, 15)
    return Blocks(BlockKind.Q4_1, q.to(torch.uint8), d, lo)


def _q8_0(b: torch.Tensor) -> Blocks:
    d = (b.abs().amax(-1) / 127).half().float()
    q = (b / _divisor(d)).round_().clamp_(-128, 127)
    return Blocks(BlockKind.Q8_0, q.to(torch.int8), d, torch.zeros_like(d))


def dequantize(blocks: Blocks) -> torch.Tensor:
    """The float32 weights [n, k] the blocks hold, computed as GGUF's dequantizer does (also
    what an embedding lookup over blocks returns: ``rows`` of the table, exactly)."""
    w = blocks.q.float().mul_(blocks.d[..., None]).add_(blocks.m[..., None])
    return w.reshape(w.shape[0], -1)


def _exact(find, b: torch.Tensor) -> Blocks | None:
    """``find``'s blocks for the weights ``b`` [n, k/32, 32], if they give back every one."""
    blocks = find(b)
    if blocks is None or not _exact_half(blocks.d):
        return None
    return blocks if torch.equal(dequantize(blocks), b.reshape(b.shape[0], -1)) else None


def find_blocks(w: torch.Tensor) -> Blocks | None:
    """The Q4_1 or Q8_0 blocks that hold exactly the float32 weights ``w`` [n, k], or None.
    Each kind is tried on the first ``SAMPLE_ROWS`` rows first, so a weight that is no blocks
    (a float32 checkpoint's) costs a few passes over those rows, not over the whole tensor."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % QB or w.numel() == 0:
        return None
    b = w.detach().reshape(w.shape[0], -1, QB)
    for find in (_q4_1, _q8_0):       # (a weight that is not finite fails the final check)
        if _exact(find, b[:SAMPLE_ROWS]) is not None:
            return _exact(find, b)
    return None


def rows(blocks: Blocks, index: torch.Tensor) -> Blocks:
    """The blocks of rows ``index`` (an embedding lookup's token ids)."""
    return Blocks(blocks.kind, blocks.q[index], blocks.d[index], blocks.m[index])


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[n, nb, ...] -> [ceil(n/16), nb, ..., 16]: each panel's 16 features last, rows past n zero."""
    n = t.shape[0]
    padded = torch.zeros((-(-n // PANEL) * PANEL, *t.shape[1:]), dtype=t.dtype)
    padded[:n] = t
    p = padded.view(-1, PANEL, *t.shape[1:])
    return p.permute(0, *range(2, p.dim()), 1).contiguous()


def pack_blocks(blocks: Blocks) -> torch.Tensor:
    """The panels engine/csrc/qlinear.cpp multiplies by: uint8 [ceil(n/16), k/32, bytes], per
    (panel, block) d[16] (and m[16] for Q4_1) as float32, then per input the 16 weights' q
    (Q4_1: two to a byte, feature j low and j + 8 high; Q8_0: one int8 each). Rows past n: zero."""
    nb = blocks.q.shape[1]
    parts = [_panels(blocks.d).view(torch.uint8)]
    q = _panels(blocks.q)                               # [P, nb, 32, 16]
    if blocks.kind is BlockKind.Q4_1:
        parts.append(_panels(blocks.m).view(torch.uint8))
        parts.append((q[..., :8] | (q[..., 8:] << 4)).reshape(q.shape[0], nb, -1))
    else:
        parts.append(q.view(torch.uint8).reshape(q.shape[0], nb, -1))
    return torch.cat(parts, dim=-1).contiguous()


def pack_bf16_pairs(blocks: Blocks) -> torch.Tensor:
    """The panels engine/csrc/qlinear_bf16.cpp multiplies bfloat16 rows by: uint8 [ceil(n/16),
    k/32, bytes], per (panel, block) d[16] (and m[16] for Q4_1) as float32, then per group of four
    inputs 4g .. 4g+3: Q4_1, 32 bytes, byte 2j + e = q[j][4g + e] | q[j][4g + 2 + e] << 4; Q8_0,
    64 bytes, byte 32 h + 2j + e = q[j][4g + 2h + e] (int8)."""
    q = _panels(blocks.q)                               # [P, nb, 32, 16]: q[p, b, k, j]
    g = q.view(*q.shape[:2], 8, 2, 2, PANEL)            # [P, nb, group, h, e, j]: k = 4 group + 2 h + e
    scales = [_panels(blocks.d).view(torch.uint8)]
    if blocks.kind is BlockKind.Q4_1:
        scales.append(_panels(blocks.m).view(torch.uint8))
        g = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).unsqueeze(3)   # [P, nb, group, 1, e, j]
    data = g.transpose(-1, -2).reshape(*q.shape[:2], -1).view(torch.uint8)   # byte 2j + e in each h
    return torch.cat([*scales, data], dim=-1).contiguous()
