"""Which device holds which request: Mell's online packing and the BF / WF / LB baselines.

One pure function, ``place(policy, cluster, epoch) -> (cluster', Decision)``. The cluster is
every device's KV capacity ``C`` (blocks) and each live request's current KV size and device;
the epoch is what happened since the last call (arrivals with their sizes, departures, new
sizes). The answer is where each arrival goes and which requests move where, with a reason.
Nothing here touches a device: the dispatcher and the rebalancer carry the decision out, and the
simulator replays it against a trace.

Mell packs requests onto as few devices as possible as their caches grow. Sizes are sorted into
categories (integer comparisons, no rounding)::

    L (C/2, C]   M (C/3, C/2]   S (C/4, C/3]   T (C/8, C/4]   tiny [0, C/8]

Tiny requests travel in *multi-items* (one group id, one device) whose total stays within C/4;
a multi-item is placed like one T-request. A device takes the category of its largest item.
ALLOCATE / DEPART / UPDATE follow the paper's Fig. 10 (comments below name each case); the
"most recently activated X-device" is the one of that category with the newest activation stamp.
Guarantees when devices are unbounded: the Theorem 1 properties up to a constant number of
exceptions (``violations``), at most 4/3 x the optimum plus a constant active devices, and at most
10 item moves per operation. With operation batching (the default) an epoch runs every DEPART,
then every UPDATE, then every ALLOCATE, and only each request's net move is carried out.

On a box with a fixed number of devices (``Cluster.max_devices``) a device that cannot be
opened falls back to the active device with the most free blocks, which may overflow; its own
scheduler then queues or preempts as on a single device. No move ends on a device it takes
over capacity: such moves are undone at the end of the epoch (``keep_moves_that_fit``). There
WF and LB spread over every device from the start, as least-loaded routers do; Mell and BF
still open devices only as needed. A device that is down for good leaves the box (``take_down``):
its requests leave the books and no operation opens it again.

Baselines (the paper's): BF puts an arrival on the fullest device it fits on, WF on the emptiest
(what round-robin / least-loaded routers do); neither migrates, so a device that overflows as its
requests grow preempts its newest requests, which are placed again as arrivals (PREEMPTION
moves: they recompute). LB places like WF and migrates one request per device pair per epoch from
the fuller to the emptier device while they differ by more than C/10 (Llumnix-style balancing),
and resolves overflow by migration too.

Cache-aware routing (WF and LB, the spreading routers): an arrival may name, per device, how many
of its prompt's token-blocks that device's prefix cache holds (``Epoch.cached``). It then goes
to the device holding the most, instead of the emptiest, while that device fits it, holds at
most ``affinity_slack`` requests more than the least-loaded device, and the placement leaves
the fullest and emptiest devices within LB's C/10: affinity never makes a placement the balancer
would undo. A chat's next turn then finds its earlier turns where they were computed. BF and
Mell place by size alone: their device choice is the packing.
"""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, replace


class Placement(enum.Enum):
    MELL = "mell"
    LB = "lb"
    BF = "bf"
    WF = "wf"


class Category(enum.IntEnum):
    """Size class of an item or a device (a device: that of its largest item)."""
    TINY = 0
    T = 1
    S = 2
    M = 3
    L = 4


class MoveKind(enum.Enum):
    MIGRATION = "migration"      # the request keeps its progress (KV copy or token re-prefill)
    PREEMPTION = "preemption"    # a baseline's overflow: dropped and placed again from scratch


def category(size: int, capacity: int) -> Category:
    """L (C/2, C], M (C/3, C/2], S (C/4, C/3], T (C/8, C/4], tiny [0, C/8]."""
    if 2 * size > capacity:
        return Category.L
    if 3 * size > capacity:
        return Category.M
    if 4 * size > capacity:
        return Category.S
    if 8 * size > capacity:
        return Category.T
    return Category.TINY


@dataclass(slots=True)
class Cluster:
    """The books the placement keeps between calls (plain values; ``place`` never mutates one)."""
    capacity: int                                      # KV blocks per device (C)
    max_devices: int | None = None                     # devices on the box; None = as many as needed
    sizes: dict[str, int] = field(default_factory=dict)      # request -> KV blocks now
    where: dict[str, int] = field(default_factory=dict)      # request -> device index
    arrived: dict[str, int] = field(default_factory=dict)    # request -> arrival stamp (newest last)
    active: dict[int, int] = field(default_factory=dict)     # device -> activation stamp
    groups: dict[str, str] = field(default_factory=dict)     # tiny request -> multi-item id (Mell)
    open_group: str | None = None                      # the multi-item new tiny requests join
    clock: int = 0                                     # stamps for activations, arrivals, groups
    machines: dict[int, int] = field(default_factory=dict)   # device -> machine (absent: machine 0)
    down: frozenset[int] = frozenset()                 # devices down for good: never opened again


