"""Apt-Serve's greedy over marginal gains (SPEC §1.4, §1.6): which requests run this iteration,
and which of them keep a hidden cache instead of a KV cache.

Request i with pending time p_i needs m_i blocks with a KV cache and r·m_i with a hidden cache
(r = hidden blocks / KV blocks per token-block; 1/2 for multi-head attention). Its value is

    g_i = p_i                    with a KV cache,
    g_i = p_i - U·ρ·m_i          with a hidden cache (its K/V recompute slows the whole batch,
                                 a delay charged to every one of the U queued requests),

and the plan maximises Σ g_i over the chosen requests within the block budget. Each request
becomes at most two items, sorted by value per block (density):

    hidden step   Δm = r·m        θ = (p - Uρm) / (r·m)
    upgrade step  Δm = (1 - r)·m  θ = Uρm / ((1 - r)·m)        (hidden -> KV)

or one KV item θ = p/m when the hidden step would be denser-losing (p - Uρm < r·p: it is then
never worth it), when r >= 1 (a hidden cache saves nothing), or for a request that already
violates its SLO (θ = ε, KV only). [open choice] A request within its SLO is worth at least 2ε
per block: one that has just produced a token has p ≈ 0 (exactly 0 on the simulator's virtual
clock), and must still rank above every violator, as the fallback intends. Items are taken in
density order until the first one that does not fit; the plan is then compared with the critical request alone in its best mode that
fits ("double check"), which makes the result at least half the optimum (the LP relaxation of
this multiple-choice knapsack is at most the greedy's value plus the critical item's).
[open choice] An item whose mode can never fit the budget is dropped before sorting (SPEC
§1.6 [INFER]: the bound needs it), so a request whose KV cache cannot fit is offered its
hidden cache even where that would otherwise be "denser-losing"; and the double check uses
the critical request's best feasible mode, not always KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.engine.messages import CacheType


@dataclass(frozen=True, slots=True)
class KnapsackRequest:
    req_id: str
    pending_s: float         # p_i
    kv_blocks: int           # m_i: blocks it needs with a KV cache
    hidden_blocks: int       # r·m_i: blocks it needs with a hidden cache (exact in our pool)
    violated: bool = False   # already past its SLO: value ε per block, KV only


@dataclass(frozen=True, slots=True)
class KnapsackParams:
    budget: int              # blocks available to this plan
    rho: float               # seconds of recompute per KV block in hidden mode
    u_cnt: int               # U: queued requests charged for the slowdown
    eps: float = 1e-6        # value per block of a violated request


def greedy_arrays(pending: np.ndarray, kv: np.ndarray, hid: np.ndarray, violated: np.ndarray,
                  p: KnapsackParams) -> tuple[np.ndarray, np.ndarray]:
    """The greedy over arrays (one entry per request): (chosen request indices in the order the
    greedy took them, whether each keeps a hidden cache). Vectorised: the taken items are the
    longest prefix of the density order whose blocks fit, found with one cumulative sum."""
    kv = kv.astype(np.int64, copy=False)
    hid = hid.astype(np.int64, copy=False)
    base = np.where(violated, p.eps * kv, np.maximum(pending, 2 * p.eps * kv))
    g_kv = base
    g_hid = base - p.u_cnt * p.rho * kv
    kv_fits = kv <= p.budget
    hid_ok = ~violated & (hid > 0) & (hid < kv) & (hid <= p.budget)
    use_hid = hid_ok & ((g_hid * kv >= g_kv * hid) | (~kv_fits & (g_hid > 0)))
    first_ok = use_hid | (kv_fits & (kv > 0))
    first_dm = np.where(use_hid, hid, kv)
    first_g = np.where(use_hid, g_hid, g_kv)
    up_ok = use_hid & kv_fits
    fi, ui = np.flatnonzero(first_ok), np.flatnonzero(up_ok)
    req = np.concatenate((fi, ui))
    dm = np.concatenate((first_dm[fi], kv[ui] - hid[ui]))
    gain = np.concatenate((first_g[fi], g_kv[ui] - g_hid[ui]))
    upgrade = np.zeros(len(req), dtype=bool)
    upgrade[len(fi):] = True
    order = np.argsort(-(gain / dm), kind="stable")    # first steps stay before upgrades at ties
    used = np.cumsum(dm[order])
    k = int(np.searchsorted(used, p.budget, side="right"))
    taken = order[:k]
    if k < len(order):                                 # the double check on the critical request
        i = int(req[order[k]])
        total = float(gain[taken].sum())
        alone = [(float(g), h) for g, h, ok in ((g_kv[i], False, kv_fits[i]), (g_hid[i], True, hid_ok[i]))
                 if ok]
        if alone and (best := max(alone, key=lambda x: x[0]))[0] > total:
            return np.array([i]), np.array([best[1]])
    first = taken[~upgrade[taken]]                     # in the order the greedy took them
    upgraded = np.zeros(len(pending), dtype=bool)
    upgraded[req[taken[upgrade[taken]]]] = True
    chosen = req[first]
    return chosen, use_hid[chosen] & ~upgraded[chosen]


def greedy(reqs: list[KnapsackRequest], p: KnapsackParams) -> dict[str, CacheType]:
    """The plan: req_id -> its cache type, for the requests chosen (SPEC §1.6 with the double check)."""
    if not reqs:
        return {}
    idx, hidden = greedy_arrays(np.array([r.pending_s for r in reqs], dtype=float),
                                np.array([r.kv_blocks for r in reqs]),
                                np.array([r.hidden_blocks for r in reqs]),
                                np.array([r.violated for r in reqs], dtype=bool), p)
    return {reqs[i].req_id: CacheType.HIDDEN if h else CacheType.KV for i, h in zip(idx.tolist(), hidden.tolist())}

