"""The resident int8 block pool (``kv_cache_dtype="int8"``): full blocks kept compressed,
channel-wise and asymmetric per block as in engine.kvquant, open blocks in full precision.

Layout, per layer (same rows as the full-precision pool in engine.attention)::

    q      uint8 [kv_heads, num_blocks * B, head_dim]   a closed block's values
    scale  fp32  [kv_heads, num_blocks, head_dim]       λ per block and channel
    low    fp32  [kv_heads, num_blocks, head_dim]       lo per block and channel
    stage  dtype [kv_heads, open_capacity * B, head_dim]  the open blocks, at the model's dtype
    stage_of     [num_blocks] long                       a block's staging slot, -1: closed

A block a step only partly fills is *opened* (given a staging slot) before the step writes
into it, and *closed* once all its B rows hold computed tokens: then it is compressed in one go
into ``q`` and its slot is freed. A block a step writes whole (a prefill's inner blocks, a
swapped or migrated cache coming back) is compressed as it is written and never staged.
Compressing a block only when it is full keeps a per-block λ and lo that never have to be
recomputed, and keeps every token of the open block exact, as SPEC §3.6 asks; a step's new
tokens attend to each other as computed either way. Readers resolve a row through
``stage_of``: the staged copy while its block is open, ``lo + λ q`` once closed. Staging holds
the open blocks only (one per kind of row per request with a partial block); the worker
reserves it out of the memory budget for max_num_seqs requests, and it grows by doubling if
more are ever open at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.kvquant import quantize_groups, reconstruct


def _resolve(q, scale, low, stage, stage_of, block_size: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows (any shape) of ``[..., S, D]``-shaped stores -> ``[..., *rows.shape, D]`` at the
    staging dtype: staged rows copied, closed rows dequantized."""
    flat = rows.reshape(-1)
    blocks = torch.div(flat, block_size, rounding_mode="floor")
    slot = stage_of[blocks]
    staged = slot >= 0
    out = reconstruct(q[..., flat, :], scale[..., blocks, :], low[..., blocks, :]).to(stage.dtype)
    if bool(staged.any()):
        idx = staged.nonzero().squeeze(1)
        src = slot[idx] * block_size + flat[idx] % block_size
        out[..., idx, :] = stage[..., src, :]
    return out.reshape(*out.shape[:-2], *rows.shape, out.shape[-1])


def _store(q, scale, low, stage, stage_of, block_size: int, rows: torch.Tensor, x: torch.Tensor) -> None:
    """x ``[..., n, D]`` into rows [n] of ``[..., S, D]``-shaped stores: rows whose block is open
    go to its staging slot; the others must form whole blocks, compressed here."""
    B = block_size
    slot = stage_of[torch.div(rows, B, rounding_mode="floor")]
    staged = slot >= 0
    if bool(staged.all()):
        stage[..., slot * B + rows % B, :] = x.to(stage.dtype)
        return
    if bool(staged.any()):
        i = staged.nonzero().squeeze(1)
        stage[..., slot[i] * B + rows[i] % B, :] = x[..., i, :].to(stage.dtype)
        keep = (~staged).nonzero().squeeze(1)
        rows, x = rows[keep], x[..., keep, :]
    order = torch.argsort(rows)
    r = rows[order].view(-1, B) if rows.numel() % B == 0 else None
    if r is None or not bool((r == r[:, :1] + torch.arange(B, device=r.device)).all()) or bool((r[:, 0] % B).any()):
        raise RuntimeError("int8 pool: rows written outside open blocks must fill whole blocks")
    xs = x[..., order, :]
    codes, lam, lo = quantize_groups(xs.reshape(*xs.shape[:-2], r.shape[0], B, xs.shape[-1]))
    q[..., r.reshape(-1), :] = codes.reshape(xs.shape)
    blocks = torch.div(r[:, 0], B, rounding_mode="floor")
    scale[..., blocks, :] = lam
    low[..., blocks, :] = lo


@dataclass(slots=True)
class QuantLayer:
    """One layer's view of a QuantPool: what paged attention reads and writes."""
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    stage: torch.Tensor
    stage_of: torch.Tensor
    block_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """x [kv_heads, n, head_dim] into pool rows ``rows`` [n]: rows of open blocks staged,
        the rest compressed (they must make whole blocks)."""
        _store(self.q, self.scale, self.low, self.stage, self.stage_of, self.block_size, rows, x)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[kv_heads, *rows.shape, head_dim] at the model's dtype."""
        return _resolve(self.q, self.scale, self.low, self.stage, self.stage_of, self.block_size, rows)


