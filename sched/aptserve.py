"""Apt-Serve's scheduling policy (SPEC §1.4-1.7) over the same Snapshot as FCFS and BROS.

Per iteration:
  1. Iteration type by cumulative pending time: decode when the running queue's Σ p is larger
     than the waiting queue's, or when no waiting request fits; prefill otherwise. The two are
     never mixed in one iteration (as in the paper).
  2. Prefill: the greedy of sched/knapsack.py over the waiting requests, budget = free blocks,
     each chosen request with the cache type the greedy gave it; the token and sequence limits
     then cut the chosen list in the greedy's order.
  3. Decode: the greedy over the running requests with budget = the whole pool (each needs its
     blocks after one more token); a request not chosen is preempted (recompute), one chosen
     with the other cache type switches (its cache is discarded and recomputed).
Values: p_i (pending time) minus U·ρ·m_i with a hidden cache; a request past its SLO (TTFT if
never run, else TBT) is worth ε per block, or [flag] decay·p_i (the paper's decay variant).
U = queued requests not past their SLO (the code's form).

Ablations: ``hybrid=False`` offers KV caches only (the knapsack becomes 0-1 by density);
``adaptive=False`` keeps FCFS order and admission, with hidden caches for the requests that
would not fit otherwise (the paper's "FCFS + hybrid cache" row).
"""
from __future__ import annotations

from sched.knapsack import KnapsackParams, KnapsackRequest, greedy
from sched.policy import Candidate, Plan, Snapshot, _decide, fcfs

from engine.messages import CacheType


class AptServe:
    name = "aptserve"

    def __init__(self, rho: float, hybrid: bool = True, adaptive: bool = True, decay: float | None = None):
        self.rho = rho
        self.hybrid = hybrid
        self.adaptive = adaptive
        self.decay = decay

    # ---- helpers ---------------------------------------------------------------
    @staticmethod
    def _violated(c: Candidate) -> bool:
        return c.slo_s is not None and c.pending_s > c.slo_s

    def _request(self, snap: Snapshot, c: Candidate, tokens: int) -> KnapsackRequest:
        tb = -(-tokens // snap.block_size)
        kv = tb * snap.blocks_per_token_block
        hid = tb * snap.hidden_blocks_per_token_block
        if not (self.hybrid and 0 < hid < kv):      # never offered where it saves no memory
            hid = kv
        violated = self._violated(c)
        pending = c.pending_s
        if violated and self.decay is not None:     # decay variant: a discounted value, both modes
            pending, violated = self.decay * c.pending_s, False
        return KnapsackRequest(c.req_id, pending, kv, hid, violated)

    def _params(self, snap: Snapshot, budget: int) -> KnapsackParams:
        cands = snap.waiting + snap.running
        u = max(1, len(cands) - sum(map(self._violated, cands)))
        total = snap.num_free_blocks + sum(c.num_blocks for c in snap.running)
        eps = min(c.pending_s for c in snap.waiting) * 1e-4 / max(1, total) if snap.waiting else 1e-6
        return KnapsackParams(budget, self.rho, u, max(eps, 1e-12))

    # ---- plans -------------------------------------------------------------------
    def _prefill(self, snap: Snapshot) -> Plan:
        plan = Plan()
        lim = snap.limits
        reqs = [self._request(snap, c, c.num_tokens) for c in snap.waiting]
        chosen = greedy(reqs, self._params(snap, snap.num_free_blocks))
        by_id = {c.req_id: c for c in snap.waiting}
        tokens_left, seqs = lim.max_num_batched_tokens, len(snap.running)
        for rid, ct in chosen.items():
            c = by_id[rid]
            n = c.num_tokens - c.num_computed
            if seqs >= lim.max_num_seqs or tokens_left <= 0:
                break
            if n > tokens_left:
                if not lim.chunked_prefill or plan.scheduled:
                    continue
                n = tokens_left
            plan.scheduled.append(_decide(c, n))
            plan.cache_types[rid] = ct
            plan.reasons[rid] = f"prefill ({ct.value} cache)"
            tokens_left -= n
            seqs += 1
        return plan

    def _decode(self, snap: Snapshot) -> Plan:
        plan = Plan()
        total = snap.num_free_blocks + sum(c.num_blocks for c in snap.running)
        reqs = [self._request(snap, c, c.num_computed + 1) for c in snap.running]
        chosen = greedy(reqs, self._params(snap, total))
        tokens_left = snap.limits.max_num_batched_tokens
        for c in snap.running:
            ct = chosen.get(c.req_id)
            if ct is None:
                plan.preempted.append(c.req_id)
                plan.reasons[c.req_id] = "preempted: not in the decode knapsack"
            elif ct is not c.cache_type:
                plan.cache_types[c.req_id] = ct
                plan.reasons[c.req_id] = f"switched to a {ct.value} cache (recompute)"
            elif tokens_left > 0:
                n = min(c.num_tokens - c.num_computed, tokens_left)
                plan.scheduled.append(_decide(c, n))
                plan.reasons[c.req_id] = "decode"
                tokens_left -= n
        return plan

    def _fcfs_hybrid(self, snap: Snapshot) -> Plan:
        """Ablation: FCFS order and admission; a waiting request whose KV cache does not fit
        is admitted with a hidden cache when that fits."""
        plan = fcfs(snap)
        if not self.hybrid or not snap.hidden_blocks_per_token_block:
            return plan
        if plan.preempted:
            return plan
        admitted = {d.req_id for d in plan.scheduled}
        waiting_ids = {c.req_id for c in snap.waiting}
        free = snap.num_free_blocks - sum(self._request(snap, c, c.num_computed + d.num_new_tokens).kv_blocks
                                          - c.num_blocks
                                          for c, d in self._pairs(snap, plan))
        tokens_left = snap.limits.max_num_batched_tokens - sum(d.num_new_tokens for d in plan.scheduled)
        seqs = len(snap.running) + len(admitted & waiting_ids)
        for c in snap.waiting:
            if c.req_id in admitted:
                continue
            r = self._request(snap, c, c.num_tokens)
            n = c.num_tokens - c.num_computed
            if not (r.hidden_blocks < r.kv_blocks and r.hidden_blocks <= free and n <= tokens_left
                    and seqs < snap.limits.max_num_seqs):
                break                                  # FCFS: no overtaking
            plan.scheduled.append(_decide(c, n))
            plan.cache_types[c.req_id] = CacheType.HIDDEN
            plan.reasons[c.req_id] = "admitted with a hidden cache (FCFS + hybrid)"
            free -= r.hidden_blocks
            tokens_left -= n
            seqs += 1
        return plan

    @staticmethod
    def _pairs(snap: Snapshot, plan: Plan):
        by_id = {c.req_id: c for c in snap.running + snap.waiting}
        return [(by_id[d.req_id], d) for d in plan.scheduled]

    def __call__(self, snap: Snapshot) -> Plan:
        if not self.adaptive:
            return self._fcfs_hybrid(snap)
        urg_w = sum(c.pending_s for c in snap.waiting)
        urg_r = sum(c.pending_s for c in snap.running)
        if snap.running and urg_r > 0 and urg_r > urg_w:
            return self._decode(snap)
        pre = self._prefill(snap) if snap.waiting else Plan()
        if snap.running and urg_r > 0 and not pre.scheduled:
            return self._decode(snap)
        return pre
