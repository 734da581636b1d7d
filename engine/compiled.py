"""torch.compile of the dense per-layer parts of a model step.

Attention (paged, data-dependent) stays eager; the pieces around it (norms,
projections, rotary embeddings, MLP) are compiled once with a dynamic token
dimension, which fuses their elementwise work.
"""
from __future__ import annotations

import torch

from tandem.engine.models.llama import LlamaModel


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(model, LlamaModel):
        model.attn_in = torch.compile(model.attn_in, dynamic=True)
        model.attn_out_mlp = torch.compile(model.attn_out_mlp, dynamic=True)
    return model
