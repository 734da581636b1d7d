"""Apt-Serve's scheduling policy (SPEC §1.4-1.7) over the same Snapshot as FCFS and BROS.

Per iteration:
  1. Iteration type by cumulative pending time: decode when the running queue's Σ p is larger
     than the waiting queue's, or when no waiting request fits; prefill otherwise. The two are
     never mixed in one iteration (as in the paper), unless ``mixed`` (Apt-Serve-S): then every
     iteration runs the decode plan and a prefill plan on the blocks it leaves.
  2. Prefill: the greedy of sched/knapsack.py over the waiting requests, budget = free blocks
     less those the running chunked prompts still need to finish (``_prompt_blocks_left``);
     the token and sequence limits then cut the chosen list in the greedy's order, and the
     cache types of those that run come from the greedy over them alone (``_retype``).
  3. Decode: the greedy over the running requests with budget = the whole pool (each needs its
     blocks after one more token); a request not chosen is preempted (recompute), one chosen
     with the other cache type switches (its cache is discarded and recomputed), except a
     chunked prompt not done yet, which keeps its type until the prompt ends.
Values: p_i (pending time) minus U·ρ·m_i with a hidden cache; a request past its SLO (TTFT if
never run, else TBT) is worth ε per block, or [flag] decay·p_i (the paper's decay variant).
U = queued requests not past their SLO (the code's form).

Ablations: ``hybrid=False`` offers KV caches only (the knapsack becomes 0-1 by density);
``adaptive=False`` keeps FCFS order and admission, with hidden caches for the requests that
would not fit otherwise (the paper's "FCFS + hybrid cache" row).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.sched.knapsack import KnapsackParams, greedy_arrays
from tandem.engine.messages import CacheType, Phase
from tandem.sched.policy import Candidate, Decision, Plan, Snapshot, _blocks, _decide, fcfs

_KV, _HIDDEN, _DECODE = CacheType.KV, CacheType.HIDDEN, Phase.DECODE     # enum lookups are slow in loops
_SWITCHED = {False: "switched to a kv cache (recompute)", True: "switched to a hidden cache (recompute)"}


class AptServe:
    name = "aptserve"

    def __init__(self, rho: float, hybrid: bool = True, adaptive: bool = True, decay: float | None = None,
                 mixed: bool = False, cost=None):
        self.rho0 = rho
        self.cost = cost          # an OnlineCostModel refined from measured steps, or None
        self.mixed = mixed
        self.hybrid = hybrid
        self.adaptive = adaptive
        self.decay = decay

    @property
    def rho(self) -> float:
        """ρ in use: the online cost model's hidden-block coefficient (refitted from measured steps,
        SPEC §1.3's profile refined online) once it has one, else the start-up value."""
        model = getattr(self.cost, "model", None)
        return model.per_hidden_block if model is not None and model.per_hidden_block > 0 else self.rho0

    # ---- helpers ---------------------------------------------------------------
    def _sizes(self, snap: Snapshot, tokens):
        """(KV blocks, hidden blocks) for this many tokens (ints or arrays); hidden = KV where a
        hidden cache saves nothing or is not offered."""
        tb = -(-tokens // snap.block_size)
        kv = tb * snap.blocks_per_token_block
        hb = snap.hidden_blocks_per_token_block
        return kv, (tb * hb if self.hybrid and 0 < hb < snap.blocks_per_token_block else kv)

    @staticmethod
    def _pending(cands: list[Candidate]) -> tuple[np.ndarray, np.ndarray]:
        """(p_i, past its SLO) per candidate."""
        n = len(cands)
        pending = np.fromiter((c.pending_s for c in cands), float, n)
        slo = np.array([c.slo_s for c in cands], dtype=float)      # None -> nan: never violated
        return pending, pending > slo

    def _greedy(self, snap: Snapshot, q: _Queue, tokens: np.ndarray, budget: int, u: int, eps: float,
                fixed: np.ndarray | None = None, is_hidden: np.ndarray | None = None):
        """(indices into q's candidates, hidden flags) chosen, in the order the greedy took them.
        Candidates in ``fixed`` keep their cache type (hidden where ``is_hidden``): the greedy
        only keeps or drops them, at that type's size."""
        kv, hid = self._sizes(snap, tokens)
        if fixed is not None and fixed.any():
            size = np.where(is_hidden, hid, kv)
            kv, hid = np.where(fixed, size, kv), np.where(fixed, size, hid)
        pending, violated = q.pending, q.violated
        if self.decay is not None:       # decay variant: a discounted value, both modes
            pending = np.where(violated, self.decay * pending, pending)
            violated = np.zeros(len(pending), dtype=bool)
        return greedy_arrays(pending, kv, hid, violated, KnapsackParams(budget, self.rho, u, eps))

    # ---- plans -------------------------------------------------------------------
    def _prefill(self, snap: Snapshot, q: _Queue, u: int, eps: float, plan: Plan | None = None,
                 free: int | None = None, seqs: int | None = None) -> Plan:
        """Waiting requests by the greedy over ``free`` blocks (default: the pool's free blocks),
        added to ``plan`` (default: a new one) within the token and sequence limits left."""
        plan = Plan() if plan is None else plan
        lim = snap.limits
        tokens_left = lim.max_num_batched_tokens - sum(d.num_new_tokens for d in plan.scheduled)
        seqs = len(snap.running) if seqs is None else seqs
        if seqs >= lim.max_num_seqs or tokens_left <= 0:
            return plan
        tokens = np.fromiter((c.num_tokens for c in q.cands), np.int64, len(q.cands))
        budget = snap.num_free_blocks if free is None else free
        idx, hidden = self._greedy(snap, q, tokens, budget, u, eps)
        chunked = False
        picked: list[tuple[int, int, bool]] = []         # (candidate index, tokens, hidden)
        for i, h in zip(idx.tolist(), hidden.tolist()):
            c = q.cands[i]
            n = c.num_tokens - c.num_computed
            if seqs >= lim.max_num_seqs or tokens_left <= 0:
                break
            if n > tokens_left:
                if not lim.chunked_prefill or chunked:
                    continue
                n, chunked = tokens_left, True
            picked.append((i, n, h))
            tokens_left -= n
            seqs += 1
        for (i, n, _), h in zip(picked, self._retype(snap, q, tokens, budget, u, eps, picked)):
            c = q.cands[i]
            ct = CacheType.HIDDEN if h else CacheType.KV
            plan.scheduled.append(_decide(c, n))
            plan.cache_types[c.req_id] = ct
            plan.reasons[c.req_id] = f"prefill ({ct.value} cache)"
        return plan

    def _retype(self, snap: Snapshot, q: _Queue, tokens: np.ndarray, budget: int, u: int, eps: float,
                picked: list[tuple[int, int, bool]]) -> list[bool]:
        """Cache types of the requests that run, by the greedy over them alone.

        [open choice] The greedy over every waiting request gives blocks to requests that the
        token and sequence limits then leave waiting; the ones that run got hidden caches
        against that phantom crowding, and the next decode iteration, seeing the pool, switched
        them to KV caches and threw away their prefill (two chunked prompts did so to each other
        for ever). Their first steps fit the budget together, so the greedy over them keeps them
        all and only decides the upgrades; if its double check would drop some, the first
        answer stands."""
        if len(picked) == len(q.cands) or not picked:
            return [h for *_, h in picked]
        sub = np.array([i for i, *_ in picked])
        idx, hidden = self._greedy(snap, _Queue([q.cands[i] for i in sub], q.pending[sub], q.violated[sub]),
                                   tokens[sub], budget, u, eps)
        if len(idx) < len(sub):
            return [h for *_, h in picked]
        flags = dict(zip(idx.tolist(), hidden.tolist()))
        return [flags[j] for j in range(len(sub))]

    def _mixed(self, snap: Snapshot, w: _Queue, r: _Queue, total: int, u: int, eps: float) -> Plan:
        """Apt-Serve-S (paper §6.6, chunked prefill and coalesced batches): the decode knapsack
        over the running requests, then the prefill knapsack over the waiting ones on the blocks
        left, in the same iteration."""
        plan = self._decode(snap, r, total, u, eps) if r.cands else Plan()
        if not w.cands:
            return plan
        free = _free_after(snap, plan) - _prompt_blocks_left(snap, plan)
        return self._prefill(snap, w, u, eps, plan, max(0, free), len(plan.scheduled))

    def _decode(self, snap: Snapshot, q: _Queue, total: int, u: int, eps: float) -> Plan:
        plan = Plan()
        cands, n = q.cands, len(q.cands)
        ntok = np.fromiter((c.num_tokens for c in cands), np.int64, n)
        ncomp = np.fromiter((c.num_computed for c in cands), np.int64, n)
        is_hidden = np.fromiter((c.cache_type is _HIDDEN for c in cands), bool, n)
        # [open choice] a prompt still being computed (chunked) keeps its cache type until it
        # ends: a switch would discard the chunks it computed. The greedy keeps or preempts it
        # at its own type's size. (Upgrading such hidden caches, and then downgrading such KV
        # caches, made prompts discard each other's chunks in turn, for ever.)
        mid_prefill = (ncomp > 0) & (ncomp + 1 < ntok)
        # blocks after one more token (after the whole prompt for a request still in prefill)
        idx, hidden = self._greedy(snap, q, np.maximum(ncomp + 1, ntok), total, u, eps, mid_prefill, is_hidden)
        chosen = np.zeros(n, dtype=bool)
        chosen[idx] = True
        to_hidden = np.zeros(n, dtype=bool)
        to_hidden[idx] = hidden
        switch = chosen & (to_hidden != is_hidden) & ~mid_prefill
        for i in np.flatnonzero(~chosen).tolist():
            plan.preempted.append(cands[i].req_id)
            plan.reasons[cands[i].req_id] = "preempted: not in the decode knapsack"
        for i in np.flatnonzero(switch).tolist():
            h = bool(to_hidden[i])
            plan.cache_types[cands[i].req_id] = _HIDDEN if h else _KV
            plan.reasons[cands[i].req_id] = _SWITCHED[h]
        run = chosen & ~switch
        k = ntok - ncomp
        if np.all(k[run] == 1) and int(run.sum()) <= snap.limits.max_num_batched_tokens:
            usual = (ncomp > 0).tolist()                   # a decode token, without _decide's checks
            plan.scheduled = [Decision(cands[i].req_id, 1, _DECODE, True) if usual[i] else _decide(cands[i], 1)
                              for i in np.flatnonzero(run).tolist()]
        else:
            plan.scheduled = self._decode_budget(cands, run, snap.limits.max_num_batched_tokens)
        plan.reasons.update(dict.fromkeys((d.req_id for d in plan.scheduled), "decode"))
        return plan

    @staticmethod
    def _decode_budget(cands: list[Candidate], run: np.ndarray, tokens_left: int) -> list[Decision]:
        """Decisions for the running requests kept, in queue order, within the token budget (a
        request still in prefill takes a chunk of what is left)."""
        out = []
        for i in np.flatnonzero(run).tolist():
            if tokens_left <= 0:
                break
            c = cands[i]
            k = min(c.num_tokens - c.num_computed, tokens_left)
            out.append(_decide(c, k))
            tokens_left -= k
        return out

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
        free = _free_after(snap, plan)
        tokens_left = snap.limits.max_num_batched_tokens - sum(d.num_new_tokens for d in plan.scheduled)
        seqs = len(snap.running) + len(admitted & waiting_ids)
        for c in snap.waiting:
            if c.req_id in admitted:
                continue
            kv, hid = self._sizes(snap, c.num_tokens)
            n = c.num_tokens - c.num_computed
            if not (hid < kv and hid <= free and n <= tokens_left
                    and seqs < snap.limits.max_num_seqs):
                break                                  # FCFS: no overtaking
            plan.scheduled.append(_decide(c, n))
            plan.cache_types[c.req_id] = CacheType.HIDDEN
            plan.reasons[c.req_id] = "admitted with a hidden cache (FCFS + hybrid)"
            free -= hid
            tokens_left -= n
            seqs += 1
        return plan

    def __call__(self, snap: Snapshot) -> Plan:
        if not self.adaptive:
            return self._fcfs_hybrid(snap)
        w, r = _Queue(snap.waiting, *self._pending(snap.waiting)), _Queue(snap.running, *self._pending(snap.running))
        u = max(1, len(w.cands) + len(r.cands) - int(w.violated.sum()) - int(r.violated.sum()))
        total = snap.num_free_blocks + sum(c.num_blocks for c in snap.running)
        eps = max(float(w.pending.min()) * 1e-4 / max(1, total), 1e-12) if w.cands else 1e-6
        if self.mixed:
            return self._mixed(snap, w, r, total, u, eps)
        urg_w, urg_r = float(w.pending.sum()), float(r.pending.sum())
        if r.cands and urg_r > 0 and urg_r > urg_w:
            return self._decode(snap, r, total, u, eps)
        pre = self._prefill(snap, w, u, eps, free=max(0, snap.num_free_blocks - _prompt_blocks_left(snap))) \
            if w.cands else Plan()
        if r.cands and not pre.scheduled:      # (the code also asks urg_r > 0: with a virtual
            return self._decode(snap, r, total, u, eps)   # clock that can stall the running queue)
        return pre


def _free_after(snap: Snapshot, plan: Plan) -> int:
    """Free blocks once ``plan`` has run: preempted and switching requests hand theirs back,
    scheduled ones take what their new tokens need (in their own cache type)."""
    by_id = {c.req_id: c for c in snap.running + snap.waiting}
    free = snap.num_free_blocks + sum(by_id[x].freed() for x in (*plan.preempted, *plan.cache_types))
    for d in plan.scheduled:
        c = by_id[d.req_id]
        free -= _blocks(snap, c.num_computed + d.num_new_tokens, c) - c.num_blocks
    return free


def _prompt_blocks_left(snap: Snapshot, plan: Plan | None = None) -> int:
    """Blocks the running requests still need to finish their prompts beyond what they hold (and
    what ``plan`` gives them). [open choice] The greedy admitted each prompt at its whole size,
    but chunked prefill takes its blocks chunk by chunk; a prefill budget of the free blocks
    alone gave them to new prompts, the pool then could not hold every prompt, and the decode
    greedy moved a running one to another cache type, discarding its chunks, in turn, for ever."""
    chunked = [c for c in snap.running if c.num_tokens - c.num_computed > 1]
    if not chunked:                 # the usual iteration: every running request decodes
        return 0
    gone = set(plan.preempted) | set(plan.cache_types) if plan is not None else set()
    planned = {d.req_id: d.num_new_tokens for d in plan.scheduled} if plan is not None else {}
    left = 0
    for c in chunked:
        if c.req_id not in gone:
            held = max(c.num_blocks, _blocks(snap, c.num_computed + planned.get(c.req_id, 0), c))
            left += max(0, _blocks(snap, c.num_tokens, c) - held)
    return left


@dataclass(slots=True)
class _Queue:
    """One queue's candidates with their pending times and SLO state as arrays."""
    cands: list[Candidate]
    pending: np.ndarray
    violated: np.ndarray