class QuantPool:
    """All layers' int8 stores plus the full-precision staging of open blocks (module docstring)."""

    def __init__(self, layers: int, kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", open_capacity: int = 16):
        B, dev = block_size, torch.device(device)
        self.block_size = B
        self.num_blocks = num_blocks
        self.q = torch.zeros(layers, kv_heads, num_blocks * B, head_dim, dtype=torch.uint8, device=dev)
        self.scale = torch.zeros(layers, kv_heads, num_blocks, head_dim, device=dev)
        self.low = torch.zeros(layers, kv_heads, num_blocks, head_dim, device=dev)
        self.stage = torch.zeros(layers, kv_heads, open_capacity * B, head_dim, dtype=dtype, device=dev)
        self.stage_of = torch.full((num_blocks,), -1, dtype=torch.long, device=dev)
        self._free = list(range(open_capacity - 1, -1, -1))
        self.peak_open = 0          # most blocks open at once

    # ---- what the runner and the models see of a pool ------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.stage.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, layer: int) -> QuantLayer:
        return QuantLayer(self.q[layer], self.scale[layer], self.low[layer], self.stage[layer],
                          self.stage_of, self.block_size)

    @property
    def num_open(self) -> int:
        return self.stage.shape[2] // self.block_size - len(self._free)

    def resident_bytes(self) -> int:
        """Bytes held now: the compressed stores plus the staging area."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.low, self.stage))

    # ---- opening and closing blocks ------------------------------------------------------------
    def open(self, blocks: torch.Tensor) -> None:
        """Give every listed block that is closed a staging slot (its old contents are void:
        whoever writes into a closed block starts it afresh)."""
        blocks = torch.unique(blocks)
        need = blocks[self.stage_of[blocks] < 0]
        if need.numel() == 0:
            return
        if need.numel() > len(self._free):
            self._grow(need.numel())
        slots = [self._free.pop() for _ in range(need.numel())]
        self.stage_of[need] = torch.tensor(slots, dtype=torch.long, device=self.stage_of.device)
        self.peak_open = max(self.peak_open, self.num_open)

    def close(self, blocks: torch.Tensor) -> None:
        """Compress full open blocks into the int8 store and free their staging slots."""
        blocks = torch.unique(blocks)
        blocks = blocks[self.stage_of[blocks] >= 0]
        if blocks.numel() == 0:
            return
        B = self.block_size
        offs = torch.arange(B, device=blocks.device)
        src = (self.stage_of[blocks][:, None] * B + offs).reshape(-1)
        L, H, _, D = self.stage.shape
        q, scale, low = quantize_groups(self.stage[:, :, src].reshape(L, H, blocks.numel(), B, D))
        self.q[:, :, (blocks[:, None] * B + offs).reshape(-1)] = q.reshape(L, H, -1, D)
        self.scale[:, :, blocks] = scale
        self.low[:, :, blocks] = low
        self.release(blocks)

    def release(self, blocks: torch.Tensor) -> None:
        """Free the staging slots of open blocks without compressing them (a partial block whose
        request dropped its cache)."""
        blocks = torch.unique(blocks)
        slots = self.stage_of[blocks]
        self._free.extend(slots[slots >= 0].tolist())
        self.stage_of[blocks] = -1

    def _grow(self, need: int) -> None:
        old = self.stage.shape[2] // self.block_size
        new = max(2 * old, old + need - len(self._free))
        L, H, _, D = self.stage.shape
        grown = torch.zeros(L, H, new * self.block_size, D, dtype=self.stage.dtype, device=self.stage.device)
        grown[:, :, :self.stage.shape[2]] = self.stage
        self.stage = grown
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    # ---- whole-request copies (swapping, migration) -----------------------------------------------
    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """[layers, kv_heads, n, head_dim] at the model's dtype for pool rows [n]."""
        return _resolve(self.q, self.scale, self.low, self.stage, self.stage_of, self.block_size, rows)

    def write(self, rows: torch.Tensor, src: torch.Tensor) -> None:
        """src [layers, kv_heads, n, head_dim] into pool rows [n]: rows of open blocks staged,
        the others compressed (they must make whole blocks)."""
        _store(self.q, self.scale, self.low, self.stage, self.stage_of, self.block_size, rows,
               src.to(self.stage.device))
