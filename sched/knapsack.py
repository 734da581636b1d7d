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
violates its SLO (θ = ε, KV only). Items are taken in density order until the first one that
does not fit; the plan is then compared with the critical request alone in its best mode that
fits ("double check"), which makes the result at least half the optimum (the LP relaxation of
this multiple-choice knapsack is at most the greedy's value plus the critical item's).
[open choice] An item whose mode can never fit the budget is dropped before sorting (SPEC
§1.6 [INFER]: the bound needs it), so a request whose KV cache cannot fit is offered its
hidden cache even where that would otherwise be "denser-losing"; and the double check uses
the critical request's best feasible mode, not always KV.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.messages import CacheType


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


def value(r: KnapsackRequest, mode: CacheType, p: KnapsackParams) -> float:
    """g_i of one request in one mode (what the plan maximises)."""
    base = p.eps * r.kv_blocks if r.violated else r.pending_s
    return base - (p.u_cnt * p.rho * r.kv_blocks if mode is CacheType.HIDDEN else 0.0)


def blocks(r: KnapsackRequest, mode: CacheType) -> int:
    return r.hidden_blocks if mode is CacheType.HIDDEN else r.kv_blocks


def _items(r: KnapsackRequest, p: KnapsackParams) -> list[tuple[float, int, CacheType]]:
    """(density, Δblocks, mode reached) steps of one request, densest first."""
    kv_fits = r.kv_blocks <= p.budget
    hid_ok = (not r.violated and 0 < r.hidden_blocks < r.kv_blocks and r.hidden_blocks <= p.budget)
    g_kv, g_hid = value(r, CacheType.KV, p), value(r, CacheType.HIDDEN, p)
    if hid_ok and (g_hid >= g_kv * r.hidden_blocks / r.kv_blocks       # hidden step at least as dense as KV,
                   or (not kv_fits and g_hid > 0)):                    # or the only mode that fits
        steps = [(g_hid / r.hidden_blocks, r.hidden_blocks, CacheType.HIDDEN)]
        if kv_fits:
            steps.append(((g_kv - g_hid) / (r.kv_blocks - r.hidden_blocks),
                          r.kv_blocks - r.hidden_blocks, CacheType.KV))
        return steps
    if kv_fits and r.kv_blocks > 0:
        return [(g_kv / r.kv_blocks, r.kv_blocks, CacheType.KV)]
    return []


def greedy(reqs: list[KnapsackRequest], p: KnapsackParams) -> dict[str, CacheType]:
    """The plan: req_id -> its cache type, for the requests chosen (SPEC §1.6 with the double check)."""
    items = [(theta, dm, mode, i) for i, r in enumerate(reqs) for theta, dm, mode in _items(r, p)]
    items.sort(key=lambda it: -it[0])       # stable: a request's hidden step stays before its upgrade
    used, total, plan = 0, 0.0, {}
    for theta, dm, mode, i in items:
        if used + dm <= p.budget:
            used += dm
            total += theta * dm
            plan[reqs[i].req_id] = mode
            continue
        r = reqs[i]
        alone = max(((value(r, m, p), m) for m in (CacheType.KV, CacheType.HIDDEN)
                     if (m is CacheType.KV or not r.violated) and blocks(r, m) <= p.budget),
                    key=lambda vm: vm[0], default=None)
        if alone is not None and alone[0] > total:
            return {r.req_id: alone[1]}
        break
    return plan


def plan_value(reqs: list[KnapsackRequest], plan: dict[str, CacheType], p: KnapsackParams) -> float:
    return sum(value(r, plan[r.req_id], p) for r in reqs if r.req_id in plan)


def plan_blocks(reqs: list[KnapsackRequest], plan: dict[str, CacheType]) -> int:
    return sum(blocks(r, plan[r.req_id]) for r in reqs if r.req_id in plan)
