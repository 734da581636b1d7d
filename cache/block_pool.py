"""Bookkeeping for one device's unified block pool.

A block holds ``block_size`` rows of ``unit`` elements in every layer. A
KV-cache request takes a (K, V) pair of blocks per ``block_size`` tokens:

    block table of a KV request:  [K0, V0, K1, V1, ...]   tokens 0..B-1 -> (K0, V0), ...

The pool answers with an ``Allocation`` or ``None``; it never touches tensors
and never sees a request object, only its id.

With prefix caching (cache.prefix) a full KV token-block may be in several tables at once:
each block counts the tables that hold it, and a named block nobody holds stays idle, free to
take, until the pool needs it for something else.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.cache.prefix import Key, PrefixCache
from tandem.engine.messages import CacheType, Direction, PoolInfo, SlotCopy


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    num_blocks: int             # blocks in the pool
    block_size: int             # token slots per block
    hidden_blocks: int = 0      # blocks per block_size tokens of a hidden cache: d_model / unit
                                # (1 for multi-head attention); 0 when d_model is not a multiple

    @classmethod
    def of(cls, info: PoolInfo) -> "PoolGeometry":
        """The geometry of the pool a worker reported."""
        return cls(info.num_blocks, info.block_size, info.hidden_rows)

    def blocks_per_token_block(self, cache_type: CacheType) -> int:
        """Blocks a request needs per block_size tokens (2 for KV: one K, one V)."""
        if cache_type is CacheType.KV:
            return 2
        if self.hidden_blocks:
            return self.hidden_blocks
        raise ValueError(f"cache type {cache_type.value} is not supported by this pool")

    @property
    def hidden_ratio(self) -> float:
        """Apt-Serve's r: memory of a hidden cache relative to a KV cache (inf if unsupported)."""
        return self.hidden_blocks / 2 if self.hidden_blocks else float("inf")

    def blocks_for(self, num_tokens: int, cache_type: CacheType = CacheType.KV) -> int:
        """Blocks needed to hold num_tokens tokens."""
        token_blocks = -(-num_tokens // self.block_size)
        return token_blocks * self.blocks_per_token_block(cache_type)


@dataclass(slots=True)
class Allocation:
    block_ids: list[int]                 # appended to the request's table, in order
    directions: list[Direction]          # fill direction of each new block


@dataclass(slots=True)
class Placement:
    """What growing a request for one step did, in either kind of pool (the scheduler's contract):
    whole blocks appended to its table, or explicit slots of shared blocks plus the copies to
    run before the step."""
    block_ids: list[int] = field(default_factory=list)        # whole-block pools: appended blocks
    directions: list[Direction] = field(default_factory=list)
    slots: list[tuple[int, int]] | None = None                # bidirectional pools: (token-block, slot)
    checkpoints: list[SlotCopy] = field(default_factory=list)  # copy out to the CPU first
    swap_ins: list[SlotCopy] = field(default_factory=list)     # then copy these back in


@dataclass(slots=True)
class _Table:
    cache_type: CacheType
    block_ids: list[int] = field(default_factory=list)
    directions: list[Direction] = field(default_factory=list)
    named: int = 0                       # leading token-blocks whose keys were offered (prefix caching)


class BlockPool:
    """Whole blocks per request. The scheduler uses ``place``, ``free``, ``num_blocks_of``,
    ``num_free``, ``num_cpu``, ``num_be_only``, ``num_rt_with_room``, ``foreign_slots``, ``drop``
    and ``check_cache_type``; a pool that can take a BE owner's slots for an RT request
    (bidirectional blocks) says so with ``preempts_blocks``. With ``prefix_caching`` it also
    answers ``cached_prefix``, ``attach`` and ``name_full``."""

    preempts_blocks = False
    num_be_only = 0                      # blocks an RT request could take from BE owners
    num_rt_with_room = 0                 # blocks a BE request could fill beside an RT owner

    def __init__(self, geometry: PoolGeometry, prefix_caching: bool = False):
        self.geometry = geometry
        # blocks given back, handed out again last-in first-out; blocks from ``_fresh`` up were
        # never handed out. A pool keeps books on the blocks it has used, not on all it has: a
        # small model's pool has a million blocks, and building or checking lists of them all
        # cost tens of milliseconds (each step, where tests check the invariants)
        self._free: list[int] = []
        self._fresh = 0
        self._refs: list[int] = []          # tables holding each block below ``_fresh``
        self._num_shared = 0                 # blocks more than one table holds (prefix caching)
        self._tables: dict[str, _Table] = {}
        self.prefix = PrefixCache() if prefix_caching else None

    @property
    def num_free(self) -> int:
        """Blocks a request may take: never handed out, or named but idle (prefix caching)."""
        return self._unheld + (self.prefix.num_idle_blocks if self.prefix else 0)

    @property
    def _unheld(self) -> int:
        """Blocks on the free list or never handed out."""
        return len(self._free) + self.geometry.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        return self.geometry.num_blocks - self._unheld

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used / max(1, self.geometry.num_blocks)

    def num_blocks_of(self, req_id: str) -> int:
        t = self._tables.get(req_id)
        return len(t.block_ids) if t else 0

    def table(self, req_id: str) -> list[int]:
        t = self._tables.get(req_id)
        return list(t.block_ids) if t else []

    def grow(self, req_id: str, num_tokens: int, cache_type: CacheType = CacheType.KV) -> Allocation | None:
        """Make req_id's table hold num_tokens tokens; None (and no change) if blocks run out."""
        t = self._tables.get(req_id)
        if t is not None and t.cache_type is not cache_type:
            raise ValueError(f"request {req_id} holds {t.cache_type.value} blocks, asked for {cache_type.value}")
        have = len(t.block_ids) if t else 0
        need = self.geometry.blocks_for(num_tokens, cache_type) - have
        if need <= 0:
            return Allocation([], [])
        if need > self.num_free:
            return None
        if t is None:
            t = self._tables[req_id] = _Table(cache_type)
        new = self._take(need)
        dirs = [Direction.LEFT] * need
        t.block_ids.extend(new)
        t.directions.extend(dirs)
        return Allocation(new, dirs)

    def _take(self, n: int) -> list[int]:
        """n blocks off the free list, forgetting the least recently used idle named ones when it
        runs dry (the caller checked n <= num_free)."""
        while self._unheld < n:
            self._free.extend(reversed(self.prefix.evict()))
        new = [self._free.pop() for _ in range(min(n, len(self._free)))]
        for b in new:
            self._refs[b] = 1
        fresh = n - len(new)                 # low ids first
        new.extend(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        self._refs.extend([1] * fresh)
        return new

    # ---- prefix caching --------------------------------------------------------------------
    def cached_prefix(self, keys: list[Key], limit: int) -> int:
        """How many leading token-blocks (at most ``limit``) of a token sequence with these keys
        are cached here."""
        return self.prefix.longest(keys, limit) if self.prefix else 0

    def shared_blocks(self, keys: list[Key]) -> int:
        """Blocks of these cached token-blocks (all cached: see ``cached_prefix``) that other
        requests hold: a request attaching them takes them from nobody's free count."""
        return self.prefix.held_blocks(keys) if self.prefix else 0

    def held_ids(self, keys: Iterable[Key]) -> set[int]:
        """Blocks of these cached token-blocks that some request holds (the ones ``shared_blocks``
        counts)."""
        if self.prefix is None:
            return set()
        return {b for k in keys if k not in self.prefix.idle for b in self.prefix.blocks[k]}

    def attach(self, req_id: str, keys: list[Key]) -> Allocation:
        """Start req_id's (KV) table with the cached token-blocks of these keys (all cached: see
        ``cached_prefix``), as ``grow`` would have appended them."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id} already holds blocks")
        t = self._tables[req_id] = _Table(CacheType.KV, named=len(keys))
        for k in keys:
            group = self.prefix.blocks[k]
            self.prefix.held(k)
            for b in group:
                self._refs[b] += 1
                self._num_shared += self._refs[b] == 2
            t.block_ids.extend(group)
        t.directions = [Direction.LEFT] * len(t.block_ids)
        return Allocation(list(t.block_ids), list(t.directions))

    def shared_ids(self, req_id: str) -> list[int]:
        """Blocks of req_id's table that other requests hold too (prefix caching): freeing its
        table does not free them. Only its named leading blocks can be shared; a group's blocks
        are held together, so one count per group says it for all of them."""
        t = self._tables.get(req_id)
        if not self._num_shared or t is None or not t.named:
            return []
        refs, per, ids = self._refs, self.geometry.blocks_per_token_block(t.cache_type), t.block_ids
        return [b for i in range(0, t.named * per, per) if refs[ids[i]] > 1 for b in ids[i:i + per]]

    def num_shared(self, req_id: str) -> int:
        return len(self.shared_ids(req_id))

    def num_named(self, req_id: str) -> int:
        """Leading token-blocks of req_id's table already offered to the prefix cache."""
        t = self._tables.get(req_id)
        return t.named if t else 0

    def name_full(self, req_id: str, keys: list[Key]) -> None:
        """req_id's first len(keys) token-blocks are computed and full: name those not named yet,
        so later requests with the same tokens find them."""
        t = self._tables.get(req_id)
        if self.prefix is None or t is None or t.cache_type is not CacheType.KV:
            return
        end = min(len(keys), len(t.block_ids) // 2)
        for i in range(t.named, end):
            self.prefix.name(keys[i], tuple(t.block_ids[2 * i:2 * i + 2]))
        t.named = max(t.named, end)

    def place(self, req_id: str, num_tokens: int, cache_type: CacheType, rt: bool) -> Placement | None:
        """Grow req_id to num_tokens tokens for a step; None (and no change) if blocks run out."""
        a = self.grow(req_id, num_tokens, cache_type)
        return None if a is None else Placement(a.block_ids, a.directions)

    def num_cpu(self, req_id: str) -> int:
        """Tokens of req_id parked on the CPU (never, with whole blocks)."""
        return 0

    def foreign_slots(self, req_id: str) -> int:
        """Slots of req_id's blocks that it cannot fill (none: a whole block is its owner's)."""
        return 0

    def drop(self, req_id: str) -> list[SlotCopy]:
        raise TypeError("a whole-block pool does not preempt blocks (preempts_blocks is False)")

    def check_cache_type(self, cache_type: CacheType) -> None:
        """ValueError if this pool cannot hold that kind of cache."""
        self.geometry.blocks_per_token_block(cache_type)

    def free(self, req_id: str) -> int:
        """Let go of all of req_id's blocks; how many it held. A block no table holds any more
        goes back to the free list, or, named, waits idle (its last token-blocks first in line
        to go, so the start of a prefix stays longest)."""
        t = self._tables.pop(req_id, None)
        if t is None:
            return 0
        g = 2 if t.cache_type is CacheType.KV else 1
        ids = t.block_ids
        for i in range(len(ids) - g, -1, -g):
            group = ids[i:i + g]
            for b in group:
                self._num_shared -= self._refs[b] == 2
                self._refs[b] -= 1
            if self._refs[group[0]]:
                continue
            key = self.prefix.key_of(group) if self.prefix and t.cache_type is CacheType.KV else None
            if key is None:
                self._free.extend(reversed(group))
            else:
                self.prefix.released(key)
        return len(ids)

    def check_invariants(self) -> None:
        """Every block is exactly one of: free, held (its count = the tables listing it), or named
        and idle; a named block is idle exactly when no table holds it."""
        n = self.geometry.num_blocks
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if not 0 <= self._fresh <= n or len(self._refs) != self._fresh or any(b >= self._fresh for b in free):
            raise AssertionError(f"blocks handed out: {self._fresh} of {n}, counts kept for {len(self._refs)}, "
                                 f"free list up to {max(free, default=None)}")
        listed: dict[int, int] = {}
        for rid, t in self._tables.items():
            if len(set(t.block_ids)) != len(t.block_ids):
                raise AssertionError(f"{rid} lists a block twice")
            for b in t.block_ids:
                listed[b] = listed.get(b, 0) + 1
        if any(b >= self._fresh for b in listed):
            raise AssertionError(f"a table lists a block never handed out (from {self._fresh} up)")
        # counted in C, not per block in Python: a test checks this after every step
        for b, k in listed.items():
            if self._refs[b] != k:
                raise AssertionError(f"block {b}: count {self._refs[b]}, listed by {k} tables")
        held = self._fresh - self._refs.count(0)
        if held != len(listed):     # the listed blocks' counts match, so another block has one
            b = next(b for b, r in enumerate(self._refs) if r and b not in listed)
            raise AssertionError(f"block {b}: count {self._refs[b]}, listed by 0 tables")
        shared = held - self._refs.count(1)
        if self._num_shared != shared:
            raise AssertionError(f"{self._num_shared} blocks counted as shared, {shared} are")
        if free & listed.keys():
            raise AssertionError("a block is both free and held")
        idle: set[int] = set()
        if self.prefix:
            for key, group in self.prefix.blocks.items():
                if (key in self.prefix.idle) == bool(self._refs[group[0]]):
                    raise AssertionError(f"named group {group}: idle {key in self.prefix.idle}, "
                                         f"held by {self._refs[group[0]]}")
                if free & set(group):
                    raise AssertionError(f"named group {group} is on the free list")
                if key in self.prefix.idle:
                    idle.update(group)
            if len(idle) != self.prefix.num_idle_blocks:
                raise AssertionError("idle block count is off")
        if len(free) + len(listed) + len(idle) != self._fresh:
            raise AssertionError(f"free {len(free)} + held {len(listed)} + idle {len(idle)} != handed out "
                                 f"{self._fresh}")