@dataclass(slots=True)
class Epoch:
    """What changed since the last call."""
    arrivals: dict[str, int] = field(default_factory=dict)   # new request -> KV blocks it needs
    departures: set[str] = field(default_factory=set)        # requests that finished or left
    sizes: dict[str, int] = field(default_factory=dict)      # live request -> KV blocks now
    # arrival -> {device: leading token-blocks of its prompt that device's prefix cache holds}
    cached: dict[str, dict[int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Move:
    req_id: str
    src: int                 # device index
    dst: int                 # device index
    kind: MoveKind
    reason: str              # why, for the log


@dataclass(slots=True)
class Decision:
    placed: dict[str, int]               # each arrival -> its device
    moves: list[Move]                    # net moves of requests that were already placed
    item_moves: list[int]                # item moves each operation caused, in execution order
    overflowing: list[int]               # devices over capacity after the epoch (bounded boxes)


def place(policy: Placement, cluster: Cluster, epoch: Epoch, *, batched: bool = True) -> tuple[Cluster, Decision]:
    """Apply one epoch's operations under ``policy``; return the new books and the decision.

    ``batched=False`` carries out every move of every operation (for measuring what operation
    batching saves): ``Decision.moves`` then lists each intermediate move as well."""
    books = _Mell(cluster, batched) if policy is Placement.MELL else _Baseline(cluster, policy, batched)
    books.run(epoch)
    books.keep_moves_that_fit()
    return books.cl, books.decision()


def take_down(cluster: Cluster, device: int) -> tuple[Cluster, dict[str, int]]:
    """The books without ``device``, down for good: the requests booked there leave them
    (returned with their sizes: those running on another device are the caller's to place again),
    the device leaves the active ones, and no later operation opens it. Nothing else moves: this
    is no operation of the placement's (a departure's repacking would refill the device going
    down from the others)."""
    booked = {r: n for r, n in cluster.sizes.items() if cluster.where[r] == device}
    groups = {r: g for r, g in cluster.groups.items() if r not in booked}
    cluster = replace(cluster, sizes={r: n for r, n in cluster.sizes.items() if r not in booked},
                      where={r: d for r, d in cluster.where.items() if r not in booked},
                      arrived={r: t for r, t in cluster.arrived.items() if r not in booked},
                      active={d: t for d, t in cluster.active.items() if d != device}, groups=groups,
                      open_group=cluster.open_group if cluster.open_group in groups.values() else None,
                      down=cluster.down | {device})
    return cluster, booked


def affinity_slack(least: int) -> int:
    """Requests a device holding an arrival's prompt prefix may hold beyond the least-loaded
    device's ``least`` and still take it: 2, or half of ``least`` when that is more."""
    return max(2, least // 2)


def prefix_affinity(cached: dict[int, int], counts: dict[int, int]) -> int | None:
    """Cache-aware routing's choice for one arrival: of the devices in ``counts`` (device ->
    requests it holds), the one whose prefix cache holds the most of the arrival's leading
    token-blocks (``cached``: device -> blocks; fewest requests, then lowest index, on ties),
    among those no more than ``affinity_slack`` ahead of the least-loaded; None when no such
    device holds any (the caller then places by load)."""
    if not counts:
        return None
    least = min(counts.values())
    near = [d for d, n in cached.items() if n > 0 and d in counts and counts[d] <= least + affinity_slack(least)]
    return max(near, key=lambda d: (cached[d], -counts[d], -d)) if near else None


# ---- shared books --------------------------------------------------------------------------


NOWHERE = -1          # the pseudo-device of a request between leaving one device and joining another


class _Books:
    """A working copy of a Cluster during one ``place`` call, at request level."""

    def __init__(self, cluster: Cluster, batched: bool):
        self.cl = copy.deepcopy(cluster)
        self.C = cluster.capacity
        self.batched = batched
        self.origin = dict(self.cl.where)          # request -> device at the start of the epoch
        self.why: dict[str, str] = {}              # request -> reason of its last move
        self.kind: dict[str, MoveKind] = {}
        self.placed: dict[str, int] = {}
        self.item_moves: list[int] = []
        self.steps: list[Move] = []                # every move in order (unbatched mode)
        self._load: dict[int, int] = {}
        self._on: dict[int, set[str]] = {}
        for r, d in self.cl.where.items():
            self._add(r, d)

    # request-level primitives
    def _add(self, r: str, d: int) -> None:
        self._load[d] = self._load.get(d, 0) + self.cl.sizes[r]
        self._on.setdefault(d, set()).add(r)
        self.cl.where[r] = d

    def _remove(self, r: str) -> int:
        d = self.cl.where.pop(r)
        self._load[d] -= self.cl.sizes[r]
        self._on[d].discard(r)
        return d

    def _relocate(self, r: str, d: int, reason: str, kind: MoveKind = MoveKind.MIGRATION) -> None:
        src = self._remove(r)
        self._add(r, d)
        if r in self.origin:
            self.why[r], self.kind[r] = reason, kind
            self.steps.append(Move(r, src, d, kind, reason))

    def _unplace(self, r: str) -> None:
        """Park ``r`` off every device while an operation finds it a place."""
        if r in self.cl.where:
            self._remove(r)
        self._add(r, NOWHERE)

    def _resize(self, r: str, size: int) -> None:
        d = self.cl.where[r]
        self._load[d] += size - self.cl.sizes[r]
        self.cl.sizes[r] = size

    def load(self, d: int) -> int:
        return self._load.get(d, 0)

    def free(self, d: int) -> int:
        return self.C - self.load(d)

    def requests_on(self, d: int) -> set[str]:
        return self._on.get(d, set())

    def open_device(self) -> int | None:
        """Activate the lowest unused device index; None when the box has no more."""
        d = 0
        while d in self.cl.active or d in self.cl.down:
            d += 1
        if self.cl.max_devices is not None and d >= self.cl.max_devices:
            return None
        self.cl.clock += 1
        self.cl.active[d] = self.cl.clock
        return d

    def emptiest(self, avoid: set[int] = frozenset()) -> int:
        """Fallback on a full box: the active device with the most free blocks."""
        cands = [d for d in self.cl.active if d not in avoid] or list(self.cl.active)
        return max(cands, key=lambda d: (self.free(d), -d))

    def _arrive(self, r: str, size: int) -> None:
        self.cl.clock += 1
        self.cl.arrived[r] = self.cl.clock
        self.cl.sizes[r] = size

    def _depart(self, r: str) -> None:
        self._remove(r)
        del self.cl.sizes[r]
        self.cl.arrived.pop(r, None)

    def terminate_empty(self) -> None:
        for d in [d for d in self.cl.active if not self.requests_on(d)]:
            del self.cl.active[d]

    def item_of(self, r: str) -> str:
        """The unit that moves: the request itself (Mell groups tiny ones)."""
        return r

    def spreads(self) -> bool:
        """Whether every device of a bounded box stays active (least-loaded routers)."""
        return False

    def keep_moves_that_fit(self) -> None:
        """On a bounded box, undo the epoch's moves into a device they leave over capacity,
        the newest request's item first, until it fits or nothing moved in is left.

        [open choice] Where no device can be opened, such a move only shifts the overflow
        (the destination's scheduler preempts instead of the source's) and costs a migration's
        pause; the next epoch then moves something back. On two CPU devices with 1,024 tokens
        each (``bench skew --seed 1``), LB's overflow shedding moved 67 requests this way, 28
        of them as a whole re-prefill, and preempted 23 times against static placement's 7.
        An item goes back whole (a multi-item's members share a device, and a member that
        arrived this epoch is placed with it), and only to the device it started the epoch on,
        if that is still active."""
        if self.cl.max_devices is None:
            return
        undone = True
        while undone:                   # an item sent back may overflow a device already seen
            undone = False
            for d in sorted(self.cl.active):
                while self.load(d) > self.C and self._undo_one(d):
                    undone = True
        if not self.spreads():
            self.terminate_empty()

    def _undo_one(self, d: int) -> bool:
        """Send the newest item moved onto ``d`` this epoch back where it started; False if none
        can go (each item goes back at most once, so the loop above ends)."""
        came = [r for r in self.requests_on(d) if self.origin.get(r, d) not in (d, NOWHERE)]
        back = [r for r in sorted(came, key=lambda r: -self.cl.arrived.get(r, 0)) if self._returnable(r, d)]
        if not back:
            return False
        item, home = self.item_of(back[0]), self.origin[back[0]]
        for m in [m for m in self.requests_on(d) if self.item_of(m) == item]:
            self._relocate(m, home, f"no room on device {d}", self.kind.get(m, MoveKind.MIGRATION))
        return True

    def _returnable(self, r: str, d: int) -> bool:
        """``r``'s item on ``d`` came from one device that is still active (members that arrived
        this epoch have no home yet and go with it)."""
        item = self.item_of(r)
        homes = {self.origin[m] for m in self.requests_on(d) if self.item_of(m) == item and m in self.origin}
        return len(homes) == 1 and next(iter(homes)) in self.cl.active

    def _op(self, fn) -> int:
        """Run one operation; return how many placed items it moved (an item that is off-device
        at either end, i.e. arriving or waiting for its ALLOCATE, is not counted)."""
        before = {r: d for r, d in self.cl.where.items() if d != NOWHERE}
        fn()
        moved = {self.item_of(r) for r, d in before.items()
                 if self.cl.where.get(r, d) not in (d, NOWHERE)}
        return len(moved)

    def decision(self) -> Decision:
        placed = {r: self.cl.where[r] for r in self.placed if r in self.cl.where}
        if self.batched:
            moves = [Move(r, d, self.cl.where[r], self.kind[r], self.why[r])
                     for r, d in self.origin.items() if r in self.cl.where and self.cl.where[r] != d]
        else:
            moves = list(self.steps)
        over = sorted(d for d in self.cl.active if self.load(d) > self.C)
        return Decision(placed, moves, self.item_moves, over)


# ---- baselines -----------------------------------------------------------------------------


class _Baseline(_Books):
    def __init__(self, cluster: Cluster, policy: Placement, batched: bool):
        super().__init__(cluster, batched)
        self.policy = policy

    def spreads(self) -> bool:
        """WF and LB on a bounded box use every device from the start, as a least-loaded router
        does (the paper's cloud opens devices on demand; a box's devices are there anyway)."""
        return self.cl.max_devices is not None and self.policy in (Placement.WF, Placement.LB)

    def run(self, ep: Epoch) -> None:
        if self.spreads():
            while self.open_device() is not None:
                pass
        for r in ep.departures:
            if r in self.cl.where:
                self._depart(r)
        for r, s in ep.sizes.items():
            if r in self.cl.where:
                self._resize(r, s)
        self._fix_overflow()
        for r, s in ep.arrivals.items():
            self._arrive(r, s)
            self._unplace(r)
            d = self.target(s, cached=ep.cached.get(r))
            self._relocate(r, d, "arrival")
            self.placed[r] = d
            self.item_moves.append(0)
        if self.policy is Placement.LB:
            self._balance()
        if not self.spreads():
            self.terminate_empty()

    def target(self, size: int, avoid: set[int] = frozenset(), cached: dict[int, int] | None = None) -> int:
        fits = [d for d in self.cl.active if d not in avoid and self.free(d) >= size]
        if fits:
            if self.policy is Placement.BF:
                return min(fits, key=lambda d: (self.free(d), d))
            worst = max(fits, key=lambda d: (self.free(d), -d))
            if cached:
                d = self._affine(size, cached, fits, worst)
                if d is not None:
                    return d
            return worst
        d = self.open_device()
        return d if d is not None else self.emptiest(avoid)

    def _affine(self, size: int, cached: dict[int, int], fits: list[int], worst: int) -> int | None:
        """The device of ``fits`` that cache-aware routing picks for an arrival of ``size``
        blocks, if any: LB's balancer would move nothing once it is placed there (the fullest
        and the emptiest active devices differ by at most C/10 blocks, or the fullest holds no
        request that would narrow the gap), or it is ``worst``, where worst fit puts it anyway.
        ``worst`` holding as much of the prompt as affinity's pick (which the request-count slack
        may have left it out of) keeps it: the arrival goes where worst fit puts it."""
        counts = {d: len(self.requests_on(d)) for d in self.cl.active}
        d = prefix_affinity({d: n for d, n in cached.items() if d in fits}, counts)
        if d is not None and cached.get(worst, 0) >= cached[d]:
            return worst
        if d is None or d == worst or not self._balancing(extra=(d, size)):
            return d
        return None

    def _fix_overflow(self) -> None:
        """A device over capacity sheds its newest requests: BF/WF preempt them (they start
        again wherever they fit), LB migrates them with their progress."""
        kind = MoveKind.MIGRATION if self.policy is Placement.LB else MoveKind.PREEMPTION
        for d in sorted(self.cl.active):
            if self.load(d) > self.C:
                self.item_moves.append(self._op(lambda d=d: self._shed_newest(d, kind)))

    def _shed_newest(self, d: int, kind: MoveKind) -> None:
        for r in sorted(self.requests_on(d), key=lambda r: -self.cl.arrived[r]):
            if self.load(d) <= self.C or len(self.requests_on(d)) == 1:
                return
            dst = self.target(self.cl.sizes[r], avoid={d})
            if dst != d:
                self._relocate(r, dst, f"device {d} overflowed as its requests grew", kind)

    def _balance(self) -> None:
        for r, hi, lo, gap in self._balancing():
            why = f"load balancing: device {hi} holds {gap} blocks more than {lo}"
            self.item_moves.append(self._op(lambda r=r, lo=lo, why=why: self._relocate(r, lo, why)))

    def _balancing(self, extra: tuple[int, int] | None = None) -> list[tuple[str, int, int, int]]:
        """LB's moves, as (request, from, to, gap): pair the fullest device with the emptiest,
        the next with the next, and move the request that best halves each pair's gap when the
        gap exceeds C/10. ``extra``: (device, blocks) of an arrival not yet placed, counted there
        as a request named ""."""
        load = {d: self.load(d) for d in self.cl.active}
        held = {d: {r: self.cl.sizes[r] for r in self.requests_on(d)} for d in self.cl.active}
        if extra is not None:
            load[extra[0]] += extra[1]
            held[extra[0]][""] = extra[1]
        order = sorted(self.cl.active, key=lambda d: (load[d], d))
        moves = []
        while len(order) >= 2:
            lo, hi = order.pop(0), order.pop()
            gap = load[hi] - load[lo]
            if 10 * gap <= self.C:
                break
            cands = [r for r, n in held[hi].items() if n < gap and n <= self.C - load[lo]]
            if cands:
                moves.append((min(cands, key=lambda r: (abs(2 * held[hi][r] - gap), r)), hi, lo, gap))
        return moves


# ---- Mell ----------------------------------------------------------------------------------


_CAP = {Category.M: 2, Category.S: 3}      # how many of its own category an M- / S-device takes


class _Mell(_Books):
    """Mell's operations over *items*: a request of category T..L is its own item; tiny
    requests are members of a multi-item (``cl.groups``), moved together."""

    def __init__(self, cluster: Cluster, batched: bool):
        super().__init__(cluster, batched)
        self.members: dict[str, set[str]] = {}
        for r, g in self.cl.groups.items():
            self.members.setdefault(g, set()).add(r)

    # ---- items ---------------------------------------------------------------------------
    def item_of(self, r: str) -> str:
        return self.cl.groups.get(r, r)

    def reqs(self, i: str) -> set[str]:
        return self.members.get(i) or {i}

    def size(self, i: str) -> int:
        return sum(self.cl.sizes[r] for r in self.reqs(i))

    def cat(self, i: str) -> Category:
        if i in self.members:
            return Category.T                  # a multi-item behaves as one T-item
        return max(category(self.cl.sizes[i], self.C), Category.T)

    def dev(self, i: str) -> int:
        return self.cl.where[next(iter(self.reqs(i)))]

    def items_on(self, d: int) -> set[str]:
        return {self.item_of(r) for r in self.requests_on(d)}

    def dev_cat(self, d: int) -> Category | None:
        items = self.items_on(d)
        return max((self.cat(i) for i in items), default=None)

    def under_three_quarters(self, d: int) -> bool:
        """Below Theorem 1's level: every T-device but the newest, and every L/M-device while
        T-devices exist, holds at least 3/4 of C."""
        return 4 * self.load(d) < 3 * self.C

    def count(self, d: int, c: Category) -> int:
        return sum(1 for i in self.items_on(d) if self.cat(i) is c)

    def put(self, i: str, d: int, reason: str) -> None:
        for r in self.reqs(i):
            self._relocate(r, d, reason)

    # ---- device choice -------------------------------------------------------------------
    def newest(self) -> int | None:
        return max(self.cl.active, key=lambda d: self.cl.active[d], default=None)

    def most_recent(self, cats: set[Category], exclude: set[int] = frozenset()) -> int | None:
        cands = [d for d in self.cl.active if d not in exclude and self.dev_cat(d) in cats]
        return max(cands, key=lambda d: self.cl.active[d], default=None)

    def prio(self, d: int) -> tuple:
        """Priority of a device for an arrival: more idle memory, then fewer items."""
        return (self.free(d), -len(self.items_on(d)), -d)

    def prio_to(self, src: int, d: int) -> tuple:
        """Priority of partner ``d`` for ``src``: same machine, more idle memory, fewer items."""
        same = self.cl.machines.get(src, 0) == self.cl.machines.get(d, 0)
        return (same, self.free(d), -len(self.items_on(d)), -d)

    def new_device(self, avoid: set[int]) -> int:
        """A fresh device, or on a full box the emptiest one."""
        d = self.open_device()
        return self.emptiest(avoid) if d is None else d

    # ---- ALLOCATE ------------------------------------------------------------------------
    def allocate(self, i: str, avoid: set[int] = frozenset()) -> None:
        c = self.cat(i)
        if c is Category.T:
            self._allocate_t(i, avoid)
        elif c is Category.L:
            self._allocate_l(i, avoid)
        else:
            self._allocate_sm(i, c, avoid)

    def _l_devices(self, avoid: set[int]) -> list[int]:
        return [d for d in self.cl.active if d not in avoid and self.dev_cat(d) is Category.L]

    def _lm_devices(self, avoid: set[int]) -> list[int]:
        return [d for d in self.cl.active if d not in avoid and self.dev_cat(d) in (Category.L, Category.M)]

    def _fill_t(self, d: int, max_moves: int = 4) -> None:
        """While device ``d`` is under 3/4 full, pull a T-item (``_filler``) from the most recent
        T-device (which keeps every other T-device full); at most ``max_moves`` items, so an
        operation stays within its migration bound."""
        for _ in range(max_moves):
            if not self.under_three_quarters(d):
                return
            src = self.most_recent({Category.T}, exclude={d})
            if src is None:
                return
            cands = [i for i in self.items_on(src) if self.cat(i) is Category.T and self.size(i) <= self.free(d)]
            if not cands:
                return
            self.put(self._filler(cands, d), d, f"T-item fills device {d}")

    def _allocate_t(self, i: str, avoid: set[int]) -> None:
        """T: an L- or M-device with room (highest priority), else an older T-device left under
        3/4 full (the fullest that fits), else the most recent T-device, else a new one.

        [open choice] The paper goes from the L/M-devices straight to the most recent T-device.
        An older T-device under 3/4 full (one a departure left with no T-item to pull back,
        or one that shed a grown item) is an exception to Theorem 1 that the paper closes with
        a migration the next time it refills; placing the item there closes it with none."""
        s = self.size(i)
        fits = [d for d in self._lm_devices(avoid) if self.free(d) >= s]
        if fits:
            d = max(fits, key=self.prio)
            return self.put(i, d, f"T-item fills {self.dev_cat(d).name}-device {d}")
        newest = self.most_recent({Category.T}, avoid)
        lagging = [d for d in self.cl.active if d not in avoid and d != newest and self.dev_cat(d) is Category.T
                   and self.under_three_quarters(d) and self.free(d) >= s]
        if lagging:
            d = max(lagging, key=lambda d: (self.load(d), -d))
            return self.put(i, d, f"T-item fills T-device {d}, under 3/4 full")
        d = newest
        if d is None or self.free(d) < s:
            d = self.new_device(avoid)
        self.put(i, d, f"T-item onto T-device {d}")

    def _allocate_sm(self, i: str, c: Category, avoid: set[int]) -> None:
        """S/M: an L-device whose L-item leaves room (T fillers there are re-allocated), else the
        most recent device of the same category with a free seat, else a new one."""
        s = self.size(i)
        fits = [d for d in self._l_devices(avoid) if self._sm_room(d) >= s]
        if fits:
            d = max(fits, key=self.prio)
            self.put(i, d, f"{c.name}-item beside the L-item of device {d}")
            return self._shed_t(d)
        d = self.most_recent({c}, avoid)
        if d is None or self.count(d, c) >= _CAP[c] or self._sm_room(d) < s:
            d = self.new_device(avoid)
        self.put(i, d, f"{c.name}-item onto {c.name}-device {d}")
        self._shed_t(d)
        if c is Category.M and self.count(d, c) == _CAP[c]:
            self._fill_t(d)

    def _sm_room(self, d: int) -> int:
        """Room for an S/M-item on an L-device (none if it has one already), or on an S/M-device,
        counting the T fillers as movable."""
        items = self.items_on(d)
        if self.dev_cat(d) is Category.L and any(self.cat(i) in (Category.S, Category.M) for i in items):
            return 0
        return self.C - sum(self.size(i) for i in items if self.cat(i) > Category.T)

    def _shed_t(self, d: int) -> None:
        """Re-allocate T-items (largest first) off device ``d`` until it fits."""
        while self.load(d) > self.C:
            ts = [i for i in self.items_on(d) if self.cat(i) is Category.T]
            if not ts:
                return
            i = max(ts, key=lambda i: (self.size(i), i))
            self.allocate(i, avoid={d})
            if self.dev(i) == d:                # a full box had nowhere else to put it
                return

    def _allocate_l(self, i: str, avoid: set[int]) -> None:
        """L: a new device; pull one S/M-item and T fillers into it (the S/M-item's device is
        refilled from the most recent device of its category)."""
        d = self.open_device()
        if d is None:
            d = self.emptiest(avoid)
            return self.put(i, d, f"L-item onto device {d} (no device left to open)")
        self.put(i, d, f"L-item opens device {d}")
        self._pull_sm(d, avoid)
        self._fill_t(d)

    def _pull_sm(self, d: int, avoid: set[int]) -> None:
        """Move an S/M-item from the highest-priority S/M-device into ``d`` if one fits, then
        refill the device it came from with one from the most recent device of its category."""
        room = self._sm_room(d)
        best = None
        for j in sorted(self.cl.active, key=lambda j: self.prio_to(d, j), reverse=True):
            if j == d or j in avoid or self.dev_cat(j) not in (Category.S, Category.M):
                continue
            cands = [i for i in self.items_on(j) if self.cat(i) in (Category.S, Category.M) and self.size(i) <= room]
            if cands:
                best = (j, max(cands, key=lambda i: (self.size(i), i)))
                break
        if best is None:
            return
        j, moved = best
        c = self.cat(moved)
        self.put(moved, d, f"{c.name}-item fills L-device {d}")
        self._shed_t(d)
        self._refill_sm(j, c)

    def _refill_sm(self, j: int, c: Category) -> None:
        """Device ``j`` lost a ``c``-item: take one from the most recent ``c``-device."""
        if j == self.newest() or not self.requests_on(j):
            return
        src = self.most_recent({c}, exclude={j})
        if src is None or self.cl.active[src] < self.cl.active[j]:
            return                                  # j is the most recent of its kind
        cands = [i for i in self.items_on(src) if self.cat(i) is c and self.size(i) <= self._sm_room(j)]
        if cands and self.count(j, c) < _CAP[c]:
            i = max(cands, key=lambda i: (self.size(i), i))
            self.put(i, j, f"{c.name}-item refills {c.name}-device {j}")
            self._shed_t(j)

    # ---- DEPART --------------------------------------------------------------------------
    def depart(self, i: str, d: int, c: Category, dcat: Category | None) -> None:
        """Item ``i`` (category ``c``) has left device ``d`` (category ``dcat`` before)."""
        if d == self.newest() or dcat is None:
            return
        if c is Category.T:
            kinds = {Category.T, Category.M} if dcat is Category.T else {Category.T}
            self._refill_t(d, kinds)
        elif c in (Category.S, Category.M):
            if dcat in (Category.S, Category.M):
                self._refill_sm(d, c)
            elif dcat is Category.L:
                self._replenish(d)
        else:
            for other in sorted(self.items_on(d)):
                self.allocate(other, avoid={d})

    def _replenish(self, d: int) -> None:
        """An L-device that lost items takes an S/M-item (if one fits) and T fillers."""
        if self.dev_cat(d) is Category.L:
            self._pull_sm(d, avoid=set())
            self._fill_t(d)

    def _refill_t(self, d: int, kinds: set[Category]) -> None:
        """A T-item left device ``d``: take a T-item (``_filler``) from the most recent device of
        ``kinds``, if ``d`` is now under 3/4 full.

        [open choice] The paper refills on every T departure; Theorem 1 only needs a T-device
        3/4 full, and a device left between 3/4 and full keeps the rest as room for its
        requests' growth. Refilling it anyway packed it to the brim, so the next tokens
        overflowed it and an item moved out again: in the paper-scale simulation (six ShareGPT x10
        traces) the lazy refill moved 28-40% fewer requests, peaks within a device."""
        if not self.under_three_quarters(d):
            return
        src = self.most_recent(kinds, exclude={d})
        if src is None:
            return
        cands = [i for i in self.items_on(src) if self.cat(i) is Category.T and self.size(i) <= self.free(d)]
        if cands:
            self.put(self._filler(cands, d), d, f"T-item refills device {d}")

    def _filler(self, cands: list[str], d: int) -> str:
        """Which T-item a device under 3/4 full pulls: the smallest that brings it to 3/4, else
        the largest that fits (and the next pull goes on).

        [open choice] The paper pulls the largest that fits, which packs the device to the brim,
        so its requests' next tokens overflow it and an item moves out again. Pulling only what
        3/4 needs keeps the rest as room for growth: at paper scale (18 ShareGPT x10 traces, three
        seeds) this and the T placement above move 12% fewer requests, with 1% fewer mean devices
        and peaks from two devices lower to one higher."""
        need = -(-3 * self.C // 4) - self.load(d)
        enough = [i for i in cands if self.size(i) >= need]
        if enough:
            return min(enough, key=lambda i: (self.size(i), i))
        return max(cands, key=lambda i: (self.size(i), i))

    def remove_item(self, i: str) -> None:
        for r in self.reqs(i):
            self._unplace(r)

    # ---- UPDATE --------------------------------------------------------------------------
    def update(self, i: str, old: Category) -> set[int] | None:
        """``i`` grew from category ``old`` into a larger one (Fig. 10 UPDATE). When it has to
        move, it departs here (as an ``old``-item) and the set of devices to avoid is returned:
        the epoch allocates every such item afterwards, largest first."""
        new, d = self.cat(i), self.dev(i)
        over = self.load(d) > self.C
        if new in (Category.S, Category.M) and old in (Category.T, Category.S):
            return self._leave(i, old, set())
        if new is Category.L and old is not Category.L:
            if any(self.cat(o) is Category.L for o in self.items_on(d) if o != i):
                return self._leave(i, old, set())
            if over:
                self._clear_others(d, i)
            else:
                self._replenish(d)            # a new L-device takes an S/M-item if it has none
            return None
        return self._leave(i, old, {d}) if over else None

    def _leave(self, i: str, as_cat: Category, avoid: set[int]) -> set[int]:
        """DEPART ``i`` as an ``as_cat``-item; it waits off-device for its ALLOCATE."""
        d = self.dev(i)
        dcat = max(as_cat, max((self.cat(o) for o in self.items_on(d) if o != i), default=Category.TINY))
        self.remove_item(i)
        self.depart(i, d, as_cat, dcat)
        return avoid

    def _move_out(self, i: str, avoid: set[int]) -> None:
        self._leave(i, self.cat(i), avoid)
        self.allocate(i, avoid)

    def _clear_others(self, d: int, keep: str) -> None:
        """Every item on ``d`` but ``keep`` is allocated elsewhere; an L-device left with room
        takes an S/M-item and T fillers again."""
        for other in sorted(self.items_on(d) - {keep}):
            self.allocate(other, avoid={d})
        self._replenish(d)

    # ---- an epoch ------------------------------------------------------------------------
    def run(self, ep: Epoch) -> None:
        """DEPARTs (newest device first), then UPDATEs (size changes: every departure part
        first, then the allocations, largest item first), then ALLOCATEs; empty devices are
        terminated."""
        self._departures(ep.departures)
        was = {r: self.cat(self.item_of(r)) for r in self.cl.where}
        for r, s in ep.sizes.items():
            if r in self.cl.where:
                self._resize(r, s)
        self._regroup()
        self._updates(was)
        for d in sorted(self.cl.active):
            self._settle_overflow(d)
        for r, s in ep.arrivals.items():
            self._arrive(r, s)
            self.placed[r] = NOWHERE
            self.item_moves.append(self._op(lambda r=r, s=s: self._allocate_request(r, s)))
        self.terminate_empty()
        self.cl.groups = {r: g for g, ms in self.members.items() for r in ms}

    def _departures(self, gone: set[str]) -> None:
        """DEPART each request (newest device first). A tiny request leaving shrinks its
        multi-item without a DEPART of its own, so afterwards every device left under 3/4 full
        (oldest first) takes T-items from the most recent T-device, as a T departure would."""
        rs = [r for r in gone if r in self.cl.where]
        left = {self.cl.where[r] for r in rs}
        for r in sorted(rs, key=lambda r: (-self.cl.active.get(self.cl.where[r], 0), r)):
            self.item_moves.append(self._op(lambda r=r: self._depart_request(r)))
        for d in sorted(left & set(self.cl.active), key=lambda d: self.cl.active[d]):
            if d != self.newest() and self.requests_on(d):
                self.item_moves.append(self._op(lambda d=d: self._fill_t(d)))

    def _updates(self, was: dict[str, Category]) -> None:
        waiting: list[tuple[str, set[int], int, int]] = []
        for i in sorted({self.item_of(r) for r in self.cl.where}):
            old = was[next(iter(self.reqs(i)))]
            if self.cat(i) > old:
                d, out = self.dev(i), []
                n = self._op(lambda i=i, old=old: out.append(self.update(i, old)))
                if out[0] is not None:
                    waiting.append((i, out[0], d, n))
                else:
                    self.item_moves.append(n)
        for i, avoid, d, n in sorted(waiting, key=lambda w: (-self.size(w[0]), w[0])):
            m = self._op(lambda i=i, avoid=avoid: self.allocate(i, avoid))
            self.item_moves.append(n + m + (self.dev(i) != d))

    def _settle_overflow(self, d: int) -> None:
        """A device still over capacity after the category changes (growth within a category):
        with an L-item there, the others leave (L -> L growth); otherwise items leave, smallest
        category first, until it fits. [open choice] Within that category the item that makes
        room with the fewest requests (then the smallest) leaves, else the largest: a
        multi-item moves all its tiny requests, and a device that overflows by a block or two
        needs only one of them gone (at paper scale 15-30% fewer migrations, the same peaks
        within a device)."""
        for _ in range(len(self.items_on(d))):
            items = self.items_on(d)
            if d not in self.cl.active or self.load(d) <= self.C or len(items) <= 1:
                return
            ls = [i for i in items if self.cat(i) is Category.L]
            if ls:
                keep = max(ls, key=lambda i: (self.size(i), i))
                self.item_moves.append(self._op(lambda: self._clear_others(d, keep)))
                return
            i = self._leaver(items, self.load(d) - self.C)
            self.item_moves.append(self._op(lambda i=i: self._move_out(i, avoid={d})) + 1)

    def _leaver(self, items: set[str], excess: int) -> str:
        """The item of the smallest category that makes ``excess`` blocks of room with the
        fewest requests (then the smallest), else the largest of that category."""
        low = min(self.cat(i) for i in items)
        cands = [i for i in items if self.cat(i) is low]
        enough = [i for i in cands if self.size(i) >= excess]
        if enough:
            return min(enough, key=lambda i: (len(self.reqs(i)), self.size(i), i))
        return max(cands, key=lambda i: (self.size(i), i))

    def _depart_request(self, r: str) -> None:
        i = self.item_of(r)
        if i in self.members and len(self.members[i]) > 1:
            self.members[i].discard(r)             # the multi-item stays; it just shrinks
            del self.cl.groups[r]
            self._depart(r)
            return
        d, c, dcat = self.dev(i), self.cat(i), self.dev_cat(self.dev(i))
        self._depart(r)
        self._drop_group(i)
        self.depart(i, d, c, dcat)

    def _new_group(self, r: str) -> str:
        """A new multi-item holding only ``r``."""
        self.cl.clock += 1
        g = f"~{self.cl.clock}"
        self.members[g] = {r}
        self.cl.groups[r] = g
        return g

    def _drop_group(self, g: str) -> None:
        for r in self.members.pop(g, ()):
            self.cl.groups.pop(r, None)
        if self.cl.open_group == g:
            self.cl.open_group = None

    def _allocate_request(self, r: str, s: int) -> None:
        if category(s, self.C) is Category.TINY and self._join_open_group(r, s):
            return
        if category(s, self.C) is Category.TINY:
            self.cl.open_group = self._new_group(r)
        self._unplace(r)
        self.allocate(self.item_of(r))
        self.placed[r] = self.cl.where[r]

    def _join_open_group(self, r: str, s: int) -> bool:
        g = self.cl.open_group
        if g is None or g not in self.members:
            return False
        d = self.dev(g)
        if 4 * (self.size(g) + s) > self.C or self.free(d) < s:
            return False
        self.members[g].add(r)
        self.cl.groups[r] = g
        self._add(r, d)
        self.placed[r] = d
        return True

    def _regroup(self) -> None:
        """After growth: a member that is no longer tiny leaves its multi-item (in place); a
        multi-item over C/4 splits its largest members off, in place, as new multi-items."""
        for g in sorted(self.members):
            ms = self.members[g]
            for r in sorted(ms):
                if category(self.cl.sizes[r], self.C) is not Category.TINY and len(ms) > 1:
                    ms.discard(r)
                    del self.cl.groups[r]
            if len(ms) == 1 and category(self.cl.sizes[next(iter(ms))], self.C) is not Category.TINY:
                self._drop_group(g)
                continue
            while 4 * self.size(g) > self.C and len(ms) > 1:
                r = max(ms, key=lambda r: (self.cl.sizes[r], r))
                ms.discard(r)
                self._new_group(r)


def violations(cluster: Cluster) -> list[str]:
    """Theorem 1's properties, checked on a cluster, except on the most recently activated
    device of each category (the paper's constant number of exceptions; the most recent
    T-device alone does not count as "T-devices exist"). Returns what fails."""
    m = _Mell(cluster, True)
    out = []
    latest = {c: m.most_recent({c}) for c in Category}
    by_cat = {d: m.dev_cat(d) for d in m.cl.active}
    t_exist = any(c is Category.T and d != latest[Category.T] for d, c in by_cat.items())
    sm_items = [(d, i) for d in m.cl.active if by_cat[d] in (Category.S, Category.M)
                for i in m.items_on(d) if m.cat(i) in (Category.S, Category.M)]
    for d, c in by_cat.items():
        if c is None or d == latest.get(c):
            continue
        if c is Category.M and m.count(d, Category.M) != 2:
            out.append(f"M-device {d} holds {m.count(d, Category.M)} M-items")
        if c is Category.S and m.count(d, Category.S) != 3:
            out.append(f"S-device {d} holds {m.count(d, Category.S)} S-items")
        if c is Category.T and m.under_three_quarters(d):
            out.append(f"T-device {d} is {m.load(d)}/{m.C} full")
        if c is Category.L and m._sm_room(d) > 0 and not any(
                m.cat(i) in (Category.S, Category.M) for i in m.items_on(d)):
            if any(m.size(i) <= m._sm_room(d) for j, i in sm_items):
                out.append(f"L-device {d} has room for an S/M-item left on an S/M-device")
        if t_exist and c in (Category.L, Category.M) and m.under_three_quarters(d):
            out.append(f"T-devices exist while {c.name}-device {d} is {m.load(d)}/{m.C} full")
    return out
