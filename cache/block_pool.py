"""Bookkeeping for one device's unified block pool.

A block holds ``block_size`` rows of ``unit`` elements in every layer. A
KV-cache request takes a (K, V) pair of blocks per ``block_size`` tokens:

    block table of a KV request:  [K0, V0, K1, V1, ...]   tokens 0..B-1 -> (K0, V0), ...

The pool answers with an ``Allocation`` or ``None``; it never touches tensors
and never sees a request object, only its id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


class BlockPool:
    """Whole blocks per request. The scheduler uses ``place``, ``free``, ``num_blocks_of``,
    ``num_free``, ``num_cpu``, ``num_be_only``, ``num_rt_with_room``, ``foreign_slots``, ``drop``
    and ``check_cache_type``; a pool that can take a BE owner's slots for an RT request
    (bidirectional blocks) says so with ``preempts_blocks``."""

    preempts_blocks = False
    num_be_only = 0                      # blocks an RT request could take from BE owners
    num_rt_with_room = 0                 # blocks a BE request could fill beside an RT owner

    def __init__(self, geometry: PoolGeometry):
        self.geometry = geometry
        # pop() from the end hands out low ids first; purely cosmetic
        self._free: list[int] = list(range(geometry.num_blocks - 1, -1, -1))
        self._owner: list[str | None] = [None] * geometry.num_blocks
        self._tables: dict[str, _Table] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.geometry.num_blocks - len(self._free)

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
        if need > len(self._free):
            return None
        if t is None:
            t = self._tables[req_id] = _Table(cache_type)
        new = [self._free.pop() for _ in range(need)]
        for b in new:
            self._owner[b] = req_id
        dirs = [Direction.LEFT] * need
        t.block_ids.extend(new)
        t.directions.extend(dirs)
        return Allocation(new, dirs)

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
        """Return all of req_id's blocks to the free list; how many were freed."""
        t = self._tables.pop(req_id, None)
        if t is None:
            return 0
        for b in t.block_ids:
            self._owner[b] = None
        self._free.extend(reversed(t.block_ids))
        return len(t.block_ids)

    def check_invariants(self) -> None:
        """free + used = total; every used block has exactly one owner whose table lists it."""
        n = self.geometry.num_blocks
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        listed: dict[int, str] = {}
        for rid, t in self._tables.items():
            for b in t.block_ids:
                if b in listed:
                    raise AssertionError(f"block {b} owned by {listed[b]} and {rid}")
                listed[b] = rid
                if self._owner[b] != rid:
                    raise AssertionError(f"block {b}: owner {self._owner[b]} but listed by {rid}")
        if free & listed.keys():
            raise AssertionError("a block is both free and owned")
        if len(free) + len(listed) != n:
            raise AssertionError(f"free {len(free)} + used {len(listed)} != total {n}")
