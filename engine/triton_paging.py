"""How the Triton kernels find a context token's pool row, and the tables they read.

Every Triton attention kernel addresses the pool of engine.attention
(``[kv_heads, num_blocks * B, head_dim]``, block b owning rows b*B .. b*B+B-1)
through one of two tables per request, chosen per launch by ``Paging``:

* **block table** (``Paging.BLOCKS``)::

      table [n, max_blocks] int32   physical block of each token-block, in logical order
      dirs  [n, max_blocks] int8    0: filled from offset 0 up (LEFT), 1: from B-1 down (RIGHT)

      token t  ->  row = table[t // B] * B + (t % B          if dirs == 0
                                              B - 1 - t % B  if dirs == 1)

  This is the paged layout: a BROS block shared by an RT owner (from the front)
  and a BE owner (from the back) is read in place by both, so nothing is
  gathered first.

* **row table** (``Paging.ROWS``): ``rows [n, L] int32``, the pool row of every
  token. Needed only when a request's tokens do not follow its blocks in order,
  which happens after a bidirectional block's checkpointed tokens are swapped
  back into whatever slot was free. ``tables_from_rows`` tells which one a batch
  can use.

A KV-cache token has two tables (K blocks and V blocks); a hidden-cache token's
m rows live in the m blocks of a token-block (``table [n, max_blocks, m]``).
"""
from __future__ import annotations

import enum
import os

import torch


class Paging(enum.Enum):
    BLOCKS = 0
    ROWS = 1


def triton_available() -> bool:
    """Triton imports, and can run here: on a CUDA device, or anywhere under its interpreter."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or interpreting()


def interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tables_from_rows(rows: list[torch.Tensor], block_size: int, pad: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block table and directions for requests given as per-token pool rows (each a 1-D long
    tensor, or ``[n_i, m]`` for hidden caches), or None when some request's rows do not follow
    whole blocks in one direction each (then the row table must be used).

    Returns table int32 ``[n, max_blocks(, m)]`` and dirs int8 ``[n, max_blocks]``; unused
    entries are ``pad``."""
    B = block_size
    nb = max((-(-r.shape[0] // B) for r in rows), default=0)
    lead = rows[0].shape[1:] if rows else ()
    table = torch.full((len(rows), max(nb, 1), *lead), pad, dtype=torch.int32)
    dirs = torch.zeros(len(rows), max(nb, 1), dtype=torch.int8)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n == 0:
            continue
        first = r[::B]                                            # row of each token-block's offset 0
        right = (first % B == B - 1) & (B > 1)
        if right.dim() > 1:                                       # hidden: the m rows share a direction
            if bool((right != right[:, :1]).any()):
                return None
            right = right[:, 0]
        off = torch.arange(n) % B
        slot = torch.where(right.repeat_interleave(B)[:n], B - 1 - off, off)
        blk = first // B
        expect = blk.repeat_interleave(B, dim=0)[:n] * B + (slot if r.dim() == 1 else slot[:, None])
        if not torch.equal(expect, r):
            return None
        table[i, :blk.shape[0]] = blk.to(torch.int32)
        dirs[i, :blk.shape[0]] = right.to(torch.int8)
    return table, dirs


def row_table(rows: list[torch.Tensor], pad: int = 0) -> torch.Tensor:
    """Per-token rows of several requests, padded: int32 ``[n, L(, m)]``."""
    return torch.nn.utils.rnn.pad_sequence([r.to(torch.int32) for r in rows], batch_first=True,
                                           padding_value=pad)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


try:
    import triton
    import triton.language as tl

    @triton.jit
    def token_rows(tab_ptr, dir_ptr, req, t, valid, stride_tab, stride_dir,
                   B: tl.constexpr, ROWS: tl.constexpr, COL: tl.constexpr = 0,
                   STRIDE_COL: tl.constexpr = 1):
        """Pool rows of logical tokens ``t`` (a vector) of request ``req``: through the row table
        when ROWS, else the block table and directions (module docstring). COL picks one of a
        hidden cache's m rows."""
        if ROWS:
            rows = tl.load(tab_ptr + req * stride_tab + t * STRIDE_COL + COL, mask=valid, other=0)
        else:
            blk_i = t // B
            off = t % B
            blk = tl.load(tab_ptr + req * stride_tab + blk_i * STRIDE_COL + COL, mask=valid, other=0)
            right = tl.load(dir_ptr + req * stride_dir + blk_i, mask=valid, other=0)
            rows = blk * B + tl.where(right != 0, B - 1 - off, off)
        return rows.to(tl.int64)
except ImportError:          # no Triton: the torch and C++ paths serve; nothing here is called
    pass
