"""DeviceActor: one device's books and the phases of its steps.

A device actor owns the requests placed on its device, their RT/BE queues, its block pool and
its policy instance. One step is three phases, each a method:

    intake   add() / abort() / detach() / attach()   (arrivals, cancellations, migrations)
    plan     snapshot -> policy(snapshot) -> apply the plan to the block books -> StepInput
    account  StepOutput -> tokens, text, stops -> Updates

Nothing here waits or runs threads: ``sched.runtime`` drives each actor on its own thread
against its worker, and ``Scheduler.step`` drives all of them in lock-step (the simulator and
the start-up profiles). Only the thread driving an actor may call it.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Callable

from tandem.cache import Allocation, BlockPool, PoolGeometry
from tandem.cache.bidir import BidirBlockPool
from tandem.cache.host_pool import HostPool
from tandem.cache.prefix import Key, block_keys
from tandem.engine.grammar import compile_grammar
from tandem.engine.messages import (AdapterWeights, CacheImport, CacheType, Command, LoraRef, NewRequest, Offload,
                                    Phase, SamplingSpec, ScheduledRequest, StepInput, StepOutput)
from tandem.sched.cost_model import OnlineCostModel, StepShape
from tandem.sched.detok import Decoder, TextTracker
from tandem.sched.policy import Candidate, Limits, Plan, Snapshot
from tandem.sched.request import FinishReason, Migration, RequestState, ServiceClass, Status, error_id
from tandem.sched.steplog import StepLog, StepRecord

log = logging.getLogger("tandem.actor")
KEPT_ADAPTERS = 8     # LoRA adapters a worker keeps, unused ones included, before unused ones are dropped


def _queued(st: RequestState) -> float | None:
    """Seconds from the request's arrival to its first being scheduled, once it was."""
    return st.first_scheduled_time - st.request.arrival_time if st.first_scheduled_time is not None else None


@dataclass(slots=True)
class Update:
    """What happened to one request in a step (new tokens and/or its end)."""
    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""                    # new text safe to show (held back: a possible stop string start)
    queue_s: float | None = None      # with the first token and at the end: seconds from arrival to first scheduled
    logprobs: list | None = None      # TokenLogprobs of new_token_ids, when the request asked for them
    prompt_logprobs: list | None = None   # with the first token: each prompt token's (None first), if asked
    cached_tokens: int = 0            # at the end: prompt tokens it found in the prefix cache when it started
    stop_reason: str | int | None = None  # at the end: the stop string or stop token id that ended it


@dataclass(slots=True)
class Pending:
    """A step handed to the device, waiting for its StepOutput."""
    inp: StepInput
    plan: Plan
    shape: StepShape
    started: float                    # clock when it was planned


@dataclass(frozen=True, slots=True)
class SwapConfig:
    """Swapping preempted requests' caches to the host instead of recomputing them (ALISE)."""
    space_bytes: int                  # host memory for swapped caches, per device
    int8: bool                        # compress them to int8 on the way out (engine.kvquant)


@dataclass(slots=True)
class ActorConfig:
    """What an actor needs of the scheduler's configuration (see sched.scheduler.SchedConfig)."""
    limits: Limits
    bidirectional: bool
    cache_type: CacheType
    swap: SwapConfig | None = None    # None: preempted requests recompute
    prefix_caching: bool = False      # reuse full KV blocks of equal token prefixes (cache.prefix)


