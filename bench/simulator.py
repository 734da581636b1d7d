"""Simulator: the real sched/ and cache/ code driven by a cost model instead of a model forward.

``SimDevice`` implements the scheduler's Device protocol: it mirrors each
request's computed tokens from the StepInputs it receives, prices the step with
a CostModel (times a drawn measured/predicted ratio, when given) and advances a virtual clock;
all devices of a step start together and the step ends with the slowest. A request keeping a
hidden cache (Apt-Serve) adds ``rho`` seconds per KV block of the context it had before the
step (its K and V are projected again from the stored hidden states). Caches swapped to the host
and back (offloads, uploads) take their bytes over ``host_bw``: within the step, or with a side
link (a GPU worker's side stream) swap-outs beside the steps that follow (``_swap_seconds``).
Tokens are dummies (id 0, never a stop id).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from tandem.bench.metrics import RequestRecord
from tandem.bench.workloads import TraceItem
from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType, Phase, PoolInfo, StepInput, StepOutput
from tandem.engine.params import SamplingParams
from tandem.sched.cost_model import CostModel, OnlineCostModel, StepShape
from tandem.sched.request import Request, ServiceClass
from tandem.sched.scheduler import PRICED, SchedConfig, Scheduler


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class SimDevice:
    def __init__(self, name: str, geometry: PoolGeometry, cost: CostModel, clock: SimClock,
                 noise: tuple[float, ...] = (), seed: int = 0, noise_prefill: tuple[float, ...] = (),
                 rho: float = 0.0, block_bytes: tuple[int, int] = (0, 0), host_bw: float = 25e9,
                 side_link: bool = False):
        self.name, self.geometry, self.cost, self.clock = name, geometry, cost, clock
        self.pool_info = PoolInfo(geometry.num_blocks, geometry.block_size, geometry.hidden_blocks, *block_bytes)
        self.rho = rho
        self.host_bw = host_bw
        self.side_link = side_link
        self.link_free = 0.0        # when the swap-outs queued on the side link have all been copied
        self.host: dict[str, tuple[int, int]] = {}     # swapped out: req_id -> (tokens, bytes)
        self.hidden: set[str] = set()
        self.noise, self.noise_prefill = noise, noise_prefill or noise
        self.rng = random.Random(seed)
        self.computed: dict[str, int] = {}
        self._end = 0.0
        self._out: StepOutput | None = None

    def submit(self, inp: StepInput) -> None:
        for rid in inp.finished_ids:
            self.computed.pop(rid, None)
            self.hidden.discard(rid)
            self.host.pop(rid, None)
        for rid in inp.reset_ids:
            self.computed[rid] = 0
            self.host.pop(rid, None)
        for nr in inp.new_requests:
            self.computed[nr.req_id] = 0
            if nr.cache_type is CacheType.HIDDEN:
                self.hidden.add(nr.req_id)
        out_bytes = in_bytes = 0
        for off in inp.offloads:
            info = self.pool_info
            per_block = info.int8_block_bytes if off.int8 else info.block_bytes
            nbytes = self.geometry.blocks_for(off.num_tokens) * per_block
            self.host[off.req_id] = (off.num_tokens, nbytes)
            self.computed[off.req_id] = 0
            out_bytes += nbytes
        for rid in inp.uploads:
            self.computed[rid], nbytes = self.host.pop(rid)
            in_bytes += nbytes
        shape, sampled, tokens, recompute = StepShape(), {}, 0, 0
        for s in inp.scheduled:
            before = self.computed[s.req_id]
            ctx = before + s.num_new_tokens
            self.computed[s.req_id] = ctx
            if s.req_id in self.hidden:
                recompute += self.geometry.blocks_for(before)
            shape = shape.add(s.num_new_tokens, ctx, s.phase is Phase.DECODE)
            tokens += s.num_new_tokens
            if s.sample:
                sampled[s.req_id] = 0
        dur = self.cost.predict(shape) + self.rho * recompute if inp.scheduled else 0.0
        dur += self._swap_seconds(out_bytes, in_bytes)
        pool = self.noise_prefill if shape.prefill_tokens else self.noise
        if pool and dur:
            dur *= self.rng.choice(pool)
        self._end = self.clock.t + dur
        self._out = StepOutput(inp.step_id, sampled, tokens, dur, 0.0)

    def _swap_seconds(self, out_bytes: int, in_bytes: int) -> float:
        """What this step's swaps add to it. Serial (a CPU worker quantizes and copies before its
        forward): every byte at ``host_bw``. With a side link (a GPU worker, engine.hostcopy): a
        swap-out is queued on the link and the step goes on; a swap-in first waits until the link
        has copied every swap-out queued so far (the main stream waits for the side stream), then
        copies its own bytes before the forward."""
        if not self.side_link:
            return (out_bytes + in_bytes) / self.host_bw
        t = self.clock.t
        if out_bytes:
            self.link_free = max(self.link_free, t) + out_bytes / self.host_bw
        return max(self.link_free - t, 0.0) + in_bytes / self.host_bw if in_bytes else 0.0

    def collect(self) -> StepOutput:
        self.clock.t = max(self.clock.t, self._end)
        out, self._out = self._out, None
        return out


@dataclass(frozen=True)
class SimSetup:
    cost: CostModel
    geometry: PoolGeometry            # per device
    sched: SchedConfig
    max_model_len: int
    num_devices: int = 1
    # measured / predicted step-time ratios of the real engine; each simulated step draws one
    # (seeded), so the simulated step times have the real spread, not only the fitted mean
    noise: tuple[float, ...] = ()
    noise_prefill: tuple[float, ...] = ()   # ratios of steps carrying prefill work (default: noise)
    seed: int = 0
    slo_ttft_s: float | None = None   # given to every RT request (the policy's deadlines)
    slo_tbt_s: float | None = None
    rho: float = 0.0                  # device's seconds per KV block of context re-projected (hidden caches)
    block_bytes: tuple[int, int] = (0, 0)   # bytes of one pool block: as resident, compressed to int8 (swaps)
    host_bw: float = 25e9             # bytes/s between the device and host memory (swaps)
    side_link: bool = False           # swap-outs copied beside the steps (a GPU's side stream); else serial


@dataclass
class BeJobs:
    """Best-effort work as batch jobs: ``job_size`` items submitted together, the next job when the
    previous one has finished (items are cycled). The run then ends when the last RT request ends."""
    items: list[TraceItem]
    job_size: int
    submitted: int = 0
    completed: int = 0
    output_tokens: int = 0


def policy_cost(setup: SimSetup) -> OnlineCostModel | None:
    """The cost model a policy that prices iterations plans with: the device's, a hidden cache's
    recompute and the copy of a swapped-out cache back included (not the wait for a busy side
    link, nor a serial device's swap-outs); None for policies that price nothing."""
    if setup.sched.policy not in PRICED:
        return None
    priced = replace(setup.cost, per_hidden_block=setup.rho or setup.cost.per_hidden_block,
                     per_swap_in_byte=1 / setup.host_bw)
    return OnlineCostModel(priced, refit_every=1 << 60)


def simulate(trace: list[TraceItem], setup: SimSetup, be: BeJobs | None = None,
             stats: dict | None = None) -> tuple[list[RequestRecord], float]:
    """Replay ``trace`` (arrival offsets in seconds); returns per-request records and the makespan.

    With ``be``, BE jobs are kept pending alongside; only their completed counts are kept (in ``be``).
    ``stats``, when given, receives the scheduler's counts at the end: preemptions, cache-type
    switches (by new type), tokens computed into each cache type, swaps and starts (and
    resumptions) by the policy's reason.
    """
    clock = SimClock()
    devices = [SimDevice(f"sim{i}", setup.geometry, setup.cost, clock, setup.noise, setup.seed + i,
                         setup.noise_prefill, setup.rho, setup.block_bytes, setup.host_bw, setup.side_link)
               for i in range(setup.num_devices)]
    cost = policy_cost(setup)
    cfg = setup.sched if setup.sched.rt_budget_s is not None else replace(setup.sched, rt_budget_s=setup.slo_tbt_s)
    sched = Scheduler(cfg, devices, eos_ids=(), max_model_len=setup.max_model_len, clock=clock,
                      cost=cost)
    items = sorted(trace, key=lambda it: it.arrival_s)
    recs: dict[str, RequestRecord] = {}
    order: list[RequestRecord] = []
    be_open: set[str] = set()
    be_tokens: dict[str, int] = {}

    def add(rid: str, it: TraceItem, at: float) -> None:
        rt = it.service_class == "rt"
        sched.add(Request(rid, it.prompt_ids, SamplingParams(max_tokens=it.max_tokens, temperature=0,
                                                             ignore_eos=True),
                          ServiceClass(it.service_class), arrival_time=at, predicted_len=it.predicted,
                          predicted_spread=it.spread,
                          slo_ttft_s=setup.slo_ttft_s if rt else None, slo_tbt_s=setup.slo_tbt_s if rt else None))
    i = 0
    trace_left = len(items)
    while i < len(items) or (sched.has_unfinished() if be is None else trace_left > 0):
        while i < len(items) and items[i].arrival_s <= clock.t:
            it = items[i]
            rid = f"r{i}"
            add(rid, it, it.arrival_s)
            recs[rid] = RequestRecord(it.service_class, it.arrival_s)
            order.append(recs[rid])
            i += 1
        if be is not None and not be_open:
            for _ in range(be.job_size):
                it = be.items[be.submitted % len(be.items)]
                rid = f"be{be.submitted}"
                add(rid, it, clock.t)
                be_open.add(rid)
                be.submitted += 1
        if not sched.has_unfinished():
            clock.t = items[i].arrival_s
            continue
        before = clock.t
        for u in sched.step():
            if u.req_id in be_open:
                if u.finish_reason is not None:
                    be_open.discard(u.req_id)
                    be.completed += 1
                    be.output_tokens += len(u.new_token_ids) + be_tokens.pop(u.req_id, 0)
                else:
                    be_tokens[u.req_id] = be_tokens.get(u.req_id, 0) + len(u.new_token_ids)
                continue
            r = recs[u.req_id]
            r.token_times.extend([clock.t] * len(u.new_token_ids))
            if u.finish_reason is not None:
                r.end, r.output_tokens = clock.t, len(r.token_times)
                trace_left -= 1
        if clock.t == before:          # nothing could run: jump to the next arrival (or stop)
            if i >= len(items):
                raise RuntimeError("simulation stalled with requests that can never be scheduled")
            clock.t = max(clock.t, items[i].arrival_s)
    if stats is not None:
        stats.update(preemptions=sum(sched.preemptions_by_class.values()),
                     switches={k.value: v for k, v in sched.cache_switches.items()},
                     tokens={k.value: v for k, v in sched.tokens_by_cache_type.items()},
                     swaps=dict(sched.counts("swaps")), swap_bytes=dict(sched.counts("swap_bytes")),
                     starts=dict(sched.counts("start_reasons")))
    return order, clock.t
