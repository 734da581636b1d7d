"""The Triton attention path of a step: its metadata, built by the runner, and the calls that
engine.attention makes instead of the torch reference when a step carries it.

Each part of a step gets its tables once per step (engine.triton_paging): the block table
with directions when every request's rows follow its blocks, else the row table.

* decodes of KV-cache requests: engine.triton_decode (full-precision or int8 pool; with a
  sliding window the runner hands it only the rows the window reaches);
* prefills of KV-cache requests: engine.triton_prefill, after the paged write (full-precision
  pools; an int8 pool's new tokens must attend to each other as computed: torch path);
* single-token steps of hidden-cache requests: engine.triton_hidden (prefill chunks of
  hidden-cache requests keep the torch path, which projects the new rows anyway).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.triton_paging import Paging, block_tables


@dataclass(slots=True)
class Tables:
    """One part's addressing (engine.triton_paging), on the device."""
    paging: Paging
    tabs: tuple[torch.Tensor, ...]       # (K, V) tables, or (hidden table,): int32
    dirs: tuple[torch.Tensor | None, ...]  # int8 directions per table (BLOCKS), else None


@dataclass(slots=True)
class TritonMeta:
    block_size: int
    decode: Tables | None = None         # the step's KV decodes
    decode_lens: torch.Tensor | None = None   # [nd] context lengths, this token included
    prefill: Tables | None = None        # the step's KV prefills, in step order
    seg_start: list[int] | None = None   # first row of each prefill segment
    seg_n: list[int] | None = None       # its new tokens
    seg_ctx: list[int] | None = None     # its context, new tokens included
    hidden: Tables | None = None         # hidden-cache single-token segments
    hidden_segs: list[int] | None = None  # their indices in HiddenBatch.segs
    hidden_lens: torch.Tensor | None = None
    window: int = 0                      # the model's sliding window (prefills mask by it), 0: none

    # ---- the calls engine.attention makes ----------------------------------------------
    def attend_decode(self, qg, pool, scale: float) -> torch.Tensor:
        from tandem.engine.triton_decode import paged_decode
        t = self.decode
        return paged_decode(qg, pool, t.tabs[0], t.tabs[1], self.decode_lens, scale, self.block_size,
                            t.paging, *t.dirs)

    def attend_prefill(self, q, pool, num_heads: int, scale: float) -> torch.Tensor:
        from tandem.engine.triton_prefill import paged_prefill
        t = self.prefill
        return paged_prefill(q, pool, t.tabs[0], t.tabs[1], self.seg_start, self.seg_n, self.seg_ctx,
                             num_heads, scale, self.block_size, t.paging, *t.dirs, window=self.window)

    def attend_hidden(self, qg, pool, proj, scale: float) -> torch.Tensor:
        from tandem.engine.triton_hidden import hidden_decode
        t = self.hidden
        return hidden_decode(qg, pool, t.tabs[0], self.hidden_lens, proj.w, proj.b, proj.cos, proj.sin,
                             scale, self.block_size, t.paging, t.dirs[0])


def tables(rows: list[torch.Tensor], lens: torch.Tensor, block_size: int, to) -> Tables:
    """Tables for one or two padded row tensors ``[n, L(, m)]`` sharing ``lens``: blocks when
    all of them follow their blocks, else rows."""
    blocks = [block_tables(r, lens, block_size) for r in rows]
    if all(b is not None for b in blocks):
        return Tables(Paging.BLOCKS, tuple(to(b[0]) for b in blocks), tuple(to(b[1]) for b in blocks))
    return Tables(Paging.ROWS, tuple(to(r.to(torch.int32)) for r in rows), tuple(None for _ in rows))