class DeviceActor:
    def __init__(self, index: int, device, cfg: ActorConfig, policy, eos_ids: tuple[int, ...],
                 max_model_len: int, decoder: Callable[[bool], Decoder] | None,
                 clock: Callable[[], float] = time.monotonic, cost: OnlineCostModel | None = None):
        self.index = index
        self.device = device              # the worker handle (Device protocol)
        self.cfg = cfg
        self.policy = policy
        self.cost = cost                  # refined from every measured step when given
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.decoder = decoder            # decoder(skip_special_tokens) -> Decoder; None: no text
        self.clock = clock
        self.pool = self.new_pool(PoolGeometry.of(device.pool_info))
        self.states: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []      # sorted by arrival
        self._new: list[NewRequest] = []
        self._reset_ids: list[str] = []
        self._finished_ids: list[str] = []
        self._imports: list[CacheImport] = []
        self._offloads: list[Offload] = []
        self._adapters_sent: set[LoraRef] = set()    # the LoRA adapters the worker holds
        self.host = HostPool(cfg.swap.space_bytes) if cfg.swap is not None else None
        self.swap_bytes: Counter = Counter()       # bytes moved to ("out") and back from ("in") the host
        self.swaps: Counter = Counter()            # caches swapped "out", back "in", "evicted" to recompute
        self.leaving: dict[str, RequestState] = {}   # migrated out with their cache: blocks held
                                                     # until the destination has imported it
        self.moves: deque[Migration] = deque(maxlen=4096)  # migrations that arrived here, measured
        self.moves_total = 0
        self.moved_out: Counter = Counter()        # migrations that left here, by Transfer (each once)
        self._texts: dict[str, TextTracker] = {}
        self.dead: str | None = None      # why this device no longer serves
        self.t_avg = 0.0                  # EWMA of iteration wall time (BROS's T_avg)
        self.step_id = 0
        self.last_plan = Plan()
        self.first_waits: tuple = ()          # first_token_waits of the last plan's snapshot (admission)
        self.waiting_be = 0                   # BE requests waiting once the last plan was applied (admission)
        self.num_preemptions = 0
        self.preemptions_by_class: Counter = Counter()
        self.preemption_reasons: Counter = Counter()   # the policy's reason for each preemption
        self.start_reasons: Counter = Counter()        # its reason for each start or resumption
        self.tokens_by_cache_type: Counter = Counter()
        self.tokens_by_phase: Counter = Counter()  # (ServiceClass, Phase) -> tokens computed
        self.steps: deque[tuple[float, int]] = deque(maxlen=1024)   # (seconds, tokens) of recent steps
        self.steps_total = 0
        self.cache_switches: Counter = Counter()   # type changes that discarded a cache, by new type
        self.step_log: list[tuple[StepShape, float]] | None = None   # set to a list to record steps
        self.trace: StepLog | None = None   # every step written out (LLM.log_steps)
        self._keys: dict[str, list[Key]] = {}     # prefix caching: each request's token-block keys
        self._hits: dict[str, int] = {}           # waiting requests' cached token-blocks, this plan
        self.prefix_tokens: Counter = Counter()   # prompt tokens "queried" at admission, and cache "hits"
        self.prefix_routed = 0                    # arrivals sent here because this cache held their prompt's start

    def new_pool(self, g: PoolGeometry) -> BlockPool:
        return BidirBlockPool(g) if self.cfg.bidirectional else BlockPool(g, self.cfg.prefix_caching)

    # ---- intake ------------------------------------------------------------------
    def add(self, st: RequestState) -> None:
        st.device = self.index
        self.states[st.req_id] = st
        self.waiting.append(st.req_id)
        if self.decoder is not None and (st.request.stream_text or st.request.sampling.stop):
            sp = st.request.sampling
            self._texts[st.req_id] = TextTracker(self._decoder(sp), sp.stop, sp.include_stop_str_in_output)

    def _decoder(self, sp) -> Decoder:
        """Ids to text as the request asks: special tokens' text skipped, or kept."""
        return self.decoder(sp.skip_special_tokens)

    def abort(self, req_id: str) -> Update | None:
        st = self.states.get(req_id)
        if st is None or st.status is Status.FINISHED:
            return None
        return self._finish(st, FinishReason.ABORT)

    def detach(self, req_id: str, keep_cache: bool = False) -> RequestState | None:
        """Take a request off this device to place it elsewhere; its text tracking goes with it.
        Its cache is dropped here (the destination recomputes prompt + generated tokens), or with
        ``keep_cache`` its blocks stay held (``leaving``) until ``release``: the destination
        confirms it has imported the exported copy."""
        st = self.states.pop(req_id, None)
        if st is None:
            return None
        self._keys.pop(req_id, None)
        if keep_cache:
            self.running.remove(req_id)
            self.leaving[req_id] = st
        else:
            self._drop(st)
            st.status, st.num_computed, st.sent_to_device, st.cache_exact = Status.WAITING, 0, False, True
        st.text = self._texts.pop(req_id, None)
        return st

    def can_export(self, req_id: str) -> bool:
        """Can this request leave with its cache? (It holds computed tokens on a whole-block pool;
        bidirectional blocks share slots with other owners, so those requests move as tokens.)"""
        st = self.states.get(req_id)
        return (st is not None and st.status is Status.RUNNING and st.num_computed > 0
                and st.sent_to_device and not self.pool.preempts_blocks)

    def export_input(self, req_id: str) -> StepInput:
        """A step that only copies the request's cache out (StepOutput.exported), carrying the
        worker messages that are due."""
        return self._due_input(exports=[req_id])

    def _due_input(self, **kw) -> StepInput:
        """A StepInput carrying the worker messages that are due (new, reset, finished requests and
        imported caches); they are handed over, not kept."""
        inp = StepInput(Command.STEP, self.step_id, self._new, [], self._reset_ids, self._finished_ids,
                        imports=self._imports, offloads=self._offloads, **kw)
        self._new, self._reset_ids, self._finished_ids, self._imports = [], [], [], []
        self._offloads = []
        return inp

    def release(self, req_id: str) -> None:
        """The destination has the cache of a request that left: free its blocks here."""
        if self.leaving.pop(req_id, None) is not None:
            self.pool.free(req_id)
            self._finished_ids.append(req_id)

    def attach(self, st: RequestState, rows: object | None = None) -> bool:
        """Place a request detached from another device. With its exported cache ``rows``, blocks
        for its computed tokens are reserved here and it continues where it stopped (True); when
        they do not fit, or without rows, it waits first in line to recompute (False). One that
        left here with its cache and comes back before the release reached here frees those
        blocks first: its next device has (or has dropped) the copy."""
        if st.req_id in self.leaving:
            self.release(st.req_id)
        st.device = self.index
        self.states[st.req_id] = st
        if st.text is not None:
            self._texts[st.req_id] = st.text
            st.text = None
        p = None
        if rows is not None and not self.pool.preempts_blocks:
            p = self.pool.place(st.req_id, st.num_computed, st.cache_type,
                                st.request.service_class is ServiceClass.RT)
        if p is None:
            st.status, st.num_computed, st.sent_to_device, st.cache_exact = Status.WAITING, 0, False, True
            self.waiting.appendleft(st.req_id)
            return False
        st.status, st.sent_to_device = Status.RUNNING, True
        self._insert_running(st.req_id)
        self._new.append(self._new_request(st))
        self._imports.append(CacheImport(st.req_id, st.num_computed, p.block_ids, p.directions, rows))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_messages(self) -> bool:
        """Worker state to update even with nothing to run (finished or reset requests)."""
        return bool(self._new or self._reset_ids or self._finished_ids or self._imports or self._offloads)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def chat_wait_targets(self) -> float:
        """The longest an RT request of the last plan still without its first token has waited,
        in its own TTFT targets, as of now: a step of many seconds (a long prompt chunk on a CPU)
        keeps it waiting all that time, so its wait is not the one it had when the step was
        planned. One that has left since (ended, failed, moved away) or got its first token no
        longer counts: a device left idle plans nothing more. Read from other threads."""
        states = self.states
        live = tuple((arrival, target) for rid, arrival, target in self.first_waits
                     if (st := states.get(rid)) is not None and not st.output_token_ids)
        return wait_targets(live, self.clock())

    # ---- plan ----------------------------------------------------------------------
    def plan(self) -> Pending | None:
        """Plan one step; None when there is nothing to tell the device."""
        self.step_id += 1
        t0 = self.clock()
        self._hits = self._cached_prefixes()
        snap = self.snapshot() if self.has_work() else None
        plan = self.policy(snap) if snap is not None else Plan()
        self.last_plan = plan                   # why each request waits or runs (status endpoint)
        self.first_waits = first_token_waits(snap)
        inp, shape = self._apply(plan)
        self.waiting_be = sum(self.states[r].request.service_class is ServiceClass.BE for r in self.waiting)
        if (inp.scheduled or inp.finished_ids or inp.reset_ids or inp.new_requests or inp.imports
                or inp.offloads):
            self._send_adapters(inp)
            return Pending(inp, plan, shape, t0)
        return None

    def _send_adapters(self, inp: StepInput) -> None:
        """The LoRA adapters of the step's new requests that the worker lacks go with them; past
        KEPT_ADAPTERS held, those no request here runs with are dropped there (looked for only
        when one is sent: the requests are not scanned at every step)."""
        for nr in inp.new_requests:
            if nr.lora is not None and nr.lora not in self._adapters_sent:
                inp.adapters.append(AdapterWeights(nr.lora, self.states[nr.req_id].request.adapter.weights))
                self._adapters_sent.add(nr.lora)
        if inp.adapters and len(self._adapters_sent) > KEPT_ADAPTERS:
            used = {st.request.lora for st in self.states.values()}
            inp.drop_adapters = [ref for ref in self._adapters_sent if ref not in used]
            self._adapters_sent -= set(inp.drop_adapters)

    def snapshot(self) -> Snapshot:
        now = self.clock()
        pool = self.pool
        promised = self._promised()

        def cand(rid):
            st = self.states[rid]
            r = st.request
            slo = r.slo_tbt_s if st.output_token_ids else r.slo_ttft_s
            hit = self._hits.get(rid, 0)
            computed = st.num_computed or hit * pool.geometry.block_size
            # a cached prefix's blocks that running requests hold cost it nothing: as if its own
            own = pool.num_blocks_of(rid)
            blocks = own or (pool.shared_blocks(self._keys[rid][:hit]) if hit else 0)
            return Candidate(rid, st.num_tokens, computed, blocks, r.arrival_time,
                             r.service_class is ServiceClass.RT, slo, now - (st.last_token_time or r.arrival_time),
                             pool.num_cpu(rid), missed_ttft(st, now), st.cache_type, len(st.output_token_ids),
                             r.predicted_len, st.stalled_s,
                             None if st.first_token_time is None else now - st.first_token_time,
                             r.predicted_spread,
                             min(r.sampling.max_tokens, self.max_model_len - len(r.prompt_token_ids)),
                             pool.foreign_slots(rid), self._kept(rid, promised) if own else blocks,
                             self.host.bytes_of(rid) if self.host is not None else 0, r.lora)
        g = pool.geometry
        return Snapshot([cand(r) for r in self.running], [cand(r) for r in self.waiting],
                        pool.num_free, g.block_size, g.blocks_per_token_block(CacheType.KV),
                        self.cfg.limits, self.t_avg, pool.num_be_only, pool.preempts_blocks, g.hidden_blocks,
                        pool.num_rt_with_room)

    def _promised(self) -> set[int]:
        """Blocks a running request holds that a waiting request's cached prefix counts on at no
        cost (``Candidate.num_blocks``)."""
        if not self._hits:
            return set()
        pool = self.pool
        keys: set[Key] = set()          # waiting requests share prompt starts: each key once
        for rid, hit in self._hits.items():
            if hit and not pool.num_blocks_of(rid):
                keys.update(self._keys[rid][:hit])
        return pool.held_ids(keys)

    def _kept(self, rid: str, promised: set[int]) -> int:
        """Of a running request's blocks, those that preempting it would not give back as free
        blocks for the plan: those other requests share, and those a waiting request's cached
        prefix counts as costing it nothing. Counting the latter as freed too would count the
        same blocks twice, once as room and once as the newcomer's own."""
        if not promised:                # (only a whole-block pool with prefix caching promises any)
            return self.pool.num_shared(rid)
        return len(set(self.pool.shared_ids(rid)) | (promised & set(self.pool.table(rid))))

    def _apply(self, plan: Plan) -> tuple[StepInput, StepShape]:
        """Carry out the plan in the bookkeeping; describe it to the device (and its cost shape)."""
        self._switch_types(plan)
        self._preempt([self.states[r] for r in plan.preempted], plan.ewt,
                      frozenset(d.req_id for d in plan.scheduled))
        for r in plan.preempted:
            self.preemption_reasons[reason_kind(plan.reasons.get(r, "preempted"))] += 1
        inp = self._due_input()
        shape = StepShape()
        placed, adapters = [], set()
        swapped_in = self.swap_bytes["in"]
        # RT grows first (a pool that preempts blocks lets RT take BE slots, never the reverse)
        decisions = sorted(plan.scheduled, key=lambda d: self.states[d.req_id].request.service_class
                           is not ServiceClass.RT)
        planned = {d.req_id for d in decisions}
        cached = self._attach_prefixes(decisions)
        for dec in decisions:
            st = self.states[dec.req_id]
            sr = self._place(st, dec, inp, planned, cached.get(dec.req_id))
            if sr is None:
                continue
            placed.append(dec)
            if st.request.lora is not None:
                adapters.add(st.request.lora)
            hidden = self.pool.geometry.blocks_for(st.num_computed) if st.cache_type is CacheType.HIDDEN else 0
            shape = shape.add(dec.num_new_tokens, st.num_computed + dec.num_new_tokens,
                              dec.phase is Phase.DECODE, hidden, lora=st.request.lora is not None)
            if st.status is Status.WAITING:
                self.start_reasons[reason_kind(plan.reasons.get(dec.req_id, "scheduled"))] += 1
            self._start(st)
            if not st.sent_to_device:
                inp.new_requests.append(self._new_request(st))
                st.sent_to_device = True
            inp.scheduled.append(sr)
            self.tokens_by_cache_type[st.cache_type] += dec.num_new_tokens
            self.tokens_by_phase[st.request.service_class, dec.phase] += dec.num_new_tokens
        plan.scheduled = placed
        self._hits = {}
        return inp, replace(shape, swap_in_bytes=self.swap_bytes["in"] - swapped_in, adapters=len(adapters))

    # ---- prefix caching ---------------------------------------------------------------------
    def _keys_of(self, st: RequestState, num_tokens: int) -> list[Key]:
        """The request's token-block keys, covering at least the full blocks among its first
        num_tokens tokens (computed once, extended as its tokens grow)."""
        keys = self._keys.setdefault(st.req_id, [])
        if len(keys) < num_tokens // self.pool.geometry.block_size:
            block_keys(st.all_token_ids(), self.pool.geometry.block_size, keys, num_tokens, st.request.prefix_salt)
        return keys

    def _cached_prefixes(self) -> dict[str, int]:
        """Token-blocks of each waiting request that starts from nothing (a new KV request, or
        one preempted to recompute) that this pool has cached. At least its last token is left
        to compute: the step that computes it also samples. A request that asks for its prompt's
        log probabilities computes every token."""
        if self.pool.prefix is None:
            return {}
        hits = {}
        for rid in self.waiting:
            st = self.states[rid]
            if (st.num_computed or st.cache_type is not CacheType.KV
                    or st.request.sampling.prompt_logprobs is not None):
                continue
            last = st.num_tokens - 1
            n = self.pool.cached_prefix(self._keys_of(st, last), last // self.pool.geometry.block_size)
            if n:
                hits[rid] = n
        return hits

    def _attach_prefixes(self, decisions) -> dict[str, Allocation]:
        """Before anything grows in this step (growing may take idle cached blocks), the requests
        scheduled from a cached prefix take its blocks and start with those tokens computed;
        their blocks by request. Every request that starts from nothing and looks the cache up
        counts its tokens as queried, and the cached ones as hits (one that scores its prompt
        looks nothing up, and counts nothing, as vLLM's)."""
        if self.pool.prefix is None:
            return {}
        out = {}
        for dec in decisions:
            st = self.states[dec.req_id]
            if (st.num_computed or st.status is not Status.WAITING or st.cache_type is not CacheType.KV
                    or st.request.sampling.prompt_logprobs is not None):
                continue
            n = self._hits.get(st.req_id, 0)
            self.prefix_tokens["queried"] += st.num_tokens
            if st.cached_tokens is None:
                st.cached_tokens = n * self.pool.geometry.block_size
            if not n:
                continue
            out[st.req_id] = self.pool.attach(st.req_id, self._keys[st.req_id][:n])
            st.num_computed = n * self.pool.geometry.block_size
            self.prefix_tokens["hits"] += st.num_computed
        return out

    def _name_computed(self, st: RequestState) -> None:
        """After a step: the request's full computed token-blocks become findable by their keys."""
        full = st.num_computed // self.pool.geometry.block_size
        if st.cache_exact and full > self.pool.num_named(st.req_id):
            self.pool.name_full(st.req_id, self._keys_of(st, st.num_computed)[:full])

    def _switch_types(self, plan: Plan) -> None:
        switched = set()
        for rid, ct in plan.cache_types.items():
            st = self.states[rid]
            # one planned from a cached prefix it no longer takes starts in a later iteration
            if st.cache_type is not ct and (self._switch_cache_type(st, ct) or self._hits.pop(rid, 0)):
                switched.add(rid)     # planned again next iteration, from its first token
                self.cache_switches[ct] += 1
        if switched:
            plan.scheduled = [d for d in plan.scheduled if d.req_id not in switched]
            plan.preempted = [r for r in plan.preempted if r not in switched]

    def _preempt(self, preempted: list[RequestState], ewt: dict[str, float],
                 planned: frozenset[str] = frozenset()) -> None:
        """Preempted requests give their blocks back and wait first in line; with swapping, those
        the host pool takes keep their cache there (and their computed tokens), the others
        recompute. Swapped requests ``planned`` for this step keep theirs."""
        swapped = self._swap_out(preempted, ewt, planned)
        for st in preempted:
            self.pool.free(st.req_id)
            self.running.remove(st.req_id)
            st.status = Status.WAITING
            st.num_preemptions += 1
            self.num_preemptions += 1
            self.preemptions_by_class[st.request.service_class] += 1
            if st.req_id not in swapped:
                self._lose_cache(st)
        for st in sorted(preempted, key=lambda s: s.request.arrival_time, reverse=True):
            self.waiting.appendleft(st.req_id)

    def _lose_cache(self, st: RequestState) -> None:
        """A waiting request will recompute every token (the worker forgets its cache)."""
        st.num_computed, st.cache_exact = 0, True
        self._cancel_import(st)
        if st.sent_to_device:
            self._reset_ids.append(st.req_id)

    # ---- swapping ------------------------------------------------------------------
    def _swap_out(self, preempted: list[RequestState], ewt: dict[str, float],
                  planned: frozenset[str]) -> set[str]:
        """Offer the preempted requests' caches to the host pool, those expected back soonest
        first (EWT; arrival order when the policy gives none); which ones it took."""
        if self.host is None:
            return set()
        pending = self.pending_imports()
        taken = set()
        key = {st.req_id: ewt.get(st.req_id, st.request.arrival_time) for st in preempted}
        for st in sorted(preempted, key=lambda s: key[s.req_id]):
            if not st.num_computed or not st.sent_to_device or st.req_id in pending:
                continue
            nbytes = self._host_bytes(st)
            evicted = self.host.admit(st.req_id, nbytes, key[st.req_id], planned)
            if evicted is None:
                continue
            for r in evicted:            # expected to wait longer: they recompute instead
                self._lose_cache(self.states[r])
                self.swaps["evicted"] += 1
            self._offloads.append(Offload(st.req_id, st.num_computed, self.cfg.swap.int8))
            self.swap_bytes["out"] += nbytes
            self.swaps["out"] += 1
            taken.add(st.req_id)
        return taken

    def _host_bytes(self, st: RequestState) -> int:
        info = self.device.pool_info
        per_block = info.int8_block_bytes if self.cfg.swap.int8 else info.block_bytes
        return self.pool.geometry.blocks_for(st.num_computed, st.cache_type) * per_block

    def _swap_in(self, st: RequestState, inp: StepInput) -> None:
        """A swapped request got its blocks back: its cache is uploaded before the forward. Back
        from int8, it holds values near its own, not equal: nothing it computes from them is
        offered to other requests' prefixes until it recomputes."""
        if self.host is not None and st.req_id in self.host:
            self.swap_bytes["in"] += self.host.release(st.req_id)
            self.swaps["in"] += 1
            inp.uploads.append(st.req_id)
            if self.cfg.swap.int8:
                st.cache_exact = False

    def _release_host(self, st: RequestState) -> None:
        if self.host is not None:
            self.host.release(st.req_id)

    def _start(self, st: RequestState) -> None:
        if st.status is Status.WAITING:
            if st.first_scheduled_time is None:
                st.first_scheduled_time = self.clock()
            self.waiting.remove(st.req_id)
            self._insert_running(st.req_id)
            st.status = Status.RUNNING

    def _insert_running(self, rid: str) -> None:
        bisect.insort(self.running, rid, key=lambda r: self.states[r].request.arrival_time)

    def _switch_cache_type(self, st: RequestState, ct: CacheType) -> bool:
        """Give the request a new kind of cache. One holding nothing just changes type and may run
        in this iteration (False); otherwise its cache (worker state too) is discarded and it is
        queued first, to recompute every known token (True: not run in this iteration)."""
        holds = st.num_computed > 0 or self.pool.num_blocks_of(st.req_id) > 0
        self.pool.check_cache_type(ct)          # ValueError if the pool cannot hold it
        self._start_over(st)
        st.cache_type = ct
        return holds

    def _start_over(self, st: RequestState) -> None:
        """The request loses its cache here, in the host pool and on the worker (which forgets
        it, to hear of it again as new), and waits to recompute every token it has: first in
        line if it was running, where it was if it was waiting."""
        self.pool.free(st.req_id)
        self._release_host(st)
        if st.req_id in self._reset_ids:
            self._reset_ids.remove(st.req_id)
        if st.req_id in self.running:
            self.running.remove(st.req_id)
            self.waiting.appendleft(st.req_id)
        st.status, st.num_computed, st.cache_exact = Status.WAITING, 0, True
        self._cancel_import(st)
        if st.sent_to_device:
            self._finished_ids.append(st.req_id)
            st.sent_to_device = False

    def _place(self, st: RequestState, dec, inp: StepInput, planned: set[str],
               cached: Allocation | None = None) -> ScheduledRequest | None:
        """Grow the request's cache for this step (None = skip it this step). Where the pool
        preempts blocks, an RT request that finds no room sends other requests to the CPU whole
        until it fits; elsewhere the policy has already made room. ``cached``: the blocks of a
        cached prefix it took in this step, sent to the worker first."""
        tokens = st.num_computed + dec.num_new_tokens
        rt = st.request.service_class is ServiceClass.RT
        p = self.pool.place(st.req_id, tokens, st.cache_type, rt)
        while p is None and rt and self.pool.preempts_blocks:
            victim = self._drop_victim(planned)
            if victim is None:
                break
            inp.checkpoints.extend(self.pool.drop(victim))
            p = self.pool.place(st.req_id, tokens, st.cache_type, rt)
        if p is None:
            if not self.pool.preempts_blocks:
                raise AssertionError(f"policy over-committed blocks for {st.req_id}")
            return None
        inp.checkpoints.extend(p.checkpoints)
        inp.swap_ins.extend(p.swap_ins)
        self._swap_in(st, inp)
        if cached is not None:
            return ScheduledRequest(st.req_id, dec.phase, dec.num_new_tokens, cached.block_ids + p.block_ids,
                                    cached.directions + p.directions, dec.sample, num_cached=st.num_computed)
        return ScheduledRequest(st.req_id, dec.phase, dec.num_new_tokens, p.block_ids, p.directions,
                                dec.sample, new_slots=p.slots)

    def _drop_victim(self, planned: set[str]) -> str | None:
        """Who goes to the CPU whole when an RT request finds no slot: BE first (latest arrival
        first), then RT by the largest residual time; never one planned for this step."""
        now = self.clock()
        held = [self.states[r] for r in self.running if r not in planned and self.pool.num_blocks_of(r)]
        be = [s for s in held if s.request.service_class is ServiceClass.BE]
        if be:
            return max(be, key=lambda s: s.request.arrival_time).req_id

        def residual(s):
            r = s.request
            slo = r.slo_tbt_s if s.output_token_ids else r.slo_ttft_s
            return math.inf if slo is None else slo - (now - (s.last_token_time or r.arrival_time))
        # requests that already missed their TTFT go first: they can no longer meet their SLO
        return max(held, key=lambda s: (missed_ttft(s, now), residual(s))).req_id if held else None

    def _new_request(self, st: RequestState) -> NewRequest:
        sp = st.request.sampling
        stop_ids = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else self.eos_ids)
        spec = SamplingSpec(float(sp.temperature), float(sp.top_p), sp.top_k, st.seed,
                            sp.min_tokens, stop_ids, -1 if sp.logprobs is None else sp.logprobs,
                            -1 if sp.prompt_logprobs is None else sp.prompt_logprobs,
                            tuple(sorted((sp.logit_bias or {}).items())), float(sp.presence_penalty),
                            float(sp.frequency_penalty), float(sp.repetition_penalty),
                            compile_grammar(sp.structured_outputs) if sp.structured_outputs else "",
                            float(sp.min_p), tuple(sp.allowed_token_ids or ()), st.request.bad_words_ids)
        return NewRequest(st.req_id, st.all_token_ids(), len(st.request.prompt_token_ids),
                          st.cache_type, spec, st.request.lora)

    # ---- account -----------------------------------------------------------------
    def account(self, p: Pending, out: StepOutput) -> list[Update]:
        """Fold a step's results into the books; one Update per request that changed."""
        now = self.clock()
        if p.inp.scheduled:
            trace = self.trace            # LLM.log_steps may swap it from another thread
            if trace is not None:
                trace.write(self._record(p, now))
            self.observe(p.shape, now - p.started)
        for dec in p.plan.scheduled:
            st = self.states.get(dec.req_id)
            if st is not None and st.status is Status.RUNNING:
                st.num_computed += dec.num_new_tokens
                if st.cache_type is CacheType.KV and self.pool.prefix is not None:
                    self._name_computed(st)
        self._score_prompts(out)
        updates = []
        for rid, tok in out.sampled.items():
            st = self.states.get(rid)
            if st is None or st.status is not Status.RUNNING:
                continue
            st.output_token_ids.append(tok)
            lp = out.logprobs.get(rid)
            if lp is not None:
                st.output_logprobs.append(lp)
            st.stalled_s += max(0.0, now - (st.last_token_time or st.request.arrival_time) - self.t_avg)
            st.last_token_time = now
            if st.first_token_time is None:
                st.first_token_time = now
            if st.moving is not None:
                self._arrived(st.moving, now)
                st.moving = None
            try:
                updates.append(self._token_update(st, tok))
                updates[-1].logprobs = None if lp is None else [lp]
                if len(st.output_token_ids) == 1 and st.request.sampling.prompt_logprobs is not None:
                    updates[-1].prompt_logprobs = st.scored_prompt()
            except Exception:        # a bug in one request's stops or text: it alone fails
                eid = error_id()
                log.exception("%s: request %s failed on its new token (%s)", self.device.name, rid, eid)
                self._texts.pop(rid, None)
                updates.append(self.end_with_error(st, f"internal error while generating (error id {eid})"))
        return updates

    def _record(self, p: Pending, now: float) -> StepRecord:
        """The step log's line for step ``p`` (before its requests' books move on)."""
        decodes, prompt = Counter(), Counter()
        chunks = context = 0
        for sr in p.inp.scheduled:
            st = self.states.get(sr.req_id)
            if st is None:
                continue
            rt = st.request.service_class is ServiceClass.RT
            if sr.phase is Phase.DECODE:
                decodes[rt] += 1
            else:
                prompt[rt] += sr.num_new_tokens
                chunks += 1
                context = max(context, st.num_computed + sr.num_new_tokens)
        predicted = None if self.cost is None else self.cost(p.shape)
        return StepRecord(now, self.device.name, now - p.started, predicted, decodes[True], decodes[False],
                          prompt[True], prompt[False], chunks, context, p.shape)

    def _score_prompts(self, out: StepOutput) -> None:
        """Keep the prompt tokens' log probabilities a step computed, by position (a prompt
        computed again after a preemption writes the same values again)."""
        for rid, (first, lps) in out.prompt_logprobs.items():
            st = self.states.get(rid)
            if st is None or st.status is not Status.RUNNING:
                continue
            if not st.prompt_logprobs:
                st.prompt_logprobs = [None] * len(st.request.prompt_token_ids)
            st.prompt_logprobs[first:first + len(lps)] = lps

    def _arrived(self, move: Migration, now: float) -> None:
        """A migrated request produced its first token here: the pause it saw is measured."""
        move.pause_s = now - move.started
        self.moves.append(move)
        self.moves_total += 1

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.steps.append((seconds, shape.prefill_tokens + shape.decode_tokens))
        self.steps_total += 1
        if self.step_log is not None:
            self.step_log.append((shape, seconds))
        if self.cost is not None:
            self.cost.observe(shape, seconds)
        self.t_avg = seconds if self.t_avg == 0 else 0.9 * self.t_avg + 0.1 * seconds

    def _token_update(self, st: RequestState, tok: int) -> Update:
        """The new token's text and whether it ends the request. EOS and stop token ids count once
        min_tokens tokens exist; so do stop strings, searched only in text that is new. A request
        under a grammar samples EOS below min_tokens only when its grammar is complete: it ends.
        As in vLLM, the text of a token that ends the request (EOS or a stop token id) is left out
        unless include_stop_str_in_output; its id stays among the output's."""
        sp = st.request.sampling
        n = len(st.output_token_ids)
        armed = n >= sp.min_tokens
        eos = not sp.ignore_eos and tok in self.eos_ids
        ends = (eos and sp.structured_outputs is not None) or armed and (eos or tok in sp.stop_token_ids)
        silent = ends and not sp.include_stop_str_in_output
        text = ""
        tracker = self._texts.get(st.req_id)
        if tracker is not None and not silent:
            text = tracker.push([tok], check_stop=armed)
        if ends or armed and tracker is not None and tracker.stopped:
            # vLLM's stop_reason: the stop string or stop token id; none for the end token
            st.stop_reason = tracker.stopped if tracker is not None and tracker.stopped else \
                None if eos else tok
            return self._finish(st, FinishReason.STOP, [tok], text=text, silent_last=silent)
        if n >= sp.max_tokens or st.num_tokens >= self.max_model_len:
            return self._finish(st, FinishReason.LENGTH, [tok], text=text)
        return Update(st.req_id, [tok], text=text, queue_s=_queued(st) if n == 1 else None)

    def _finish(self, st: RequestState, reason: FinishReason, new: list[int] | None = None,
                error: str | None = None, text: str = "", silent_last: bool = False) -> Update:
        self._drop(st)
        st.status, st.finish_reason, st.error = Status.FINISHED, reason, error
        self.states.pop(st.req_id, None)          # the caller keeps its RequestState if it wants it
        tracker = self._texts.pop(st.req_id, None)
        if tracker is not None:
            text += tracker.finish()
            st.text_result = tracker.text()
        elif self.decoder is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            ids = st.output_token_ids[:-1] if silent_last else st.output_token_ids
            text = st.text_result = self._decoder(st.request.sampling).whole(ids)
        return Update(st.req_id, new or [], reason, error, text, _queued(st), cached_tokens=st.cached_tokens or 0,
                      stop_reason=st.stop_reason)

    def _drop(self, st: RequestState) -> None:
        """Free the request's blocks and take it off the queues (and off the worker)."""
        self.pool.free(st.req_id)
        self._keys.pop(st.req_id, None)
        self._release_host(st)
        if st.status is Status.RUNNING:
            self.running.remove(st.req_id)
        elif st.status is Status.WAITING:
            self.waiting.remove(st.req_id)
        self._cancel_import(st)
        if st.sent_to_device:
            self._finished_ids.append(st.req_id)

    def pending_imports(self) -> set[str]:
        """Requests whose imported cache has not reached the worker yet."""
        return {imp.req_id for imp in self._imports}

    def _cancel_import(self, st: RequestState) -> None:
        """A request that arrived with its cache and loses it before the import reached the
        worker (preempted, switched, ended): the worker never hears of it."""
        if any(imp.req_id == st.req_id for imp in self._imports):
            self._imports = [imp for imp in self._imports if imp.req_id != st.req_id]
            self._new = [nr for nr in self._new if nr.req_id != st.req_id]
            st.sent_to_device = False

    # ---- failures ----------------------------------------------------------------------
    def recover_step(self, inp: StepInput) -> None:
        """The worker raised somewhere in this step, so how much of it took effect is unknown.
        What is safe to repeat goes again (the requests it was to forget); the requests whose
        caches it imported, offloaded, reset or moved slots of without running them are
        forgotten there and recompute every token here. The step's scheduled requests are the
        caller's to fail."""
        ran = {s.req_id for s in inp.scheduled}
        self._adapters_sent -= {aw.ref for aw in inp.adapters}      # sent again with their next request
        self._finished_ids.extend(r for r in inp.finished_ids if r not in self._finished_ids)
        unsure = ([i.req_id for i in inp.imports] + [o.req_id for o in inp.offloads] + inp.reset_ids
                  + [c.req_id for c in inp.checkpoints + inp.swap_ins])
        for rid in dict.fromkeys(unsure):
            st = self.states.get(rid)
            if st is not None and rid not in ran:
                self._start_over(st)

    def fail(self, req_id: str, why: str) -> Update:
        """End one request with an error (the worker is told to drop it)."""
        return self.end_with_error(self.states[req_id], why)

    def fail_all(self, why: str) -> list[Update]:
        """End every request on this device with an error; each one ends, whatever the books."""
        return [self.end_with_error(st, why) for st in list(self.states.values())]

    def end_with_error(self, st: RequestState, why: str) -> Update:
        """End a request with an error. Should undoing its books raise (they may be what broke),
        it still leaves this device's states and queues, so its caller hears that it ended; the
        recovery that follows a broken book resets the rest (``requeue_all``)."""
        try:
            return self._finish(st, FinishReason.ERROR, error=why)
        except Exception:            # noqa: BLE001 -- logged; the request must still end
            log.exception("%s: ending %s with an error failed; it ends without its books",
                          self.device.name, st.req_id)
            return self.end_without_books(st, why)

    def end_without_books(self, st: RequestState, why: str) -> Update:
        """End a request with an error, touching none of the books that may be what broke (its
        blocks, host memory and worker copy): it only leaves this device's states, queues and
        text tracking."""
        self.states.pop(st.req_id, None)
        self._texts.pop(st.req_id, None)
        self._keys.pop(st.req_id, None)
        for queue in (self.running, self.waiting):
            if st.req_id in queue:
                queue.remove(st.req_id)
        st.status, st.finish_reason, st.error = Status.FINISHED, FinishReason.ERROR, why
        return Update(st.req_id, [], FinishReason.ERROR, why)

    def requeue_all(self, geometry: PoolGeometry) -> None:
        """A fresh worker replaced a dead one: every request waits again, to recompute its prompt
        and the tokens it has generated (the new worker knows none of them)."""
        self.pool = self.new_pool(geometry)
        self._new, self._reset_ids, self._finished_ids, self._imports = [], [], [], []
        self._offloads = []
        self._adapters_sent.clear()
        if self.host is not None:
            self.host.clear()
        self.leaving.clear()
        order = sorted(self.states.values(), key=lambda s: s.request.arrival_time)
        for st in order:
            st.status, st.num_computed, st.sent_to_device, st.cache_exact = Status.WAITING, 0, False, True
        self.running = []
        self.waiting = deque(st.req_id for st in order)

    @property
    def tokens_computed(self) -> int:
        """Tokens this device has run through the model, every cache type together."""
        return sum(self.tokens_by_cache_type.values())

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for r in self.waiting:
            if self.pool.num_blocks_of(r):
                raise AssertionError(f"waiting request {r} holds blocks")
            if self.states[r].num_computed and (self.host is None or r not in self.host):
                raise AssertionError(f"waiting request {r} counts computed tokens it does not hold")
        if self.host is not None:
            self.host.check_invariants()
            if any(r in self.host for r in self.running):
                raise AssertionError("a running request still holds host memory")
        if any(self.states[r].status is not Status.RUNNING for r in self.running):
            raise AssertionError("running list holds a non-running request")
        if self.leaving.keys() & self.states.keys():
            raise AssertionError("a request both here and leaving with its cache")


def reason_kind(why: str) -> str:
    """A policy's reason without its per-request details (the level and class ALISE appends), so
    reasons can be counted."""
    return why.split(" (level ", 1)[0]


def first_token_waits(snap: Snapshot | None) -> tuple[tuple[str, float, float], ...]:
    """(request, arrival, TTFT target) of each RT request in ``snap`` still without its first token."""
    if snap is None:
        return ()
    return tuple((c.req_id, c.arrival, c.slo_s) for c in (*snap.running, *snap.waiting)
                 if c.rt and c.num_output == 0 and c.slo_s)


def wait_targets(waits: tuple[tuple[float, float], ...], now: float) -> float:
    """The longest wait of ``first_token_waits`` at ``now``, in its own TTFT target (0 with none):
    (now - arrival) / target."""
    return max(((now - arrival) / target for arrival, target in waits), default=0.0)


def missed_ttft(st: RequestState, now: float) -> bool:
    """Has this RT request's first token come, or can it now only come, after its TTFT target?"""
    r = st.request
    if r.slo_ttft_s is None or r.service_class is not ServiceClass.RT:
        return False
    return (st.first_token_time or now) - r.arrival_time > r.slo_ttft_s
