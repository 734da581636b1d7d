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

Packing is for CPU float32 with oneDNN available. A bfloat16 model on the CPU keeps its dense
weights for ``F.linear`` (oneDNN, on AMX tiles where the CPU has them) and, where a weight is
exactly a GGUF's blocks, those blocks as well (:class:`Thin`): a product of at most
:func:`thin_rows` rows (a decode step of a few requests, the LM head of a step that samples a few)
runs over the blocks, the others over the dense weights. Where the CPU has AVX-512 BF16 the
bfloat16 rows are multiplied as they are (``engine/csrc/qlinear_bf16.cpp``: each product of a
block's 4- or 8-bit q and a bfloat16 x is exact, summed in float32), else widened to float32
for qlinear.cpp. Everything else (CUDA, a
torch built without oneDNN) keeps dense weights and ``F.linear``. Only :func:`linear`
multiplies by a packed weight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.blocks import (PANEL, Blocks, BlockKind, dequantize, find_blocks, pack_bf16_pairs, pack_blocks,
                                  rows)
from tandem.engine.dtype import cpu_flags


@dataclass(frozen=True, eq=False)
class Panels:
    """A weight [out_features, in] in column panels of 16 features, and the compiled kernel that
    multiplies by them: ``kernel(x [M, in], data, out_features) -> [M, out_features]``.
    float32: data [ceil(out/16), in, 16], data[p, k, j] = W[16 p + j, k], zero past
    ``out_features``; GGUF blocks: engine.blocks.pack_blocks's bytes, or pack_bf16_pairs's for a
    kernel that takes bfloat16 rows (``takes``; rows of another dtype are cast to it)."""
    data: torch.Tensor
    out_features: int
    kernel: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    kind: BlockKind | None = None      # the GGUF blocks held, or None for float32
    takes: torch.dtype = torch.float32   # the rows the kernel multiplies (its result is float32)

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

    @classmethod
    def pack_thin(cls, blocks: Blocks, ops: Any) -> "Panels":
        """The blocks for a bfloat16 model's thin products: in bfloat16 pairs where the CPU has
        AVX-512 BF16 (engine/csrc/qlinear_bf16.cpp multiplies the bfloat16 rows as they are),
        else as :meth:`pack_blocks` (rows widened to float32)."""
        kernel = getattr(ops, f"{blocks.kind.value}_bf16_linear", None)
        if kernel is None:
            return cls.pack_blocks(blocks, ops)
        return cls(pack_bf16_pairs(blocks), blocks.q.shape[0], kernel, blocks.kind, torch.bfloat16)


def thin_rows(flags: set[str] | None = None, native: bool = True) -> int:
    """[measured] The rows up to which a bfloat16 model's products go over GGUF's blocks: where the
    blocks' product is faster than the dense bfloat16 one. SmolLM2's projections and LM head on
    one thread (``python -m bench cpu-linear --dtype bfloat16``, three rounds), ms per sweep,
    blocks / dense bfloat16:

    - a 2-core Xeon with AMX (an AMX tile takes 16 rows at once), the blocks' float32 product
      (qlinear.cpp, six rows a tile): 15-17 / 38-45 at one row, 28-39 / 39-60 at six, 39-64 /
      39-59 at seven (the blocks' second tile): six rows. The bfloat16 pairs kernel
      (qlinear_bf16.cpp), which such a CPU builds too, was not timed there, so six rows stay.
    - a 2-core AMD EPYC (Zen 4) with AVX-512 BF16 and no AMX, the bfloat16 pairs kernel
      (qlinear_bf16.cpp): 22 / 47-54 at twelve rows, 39-45 / 61-62 at 24, 51-60 / 71-81 at 32,
      75-77 / 90-91 at 48, 99-101 / 110 at 64, 148-149 / 149-168 at 96, 195-200 / 189-197 at
      128: 64 rows. (With the float32 product it was twelve: 38-40 / 45-47 at twelve, 49 /
      47-50 at fourteen.)
    - a CPU without either computes bfloat16 only if asked to; the float32 product's twelve.

    ``native``: whether the blocks take the bfloat16 rows as they are (the pairs kernel, which a
    compiler without AVX-512 BF16 does not build even where the CPU has it); else the float32
    product's threshold."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return 6
    return 64 if native and "avx512_bf16" in flags else 12


@dataclass(frozen=True, eq=False)
class Thin:
    """A bfloat16 model's weight kept twice on the CPU: ``dense`` [out, in] for products of more
    than ``rows`` rows, and GGUF's blocks in panels for the thinner ones, which are bound by
    reading the weights (0.75 or 1.125 bytes a weight against 2, and no AMX tile to fill). The
    blocks are the float32 weights the bfloat16 ones were rounded from, so a thin product is a
    float32 sum over the exact weights (:meth:`Panels.pack_thin`), rounded to bfloat16 once at
    the end. ``rows``: the threshold for these blocks' kernel (:func:`thin_rows`)."""
    dense: torch.Tensor
    blocks: Panels
    rows: int

    @classmethod
    def pack(cls, dense: torch.Tensor, blocks: Blocks, ops: Any) -> "Thin":
        panels = Panels.pack_thin(blocks, ops)
        return cls(dense, panels, thin_rows(native=panels.takes == torch.bfloat16))


def packs(device: str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` are packed (see the module docstring)."""
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def thin_rows_of(model: nn.Module) -> int:
    """The most rows a product of ``model``'s takes over GGUF's blocks (its :class:`Thin` weights'
    threshold), 0 where it holds none."""
    return max((v.rows for m in model.modules() for v in vars(m).values() if isinstance(v, Thin)), default=0)


def threshold_rows(thin: int, last: int = 256) -> tuple[int, ...]:
    """The row counts :func:`product_seconds` times a model with a thin-product threshold of ``thin``
    rows at: one row, half the threshold, either side of it, then doubling until ``last``."""
    rows = [1, max(1, thin // 2), thin, thin + 1, 2 * thin]
    while rows[-1] < last:
        rows.append(2 * rows[-1])
    return tuple(sorted(set(rows)))


def product_seconds(weights: list, rows: tuple[int, ...], repeats: int = 2, budget_s: float = 2.0,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[tuple[int, float], ...]:
    """(rows, seconds) of multiplying ``rows`` token rows by every weight of ``weights`` (dense, or
    :class:`Thin`) in turn, for each row count: random rows in the weights' dtype, the least of
    ``repeats`` rounds. It starts from (0, 0.0): no rows, no product. A step's cost model adds it
    as measured (sched.cost_model): where the product changes path (:class:`Thin`), a step's cost
    jumps by what no fit on a few profiled steps pins down.

    The first four row counts (:func:`threshold_rows`: up to one past the threshold) are always
    timed, the others only while the timing has taken less than ``budget_s`` (a large model's
    products take seconds). The seconds never fall as the rows grow (each at least the one
    before), so that the line past the last point never falls either. ``clock``: seconds, read
    before and after each round and against the budget."""
    dtype = _dtype(weights[0]) if weights else torch.float32
    out = [(0, 0.0)]
    start = clock()
    for n, m in enumerate(rows):
        if n >= 4 and clock() - start > budget_s:
            break
        xs = {k: torch.randn(m, k).to(dtype) for k in {_in_features(w) for w in weights}}
        best = float("inf")
        for _ in range(repeats):
            t = clock()
            with torch.inference_mode():
                for w in weights:
                    linear(xs[_in_features(w)], w)
            best = min(best, clock() - t)
        out.append((m, max(best, out[-1][1])))
    return tuple(out)


def _in_features(w: torch.Tensor | Thin) -> int:
    return (w.dense if isinstance(w, Thin) else w).shape[1]


def _dtype(w: torch.Tensor | Thin) -> torch.dtype:
    return (w.dense if isinstance(w, Thin) else w).dtype


def row_projections(model: nn.Module) -> list:
    """The weights every token row of a step is multiplied by: each layer's
    ``model.ROW_PROJECTIONS`` (not a hidden cache's K/V rows, nor the LM head, which takes only
    the rows that sample)."""
    return [getattr(layer, name) for layer in model.layers for name in model.ROW_PROJECTIONS]


def thin_blocks(device: str, dtype: torch.dtype, ops: Any) -> bool:
    """Whether a model on ``device`` in ``dtype`` keeps GGUF's blocks beside its dense weights
    (:class:`Thin`): bfloat16 on the CPU with the compiled block kernels."""
    return device == "cpu" and dtype == torch.bfloat16 and ops is not None and hasattr(ops, "q4_1_linear")


def pack(w: torch.Tensor | Blocks, ops: Any = None, blocks: bool = True,
         dtype: torch.dtype = torch.float32) -> torch.Tensor | Panels | Thin:
    """``w`` [out, in] (float32, or GGUF blocks found already) packed for any number of rows:
    panels when ``ops`` (engine.kernels' module) has the panel kernel -- over GGUF's blocks when
    ``blocks`` and ``w`` is exactly some, else float32 --, otherwise oneDNN's blocked layout.
    With ``dtype`` bfloat16 (``thin_blocks``): ``w`` in bfloat16, and its blocks beside it (a
    :class:`Thin`) when it is exactly some."""
    if dtype != torch.float32:
        found = (w if isinstance(w, Blocks) else find_blocks(w)) if blocks else None
        dense = (dequantize(w) if isinstance(w, Blocks) else w).detach().to(dtype).contiguous()
        return Thin.pack(dense, found, ops) if found is not None else dense
    kernels = ops is not None and hasattr(ops, "panel_linear")
    if kernels and blocks and hasattr(ops, "q4_1_linear"):
        found = w if isinstance(w, Blocks) else find_blocks(w)
        if found is not None:
            return Panels.pack_blocks(found, ops)
    dense = dequantize(w) if isinstance(w, Blocks) else w
    if kernels:
        return Panels.pack(dense, ops)
    return torch.ops.mkldnn._reorder_linear_weight(dense.detach().contiguous(), None)


def is_packed(w: torch.Tensor | Panels | Thin) -> bool:
    return isinstance(w, (Panels, Thin)) or w.is_mkldnn


def linear(x: torch.Tensor, w: torch.Tensor | Panels | Thin, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b for a dense or a packed ``w``."""
    if isinstance(w, Thin):
        if x.numel() > w.rows * x.shape[-1]:
            return F.linear(x, w.dense, b)
        return linear(x, w.blocks, None if b is None else b.float()).to(x.dtype)
    if isinstance(w, Panels):
        rows = x.reshape(-1, x.shape[-1])
        y = w.kernel((rows if rows.dtype == w.takes else rows.to(w.takes)).contiguous(), w.data, w.out_features)
        if b is not None:
            y.add_(b)
        return y.view(*x.shape[:-1], w.out_features)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def pack_into(module: nn.Module, name: str, w: torch.Tensor | Blocks, ops: Any = None,
              blocks: bool = True, dtype: torch.dtype = torch.float32) -> None:
    """Make ``module.<name>`` the packed ``w`` (replacing a parameter or a buffer): a tensor
    (oneDNN's, or dense bfloat16) as a non-persistent buffer, panels and thin pairs as a plain
    attribute."""
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    packed = pack(w, ops, blocks, dtype)
    if isinstance(packed, (Panels, Thin)):
        setattr(module, name, packed)
    else:
        module.register_buffer(name, packed, persistent=False)


def pack_head(model: nn.Module, ops: Any = None, blocks: bool = True, dtype: torch.dtype = torch.float32) -> None:
    """Pack a model's LM head (tied to its embedding table or not), last, once its projections
    are: in float32 the table stays in GGUF's blocks for lookups when it is exactly some
    (``embedding_into``); in bfloat16 (a model built in float32 so that its blocks can be found)
    the head becomes a :class:`Thin`, then the whole model bfloat16, a tied head sharing the
    table's dense weights."""
    tied = model.lm_head is model.embed
    if dtype == torch.float32:
        table = embedding_into(model, "embed", blocks)
        pack_into(model, "lm_head", table if tied else model.lm_head, ops, blocks)
        return
    pack_into(model, "lm_head", model.lm_head, ops, blocks, dtype)
    model.to(dtype)                    # norms, embedding table, biases, rotary tables
    if tied:
        head = model.lm_head
        model.lm_head = Thin(model.embed, head.blocks, head.rows) if isinstance(head, Thin) else model.embed


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
