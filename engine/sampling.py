"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Randomness for a request's n-th generated token comes from a generator seeded
with f(seed, n), so a seeded request samples the same tokens whatever batch it
shares, whether it was preempted and recomputed, and on whichever device.
Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks
token i with probability p_i.
"""
from __future__ import annotations

import torch

from tandem.engine.messages import SamplingSpec

_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """Seed for the index-th generated token of a request with ``seed``."""
    x = (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) & _MASK63
    x ^= x >> 31
    return x


def sample(logits: torch.Tensor, specs: list[SamplingSpec], num_generated: list[int]) -> list[int]:
    """logits: [n, V] float32 (modified in place); returns one token id per row."""
    vocab = logits.shape[-1]
    for row, (sp, n) in enumerate(zip(specs, num_generated)):
        if n < sp.min_tokens and sp.stop_token_ids:      # ids the model cannot produce need no mask
            logits[row, [t for t in sp.stop_token_ids if 0 <= t < vocab]] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for row, (sp, n) in enumerate(zip(specs, num_generated)):
        if sp.temperature > 0:
            out[row] = _sample_row(logits[row], sp, n)
    return out


def _sample_row(logits: torch.Tensor, sp: SamplingSpec, index: int) -> int:
    x = logits / sp.temperature
    if 0 < sp.top_k < x.shape[0]:
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop_sorted = (cum - sorted_p) > sp.top_p     # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop_sorted, 0.0))
    gen = torch.Generator().manual_seed(token_seed(sp.seed, index))
    race = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / race).argmax())
