"""The rebalancer: places arrivals and, once an epoch, migrates requests between devices.

It keeps the placement's books (``sched.placement.Cluster``) for the device actors of one box:

    arrival  ──► ``arrive``   one ``place`` call; the device to hand the request to
    finish   ──► ``depart``   noted; applied at the next arrival or epoch (Mell batches departures)
    actor step ► ``observe``  that device's view: each request's context length and blocks
    epoch    ──► ``epoch``    new sizes and departures -> ``place`` -> moves -> KV or token

The books are the placement's intent; the devices reach it through migrations. A move waits
(``pending``) until its request is seen on a device; it is then sent as its cache or as its
tokens by SPEC §4.4's two-bin packing (``split``) against this epoch's budgets, or waits for the
next epoch when it fits neither; where both fit, it goes the way that pauses it less. A
baseline's PREEMPTION moves (BF/WF overflow) always go as tokens: the request starts again
elsewhere, as those baselines do.

The budgets (``Budgets``): ``Bcomm``, the bytes the box's link copies within one epoch (a
start-up bandwidth probe times the epoch), shared by every KV move of the epoch; and ``Bcomp``,
the re-prefill tokens a destination can add to one of its steps while its running decodes stay
within the TBT target, from the iteration cost model and the destination's current decode batch.
All of it is plain books: the runtime calls these methods from its threads under one lock.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem.sched.cost_model import StepShape
from tandem.sched.placement import Cluster, Epoch, MoveKind, Placement, place, take_down
from tandem.sched.request import Transfer

log = logging.getLogger("tandem.rebalancer")

PLACEMENTS = ("static", "mell", "lb", "bf", "wf")   # static: the least-loaded device at arrival, for life
IN_FLIGHT_S = 5.0          # a sent move not seen at its destination after this is sent again


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device as its actor last saw it (published after each of its steps)."""
    index: int
    tokens: dict[str, int]       # request -> context length (prompt + generated)
    blocks: dict[str, int]       # request -> blocks it needs for that context
    decode_batch: int = 0        # requests decoding in its last step
    decode_ctx: int = 0          # their summed context


@dataclass(frozen=True, slots=True)
class Candidate:
    """A migration the placement wants this epoch, with both of its costs."""
    req_id: str
    src: int
    dst: int
    kv_bytes: int                # bytes of cache a KV move copies over the link
    tokens: int                  # tokens a token move prefills again at dst
    reason: str = ""
    kv_s: float = 0.0            # estimated seconds the copy takes (0 with tok_s: unknown)
    tok_s: float = 0.0           # estimated seconds the re-prefill adds to dst's step


@dataclass(frozen=True, slots=True)
class Order:
    """A migration to carry out now."""
    req_id: str
    src: int
    dst: int
    transfer: Transfer
    reason: str


def split(cands: list[Candidate], comm_bytes: float, comp_tokens: dict[int, float],
          ) -> tuple[list[Candidate], list[Candidate], list[Candidate]]:
    """SPEC §4.4: the epoch's migrations into (KV, token, deferred), greedily, largest cache first
    (ties by id, so the split is deterministic). Each goes where it fits; where neither, it waits.
    ``comm_bytes``: the link's budget (one link: the box's devices share it); ``comp_tokens``: each
    destination's re-prefill budget.

    Where both fit [open choice]: the way estimated to pause the request less (``kv_s`` against
    ``tok_s``); where those are equal or unknown, the bin it leaves the smaller normalised residual
    in (best fit). Best fit alone sends as tokens exactly the moves whose re-prefill nearly fills
    the destination's budget, the longest ones: on a 2-core CPU, where a KV move of a few hundred
    tokens paused a stream about 0.1 s, such token moves paused it 0.6-0.9 s."""
    used_comm = 0.0
    used_comp: dict[int, float] = {}
    kv, tok, deferred = [], [], []
    for c in sorted(cands, key=lambda c: (-c.kv_bytes, c.req_id)):
        room_comm = comm_bytes - used_comm - c.kv_bytes
        cap = comp_tokens.get(c.dst, 0.0)
        room_comp = cap - used_comp.get(c.dst, 0.0) - c.tokens
        fit_kv, fit_tok = room_comm >= 0, room_comp >= 0
        if fit_kv and fit_tok:
            if c.kv_s != c.tok_s:
                fit_kv = c.kv_s < c.tok_s
            else:
                fit_kv = room_comm / max(comm_bytes, 1e-9) <= room_comp / max(cap, 1e-9)
            fit_tok = not fit_kv
        if fit_kv:
            used_comm += c.kv_bytes
            kv.append(c)
        elif fit_tok:
            used_comp[c.dst] = used_comp.get(c.dst, 0.0) + c.tokens
            tok.append(c)
        else:
            deferred.append(c)
    return kv, tok, deferred


