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


def supports_head_dim(head_dim: int) -> bool:
    """The kernels take whole power-of-two heads, and the hidden kernel's rotary halves must
    fill a tensor-core product (16 wide)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tables_from_rows(rows: list[torch.Tensor], block_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block table and directions for requests given as per-token pool rows (each a 1-D long
    tensor, or ``[n_i, m]`` for hidden caches), or None when some request's rows do not follow
    whole blocks in one direction each (then the row table must serve)."""
    lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return block_tables(row_table(rows), lens, block_size)


def block_tables(rows: torch.Tensor, lens: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same from padded rows ``[n, L]`` or ``[n, L, m]`` (past ``lens[i]``: anything), in a
    few batched operations: table int32 ``[n, ceil(L / B)(, m)]``, dirs int8 ``[n, ceil(L / B)]``
    (unused entries 0), or None."""
    B = block_size
    n, L = rows.shape[:2]
    nb = max(1, -(-L // B))
    rows = rows.long()
    if L < nb * B:                      # whole token-blocks, padded with copies of the last row
        rows = torch.cat([rows, rows[:, -1:].expand(n, nb * B - L, *rows.shape[2:])], dim=1)
    first = rows[:, ::B]                                        # [n, nb(, m)]: offset 0's row
    right = (first % B == B - 1) & (B > 1)
    if right.dim() == 3:                                        # a token's m rows share a direction
        if bool((right != right[..., :1]).any()):
            return None
        right = right[..., 0]
    off = torch.arange(nb * B) % B
    slot = torch.where(right.repeat_interleave(B, dim=1), B - 1 - off, off)      # [n, nb*B]
    blk = first // B
    expect = blk.repeat_interleave(B, dim=1) * B + (slot if rows.dim() == 2 else slot[..., None])
    used = torch.arange(nb * B)[None, :] < lens[:, None]
    if rows.dim() == 3:
        used = used[..., None]
    if not bool(((expect == rows) | ~used).all()):
        return None
    held = (torch.arange(nb)[None, :] * B < lens[:, None])
    table = torch.where(held if blk.dim() == 2 else held[..., None], blk, 0).to(torch.int32)
    return table, torch.where(held, right, False).to(torch.int8)


def row_table(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-token rows of several requests, padded with 0: int32 ``[n, L(, m)]``."""
    return torch.nn.utils.rnn.pad_sequence([r.to(torch.int32) for r in rows], batch_first=True)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
