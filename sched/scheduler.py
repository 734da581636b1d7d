"""The Scheduler: owns request state and per-device queues, runs one iteration per step().

Each step, per device: snapshot -> policy (pure) -> apply the plan to the
block pool bookkeeping -> StepInput; then all devices run in parallel and
their StepOutputs update the requests.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cache import BlockPool, PoolGeometry
from cache.bidir import BidirBlockPool
from engine.messages import (CacheType, Command, DeviceError, NewRequest, Phase, SamplingSpec,
                             ScheduledRequest, StepInput, StepOutput)
from sched.aptserve import AptServe
from sched.bros import Bros, RoundRobin
from sched.cost_model import OnlineCostModel, StepShape
from sched.policy import Candidate, Limits, Plan, Snapshot, fcfs, fcfs_prefill_first
from sched.request import FinishReason, Request, RequestState, ServiceClass, Status
from sched.stops import check_stop


class Device(Protocol):
    """What the scheduler needs of a device: its pool geometry and one step at a time."""
    name: str
    geometry: PoolGeometry

    def submit(self, inp: StepInput) -> None: ...
    def collect(self) -> StepOutput: ...          # raises DeviceError


@dataclass(frozen=True, slots=True)
class SchedConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    policy: str = "fcfs"
    rt_budget_s: float | None = None   # tightest RT latency target (bounds BROS iterations without RT)
    bidirectional: bool = False        # BROS bidirectional blocks with lazy checkpointing (cache/bidir.py)
    cache_type: CacheType = CacheType.KV  # what every new request's blocks hold (hidden: Apt-Serve's
                                          # layer inputs, K and V recomputed at each step)
    # aptserve: seconds of recompute per KV block with a hidden cache (profiled), whether hidden
    # caches are offered, adaptive (knapsack) or FCFS order, value decay past the SLO (None: ε)
    rho: float = 0.0
    hybrid_cache: bool = True
    adaptive: bool = True
    slo_decay: float | None = None
    mixed_batches: bool = False          # aptserve: prefill and decode in one iteration (Apt-Serve-S)


@dataclass(slots=True)
class Update:
    """What happened to one request in a step (new tokens and/or its end)."""
    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    text_end: int | None = None       # at the end: cut the text here (a stop string matched)
    queue_s: float | None = None      # at the end: seconds from arrival to first being scheduled


@dataclass(slots=True)
class _DeviceQueues:
    pool: BlockPool
    waiting: deque[str] = field(default_factory=deque)
    running: list[str] = field(default_factory=list)   # sorted by arrival
    new: list[NewRequest] = field(default_factory=list)
    reset_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    dead: str | None = None
    num_preemptions: int = 0


POLICIES = ("fcfs", "rr", "bros", "aptserve", "fcfs-prefill-first")


def _validate(cfg: SchedConfig, devices) -> None:
    """ValueError for option combinations the scheduler or the devices cannot honour."""
    if cfg.bidirectional and cfg.policy != "bros":
        raise ValueError("bidirectional: bidirectional blocks need the bros policy")
    if cfg.bidirectional and cfg.cache_type is not CacheType.KV:
        raise ValueError("cache_type: bidirectional blocks hold KV caches only")
    if cfg.cache_type is CacheType.HIDDEN and not all(d.geometry.hidden_blocks for d in devices):
        raise ValueError("cache_type: this model's d_model is not a multiple of "
                         "num_kv_heads * head_dim, so it cannot keep a hidden cache")


def make_policy(cfg: SchedConfig, cost: OnlineCostModel | None):
    """The policy callable (Snapshot -> Plan) named by cfg.policy."""
    if cfg.policy == "fcfs":
        return fcfs
    if cfg.policy == "fcfs-prefill-first":
        return fcfs_prefill_first
    if cfg.policy == "rr":
        return RoundRobin()
    if cfg.policy == "bros":
        if cost is None:
            raise ValueError("policy: bros needs a cost model (profile the engine first)")
        return Bros(cost, cfg.max_num_seqs, idle_budget_s=cfg.rt_budget_s)
    if cfg.policy == "aptserve":
        return AptServe(cfg.rho, cfg.hybrid_cache, cfg.adaptive, cfg.slo_decay, cfg.mixed_batches, cost)
    raise ValueError(f"policy: {cfg.policy!r} is not one of {list(POLICIES)}")


class Scheduler:
    def __init__(self, cfg: SchedConfig, devices: list[Device], eos_ids: tuple[int, ...],
                 max_model_len: int, detokenize: Callable[[list[int]], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, cost: OnlineCostModel | None = None):
        self.cfg = cfg
        self.cost = cost                    # refined from every measured step when given
        self.policy = make_policy(cfg, cost)
        self.t_avg = 0.0                    # EWMA of iteration wall time (BROS's T_avg)
        self.devices = devices
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.detokenize = detokenize
        _validate(cfg, devices)
        self.queues = [_DeviceQueues(BidirBlockPool(d.geometry) if cfg.bidirectional else BlockPool(d.geometry))
                       for d in devices]
        self.states: dict[str, RequestState] = {}
        self._step_id = 0
        self._rng = random.Random()
        self.preemptions_by_class: Counter = Counter()
        self.tokens_by_cache_type: Counter = Counter()   # tokens computed into each kind of cache
        self.cache_switches: Counter = Counter()   # type changes that discarded a cache, by new type
        self.clock = clock                  # time.monotonic, or the simulator's virtual clock
        self.step_log: list[tuple[StepShape, float]] | None = None   # set to a list to record steps

    def use_policy(self, name: str, cost: OnlineCostModel | None = None, bidirectional: bool = False,
                   **options) -> None:
        """Switch policy (e.g. to BROS once the start-up profile has produced its cost model);
        only while nothing is queued. ``bidirectional`` swaps in bidirectional block pools."""
        from dataclasses import replace
        if self.has_unfinished():
            raise RuntimeError("policy: can only be switched while no request is queued")
        cfg = replace(self.cfg, policy=name, bidirectional=bidirectional, **options)
        _validate(cfg, self.devices)
        self.policy = make_policy(cfg, cost or self.cost)
        self.cfg, self.cost = cfg, cost or self.cost
        for q, d in zip(self.queues, self.devices):
            q.pool = BidirBlockPool(d.geometry) if bidirectional else BlockPool(d.geometry)

    # ---- intake --------------------------------------------------------------
    def add(self, req: Request) -> RequestState:
        """Queue a request on the least-loaded live device; ValueError if it can never fit."""
        if req.req_id in self.states:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        live = [i for i, q in enumerate(self.queues) if q.dead is None]
        if not live:
            raise DeviceError("no live device: " + "; ".join(q.dead or "" for q in self.queues))
        d = min(live, key=lambda i: len(self.queues[i].waiting) + len(self.queues[i].running))
        q = self.queues[d]
        self.check_fits(len(req.prompt_token_ids), req.sampling.max_tokens)
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
        st = RequestState(req, seed=seed, device=d, last_token_time=req.arrival_time,
                          cache_type=self.cfg.cache_type)
        self.states[req.req_id] = st
        q.waiting.append(req.req_id)
        return st

    def abort(self, req_id: str) -> Update | None:
        """Cancel a request now; its blocks are freed at once."""
        st = self.states.get(req_id)
        if st is None or st.status is Status.FINISHED:
            return None
        return self._finish(st, FinishReason.ABORT)

    def load_by_class(self) -> dict:
        """{ServiceClass: (running, waiting, blocks held)} over all devices (for metrics)."""
        out: dict = {}
        for q in self.queues:
            for ids, k in ((q.running, 0), (q.waiting, 1)):
                for r in ids:
                    st = self.states.get(r)
                    if st is None:
                        continue
                    row = out.setdefault(st.request.service_class, [0, 0, 0])
                    row[k] += 1
                    row[2] += q.pool.num_blocks_of(r)
        return {c: tuple(v) for c, v in out.items()}

    def pool_view(self) -> dict[str, int]:
        """Blocks by owner over all devices: rt, be, shared (RT and BE in one block), checkpointed
        (BE slots parked on the CPU), free. Whole-block pools share nothing and checkpoint nothing."""
        view = {"rt": 0, "be": 0, "shared": 0, "checkpointed": 0, "free": 0}
        if self.cfg.bidirectional:
            for q in self.queues:
                for k, n in q.pool.view().items():       # token-blocks (and checkpointed slots)
                    view[k] += n if k == "checkpointed" else 2 * n
            return view
        for c, (_run, _wait, blocks) in self.load_by_class().items():
            view[c.value] += blocks
        view["free"] = sum(q.pool.num_free for q in self.queues)
        return view

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError if such a request could never fit a device's pool (safe from any thread)."""
        longest = min(num_prompt_tokens + max_tokens, self.max_model_len)
        g = self.queues[0].pool.geometry
        need = g.blocks_for(longest, self.cfg.cache_type)
        if need > g.num_blocks:
            raise ValueError(f"prompt: {longest} tokens of context need {need} "
                             f"blocks; the pool has {g.num_blocks}")

    def has_unfinished(self) -> bool:
        return any(q.waiting or q.running for q in self.queues)

    # ---- one iteration ---------------------------------------------------------
    def step(self) -> list[Update]:
        """Plan, run and account one iteration on every device with work."""
        self._step_id += 1
        sent: dict[int, tuple[StepInput, Plan, StepShape]] = {}
        t0 = self.clock()
        for d, q in enumerate(self.queues):
            if q.dead is not None:
                continue
            plan = self.policy(self._snapshot(q))
            inp, shape = self._apply(d, q, plan)
            if inp.scheduled or inp.finished_ids or inp.reset_ids or inp.new_requests:
                self.devices[d].submit(inp)
                sent[d] = (inp, plan, shape)
        updates: list[Update] = []
        for d, (inp, plan, shape) in sent.items():
            try:
                out = self.devices[d].collect()
                if out.error:
                    raise DeviceError(f"{self.devices[d].name}: step failed: {out.error}")
            except DeviceError as e:
                updates.extend(self._fail_device(d, str(e)))
                continue
            if inp.scheduled:
                self._observe(shape, self.clock() - t0)
            updates.extend(self._account(plan, out))
        return updates

    def _observe(self, shape: StepShape, seconds: float) -> None:
        if self.step_log is not None:
            self.step_log.append((shape, seconds))
        if self.cost is not None:
            self.cost.observe(shape, seconds)
        self.t_avg = seconds if self.t_avg == 0 else 0.9 * self.t_avg + 0.1 * seconds

    def _snapshot(self, q: _DeviceQueues) -> Snapshot:
        now = self.clock()

        def cand(rid):
            st = self.states[rid]
            r = st.request
            slo = r.slo_tbt_s if st.output_token_ids else r.slo_ttft_s
            return Candidate(rid, st.num_tokens, st.num_computed, q.pool.num_blocks_of(rid), r.arrival_time,
                             r.service_class is ServiceClass.RT, slo, now - (st.last_token_time or r.arrival_time),
                             q.pool.num_cpu(rid) if bidir else 0, _missed_ttft(st, now), st.cache_type)
        c = self.cfg
        bidir = c.bidirectional
        return Snapshot([cand(r) for r in q.running], [cand(r) for r in q.waiting],
                        q.pool.num_free, q.pool.geometry.block_size,
                        q.pool.geometry.blocks_per_token_block(CacheType.KV),
                        Limits(c.max_num_seqs, c.max_num_batched_tokens, c.chunked_prefill), self.t_avg,
                        q.pool.num_be_only if bidir else 0, bidir, q.pool.geometry.hidden_blocks)

    def _apply(self, d: int, q: _DeviceQueues, plan: Plan) -> tuple[StepInput, StepShape]:
        """Carry out the plan in the bookkeeping; describe it to the device (and its cost shape)."""
        switched = set()
        for rid, ct in plan.cache_types.items():
            st = self.states[rid]
            if st.cache_type is not ct and self._switch_cache_type(q, st, ct):
                switched.add(rid)     # planned again next iteration, from its first token
                self.cache_switches[ct] += 1
        if switched:
            plan.scheduled = [d for d in plan.scheduled if d.req_id not in switched]
            plan.preempted = [r for r in plan.preempted if r not in switched]
        preempted = [self.states[r] for r in plan.preempted]
        for st in preempted:
            q.pool.free(st.req_id)
            q.running.remove(st.req_id)
            st.status, st.num_computed = Status.WAITING, 0
            st.num_preemptions += 1
            q.num_preemptions += 1
            self.preemptions_by_class[st.request.service_class] += 1
            if st.sent_to_device:
                q.reset_ids.append(st.req_id)
        for st in sorted(preempted, key=lambda s: s.request.arrival_time, reverse=True):
            q.waiting.appendleft(st.req_id)
        inp = StepInput(Command.STEP, self._step_id, q.new, [], q.reset_ids, q.finished_ids)
        q.new, q.reset_ids, q.finished_ids = [], [], []
        shape = StepShape()
        placed = []
        decisions = plan.scheduled
        if self.cfg.bidirectional:       # RT grows first: BE never overwrites RT, RT may overwrite BE
            decisions = sorted(decisions, key=lambda d: self.states[d.req_id].request.service_class
                               is not ServiceClass.RT)
        for dec in decisions:
            st = self.states[dec.req_id]
            sr = self._place(q, st, dec, inp, {d.req_id for d in decisions})
            if sr is None:
                continue
            placed.append(dec)
            hidden = q.pool.geometry.blocks_for(st.num_computed) if st.cache_type is CacheType.HIDDEN else 0
            shape = shape.add(dec.num_new_tokens, st.num_computed + dec.num_new_tokens,
                              dec.phase is Phase.DECODE, hidden)
            if st.status is Status.WAITING:
                if st.first_scheduled_time is None:
                    st.first_scheduled_time = self.clock()
                q.waiting.remove(st.req_id)
                bisect.insort(q.running, st.req_id, key=lambda r: self.states[r].request.arrival_time)
                st.status = Status.RUNNING
            if not st.sent_to_device:
                inp.new_requests.append(self._new_request(st))
                st.sent_to_device = True
            inp.scheduled.append(sr)
            self.tokens_by_cache_type[st.cache_type] += dec.num_new_tokens
        plan.scheduled = placed
        return inp, shape

    def _switch_cache_type(self, q: _DeviceQueues, st: RequestState, ct: CacheType) -> bool:
        """Give the request a new kind of cache. One holding nothing just changes type and may run
        in this iteration (False); otherwise its cache (worker state too) is discarded and it is
        queued first, to recompute every known token (True: not run in this iteration)."""
        holds = st.num_computed > 0 or q.pool.num_blocks_of(st.req_id) > 0
        q.pool.geometry.blocks_per_token_block(ct)          # ValueError if the pool cannot hold it
        if self.cfg.bidirectional and ct is not CacheType.KV:
            raise ValueError("cache_type: bidirectional blocks hold KV caches only")
        q.pool.free(st.req_id)
        if st.req_id in q.reset_ids:
            q.reset_ids.remove(st.req_id)
        if st.req_id in q.running:
            q.running.remove(st.req_id)
            q.waiting.appendleft(st.req_id)
        st.status, st.num_computed, st.cache_type = Status.WAITING, 0, ct
        if st.sent_to_device:
            q.finished_ids.append(st.req_id)
            st.sent_to_device = False
        return holds

    def _place(self, q: _DeviceQueues, st: RequestState, dec, inp: StepInput,
               planned: set[str]) -> ScheduledRequest | None:
        """Grow the request's cache for this step: whole blocks, or slots of bidirectional blocks
        (dropping other requests to the CPU when an RT request finds no slot; None = skip it)."""
        tokens = st.num_computed + dec.num_new_tokens
        if not self.cfg.bidirectional:
            alloc = q.pool.grow(st.req_id, tokens, st.cache_type)
            if alloc is None:
                raise AssertionError(f"policy over-committed blocks for {st.req_id}")
            return ScheduledRequest(st.req_id, dec.phase, dec.num_new_tokens, alloc.block_ids,
                                    alloc.directions, dec.sample)
        rt = st.request.service_class is ServiceClass.RT
        g = q.pool.grow(st.req_id, tokens, rt)
        while g is None and rt:
            victim = self._drop_victim(q, planned)
            if victim is None:
                break
            inp.checkpoints.extend(q.pool.drop(victim))
            g = q.pool.grow(st.req_id, tokens, rt)
        if g is None:
            return None
        inp.checkpoints.extend(g.checkpoints)
        inp.swap_ins.extend(g.swap_ins)
        return ScheduledRequest(st.req_id, dec.phase, dec.num_new_tokens, [], [], dec.sample, new_slots=g.slots)

    def _drop_victim(self, q: _DeviceQueues, planned: set[str]) -> str | None:
        """Who goes to the CPU whole when an RT request finds no slot: BE first (latest arrival
        first), then RT by the largest residual time; never one planned for this step."""
        now = self.clock()
        held = [self.states[r] for r in q.running if r not in planned and q.pool.num_blocks_of(r)]
        be = [s for s in held if s.request.service_class is ServiceClass.BE]
        if be:
            return max(be, key=lambda s: s.request.arrival_time).req_id
        def residual(s):
            r = s.request
            slo = r.slo_tbt_s if s.output_token_ids else r.slo_ttft_s
            return math.inf if slo is None else slo - (now - (s.last_token_time or r.arrival_time))
        # requests that already missed their TTFT go first: they can no longer meet their SLO
        return max(held, key=lambda s: (_missed_ttft(s, now), residual(s))).req_id if held else None

    def _new_request(self, st: RequestState) -> NewRequest:
        sp = st.request.sampling
        stop_ids = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else self.eos_ids)
        spec = SamplingSpec(float(sp.temperature), float(sp.top_p), sp.top_k, st.seed,
                            sp.min_tokens, stop_ids)
        return NewRequest(st.req_id, st.all_token_ids(), len(st.request.prompt_token_ids),
                          st.cache_type, spec)

    def _account(self, plan: Plan, out: StepOutput) -> list[Update]:
        now = self.clock()
        for dec in plan.scheduled:
            st = self.states[dec.req_id]
            if st.status is Status.RUNNING:
                st.num_computed += dec.num_new_tokens
        updates = []
        for rid, tok in out.sampled.items():
            st = self.states[rid]
            if st.status is not Status.RUNNING:
                continue
            st.output_token_ids.append(tok)
            st.last_token_time = now
            if st.first_token_time is None:
                st.first_token_time = now
            reason = check_stop(st, self.eos_ids, self.max_model_len, self.detokenize)
            if reason is not None:
                updates.append(self._finish(st, reason, new=[tok]))
            else:
                updates.append(Update(rid, [tok]))
        return updates

    def _finish(self, st: RequestState, reason: FinishReason, new: list[int] | None = None,
                error: str | None = None) -> Update:
        q = self.queues[st.device]
        q.pool.free(st.req_id)
        if st.status is Status.RUNNING:
            q.running.remove(st.req_id)
        elif st.status is Status.WAITING:
            q.waiting.remove(st.req_id)
        if st.sent_to_device:
            q.finished_ids.append(st.req_id)
        st.status, st.finish_reason, st.error = Status.FINISHED, reason, error
        self.states.pop(st.req_id, None)          # the caller keeps its RequestState if it wants it
        queue_s = (st.first_scheduled_time - st.request.arrival_time
                   if st.first_scheduled_time is not None else None)
        return Update(st.req_id, new or [], reason, error, st.stop_text_end, queue_s)

    def _fail_device(self, d: int, why: str) -> list[Update]:
        q = self.queues[d]
        q.dead = why
        victims = [self.states[r] for r in [*q.running, *q.waiting]]
        return [self._finish(st, FinishReason.ERROR, error=why) for st in victims]

    def check_invariants(self) -> None:
        for q in self.queues:
            q.pool.check_invariants()
            held = {r for r in q.running}
            for r in q.waiting:
                if q.pool.num_blocks_of(r):
                    raise AssertionError(f"waiting request {r} holds blocks")
            if any(self.states[r].status is not Status.RUNNING for r in held):
                raise AssertionError("running list holds a non-running request")


def _missed_ttft(st: RequestState, now: float) -> bool:
    """Has this RT request's first token come, or can it now only come, after its TTFT target?"""
    r = st.request
    if r.slo_ttft_s is None or r.service_class is not ServiceClass.RT:
        return False
    return (st.first_token_time or now) - r.arrival_time > r.slo_ttft_s
