"""Projections with weights packed once, at load, for the CPU's GEMM.

``F.linear`` on a CPU in float32 hands each product to MKL's sgemm, which re-lays-out
(packs) the weight matrix on every call. At the row counts of decoding (1-64 tokens) that
repacking costs more than the product itself: on a 2-core AVX2 EPYC the projections and LM
head of SmolLM2 (30 layers, d=576) took 23 ms at 1 row but 50-65 ms at 2 rows and ~190 ms at
64. oneDNN can pack a weight once into its blocked layout; products then stream the packed
matrix: 19 ms at 1 row, 18 ms at 2, ~150 ms at 64, and no worse at prefill sizes (512 rows:
1,128 against 1,154 ms). vLLM's CPU build packs its weights the same way.

A packed weight is a tensor in oneDNN's layout (``is_mkldnn``) with the dense shape
[out, in]; only :func:`linear` multiplies by it. Packing is for CPU float32 with oneDNN
available; everything else (CUDA, bfloat16, a torch built without oneDNN) keeps dense
weights and ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packs(device: str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` are packed (see the module docstring)."""
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] in oneDNN's blocked layout, for any number of rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b for a dense or a packed ``w``."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def pack_into(module: nn.Module, name: str, w: torch.Tensor) -> None:
    """Make ``module.<name>`` the packed ``w`` (a non-persistent buffer, replacing a parameter)."""
    if name in module._parameters:
        del module._parameters[name]
    module.register_buffer(name, pack(w), persistent=False)
