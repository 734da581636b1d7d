"""The Scheduler: owns request state and per-device queues, runs one iteration per step().

Each step, per device: snapshot -> policy (pure) -> apply the plan to the
block pool bookkeeping -> StepInput; then all devices run in parallel and
their StepOutputs update the requests.
"""
from __future__ import annotations

import copy
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType, Command, DeviceError, PoolInfo, StepInput, StepOutput
from tandem.sched.actor import ActorConfig, DeviceActor, SwapConfig, Update
from tandem.sched.alise import Alise
from tandem.sched.aptserve import AptServe
from tandem.sched.bros import Bros, RoundRobin
from tandem.sched.cost_model import OnlineCostModel
from tandem.sched.detok import Decoder
from tandem.sched.policy import Limits, fcfs, fcfs_prefill_first
from tandem.sched.request import Request, RequestState, ServiceClass
from tandem.sched.tandem import MECHANISMS, Tandem

log = logging.getLogger(__name__)

__all__ = ["POLICIES", "PRICED", "Device", "SchedConfig", "Scheduler", "Update", "make_policy"]


class Device(Protocol):
    """What the scheduler needs of a device: its pool and one step at a time."""
    name: str
    pool_info: PoolInfo

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
    # what a preempted request's cache does: "swap" to host memory and back (ALISE), or
    # "recompute" from its tokens; None: swap under alise, recompute elsewhere
    preemption_mode: str | None = None
    swap_space_bytes: int = 4 << 30      # host memory for swapped caches, per device
    swap_dtype: str = "int8"             # swapped caches: "int8" (channel-wise, ALISE) or "auto" (as resident)
    kv_cache_dtype: str = "auto"         # the resident pool: "auto" (the model's dtype) or "int8" (full
                                         # blocks compressed as swapped ones, engine.quantpool)
    tandem_off: tuple[str, ...] = ()     # tandem: mechanisms switched off (sched.tandem.MECHANISMS)
    mean_tbt: bool = False               # tandem: the TBT target bounds the mean gap (TPOT), not each gap
    late_after: float = 0.5              # tandem: the part of its TTFT target a chat's prompt waits before
                                         # look-ahead admission stops keeping it out (Tandem._late)
    prefix_caching: bool = False         # reuse the full KV blocks of equal token prefixes (cache.prefix);
                                         # whole-block pools only: bidirectional blocks are never shared

    @property
    def swapping(self) -> bool:
        return self.preemption_mode == "swap" or (self.preemption_mode is None and self.policy in ("alise", "tandem"))

    def check(self) -> "SchedConfig":
        """ValueError naming the option for any value or combination the scheduler cannot honour.
        The one place these options are checked (the LLM, the server's flags and the scheduler
        all come here); returns self."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {list(POLICIES)}")
        if self.bidirectional and self.policy not in ("bros", "tandem"):
            raise ValueError("bidirectional_blocks: bidirectional blocks need the bros or tandem policy")
        if self.bidirectional and self.cache_type is not CacheType.KV:
            raise ValueError("cache_type: bidirectional blocks hold KV caches only")
        if self.policy in ("aptserve", "tandem") and self.cache_type is not CacheType.KV:
            raise ValueError(f"cache_type: the {self.policy} policy chooses each request's cache type itself")
        if not self.hybrid_cache and self.policy not in ("aptserve", "tandem"):
            raise ValueError("kv-only (hybrid_cache=False): an option of the aptserve and tandem policies")
        for m in self.tandem_off:
            if m not in MECHANISMS:
                raise ValueError(f"tandem_off: {m!r} is not one of {list(MECHANISMS)}")
        if self.tandem_off and self.policy != "tandem":
            raise ValueError("tandem_off: an option of the tandem policy")
        if self.mean_tbt and self.policy != "tandem":
            raise ValueError("slo_tbt_mean: an option of the tandem policy")
        if isinstance(self.late_after, bool) or not (isinstance(self.late_after, (int, float))
                                                     and self.late_after >= 0):
            raise ValueError(f"late_after: must be a number of TTFT targets >= 0, got {self.late_after!r}")
        aptserve_only = {"aptserve-fcfs (adaptive=False)": not self.adaptive,
                         "mixed_batches": self.mixed_batches, "slo_decay": self.slo_decay is not None}
        for name, set_ in aptserve_only.items():
            if set_ and self.policy != "aptserve":
                raise ValueError(f"{name}: an option of the aptserve policy")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode: {self.preemption_mode!r} is not 'swap' or 'recompute'")
        if self.preemption_mode == "swap" and self.bidirectional:
            raise ValueError("preemption_mode: bidirectional blocks checkpoint what they preempt; swap is "
                             "for whole-block pools")
        if self.swap_dtype not in ("int8", "auto"):
            raise ValueError(f"swap_dtype: {self.swap_dtype!r} is not 'int8' or 'auto'")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not 'auto' or 'int8'")
        if self.kv_cache_dtype == "int8" and self.bidirectional:
            raise ValueError("kv_cache_dtype: bidirectional blocks are filled from both ends and copied slot "
                             "by slot; int8 compresses whole blocks filled one way")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space: must be a non-negative size, got {self.swap_space_bytes!r}")
        if self.slo_decay is not None and not 0 <= self.slo_decay <= 1:
            raise ValueError(f"slo_decay: must be in [0, 1], got {self.slo_decay!r}")
        return self


POLICIES = ("tandem", "fcfs", "rr", "bros", "aptserve", "alise", "fcfs-prefill-first")
PRICED = ("bros", "alise", "tandem")     # policies that price iterations with the cost model


def cache_type_of(name: str) -> CacheType:
    kinds = {c.value: c for c in CacheType}
    if name not in kinds:
        raise ValueError(f"cache_type: {name!r} is not one of {list(kinds)}")
    return kinds[name]


def _validate(cfg: SchedConfig, devices) -> None:
    """ValueError for options the configuration or the devices cannot honour."""
    cfg.check()
    if cfg.cache_type is CacheType.HIDDEN and not all(d.pool_info.hidden_rows for d in devices):
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
    if cfg.policy == "alise":
        if cost is None:
            raise ValueError("policy: alise needs a cost model (profile the engine first)")
        return Alise(cost)
    if cfg.policy == "tandem":
        if cost is None:
            raise ValueError("policy: tandem needs a cost model (profile the engine first)")
        return Tandem(cost, cfg.max_num_seqs, cfg.rho, cfg.hybrid_cache and not cfg.bidirectional,
                      idle_budget_s=cfg.rt_budget_s, off=frozenset(cfg.tandem_off), mean_tbt=cfg.mean_tbt,
                      swapping=cfg.swapping, late_after=cfg.late_after)
    if cfg.policy == "aptserve":
        return AptServe(cfg.rho, cfg.hybrid_cache, cfg.adaptive, cfg.slo_decay, cfg.mixed_batches, cost)
    raise ValueError(f"policy: {cfg.policy!r} is not one of {list(POLICIES)}")


class Scheduler:
    def __init__(self, cfg: SchedConfig, devices: list[Device], eos_ids: tuple[int, ...],
                 max_model_len: int, decoder: Callable[[bool], Decoder] | None = None,
                 clock: Callable[[], float] = time.monotonic, cost: OnlineCostModel | None = None):
        _validate(cfg, devices)
        self.cfg = cfg
        self.devices = devices
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.decoder = decoder              # skip_special_tokens -> the requests' Decoder; None: no text
        self.clock = clock                  # time.monotonic, or the simulator's virtual clock
        self._rng = random.Random()
        self._step_id = 0
        self._products: tuple[tuple[int, float], ...] | None = None
        self.threaded = False               # the actors run on their own threads (a Runtime) from now on
        self.actors = [self._actor(i, d, cost) for i, d in enumerate(devices)]

    def _actor(self, i: int, device: Device, cost: OnlineCostModel | None) -> DeviceActor:
        """Each device gets its own policy instance and, past the first, its own copy of the cost
        model: devices may differ in speed, and each refines its model from its own steps."""
        own = cost if i == 0 or cost is None else copy.deepcopy(cost)
        c = self.cfg
        swap = SwapConfig(c.swap_space_bytes, c.swap_dtype == "int8") if c.swapping and not c.bidirectional else None
        return DeviceActor(i, device, ActorConfig(Limits(c.max_num_seqs, c.max_num_batched_tokens,
                                                         c.chunked_prefill), c.bidirectional, c.cache_type, swap,
                                                     c.prefix_caching),
                           make_policy(c, own), self.eos_ids, self.max_model_len, self.decoder,
                           self.clock, own)

    # the first device's view, for single-device callers (metrics of one device, tests)
    @property
    def queues(self) -> list[DeviceActor]:
        return self.actors

    @property
    def cost(self) -> OnlineCostModel | None:
        return self.actors[0].cost

    @property
    def policy(self):
        return self.actors[0].policy

    @policy.setter
    def policy(self, fn) -> None:
        for a in self.actors:
            a.policy = fn

    @property
    def step_log(self):
        return self.actors[0].step_log

    @step_log.setter
    def step_log(self, log) -> None:
        for a in self.actors:
            a.step_log = log

    @property
    def states(self) -> dict[str, RequestState]:
        return {rid: st for a in self.actors for rid, st in a.states.items()}

    @property
    def t_avg(self) -> float:
        return max(a.t_avg for a in self.actors)

    def counts(self, name: str) -> Counter:
        """Sum of one of the actors' counters (preemptions_by_class, tokens_by_cache_type, ...)."""
        total: Counter = Counter()
        for a in self.actors:
            total.update(getattr(a, name))
        return total

    @property
    def preemptions_by_class(self) -> Counter:
        return self.counts("preemptions_by_class")

    @property
    def tokens_by_cache_type(self) -> Counter:
        return self.counts("tokens_by_cache_type")

    @property
    def cache_switches(self) -> Counter:
        return self.counts("cache_switches")

    def use_config(self, cfg: SchedConfig, cost: OnlineCostModel | None = None) -> None:
        """Switch to ``cfg`` (e.g. to BROS once the start-up profile has produced its cost model);
        only while nothing is queued. Fresh actors: pools of the kind the configuration asks for."""
        if self.has_unfinished():
            raise RuntimeError("policy: can only be switched while no request is queued")
        _validate(cfg, self.devices)
        cost = cost or self.cost
        self.cfg = cfg
        self.actors = [self._actor(i, d, cost) for i, d in enumerate(self.devices)]

    # ---- intake and the dispatcher ---------------------------------------------------
    def new_state(self, req: Request) -> RequestState:
        """Check a request and give it its state (seed drawn when none was given); ValueError if
        it can never fit a device, or has no prompt token (a step cannot compute from none)."""
        if not req.prompt_token_ids:
            raise ValueError("prompt: is empty after tokenization")
        self.check_fits(len(req.prompt_token_ids), req.sampling.max_tokens)
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
        return RequestState(req, seed=seed, last_token_time=req.arrival_time, cache_type=self.cfg.cache_type)

    def dispatch(self) -> DeviceActor:
        """The dispatcher: the live device with the fewest requests (DeviceError if none lives)."""
        live = [a for a in self.actors if a.dead is None]
        if not live:
            raise DeviceError("no live device: " + "; ".join(a.dead or "" for a in self.actors))
        return min(live, key=DeviceActor.load)

    def add(self, req: Request) -> RequestState:
        """Queue a request on the device the dispatcher picks (lock-step use: simulator, profiles)."""
        if any(req.req_id in a.states for a in self.actors):
            raise ValueError(f"request id {req.req_id!r} is already in use")
        actor = self.dispatch()
        st = self.new_state(req)
        actor.add(st)
        return st

    def abort(self, req_id: str) -> Update | None:
        """Cancel a request now; its blocks are freed at once."""
        for a in self.actors:
            if req_id in a.states:
                return a.abort(req_id)
        return None

    def smallest_pool(self) -> PoolGeometry:
        """The geometry of the smallest device pool: pools sized by a memory fraction differ (two
        workers sharing a GPU), and a request may be placed on, or migrated to, any of them."""
        return min((a.pool.geometry for a in self.actors), key=lambda g: g.num_blocks)

    def pool_tokens(self) -> int:
        """The longest context (prompt + output) one request can hold on the smallest pool."""
        g = self.smallest_pool()
        return g.num_blocks // g.blocks_per_token_block(self.cfg.cache_type) * g.block_size

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError if such a request could never fit the smallest device pool (safe from any
        thread)."""
        longest = min(num_prompt_tokens + max_tokens, self.max_model_len)
        g = self.smallest_pool()
        need = g.blocks_for(longest, self.cfg.cache_type)
        if need > g.num_blocks:
            raise ValueError(f"prompt: {longest} tokens of context need {need} "
                             f"blocks; the pool has {g.num_blocks}")

    def has_unfinished(self) -> bool:
        return any(a.has_work() for a in self.actors)

    def products(self) -> tuple[tuple[int, float], ...]:
        """(rows, seconds) of the products a step's token rows take, for a cost model to add as
        measured (sched.cost_model): timed by the first device whose engine multiplies thin steps
        on another path (PoolInfo.thin_rows), once, when first asked; () where none does. Asked
        between steps, before serving starts (when the start-up profile is fitted), so it times
        after every worker has loaded, on a machine where no other worker computes; the devices of
        one server load one model alike, so one table serves them all."""
        if self._products is None:
            if self.threaded:
                raise RuntimeError("products: timed only before the devices' actors start (when a cost model "
                                   "is first fitted), never beside their steps")
            dev = next((d for d in self.devices if d.pool_info.thin_rows), None)
            self._products = () if dev is None else self._timed_products(dev)
        return self._products

    def _timed_products(self, dev: Device) -> tuple[tuple[int, float], ...]:
        self._step_id += 1
        dev.submit(StepInput(Command.PRODUCTS, self._step_id))
        out = dev.collect()
        if out.error:        # they refine the cost model; it fits without them
            log.warning("%s: timing the products failed; the cost model fits without them:\n%s", dev.name, out.error)
            return ()
        return out.products

    # ---- views for metrics ---------------------------------------------------------------
    def load_by_class(self) -> dict:
        """{ServiceClass: (running, waiting, blocks held)} over all devices (for metrics)."""
        return load_by_class(self.actors)

    def pool_view(self) -> dict[str, int]:
        return pool_view(self.actors)

    # ---- lock-step iteration ---------------------------------------------------------------
    def step(self) -> list[Update]:
        """Plan, run and account one iteration on every device with work; all devices start
        together and the call returns when the slowest is done."""
        self._step_id += 1
        sent = []
        for a in self.actors:
            if a.dead is None and (a.has_work() or a.has_messages()):
                p = a.plan()
                if p is not None:
                    a.device.submit(p.inp)
                    sent.append((a, p))
        updates: list[Update] = []
        for a, p in sent:
            try:
                out = a.device.collect()
                if out.error:
                    raise DeviceError(f"{a.device.name}: step failed: {out.error}")
            except DeviceError as e:
                a.dead = str(e)
                updates.extend(a.fail_all(str(e)))
                continue
            updates.extend(a.account(p, out))
        return updates

    def check_invariants(self) -> None:
        for a in self.actors:
            a.check_invariants()


def load_by_class(actors: list[DeviceActor]) -> dict:
    """{ServiceClass: (running, waiting, blocks held)} over the given devices; a block that
    several of a class's requests hold (a cached prompt start) counts once."""
    out: dict = {}
    for a in actors:
        shared: dict = {}          # class -> ids of its requests' blocks that others hold too
        for ids, k in ((a.running, 0), (a.waiting, 1)):
            for r in list(ids):
                st = a.states.get(r)
                if st is None:
                    continue
                row = out.setdefault(st.request.service_class, [0, 0, 0])
                row[k] += 1
                row[2] += a.pool.num_blocks_of(r)
                if a.pool.prefix is not None and (both := a.pool.shared_ids(r)):   # a few named blocks at most
                    row[2] -= len(both)
                    shared.setdefault(st.request.service_class, set()).update(both)
        for c, blocks in shared.items():
            out[c][2] += len(blocks)
    return {c: tuple(v) for c, v in out.items()}


