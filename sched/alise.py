"""ALISE: speculative scheduling by estimated remaining time (SPEC §3.2-3.3).

Each request J has a predicted output length L̂ (from predictor/, or the truth for an
oracle), g generated tokens and prompt length s. Its estimated remaining time, from the
shared cost model (one standalone step of each kind, on J's LoRA adapter if it has one, the
adapter's own part and its rows priced):

    T_rem(J) = T_prefill(tokens still to compute) + max(r, 1) · T_decode(context)

with r = L̂ - g. [open choice] When the predictor also gives a spread (the retrieved
neighbours' lengths as equally likely points), r is the spread's Gittins remaining after g
tokens (``gittins_remaining``): a request that may well end soon goes first, and one that
outlives its short neighbours falls back. In the simulator at 4-6 req/s this cut alise's
normalized latency by 4-9% against L̂ - g (`bench sim-alise`, systems alise / alise-point).
Memory is still budgeted with L̂ (look-ahead admission below).

Priority levels θ_i = θ_1 · 2^(i-1), i = 1..h; level(J) = the first i with T_rem <= θ_i
(h when none). Misprediction: while g >= L̂ (with a spread: its longest point), it doubles
and J drops one level. Virtual
aging: every ``age_s`` seconds J waits it rises one level, and stays risen once it runs
again; [open choice] a request that would rise above level 1 goes to level 0, served in
arrival order ahead of everyone, so nothing starves even under a stream of short jobs.
Waiting is counted as the time its tokens took beyond one iteration each (the books keep
that sum) plus the time since its last token. A promotion that lapsed when the request ran
would let it and the request it displaced take each other's blocks in turn. These counts
are derived from the request's own numbers (g, L̂₀, time waited), so the policy keeps no
per-request state and stays a pure function of the snapshot.

Each iteration fills the batch in order (class, level, T_rem, arrival): RT before BE,
then shortest remaining time first inside a level (SRPT). A request that needs blocks
may take them from running requests that come after it in that order (they lose their
cache, as a preemption); running requests left out keep their blocks and pause.
[open choice] BE requests join only while the predicted step time stays within the
tightest residual SLO time of the RT requests taken, so BE never makes an RT step late.

Estimated wait (SPEC §3.4) of each request it preempts, for swapping (SPEC §3.5: those back
soonest keep their cache in host memory first)::

    EWT(J) = min( Σ_{J' ahead of J} T_rem(J') / max(1, batch size),  T_promote(J) )

with T_promote the time until aging lifts J to level 0, and the sum divided by the number of
requests in this iteration since they run together (continuous batching).
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from tandem.engine.messages import CacheType
from tandem.sched.bros import BlockBudget, CostFn, add_chunk
from tandem.sched.cost_model import StepShape, attn_pairs, predict_many
from tandem.sched.policy import Candidate, Plan, Snapshot, _decide

DEFAULT_LENGTH = 256        # L̂ for a request that comes without a prediction


class Alise:
    """``cost(shape, swap_slots)`` predicts an iteration; levels start at ``theta1_s`` (default:
    16 decode steps at context 128, from the cost model) and double ``levels`` times."""

    name = "alise"

    def __init__(self, cost: CostFn, levels: int = 8, theta1_s: float | None = None,
                 age_s: float | None = None):
        self.cost = cost
        self.levels = levels
        self.theta1 = theta1_s if theta1_s is not None else 16 * self._decode_step(128)
        # [open choice] a request rises one level per 128 θ_1 waited (about 40 s at paper scale,
        # OPT-13B on an A100): in the simulator (`python -m bench sim-alise`) 8 θ_1 let aged
        # jobs displace running ones every few seconds, and the swaps that cost made alise
        # slower than FCFS at 4 req/s (233 vs 188 ms/token); 32 θ_1 gave 107, 128 θ_1 65.
        # A long job still waits at most about h such periods behind short ones
        self.age_s = age_s if age_s is not None else 128 * self.theta1

    # ---- the estimate ------------------------------------------------------------
    def _decode_step(self, context: int) -> float:
        return self.cost(StepShape().add(1, max(context, 1), True), 0)

    @staticmethod
    def predicted(c: Candidate) -> tuple[int, int]:
        """(L̂, doublings): the prediction doubled until it exceeds the tokens generated g, i.e.
        j doublings with j the bit length of g // L̂ (the least j with L̂ 2^j > g)."""
        L = max(1, c.predicted if c.predicted is not None else DEFAULT_LENGTH)
        j = (c.num_output // L).bit_length()
        return L << j, j

    @classmethod
    def remaining(cls, c: Candidate) -> tuple[float, int]:
        """(output tokens still to come as the ranking counts them, demotions). With a spread,
        its Gittins index while some of its lengths exceed the tokens generated; past all of
        them, or without one, L̂ doubled until it exceeds them (each doubling a demotion)."""
        left, demotions = _remaining_many(_Columns([c]))
        return left[0].item(), int(demotions[0])

    def estimates(self, cands: list[Candidate]) -> tuple[np.ndarray, np.ndarray]:
        """(T_rem, level) of each candidate, in numpy: a plan prices every candidate once."""
        col = _Columns(cands)
        left, demotions = _remaining_many(col)
        todo = col.tokens - col.computed
        pre = np.where(todo > 1, predict_many(self.cost, todo, attn_pairs(todo, col.tokens), adapters=col.lora,
                                              adapter_rows=col.lora * todo), 0.0)
        t = pre + np.maximum(left, 1) * predict_many(self.cost, decode_tokens=1, decode_ctx=np.maximum(col.tokens, 1),
                                                     adapters=col.lora, adapter_rows=col.lora)
        return t, self._levels(t, demotions, col.waited)

    def _levels(self, t: np.ndarray, demotions: np.ndarray, waited: np.ndarray) -> np.ndarray:
        """0 (aged past level 1) .. levels: the first i with T_rem <= θ_i, one lower per demotion,
        one higher per ``age_s`` waited."""
        theta = self.theta1 * 2.0 ** np.arange(self.levels)
        base = np.minimum(np.searchsorted(theta, t, side="left") + 1, self.levels)
        promotions = np.floor_divide(waited, self.age_s).astype(np.int64) if self.age_s > 0 else 0
        return np.maximum(np.minimum(self.levels, base + demotions) - promotions, 0)

    def t_rem(self, c: Candidate) -> float:
        return self.estimates([c])[0][0].item()

    def level(self, c: Candidate) -> int:
        """0 (aged past level 1) .. levels."""
        return int(self.estimates([c])[1][0])

    def order(self, snap: Snapshot) -> list[tuple[tuple, Candidate, float]]:
        """(key, candidate, T_rem) in priority order: key (class, level, T_rem or at level 0 the
        arrival, arrival), ascending."""
        cands = snap.running + snap.waiting
        if not cands:
            return []
        t, lvl = self.estimates(cands)
        arrival = np.array([c.arrival for c in cands], dtype=float)
        be = np.array([not c.rt for c in cands])
        second = np.where(lvl == 0, arrival, t)
        idx = np.lexsort((arrival, second, lvl, be))
        keys = zip(be[idx].tolist(), lvl[idx].tolist(), second[idx].tolist(), arrival[idx].tolist())
        return [(k, cands[i], ti) for k, i, ti in zip(keys, idx.tolist(), t[idx].tolist())]

    @staticmethod
    def waited(c: Candidate) -> float:
        """Seconds the request has waited in all (what aging counts)."""
        return c.stalled_s + c.pending_s

    def t_promote(self, c: Candidate, level: int) -> float:
        """Seconds until aging lifts a request at ``level`` to level 0 (if it gets no token)."""
        if level <= 0 or self.age_s <= 0:
            return 0.0
        return self.age_s - self.waited(c) % self.age_s + (level - 1) * self.age_s

    def ewt(self, keyed: list[tuple[tuple, Candidate, float]], plan: Plan) -> dict[str, float]:
        """EWT of each request ``plan`` preempts (module docstring)."""
        out: dict[str, float] = {}
        if not plan.preempted:
            return out
        gone = set(plan.preempted)
        ahead, width = 0.0, max(1, len(plan.scheduled))
        for key, c, t in keyed:
            if c.req_id in gone:
                out[c.req_id] = min(ahead / width, self.t_promote(c, key[1]))
            ahead += t
        return out

    # ---- one iteration -------------------------------------------------------------
    def __call__(self, snap: Snapshot) -> Plan:
        plan = Plan()
        lim = snap.limits
        budget = BlockBudget(snap)
        keyed = self.order(snap)
        rank = {c.req_id: (key[0], key[1], i) for i, (key, c, _) in enumerate(keyed)}
        running = {c.req_id: c for c in snap.running}
        tokens_left, shape, adapters = lim.max_num_batched_tokens, StepShape(), set()
        rt_limit = math.inf
        plan.levels = {c.req_id: key[1] for key, c, _ in keyed}
        held = Footprint(snap, snap.running, rank)
        for key, c, _ in keyed:
            if c.req_id in plan.preempted:
                continue
            if len(plan.scheduled) >= lim.max_num_seqs or tokens_left <= 0:
                plan.reasons.setdefault(c.req_id, _why(key, "the batch is full"))
                continue
            n = min(c.num_tokens - c.num_computed, tokens_left)
            if n < c.num_tokens - c.num_computed and not lim.chunked_prefill:
                plan.reasons[c.req_id] = _why(key, "its prompt exceeds the iteration's token budget")
                continue
            if not c.rt and self.cost(add_chunk(shape, c, n, 0, adapters), 0) > max(rt_limit, self.cost(shape, 0)):
                plan.reasons[c.req_id] = _why(key, "it would make an RT step miss its SLO")
                continue
            if c.req_id not in running and not held.admits(c):
                plan.reasons[c.req_id] = _why(key, "its predicted growth would not fit beside the running requests'")
                continue
            before = len(plan.preempted)
            if not self._room(c, n, budget, plan, running, rank):
                plan.reasons[c.req_id] = _why(key, "no blocks left that it may take")
                continue
            for v in plan.preempted[before:]:
                held.drop(v)
            if c.req_id not in running:
                held.add(c)
            shape = add_chunk(shape, c, n, 0, adapters)
            adapters.add(c.adapter)
            tokens_left -= n
            plan.scheduled.append(_decide(c, n))
            plan.reasons[c.req_id] = _why(key, "scheduled")
            if c.rt and c.slo_s is not None:
                rt_limit = min(rt_limit, max(c.residual(snap.t_avg), 0.0))
        plan.ewt = self.ewt(keyed, plan)
        return plan

    @staticmethod
    def _room(c: Candidate, n: int, budget: BlockBudget, plan: Plan, running: dict, rank: dict) -> bool:
        """Reserve c's blocks, preempting running requests ranked after it, lowest first.
        [open choice] A request that is not running (new, or preempted before) takes blocks only
        from a lower class or level: SRPT order inside a level decides who runs, but displacing a
        running job for a slightly shorter one would trade a swap (or a recompute) for little.
        A running request that needs a block to go on may take it from any lower rank, so the
        best-ranked running request always progresses."""
        if budget.reserve(c, n):
            return True
        width = 3 if c.req_id in running else 2            # rank, or only (class, level)
        mine = rank[c.req_id][:width]
        victims = sorted((x for x in running.values() if rank[x.req_id][:width] > mine
                          and x.req_id not in plan.preempted and x.req_id not in budget.held),
                         key=lambda x: rank[x.req_id], reverse=True)
        return budget.take_from(c, n, victims, plan, "preempted: its blocks went to a request with less "
                                                     "remaining time")


class Footprint:
    """Look-ahead admission: the blocks that the requests holding a cache will need at their
    peak, from their predicted remaining lengths.

    Request i, with x_i tokens now and r_i = max(L̂_i - g_i, 1) still to generate, holds about
    b (x_i + k) / B + b / 2 blocks k steps ahead (b blocks per token-block; its last one half
    full on average) until it ends. The sum only grows between two endings, so it peaks just
    before one: with the r_i sorted in descending order, after the j-th the j longest are
    alive, and

        peak = max_j  Σ_{i<=j} b_i (x_i + r_j - 1) / B + b_i / 2

    A request that does not hold blocks (new, or preempted) is admitted only if this peak,
    with it, fits the pool, counting the holders it may not displace (those of its class and
    level or better: `Alise._room` lets it take blocks only from a lower class or level). The
    blocks of a cached prefix that running requests hold are in its size and in theirs but in
    the pool once: they count toward the pool's total as well.
    Without this, SRPT admitted every short arrival into free blocks, the running requests
    outgrew the pool, and the lowest-ranked one was swapped out, to come back and be swapped
    out again (in the simulator at 4 req/s: 3,607 preemptions for 500 requests with true
    lengths).

    A plan asks this of every waiting request, and the holders change only when one is
    admitted or dropped: the holders' sums for each (class, level) are kept until then
    (``_Peaks``), so a question costs a binary search, not a sort of the holders."""

    _GONE = np.iinfo(np.int64).max      # the key of a dropped row: above every class and level

    def __init__(self, snap: Snapshot, holders: list[Candidate], rank: dict[str, tuple]):
        self.snap = snap
        self.rank = rank
        self.total = snap.num_free_blocks + sum(c.num_blocks for c in snap.running)
        # one row per request counted, (tokens now, tokens to go, blocks per token-block), and its
        # (class, level) key; a plan asks ``admits`` of every waiting request against every row
        # (at 1,600 candidates a Python loop over them took 70% of ALISE's plan)
        self._rows = np.zeros((max(8, 2 * len(holders)), 3))
        self._keys = np.full(len(self._rows), self._GONE, dtype=np.int64)
        self._row_of = {c.req_id: i for i, c in enumerate(holders)}
        if holders:
            self._rows[:len(holders)] = [self._item(c) for c in holders]
            self._keys[:len(holders)] = [self._key(rank[c.req_id]) for c in holders]
        self._peaks: dict[int, _Peaks | None] = {}    # by (class, level) key, until the rows change

    def _item(self, c: Candidate, starting: bool = False) -> tuple[int, int, int]:
        """(tokens now, tokens to go, blocks per token-block). A request ``starting`` that
        outlived its prediction (doubled) counts at most what it may still generate, or
        doubling without bound would keep it out for ever beside any other request."""
        L, doublings = Alise.predicted(c)
        if starting and doublings and c.max_output is not None:
            L = min(L, c.max_output)
        per = self.snap.hidden_blocks_per_token_block if c.cache_type is CacheType.HIDDEN else \
            self.snap.blocks_per_token_block
        return c.num_tokens + c.foreign_slots, max(L - c.num_output, 1), per

    @staticmethod
    def _key(rank: tuple) -> int:
        """(class, level) as one integer in the same order."""
        return int(rank[0]) * 1024 + int(rank[1])

    def _put(self, req_id: str, item: tuple[int, int, int]) -> None:
        i = self._row_of.get(req_id, len(self._row_of))
        if i == len(self._rows):
            self._rows = np.vstack([self._rows, np.zeros_like(self._rows)])
            self._keys = np.concatenate([self._keys, np.full(len(self._keys), self._GONE, dtype=np.int64)])
        self._row_of[req_id] = i
        self._rows[i] = item
        self._keys[i] = self._key(self.rank[req_id])
        self._peaks.clear()

    def add(self, c: Candidate) -> None:
        """Count a request that was admitted; the blocks of its cached prefix that others hold
        (``num_blocks`` of a waiting one) are in the pool once and in its size and theirs."""
        self._put(c.req_id, self._item(c))
        self.total += c.num_blocks

    def remove(self, c: Candidate) -> None:
        """Undo ``add(c)``: a request admitted in this plan that does not run after all."""
        i = self._row_of.get(c.req_id)
        if i is not None and self._keys[i] != self._GONE:
            self.drop(c.req_id)
            self.total -= c.num_blocks

    def drop(self, req_id: str) -> None:
        i = self._row_of.get(req_id)
        if i is not None:
            self._keys[i] = self._GONE
            self._peaks.clear()

    def admits(self, c: Candidate) -> bool:
        key = self._key(self.rank[c.req_id])
        if key not in self._peaks:
            held = self._rows[self._keys <= key]
            self._peaks[key] = _Peaks(held, self.snap.block_size) if len(held) else None
        peaks = self._peaks[key]
        if peaks is None:
            return True
        room = 2 * self.snap.block_size * (self.total + c.num_blocks)      # in _Peaks' units
        return peaks.with_item(*self._item(c, starting=True)) <= room


class _Peaks:
    """``Footprint``'s peak of some holders with one more item, times 2B (so in integers).

    With the holders sorted by r descending, the j-th term is

        P_j = Σ_{i<=j} 2 b_i x_i + (r_j - 1) Σ_{i<=j} 2 b_i + Σ_{i<=j} B b_i

    An item (x, r, b) goes after the k holders with r_i >= r (ties: holders first). The terms
    before it are unchanged, its own is P_k with its sums plus its part, and each later one gains
    2 b x + 2 b (r_j - 1) + B b, so

        peak = max( max_{j<=k} P_j,  own,  2 b x + B b + max_{j>k} (P_j + 2 b (r_j - 1)) )

    The prefix maxima are kept, the suffix maxima once per b asked (2 for KV, the hidden
    blocks per token-block for a hidden cache)."""

    def __init__(self, rows: np.ndarray, block_size: int):
        x, r, b = rows[np.argsort(-rows[:, 1], kind="stable")].T.astype(np.int64)
        self.B = block_size
        s1, s2, s3 = np.cumsum(2 * b * x), np.cumsum(2 * b), np.cumsum(block_size * b)
        self._peak = s1 + s2 * (r - 1) + s3
        self._r = r
        self._neg_r = (-r).tolist()                          # ascending, for bisect
        self._sums = list(zip(s1.tolist(), s2.tolist(), s3.tolist()))
        self._before = np.maximum.accumulate(self._peak).tolist()
        self._after: dict[int, list[int]] = {}

    def with_item(self, x: int, r: int, b: int) -> int:
        """The peak (times 2B, at least 0) of the holders and one item (x, r, b)."""
        k = bisect.bisect_right(self._neg_r, -r)
        s1, s2, s3 = self._sums[k - 1] if k else (0, 0, 0)
        best = (s1 + 2 * b * x) + (s2 + 2 * b) * (r - 1) + (s3 + self.B * b)
        if k:
            best = max(best, self._before[k - 1])
        if k < len(self._neg_r):
            best = max(best, 2 * b * x + self.B * b + self._suffix(b)[k])
        return max(best, 0)

    def _suffix(self, b: int) -> list[int]:
        """max_{j>=k} (P_j + 2 b (r_j - 1)) for each k."""
        if b not in self._after:
            self._after[b] = np.maximum.accumulate((self._peak + 2 * b * (self._r - 1))[::-1])[::-1].tolist()
        return self._after[b]


def gittins_remaining(spread: tuple[int, ...], a: int) -> float:
    """1 / Gittins index of a job whose length is one of ``spread`` (ascending, equally
    likely) and that has run ``a`` tokens: the least expected work per unit of chance to
    finish, over every horizon Δ it could be given,

        r(a) = min_Δ  E[min(L - a, Δ) | L > a] / P(L - a <= Δ | L > a)

    The minimum is at a point of the spread: with S_1 <= .. <= S_n the points above a,
    r = min_i (Σ_{j<=i} (S_j - a) + (n - i)(S_i - a)) / i. Serving the least r first
    minimises mean response time when only each job's distribution is known (Gittins; an
    M/G/1 result), where shortest expected remaining time does not: a request whose
    neighbours replied either briefly or at length gets the chance of a brief reply, and
    once it outlives those its r rises to what the long ones leave. A single point gives
    L - a, i.e. SRPT."""
    return _gittins_many([spread], np.array([a]))[0].item()


def _gittins_many(spreads: list[tuple[int, ...]], a: np.ndarray) -> np.ndarray:
    """``gittins_remaining`` of each (spread, a): the spreads right-aligned in one matrix, padded
    on the left with -1 (below every a), so the points above a are a suffix of each row, the
    i-th of them at the row's cumulative count i."""
    width = max(len(s) for s in spreads)
    S = np.full((len(spreads), width), -1, dtype=np.int64)
    for row, s in zip(S, spreads):
        row[width - len(s):] = s
    above = S > a[:, None]
    d = np.where(above, S - a[:, None], 0)
    i = np.cumsum(above, axis=1)
    r = (np.cumsum(d, axis=1) + (i[:, -1:] - i) * d) / np.maximum(i, 1)
    return np.where(above, r, np.inf).min(axis=1)


class _Columns:
    """The candidates' numbers that the estimate reads, one array each."""

    def __init__(self, cands: list[Candidate]):
        self.spreads = [c.spread for c in cands]
        self.output = np.array([c.num_output for c in cands], dtype=np.int64)
        self.predicted = np.array([DEFAULT_LENGTH if c.predicted is None else c.predicted for c in cands],
                                  dtype=np.int64)
        self.tokens = np.array([c.num_tokens for c in cands], dtype=np.int64)
        self.computed = np.array([c.num_computed for c in cands], dtype=np.int64)
        self.waited = np.array([c.stalled_s + c.pending_s for c in cands], dtype=float)
        self.lora = np.array([c.adapter is not None for c in cands], dtype=np.int64)     # runs with a LoRA adapter


def _doubled(predicted: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Alise.predicted`` of each (prediction, tokens generated): the doublings are the bit
    length of g // L̂, the exponent ``frexp`` gives."""
    L = np.maximum(predicted, 1)
    doublings = np.frexp(g // L)[1].astype(np.int64)
    return L << doublings, doublings


def _remaining_many(col: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """``Alise.remaining`` of each candidate: (tokens left as float, demotions)."""
    g = col.output
    last = np.array([s[-1] if s else 0 for s in col.spreads], dtype=np.int64)
    has = np.array([bool(s) for s in col.spreads])
    L, doublings = _doubled(np.where(has, last, col.predicted), g)
    left = np.maximum(L - g, 1).astype(float)
    gamble = np.flatnonzero(has & (last > g))
    if len(gamble):
        left[gamble] = _gittins_many([col.spreads[i] for i in gamble], g[gamble])
        doublings[gamble] = 0
    return left, doublings


def _why(key: tuple, what: str) -> str:
    return f"{what} (level {key[1]}, {'BE' if key[0] else 'RT'})"
