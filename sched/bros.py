"""BROS: RT/BE co-serving policies (SPEC §2.3-2.4): SLO-slack packing, adaptive batch size, and
the round-robin baseline. Pure over a Snapshot, like sched/policy.py::fcfs; the only state they
keep across iterations is the adaptive batch size (BROS) or the turn (round-robin).

Per iteration (Algorithm 1):
  1. RT candidates (running and waiting) in order of residual time
     res_i = T_SLO,i - t_i - (k_i - 1) T_avg, where k_i is the number of iterations its next
     token still needs (see _groups): 1 for a decode; for a prompt (or a recompute) that
     prefill chunks spread over several iterations, its remaining prefill in units of T_avg.
     [open choice] The paper prefills a prompt whole (k_i = 1 for every token); with chunked
     prefill a long prompt's first token needs several iterations, and counting them is what
     keeps its TTFT: with k_i = 1 its slack looked ample until its last iteration, BE work
     replaced it meanwhile (step 3), and its remaining chunks then ran past the target.
     k_i orders requests and guards the replacement; the time budget T_res_min is each
     request's own next deadline (k_i = 1), since k_i is only an estimate of how the coming
     iterations will chunk the prompt. Because k_i varies with the prompt, waiting requests
     are not in urgency order by arrival, so both queues are sorted (the paper's two-way
     merge assumed they were).
  2. RT requests are taken while the batch has room (B_curr), blocks can be found (by
     preempting best-effort work if needed) and the predicted iteration time C(batch) stays
     within T_res_min = min_i res_i (over requests that can still make it: see _budget).
     The first failure of the time check is the *early
     return*. [open choice] The most urgent RT request is always taken, even when it alone
     cannot make its deadline (otherwise a late request would starve forever), and a prefill
     chunk that does not fit the time budget is shortened to the longest chunk that does.
  3. BE candidates by fewest checkpointed slots (then: already running, then arrival) are
     packed while count, blocks and time allow; when one does not fit, the least urgent RT
     request taken is replaced by it if that makes it fit [SPEC safeguard: only if that RT
     request's slack after this iteration still covers one average iteration].
     [open choice] The first BE request of an iteration with nothing else in it runs even
     when its smallest chunk (min_chunk tokens, or its next decode) is predicted past the
     budget, as the most urgent RT request does: a tight RT target and a cost model that
     prices long context high left a long batch prompt with no chunk that fit, and nothing
     ran, for ever.
  4. Adaptive batch size (TCP-like): B_curr resets to B_base after an early return and
     doubles otherwise, never above max_num_seqs.
  5. [open choice] Without RT requests an iteration is bounded by the tightest RT target
     seen so far, so an RT arrival never waits behind an unbounded BE iteration.
  6. [open choice] RT requests that already missed their TTFT come after those that can still
     meet their SLO (see _rt_order): past capacity, BROS degrades instead of collapsing.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Container, Iterable

import numpy as np

from tandem.engine.messages import CacheType
from tandem.sched.cost_model import StepShape, attn_pairs, predict_many
from tandem.sched.policy import Candidate, Plan, Snapshot, _blocks, _decide, fcfs

CostFn = Callable[[StepShape, int], float]      # (shape, slots to swap in) -> predicted seconds
KEPT_WAIT = "waiting: chats whose next token is due take this iteration's time"
BE_TIME_WAIT = "pending: the batch's time budget is used by RT requests"
# why the RT requests the packing did not reach wait: what ended it (time, batch size, tokens)
FULL_WAIT = {"time": "waiting: more urgent RT requests fill this iteration's time",
             "batch": "waiting: more urgent RT requests fill this iteration's batch size",
             "tokens": "waiting: more urgent RT requests fill this iteration's token budget"}


class BlockBudget:
    """Provisional block reservations against the free count (released if a request is dropped)."""

    def __init__(self, snap: Snapshot):
        self.snap = snap
        self.free = snap.num_free_blocks
        self.held: dict[str, int] = {}

    def need(self, c: Candidate, n: int) -> int:
        """Blocks c must add for its next ``n`` tokens.

        On a bidirectional pool a BE request cannot fill the slots RT owners hold in its blocks
        (``foreign_slots``). They are counted when the pool has no other block for it (none
        free, no RT-only block with room): its growth is then bounded by its own blocks, and a
        plan that took them as room scheduled a step that could not be placed, so nothing ran,
        for ever. [open choice] With other blocks left the pool gives it one of them, and its
        blocks count whole, as BROS counts them: counting the foreign slots there too cost
        BROS 11-15% of its BE throughput at 1 req/s in the simulator."""
        bounded = c.foreign_slots and self.free <= 0 and self.snap.rt_room_blocks <= 0
        extra = c.foreign_slots if bounded else 0
        return max(0, _blocks(self.snap, c.num_computed + n + extra, c) - c.num_blocks)

    def room(self, c: Candidate) -> int:
        """Blocks c may take without preempting anyone (an RT request on a bidirectional pool
        also takes BE-only blocks)."""
        return self.free + (self.snap.be_only_blocks if c.rt and self.snap.block_preemption else 0)

    def reserve(self, c: Candidate, n: int) -> bool:
        k = self.need(c, n)
        if k > self.room(c):
            return False
        self.free -= k
        self.held[c.req_id] = k
        return True

    def release(self, c: Candidate) -> None:
        self.free += self.held.pop(c.req_id, 0)

    def take_from(self, c: Candidate, n: int, victims: Iterable[Candidate], plan: Plan, reason: str) -> bool:
        """Reserve c's blocks, preempting ``victims`` in order (each loses its cache) only until
        they fit; False, preempting none, when even all of them are not enough (they would lose
        their caches for nothing)."""
        victims = list(victims)
        if self.need(c, n) > self.room(c) + sum(v.freed() for v in victims):
            return False
        for v in victims:
            if self.need(c, n) <= self.free:
                break
            plan.preempted.append(v.req_id)
            plan.reasons[v.req_id] = reason
            self.free += v.freed()
        return self.reserve(c, n)


def add_chunk(s: StepShape, c: Candidate, n: int, block_size: int = 0,
              adapters: Container = frozenset()) -> StepShape:
    """``s`` plus c's next ``n`` tokens (a decode when it is the one token after its cache); with
    ``block_size``, a hidden cache also re-projects the KV blocks of the context it had. A cache
    swapped out to host memory is copied back first. c's rows on a LoRA adapter count, and the
    adapter itself unless it is one of ``adapters``, those of the requests ``s`` holds already."""
    hidden = 2 * -(-c.num_computed // block_size) if block_size and c.cache_type is CacheType.HIDDEN else 0
    return s.add(n, c.num_computed + n, n == 1 and c.num_computed > 0 and c.num_computed + 1 == c.num_tokens,
                 hidden, c.host_bytes, c.adapter is not None and c.adapter not in adapters, c.adapter is not None)


@dataclass(frozen=True, slots=True)
class Load:
    """Chunks of an iteration summed as the cost model reads them: their step shape, the slots
    they swap in and the LoRA adapters they run with. A packing loop keeps one per list of
    chunks it grows, so pricing the list plus one more chunk costs one addition, not a pass
    over the list."""
    shape: StepShape = StepShape()
    slots: int = 0
    adapters: frozenset = frozenset()

    def add(self, c: Candidate, n: int, block_size: int = 0) -> "Load":
        adapters = self.adapters if c.adapter is None or c.adapter in self.adapters else self.adapters | {c.adapter}
        return Load(add_chunk(self.shape, c, n, block_size, self.adapters), self.slots + c.num_cpu, adapters)

    def extend(self, items: Iterable[tuple[Candidate, int]], block_size: int = 0) -> "Load":
        load = self
        for c, n in items:
            load = load.add(c, n, block_size)
        return load


class Bros:
    """BROS packing with adaptive batch size; ``cost(shape, swap_slots)`` predicts an iteration."""

    name = "bros"
    skip_misfits = False        # BE packing stops at the first request that does not fit (the paper's)

    def __init__(self, cost: CostFn, max_num_seqs: int, b_base: int | None = None,
                 min_chunk: int = 16, safeguard: bool = True, idle_budget_s: float | None = None):
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        # [open choice] the paper's B_base is 128 of a 256-sequence vLLM; keep that ratio
        self.b_base = max(1, min(b_base if b_base is not None else max_num_seqs // 2, max_num_seqs))
        self.b_curr = self.b_base
        self.min_chunk = min_chunk
        self.safeguard = safeguard
        self.last_early = False
        # [open choice] with no RT request present an iteration is still bounded, by the tightest
        # RT target seen so far (or this budget): an RT request arriving meanwhile waits at most
        # one such iteration instead of a whole unbounded BE batch
        self.idle_budget_s = idle_budget_s
        self.loosest_s: float | None = None     # the loosest RT target seen (a TTFT target)
        self.block_size = 0                     # the snapshot's, for pricing hidden caches
        self._urg: dict[str, float] = {}        # this plan's RT urgencies, at T_avg ``_urg_t_avg``
        self._urg_t_avg = math.nan
        self._unshrunk = math.inf               # this plan's budget before its margin (``_budget``)

    # ---- helpers ---------------------------------------------------------------
    def _load(self, items: Iterable[tuple[Candidate, int]], base: Load = Load()) -> Load:
        return base.extend(items, self.block_size)

    def _time(self, load: Load, c: Candidate | None = None, n: int = 0) -> float:
        """Predicted seconds of the chunks ``load`` sums, plus c's next n tokens if given."""
        if c is not None:
            load = load.add(c, n, self.block_size)
        return self.cost(load.shape, load.slots)

    def _fit_chunk(self, load: Load, c: Candidate, n: int, limit: float) -> int:
        """Longest prefill chunk <= n (and >= min_chunk) keeping C(load + c) within ``limit``; 0 if none."""
        if n <= 1:
            return 0
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._time(load, c, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= min(self.min_chunk, n) and lo < n else 0

    @staticmethod
    def _rt_order(snap: Snapshot, res) -> list[Candidate]:
        """RT candidates, most urgent first (``res``: the urgency, residual less the further
        iterations a prompt needs): those that can still meet their SLO, then [open choice]
        those whose TTFT already passed, by residual time.

        Serving the latest requests first (pure residual order) is earliest-deadline-first, which
        under overload makes every request late in turn (the domino effect seen in the simulator
        past capacity); a request that missed its TTFT has missed its SLO whatever happens, so it
        runs on what the savable ones leave, still ahead of best-effort work.
        """
        rt = [c for c in snap.running + snap.waiting if c.rt]
        return sorted(rt, key=lambda c: (c.missed, res(c)))

    def _budget(self, q_rt, res) -> float:
        """T_res_min over the RT requests that can still make their deadline.

        [open choice] A request whose residual is below the cheapest possible iteration is
        late whatever happens; letting it set the budget would shrink every iteration to one
        request and turn lateness into collapse. Late requests are still served first (they
        sort first), inside the budget of those that can be saved. [open choice] If none can,
        the iteration is bounded only by half the loosest RT target seen (a TTFT target, so a
        request arriving meanwhile can still make its first token): past capacity what helps
        is throughput, and best-effort requests that finish give their blocks back (bounding
        such iterations by the tightest target, or keeping BE out of them, cut the paper-scale
        simulation's attainment at 2 req/s from 96% to 65%). Only an iteration without any RT
        request is bounded by the tightest RT target seen.
        """
        floor = self.cost(StepShape().add(1, 1, True), 0)
        feasible = [x for x in (res(c) for c in q_rt if not c.missed) if x >= floor]
        if feasible:
            budget = min(feasible)
        elif q_rt:
            budget = self.loosest_s / 2 if self.loosest_s else math.inf
        else:
            budget = self.idle_budget_s or math.inf
        # [open choice] plan against the budget shrunk by the cost model's recent 90th-percentile
        # overrun (measured / predicted), so a step predicted to just fit meets the deadline nine
        # times in ten; shrinking by the mean error left 40% of chats past a 1 s TTFT under a job
        self._unshrunk = budget
        return self._margin(budget)

    def _chunk_limit(self, r: Candidate, t_res_min: float) -> float:
        """The time an iteration with RT prompt ``r``'s chunk may be predicted to take: T_res_min
        (the budget with its margin) for every prompt here."""
        return t_res_min

    def _margin(self, seconds: float) -> float:
        """A time limit shrunk by the cost model's recent 90th-percentile overrun (if it keeps one)."""
        overrun = getattr(self.cost, "overrun", None)
        return seconds / overrun() if overrun is not None else seconds

    def _make_room(self, c: Candidate, n: int, snap: Snapshot, budget: BlockBudget, plan: Plan,
                   taken: set[str], t_avg: float) -> bool:
        """FindPreemptBlock: free blocks, else preempt best-effort work (least computed first:
        least lost), else RT requests not in this batch (largest residual). A bidirectional pool
        takes BE slots itself (its BE-only blocks count as room); when even those are not enough,
        RT requests are preempted as on a whole-block pool (else RT requests that fill the pool
        at a block boundary would all wait for each other)."""
        if budget.reserve(c, n):
            return True
        running = [x for x in snap.running if x.req_id not in taken and x.req_id != c.req_id
                   and x.req_id not in plan.preempted and (x.rt or not snap.block_preemption)]
        return budget.take_from(c, n, self._victims(c, running, t_avg), plan,
                                "preempted: its blocks went to a more urgent RT request")

    def _victims(self, c: Candidate, running: list[Candidate], t_avg: float) -> list[Candidate]:
        """Whom an RT request ``c`` may preempt, first to last: best-effort work, least computed
        first (least lost), then RT requests, those already late first, then by largest residual;
        only RT requests that arrived after c (or already lost their TTFT while c has not).

        The order between two RT requests must not change while they wait, or they take each
        other's blocks in turn, each time throwing a cache away. Residual time does change: the
        one that lost its cache waits, its residual falls below that of the one now running
        (whose residual is renewed at each token), and it takes the blocks back. On OPT-13B's
        shape with a 2,600-token pool that cycle made 6,247 RT-on-RT preemptions for 60
        requests (simulated); arrival order, which never changes, made 577. BROS itself only
        preempts BE-only blocks; RT victims are for pools that have none left."""
        def order(x: Candidate) -> tuple:       # arrival: fixed for a request's whole life
            return x.arrival, x.req_id

        def later(x: Candidate) -> bool:
            return (x.missed and not c.missed) or order(x) > order(c)
        return sorted((x for x in running if not x.rt), key=lambda x: x.num_computed) + \
            sorted((x for x in running if x.rt and later(x)), key=lambda x: (not x.missed, -self._urgency(x, t_avg)))

    def _res(self, c: Candidate, t_avg: float) -> float:
        """A request's residual time (BROS: its SLO less the time since its last token)."""
        return c.residual(t_avg)

    def _urgency(self, c: Candidate, t_avg: float) -> float:
        """The residual time less the further iterations its next token needs, (k_i - 1) T_avg:
        the order of RT requests, and what a request keeps if BE work replaces it. A request
        past its TTFT keeps its residual (its SLO is lost; those wait in arrival order). A plan
        computes every RT candidate's once (``_urgencies``)."""
        known = self._urg.get(c.req_id) if t_avg == self._urg_t_avg else None
        return known if known is not None else self._urgencies([c], t_avg)[0]

    def _urgencies(self, cands: list[Candidate], t_avg: float) -> list[float]:
        """``_urgency`` of each candidate, their prompts priced in one call of the cost model."""
        res = [self._res(c, t_avg) for c in cands]
        k = self._groups(cands, t_avg)
        return [r if c.missed else r - (g - 1) * t_avg for c, r, g in zip(cands, res, k.tolist())]

    def _groups(self, cands: list[Candidate], t_avg: float) -> np.ndarray:
        """k_i of each candidate: iterations its next token still needs. 1 for a decode; for a
        prompt (or a recompute) with more tokens to compute, its remaining prefill priced as one
        standalone step, C(prefill), its cache's copy back from host memory and its LoRA adapter
        and the rows run with it included, in units of the recent iteration time:

            k_i = ceil(C(prefill of the remaining tokens) / T_avg)

        (a prefill that fits one average iteration needs that one: k_i = 1)."""
        tokens = np.array([c.num_tokens for c in cands], dtype=np.int64)
        todo = tokens - np.array([c.num_computed for c in cands], dtype=np.int64)
        priced = (todo > 1) & np.array([c.slo_s is not None for c in cands], dtype=bool)
        if t_avg <= 0 or not priced.any():
            return np.ones(len(cands), dtype=np.int64)
        prompts = [c for c, p in zip(cands, priced) if p]
        lora = np.array([c.adapter is not None for c in prompts], dtype=np.int64)
        t = predict_many(self.cost, todo[priced], attn_pairs(todo[priced], tokens[priced]),
                         swap_slots=np.array([c.num_cpu for c in prompts], dtype=np.int64),
                         swap_in_bytes=np.array([c.host_bytes for c in prompts], dtype=np.int64),
                         adapters=lora, adapter_rows=lora * todo[priced])
        k = np.ones(len(cands), dtype=np.int64)
        k[priced] = np.maximum(1, np.ceil(t / t_avg)).astype(np.int64)
        return k

    def _may_replace(self, r: Candidate, t_iter: float, t_avg: float) -> bool:
        """May BE work take RT request ``r``'s place in an iteration of ``t_iter`` seconds?
        [SPEC safeguard] Only if r can still run in the next one: urgency - t_iter >= T_avg."""
        return not self.safeguard or self._urgency(r, t_avg) - t_iter >= t_avg

    def _be_room(self, b: Candidate, n: int, snap: Snapshot, budget: BlockBudget, plan: Plan,
                 taken: set[str]) -> bool:
        """Reserve a BE request's blocks (FindBlock): free blocks. When nothing else runs in this
        iteration, a running one takes those of running BE requests after it in the BE order,
        last first (as vLLM preempts the latest): with free blocks only, BE requests that filled
        the pool between them all waited for a block for ever. While others run it waits, as in
        BROS (on a bidirectional pool, RT requests then take BE slots rather than BE taking BE
        requests' blocks)."""
        if budget.reserve(b, n):
            return True
        if b.req_id not in {c.req_id for c in snap.running} or budget.held:
            return False            # others run in this iteration: it waits for their blocks, as in BROS
        queue = [x.req_id for x in self._be_queue(snap, plan)]
        running = {c.req_id: c for c in snap.running}
        victims = [running[r] for r in reversed(queue[queue.index(b.req_id) + 1:])
                   if r in running and r not in taken and r not in budget.held]
        return budget.take_from(b, n, victims, plan, "preempted: its blocks went to an earlier BE request")

    def _admits(self, c: Candidate, budget: BlockBudget) -> bool:
        """May ``c`` join this iteration at all (``budget``: the blocks this plan has left)?
        (Every request may, here.)"""
        return True

    def _kept(self, r: Candidate, t_avg: float) -> list[tuple[Candidate, int]]:
        """Work after ``r`` in this iteration's RT order (``_rt_order``) whose time ``r``'s prompt
        chunk must leave. None here: BROS's order is urgency already."""
        return []

    def _overtakes(self, r: Candidate, n: int, budget: BlockBudget) -> bool:
        """May waiting ``r`` start while a more urgent RT request waits for blocks? Not here: the
        blocks that running requests free as they end go to the waiting one first."""
        return False

    def _be_queue(self, snap: Snapshot, plan: Plan) -> list[Candidate]:
        """BE candidates in packing order: fewest checkpointed slots, then running, then arrival."""
        running_ids = {c.req_id for c in snap.running}
        return sorted((c for c in [*snap.running, *snap.waiting] if not c.rt and c.req_id not in plan.preempted),
                      key=lambda c: (c.num_cpu, c.req_id not in running_ids, c.arrival))

    # ---- Algorithm 1 -------------------------------------------------------------
    def __call__(self, snap: Snapshot) -> Plan:
        plan = Plan()
        lim, t_avg = snap.limits, snap.t_avg
        self.block_size = snap.block_size
        budget = BlockBudget(snap)
        res = lambda c: self._res(c, t_avg)  # noqa: E731
        rt = [c for c in [*snap.running, *snap.waiting] if c.rt]
        self._urg, self._urg_t_avg = dict(zip((c.req_id for c in rt), self._urgencies(rt, t_avg))), t_avg
        q_rt = deque(self._rt_order(snap, lambda c: self._urgency(c, t_avg)))
        slos = [c.slo_s for c in q_rt if c.slo_s is not None]
        if slos:
            self.loosest_s = max(slos + [self.loosest_s or 0.0])
            self.idle_budget_s = min(slos + ([self.idle_budget_s] if self.idle_budget_s else []))
        t_res_min = self._budget(q_rt, res)
        tokens_left = lim.max_num_batched_tokens
        rt_ready: list[tuple[Candidate, int]] = []
        rt_load = Load()                        # rt_ready's, kept as it grows
        taken: set[str] = set()
        early, blocked, running_ids = False, False, {c.req_id for c in snap.running}
        kept_full = False
        rt_limit = t_res_min                    # what an RT decode may fill the step to (``_chunk_limit``)
        while q_rt and len(rt_ready) < self.b_curr and tokens_left > 0:
            r, fitted = q_rt[0], False
            if r.req_id in plan.preempted:      # gave its blocks to a more urgent request this iteration
                q_rt.popleft()
                continue
            n = min(r.num_tokens - r.num_computed, tokens_left)
            if blocked and r.req_id not in running_ids and not self._overtakes(r, n, budget):
                q_rt.popleft()
                plan.reasons[r.req_id] = "waiting: behind a more urgent RT request that waits for blocks"
                continue
            if n < r.num_tokens - r.num_computed and not lim.chunked_prefill:
                plan.reasons[r.req_id] = "waiting: prompt exceeds this iteration's token budget"
                break
            kept = self._kept(r, t_avg) if n > 1 else []
            if kept and kept_full:
                # a prompt was cut to (or left out for) the time kept for others: what is left
                # is theirs, and a later prompt that keeps time for them gets none
                q_rt.popleft()
                plan.reasons[r.req_id] = KEPT_WAIT
                continue
            if not self._admits(r, budget):
                q_rt.popleft()
                plan.reasons[r.req_id] = "waiting: its predicted growth would not fit beside the running requests'"
                continue
            kept_load = self._load(kept, rt_load) if kept else rt_load
            limit = self._chunk_limit(r, t_res_min) if n > 1 else rt_limit
            if kept and self._time(kept_load, r, n) > limit:
                n = self._fit_chunk(kept_load, r, n, limit) if lim.chunked_prefill else 0
                kept_full, fitted = n == 0, n > 0
                if n == 0:
                    q_rt.popleft()
                    plan.reasons[r.req_id] = KEPT_WAIT
                    continue
            if rt_ready and self._time(rt_load, r, n) > limit:
                n = self._fit_chunk(rt_load, r, n, limit) if lim.chunked_prefill else 0
                early = True
                if n == 0:
                    plan.reasons[r.req_id] = "waiting: the batch would miss the most urgent RT deadline"
                    break
            elif not rt_ready and self._time(Load(), r, n) > limit:
                early = True        # the most urgent request cannot make it: run it alone-first anyway
            if not self._make_room(r, n, snap, budget, plan, taken, t_avg):
                plan.reasons[r.req_id] = "waiting: no block can be found or preempted"
                q_rt.popleft()
                blocked = True      # no waiting request overtakes it; running ones (holding the
                continue            # blocks it needs) still run, and finish
            q_rt.popleft()
            rt_ready.append((r, n))
            rt_load = rt_load.add(r, n, self.block_size)
            rt_limit = max(rt_limit, limit)     # decodes after a chunk may fill the step to its limit
            taken.add(r.req_id)
            tokens_left -= n
            kept_full = kept_full or fitted
            if early:
                break
        full = FULL_WAIT["time" if early else "batch" if len(rt_ready) >= self.b_curr else "tokens"]
        for c in q_rt:
            plan.reasons.setdefault(c.req_id, full)
        be_ready = self._pack_be(snap, budget, plan, rt_ready, q_rt, taken, t_res_min, tokens_left)
        for c, n in rt_ready + be_ready:
            plan.scheduled.append(_decide(c, n))
            plan.reasons.setdefault(c.req_id, "scheduled (RT)" if c.rt else "scheduled (BE)")
        for c in [*snap.running, *snap.waiting]:          # those the packing did not reach
            plan.reasons.setdefault(c.req_id, ("waiting" if c.rt else "pending") + ": behind requests that fill "
                                    "this iteration or cannot run (batch size, time or blocks)")
        self.last_early = early
        self.b_curr = self.b_base if early else min(2 * self.b_curr, self.max_num_seqs)
        self._urg = {}                                    # the next snapshot's requests are not these
        return plan

    def _pack_be(self, snap, budget, plan, rt_ready, q_rt, taken, t_res_min, tokens_left):
        """BE work into what the RT work left (Algorithm 1's second loop), in ``_be_queue``'s order;
        it stops at the first request that does not fit, or with ``skip_misfits`` passes over it
        to those after it that need fewer tokens."""
        lim, t_avg = snap.limits, snap.t_avg
        be_ready: list[tuple[Candidate, int]] = []
        load = self._load(rt_ready)                 # rt_ready's and be_ready's, kept as they change
        running_ids, blocked = {c.req_id for c in snap.running}, False
        least_misfit = math.inf                     # the fewest tokens a request passed over needed
        for b in self._be_queue(snap, plan):
            if b.req_id in plan.preempted:          # gave its blocks to a BE request ranked above it
                continue
            n = min(b.num_tokens - b.num_computed, tokens_left)
            if n <= 0 or (n < b.num_tokens - b.num_computed and not lim.chunked_prefill):
                break
            if min(n, self.min_chunk) >= least_misfit:
                plan.reasons[b.req_id] = BE_TIME_WAIT
                continue
            if not self._admits(b, budget):
                plan.reasons[b.req_id] = "pending: its predicted growth would not fit beside the running requests'"
                continue
            if b.req_id not in running_ids and blocked:
                plan.reasons[b.req_id] = "pending: behind a BE request that waits for blocks"
                continue
            before = len(plan.preempted)
            if not self._be_room(b, n, snap, budget, plan, taken):      # FindBlock
                plan.reasons[b.req_id] = "pending: no block for it"
                self._unadmit(b)
                blocked = True      # no waiting request overtakes it; running ones still run
                continue
            fits = lambda ld, count, k: (count + 1 <= self.b_curr  # noqa: E731
                                         and self._time(ld, b, k) <= t_res_min)
            count = len(rt_ready) + len(be_ready)
            if not fits(load, count, n) and lim.chunked_prefill and count < self.b_curr:
                n = self._fit_chunk(load, b, n, t_res_min) or (min(n, self.min_chunk) if count == 0 else n)
            if fits(load, count, n) or count == 0:          # alone, it runs whatever the budget
                be_ready.append((b, n))
                load = load.add(b, n, self.block_size)
                tokens_left -= n
                continue
            if not rt_ready:
                self._misfit(b, before, snap, budget, plan)
                if not self.skip_misfits:
                    break
                least_misfit, plan.reasons[b.req_id] = min(n, self.min_chunk), BE_TIME_WAIT
                continue
            r, rn = rt_ready.pop()                                     # try replacing the least urgent RT
            rest = self._load(rt_ready + be_ready)
            if self._may_replace(r, self._time(rest, b, n), t_avg) and fits(rest, count - 1, n):
                budget.release(r)
                q_rt.appendleft(r)
                taken.discard(r.req_id)
                tokens_left += rn - n
                be_ready.append((b, n))
                load = rest.add(b, n, self.block_size)
                plan.reasons[r.req_id] = "pending: replaced by a BE request (RT slack allows it)"
            else:
                rt_ready.append((r, rn))
                self._misfit(b, before, snap, budget, plan)
                plan.reasons[b.req_id] = BE_TIME_WAIT
                if not self.skip_misfits:
                    break
                least_misfit = min(n, self.min_chunk)
        return be_ready

    def _misfit(self, b: Candidate, before: int, snap: Snapshot, budget: BlockBudget, plan: Plan) -> None:
        """A BE request that found blocks but no time in this iteration gives back what it took:
        its blocks, the requests preempted for them (``plan.preempted`` from ``before`` on) and its
        place in admission's books (``_unadmit``)."""
        budget.release(b)
        if len(plan.preempted) > before:
            running = {c.req_id: c for c in snap.running}
            for rid in plan.preempted[before:]:
                budget.free -= running[rid].freed()
                plan.reasons.pop(rid, None)
            del plan.preempted[before:]
        self._unadmit(b)

    def _unadmit(self, c: Candidate) -> None:
        """``c`` was admitted (``_admits``) but does not run in this iteration. (Nothing is
        counted here.)"""


class RoundRobin:
    """BROS's second baseline: alternate RT and BE iterations (FCFS within the class); a class
    with nothing to do gives its turn to the other. When the turn's class cannot run for lack
    of blocks, the other class's running requests are preempted (latest arrival first) before
    its own, on RT's turn only: [open choice] BE's turn takes no RT blocks (as in BROS, BE work
    never displaces RT work). Preempting both ways, a chat and a batch request that could not
    fit together took each other's blocks turn by turn, each recomputing for ever."""

    name = "rr"

    def __init__(self) -> None:
        self.turn_rt = True

    def __call__(self, snap: Snapshot) -> Plan:
        for rt in (self.turn_rt, not self.turn_rt):
            plan = self._class_plan(snap, rt)
            if plan.scheduled or plan.preempted:
                self.turn_rt = not rt
                return plan
        return Plan()

    @staticmethod
    def _class_plan(snap: Snapshot, rt: bool) -> Plan:
        running = [c for c in snap.running if c.rt == rt]
        waiting = [c for c in snap.waiting if c.rt == rt]
        if not running and not waiting:
            return Plan()
        others = sorted((c for c in snap.running if rt and not c.rt), key=lambda c: -c.arrival)
        free, taken = snap.num_free_blocks, []
        while True:
            plan = fcfs(replace(snap, running=running, waiting=waiting, num_free_blocks=free))
            if (plan.scheduled and not plan.preempted) or not others:
                for v in taken:
                    plan.reasons[v] = "preempted: its blocks went to the other class's turn"
                plan.preempted[:0] = taken
                return plan
            v = others.pop(0)
            taken.append(v.req_id)
            free += v.freed()