@dataclass(slots=True)
class Budgets:
    """What a migration may cost within one epoch (SPEC §4.4's Bcomm and Bcomp)."""
    link_bytes_per_s: float              # measured copy bandwidth of a KV move
    epoch_s: float                       # the rebalancer's period: the time limit of a transfer
    step_cost: Callable[[StepShape], float] | None   # iteration cost model (seconds); None: no budget
    tbt_s: float                         # decodes must stay within this step time
    max_batched_tokens: int = 2048

    @property
    def comm_bytes(self) -> float:
        return self.link_bytes_per_s * self.epoch_s

    def kv_seconds(self, nbytes: int) -> float:
        """How long a KV move of ``nbytes`` copies at the probed bandwidth."""
        return nbytes / self.link_bytes_per_s if self.link_bytes_per_s > 0 else float("inf")

    def reprefill_seconds(self, view: DeviceView, tokens: int) -> float:
        """How much longer the destination's step gets when it prefills ``tokens`` again besides
        its decodes, by the cost model (infinite without one)."""
        if self.step_cost is None:
            return float("inf")
        base = StepShape(decode_tokens=view.decode_batch, decode_ctx=view.decode_ctx)
        return self.step_cost(base.add(tokens, tokens, False)) - self.step_cost(base)

    def comp_tokens(self, view: DeviceView) -> int:
        """Tokens a step on this device can prefill besides its decodes and stay within tbt_s
        (a prefill of n tokens at context n, by the cost model); 0 when the decodes alone do not."""
        if self.step_cost is None:
            return 0
        base = StepShape(decode_tokens=view.decode_batch, decode_ctx=view.decode_ctx)

        def fits(n: int) -> bool:
            return self.step_cost(base.add(n, n, False)) <= self.tbt_s
        if not fits(1):
            return 0
        lo, hi = 1, self.max_batched_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


@dataclass(slots=True)
class _Pending:
    dst: int
    kind: MoveKind
    reason: str
    sent: float | None = None            # clock when its order went out