def pool_view(actors: list[DeviceActor]) -> dict[str, int]:
    """Blocks by owner over the given devices: rt, be, shared (RT and BE in one block), checkpointed
    (BE slots parked on the CPU), free (cached prefixes nobody holds included). Whole-block pools
    checkpoint nothing, and share blocks only through prefix caching: a block that RT and BE
    requests both hold counts as shared, each block once."""
    view = {"rt": 0, "be": 0, "shared": 0, "checkpointed": 0, "free": 0}
    for a in actors:
        if a.pool.preempts_blocks:
            for k, n in a.pool.view().items():       # token-blocks (and checkpointed slots)
                view[k] += n if k == "checkpointed" else 2 * n
            continue
        view["free"] += a.pool.num_free
        if a.pool.prefix is None:
            for c, (_run, _wait, blocks) in load_by_class([a]).items():
                view[c.value] += blocks
            continue
        held = {c: set() for c in ServiceClass}        # blocks more than one request holds
        for r in a.running:
            st = a.states.get(r)
            if st is not None:
                shared = a.pool.shared_ids(r)
                view[st.request.service_class.value] += a.pool.num_blocks_of(r) - len(shared)
                held[st.request.service_class].update(shared)
        rt, be = held[ServiceClass.RT], held[ServiceClass.BE]
        view["rt"] += len(rt - be)
        view["be"] += len(be - rt)
        view["shared"] += len(rt & be)
    return view
