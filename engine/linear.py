"""Projections with weights packed once, at load, for the CPU.

``F.linear`` on a CPU in float32 hands each product to MKL's sgemm, which re-lays-out
(packs) the weight matrix on every call; at the row counts of decoding (1-64 tokens) that
repacking costs more than the product itself. So the worker packs every weight once, in one
of three layouts:

- **Panels** (:class:`Panels`), when the compiled CPU kernels are there (``engine.kernels``):
  W [out, in] as column panels [ceil(out/16), in, 16], multiplied by ``engine/csrc/linear.cpp``,
  which streams each panel once per six rows of x with the products in registers. A decode
  step reads every weight once, and this kernel keeps close to the memory's speed there.
- **GGUF's blocks in panels** (:class:`Panels` over ``engine/csrc/qlinear.cpp``), when a
  weight is exactly the dequantized Q4_1 or Q8_0 blocks of a GGUF model (``engine.blocks``
  finds them, bit for bit): the same products over 0.75 or 1.125 bytes a weight instead of 4.
- **oneDNN's blocked layout** otherwise (a tensor with ``is_mkldnn``), as vLLM's CPU build
  packs its weights; products then stream the packed matrix.

On a 2-core AVX2 EPYC, one thread, SmolLM2's projections and LM head took, in ms (``python -m
bench cpu-linear``, three alternating rounds; the floor: reading the layout's weights once, at
9.7 GB/s that afternoon):

| rows | 1 | 4 | 8 | 16 | 32 | 64 | 512 |
|---|---|---|---|---|---|---|---|
| GGUF blocks (111 MB, floor 12 ms) | 19-23 | 23-28 | 51-54 | 80-101 | 141-172 | 249-309 | 1,980-2,286 |
| float32 panels (538 MB, floor 56 ms) | 54-67 | 51-62 | 70-76 | 112-116 | 153-180 | 249-308 | 1,961-2,243 |
| oneDNN (538 MB) | 75-79 | 86-92 | 106-108 | 149-171 | 199-218 | 340-375 | 2,086-2,254 |

Unpacking the blocks costs compute that rows of a tile share, so from about 32 rows on the
blocks are as fast as float32 panels, not faster (from 24 rows each panel is unpacked once per
product). With two threads float32 panels were 25-45% faster than oneDNN at 1-64 rows and 2-16%
slower at 512 (oneDNN's blocking scales better with threads on large products); one layout is
kept, not both.

Packing is for CPU float32 with oneDNN available; everything else (CUDA, bfloat16, a torch
built without oneDNN) keeps dense weights and ``F.linear``. Only :func:`linear` multiplies by
a packed weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.blocks import PANEL, Blocks, BlockKind, dequantize, find_blocks, pack_blocks, rows


@dataclass(frozen=True, eq=False)
class Panels:
    """A weight [out_features, in] in column panels of 16 features, and the compiled kernel that
    multiplies by them: ``kernel(x [M, in], data, out_features) -> [M, out_features]``.
    float32: data [ceil(out/16), in, 16], data[p, k, j] = W[16 p + j, k], zero past
    ``out_features``; GGUF blocks: engine.blocks.pack_blocks's bytes."""
    data: torch.Tensor
    out_features: int
    kernel: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    kind: BlockKind | None = None      # the GGUF blocks held, or None for float32

    @classmethod
    def pack(cls, w: torch.Tensor, ops: Any) -> "Panels":
        n, k = w.shape
        padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=w.dtype)
        padded[:n] = w.detach()
        return cls(padded.view(-1, PANEL, k).transpose(1, 2).contiguous(), n, ops.panel_linear)

    @classmethod
    def pack_blocks(cls, blocks: Blocks, ops: Any) -> "Panels":
        return cls(pack_blocks(blocks), blocks.q.shape[0], getattr(ops, f"{blocks.kind.value}_linear"),
                   blocks.kind)


def packs(device: str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` are packed (see the module docstring)."""
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(w: torch.Tensor | Blocks, ops: Any = None, blocks: bool = True) -> torch.Tensor | Panels:
    """``w`` [out, in] (dense, or GGUF blocks found already) packed for any number of rows:
    panels when ``ops`` (engine.kernels' module) has the panel kernel -- over GGUF's blocks when
    ``blocks`` and ``w`` is exactly some, else float32 --, otherwise oneDNN's blocked layout."""
    kernels = ops is not None and hasattr(ops, "panel_linear")
    if kernels and blocks and hasattr(ops, "q4_1_linear"):
        found = w if isinstance(w, Blocks) else find_blocks(w)
        if found is not None:
            return Panels.pack_blocks(found, ops)
    dense = dequantize(w) if isinstance(w, Blocks) else w
    if kernels:
        return Panels.pack(dense, ops)
    return torch.ops.mkldnn._reorder_linear_weight(dense.detach().contiguous(), None)


def is_packed(w: torch.Tensor | Panels) -> bool:
    return isinstance(w, Panels) or w.is_mkldnn


def linear(x: torch.Tensor, w: torch.Tensor | Panels, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b for a dense or a packed ``w``."""
    if isinstance(w, Panels):
        y = w.kernel(x.reshape(-1, x.shape[-1]).contiguous(), w.data, w.out_features)
        if b is not None:
            y.add_(b)
        return y.view(*x.shape[:-1], w.out_features)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def pack_into(module: nn.Module, name: str, w: torch.Tensor | Blocks, ops: Any = None,
              blocks: bool = True) -> None:
    """Make ``module.<name>`` the packed ``w`` (replacing a parameter or a buffer): oneDNN's
    tensor as a non-persistent buffer, panels as a plain attribute."""
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    packed = pack(w, ops, blocks)
    if isinstance(packed, Panels):
        setattr(module, name, packed)
    else:
        module.register_buffer(name, packed, persistent=False)


def embedding(ids: torch.Tensor, table: torch.Tensor | Blocks) -> torch.Tensor:
    """Rows ``ids`` of an embedding table, dense or kept in GGUF's blocks (the same float32)."""
    if isinstance(table, Blocks):
        return dequantize(rows(table, ids))
    return F.embedding(ids, table)


def embedding_into(module: nn.Module, name: str, blocks: bool = True) -> torch.Tensor | Blocks:
    """Keep ``module.<name>`` (an embedding table) in GGUF's blocks when it is exactly some:
    a lookup dequantizes only the rows it reads. Returns the table as kept (a tied LM head
    packs the blocks found here rather than finding them again)."""
    found = find_blocks(getattr(module, name)) if blocks else None
    if found is not None:
        module._parameters.pop(name, None)
        setattr(module, name, found)
    return getattr(module, name)