@dataclass
class Rebalancer:
    policy: Placement
    num_devices: int
    capacity: int                        # blocks per device
    block_bytes: int                     # bytes of one pool block (every layer)
    budgets: Budgets
    clock: Callable[[], float] = time.monotonic
    cluster: Cluster = None              # type: ignore[assignment]
    views: dict[int, DeviceView] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)
    departed: set[str] = field(default_factory=set)
    deferred_total: int = 0              # moves that fit neither budget in their epoch
    max_active: int = 0                  # most devices holding requests at once
    idle: set[int] = field(default_factory=set)   # devices holding no request at the last epoch

    def __post_init__(self):
        if self.cluster is None:
            self.cluster = Cluster(self.capacity, self.num_devices)
        self.lock = threading.Lock()

    # ---- from the runtime's threads ---------------------------------------------------
    def arrive(self, req_id: str, blocks: int, cached: dict[int, int] | None = None) -> int:
        """The device for a new request (its prompt needs ``blocks``; ``cached``: device -> its
        prompt's leading token-blocks in that device's prefix cache), after the departures seen
        since the last call (a chat's next turn, sent as soon as the last one ended, finds the
        books without it); moves the placement makes to fit it are carried out from the next
        epoch."""
        with self.lock:
            ep = Epoch(arrivals={req_id: blocks}, departures=self._take_departed(),
                       cached={req_id: cached} if cached else {})
            self.cluster, dec = place(self.policy, self.cluster, ep)
            self._want(dec.moves)
            return dec.placed[req_id]

    def device_down(self, index: int) -> None:
        """Device ``index`` is down for good: it leaves the placement's books (``take_down``), and
        the requests booked there that run on another device (sent there while it restarted, or
        moving to it) are placed again among the devices left, moving there as wanted moves do.
        Those that ran on it end with it (their departures come as for any request)."""
        with self.lock:
            if index in self.cluster.down:
                return
            self.cluster, booked = take_down(self.cluster, index)
            elsewhere = {r: n for r, n in booked.items() if self._runs_elsewhere(r, index)}
            for r in booked:
                self.pending.pop(r, None)
            self.cluster, dec = place(self.policy, self.cluster, Epoch(arrivals=elsewhere))
            self._want(dec.moves)
            for r, d in dec.placed.items():
                self.pending[r] = _Pending(d, MoveKind.MIGRATION, f"device {index} is down")

    def _runs_elsewhere(self, req_id: str, index: int) -> bool:
        p = self.pending.get(req_id)
        return (p is not None and p.dst == index) or any(
            req_id in v.tokens for v in self.views.values() if v.index != index)

    def sent_elsewhere(self, req_id: str, device: int) -> None:
        """A request ``arrive`` placed on a device restarting its worker was sent to ``device``
        (a serving one) instead: it stays in the books where the placement put it, and moves
        there once that device serves again, as any wanted move does."""
        with self.lock:
            dst = self.cluster.where.get(req_id)
            if dst is not None and dst != device:
                self.pending[req_id] = _Pending(dst, MoveKind.MIGRATION,
                                                f"placed on device {dst} while it restarted its worker")

    def depart(self, req_id: str) -> None:
        with self.lock:
            if req_id in self.cluster.where:
                self.departed.add(req_id)

    def observe(self, view: DeviceView) -> None:
        with self.lock:
            self.views[view.index] = view

    # ---- once an epoch --------------------------------------------------------------------
    def epoch(self, restarting: frozenset[int] = frozenset(), down: frozenset[int] = frozenset()) -> list[Order]:
        """Apply the sizes and departures seen since the last epoch; the migrations to send now,
        none to a device in ``restarting`` (its worker is being started again: it waits).
        Devices in ``down`` (down for good) leave the books first (``device_down``)."""
        for d in sorted(down):
            self.device_down(d)
        with self.lock:
            where_now = {rid: v.index for v in self.views.values() for rid in v.tokens}
            sizes = {}
            for rid, old in self.cluster.sizes.items():
                d = where_now.get(rid)
                if d is not None and rid not in self.departed:
                    b = self.views[d].blocks[rid]
                    if b != old:
                        sizes[rid] = b
            self.cluster, dec = place(self.policy, self.cluster, Epoch(departures=self._take_departed(), sizes=sizes))
            self._want(dec.moves)
            self._note_idle()
            return self._orders(where_now, restarting)

    def _take_departed(self) -> set[str]:
        gone, self.departed = self.departed, set()
        for rid in gone:
            self.pending.pop(rid, None)
        return gone

    def _want(self, moves) -> None:
        for m in moves:
            self.pending[m.req_id] = _Pending(m.dst, m.kind, m.reason)

    def _orders(self, where_now: dict[str, int], restarting: frozenset[int] = frozenset()) -> list[Order]:
        now = self.clock()
        orders, cands = [], []
        for rid, p in list(self.pending.items()):
            src = where_now.get(rid)
            if src is None or (p.sent is not None and now - p.sent < IN_FLIGHT_S) or p.dst in restarting:
                continue                  # between devices, just sent, or its destination restarts: wait
            dst = self.views.get(p.dst, DeviceView(p.dst, {}, {}))
            if src == p.dst:
                del self.pending[rid]
                continue
            if p.kind is MoveKind.PREEMPTION:
                orders.append(Order(rid, src, p.dst, Transfer.TOKEN, p.reason))
                continue
            v = self.views[src]
            n, nbytes = v.tokens[rid], v.blocks[rid] * self.block_bytes
            cands.append(Candidate(rid, src, p.dst, nbytes, n, p.reason, self.budgets.kv_seconds(nbytes),
                                   self.budgets.reprefill_seconds(dst, n)))
        comp = {d: self.budgets.comp_tokens(v) for d, v in self.views.items()}
        kv, tok, deferred = split(cands, self.budgets.comm_bytes, comp)
        self.deferred_total += len(deferred)
        orders += [Order(c.req_id, c.src, c.dst, Transfer.KV, c.reason) for c in kv]
        orders += [Order(c.req_id, c.src, c.dst, Transfer.TOKEN, c.reason) for c in tok]
        for o in orders:
            self.pending[o.req_id].sent = now
        return orders

    def _note_idle(self) -> None:
        """Devices holding no request are idle (on a GPU box: free for other work); say when
        that changes."""
        idle = {i for i in range(self.num_devices)
                if i not in self.cluster.down and not self.views.get(i, DeviceView(i, {}, {})).tokens}
        for i in sorted(idle - self.idle):
            log.info("device %d is idle (holds no request)", i)
        for i in sorted(self.idle - idle):
            log.info("device %d is active again", i)
        self.idle = idle
        self.max_active = max(self.max_active, self.num_devices - len(idle) - len(self.cluster.down))


def view_of(actor) -> DeviceView:
    """A device actor's view for the placement (on its own thread, after a step)."""
    g = actor.pool.geometry
    tokens, blocks, batch, ctx = {}, {}, 0, 0
    for rid, st in actor.states.items():
        tokens[rid] = n = st.num_tokens
        blocks[rid] = g.blocks_for(n, st.cache_type)
        if st.output_token_ids and rid in actor.running:
            batch, ctx = batch + 1, ctx + n
    return DeviceView(actor.index, tokens, blocks, batch, ctx)
