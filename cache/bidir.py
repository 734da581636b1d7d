"""Bidirectional blocks with lazy checkpointing (BROS §5, SPEC §2.5): the bookkeeping.

The pool is cut into token-blocks of S slots; token-block ``t`` is the (K, V) pair of
physical blocks (2t, 2t+1). A token-block has at most one RT owner, filling slots
left to right from 0, and one BE owner, filling right to left from S-1 (its logical
offset o sits at physical slot S-1-o: Direction.RIGHT).

Every request keeps a slot map: for each of its tokens, the (token-block, physical
slot) holding its K/V, or None while that token is checkpointed on the CPU.

  RT growth (FindPreemptBlock), per token:
    1. an empty slot in its last block;
    2. else a free block; else an empty slot in an earlier block of its own (a BE owner that
       shared it has left);
    3. else, if its last block is shared with a BE owner: overwrite the BE token at the
       meeting point (BE's most recent token in that block) -- lazy checkpointing: that one
       token is recorded for copy-out to the CPU *before* the step writes the slot;
    4. else preempt the BE-only block with the most empty slots (becoming its RT owner);
    5. else fail (the caller drops requests to the CPU).
  BE growth (FindBlock), per token: an empty slot in its last block, else a free block, else
  an empty slot in an earlier block of its own (where an RT owner that overwrote its tokens
  has left), else a new block with the most empty slots (RT-owned blocks with no BE owner);
  BE never overwrites RT. [open choice] BROS looks at the last block and new blocks only;
  with no free block, holes in earlier blocks were then never filled and a pool of such
  requests stalled. Taking those holes only when no block is free keeps BROS's choices
  everywhere else (taking them first cost BROS 7% of its BE throughput in the simulator).
  Swap-in: a BE (or dropped) request's checkpointed tokens get slots by the BE rule
  (RT rule for RT requests) and are recorded for copy-in before the step.
  Drop: every on-device token of a request is recorded for copy-out and its slots freed.

Nothing here touches tensors: the caller turns the recorded copies into engine work.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tandem.cache.block_pool import Placement
from tandem.engine.messages import CacheType, SlotCopy


@dataclass(slots=True)
class TokenBlock:
    rt_id: str | None = None
    rt_fill: int = 0
    be_id: str | None = None
    be_fill: int = 0
    preempted: bool = False       # BE slots here were overwritten by the RT owner (or taken by it)

    def empty(self, size: int) -> int:
        return size - self.rt_fill - self.be_fill


@dataclass(slots=True)
class _Seq:
    rt: bool
    slots: list[tuple[int, int] | None] = field(default_factory=list)   # per token
    blocks: list[int] = field(default_factory=list)                     # token-blocks used, in order
    num_cpu: int = 0                                                    # tokens whose slot is None


@dataclass(slots=True)
class Growth:
    """What one grow/swap-in did: slots for the new tokens, and the copies to run first."""
    slots: list[tuple[int, int]] = field(default_factory=list)      # (token-block, slot) per token
    checkpoints: list[SlotCopy] = field(default_factory=list)       # copy out before the step
    swap_ins: list[SlotCopy] = field(default_factory=list)          # copy in before the step


class BidirectionalPool:
    def __init__(self, num_token_blocks: int, block_size: int):
        self.size = block_size
        self.blocks = [TokenBlock() for _ in range(num_token_blocks)]
        self.free_blocks: set[int] = set(range(num_token_blocks))
        # the others: what the per-step counts scan, so a step costs what is in use, not the pool
        self.owned: set[int] = set()
        self.seqs: dict[str, _Seq] = {}
        self.preemption_table: list[tuple[int, str, str, int]] = []   # (block, rt_id, be_id, slot)

    # ---- queries ---------------------------------------------------------------
    def num_tokens(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return len(s.slots) if s else 0

    def num_cpu(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return s.num_cpu if s else 0

    def slots_of(self, rid: str) -> list[tuple[int, int] | None]:
        return list(self.seqs[rid].slots)

    def foreign_slots(self, rid: str) -> int:
        """Slots of a BE request's token-blocks that it cannot fill, because RT owners hold them
        (BE never overwrites RT): it can hold k·S minus these before it needs another block.
        Counting k·S alone, a BE request sharing a full block with an RT request was planned to
        decode where it had no slot, and nothing ran. None for an RT request: it takes BE slots
        (the meeting point of its last block, a BE-only block), and where the pool finds none
        the scheduler sends other requests to the CPU until it fits, so the policy counts its
        blocks whole. (Counting the BE tokens in its earlier blocks against it stopped such
        a request for ever.)"""
        s = self.seqs.get(rid)
        if s is None or s.rt:
            return 0
        return sum(self.blocks[i].rt_fill for i in s.blocks if self.blocks[i].be_id == rid)

    def empty_slots(self) -> int:
        return len(self.free_blocks) * self.size + sum(self.blocks[i].empty(self.size) for i in self.owned)

    def view(self) -> dict[str, int]:
        """Token-blocks by owner (rt, be, shared, free) and checkpointed tokens."""
        v = {"rt": 0, "be": 0, "shared": 0, "free": len(self.free_blocks),
             "checkpointed": sum(s.num_cpu for s in self.seqs.values())}
        for b in map(self.blocks.__getitem__, self.owned):
            if b.rt_id and b.be_id:
                v["shared"] += 1
            elif b.rt_id:
                v["rt"] += 1
            elif b.be_id:
                v["be"] += 1
        return v

    # ---- growth ------------------------------------------------------------------
    def grow(self, rid: str, num_tokens: int, rt: bool) -> Growth | None:
        """Give ``rid`` slots up to ``num_tokens`` tokens (checkpointed ones swapped in first);
        None, with nothing changed, if the pool cannot."""
        seq = self.seqs.get(rid)
        if seq is not None and seq.rt != rt:
            raise ValueError(f"request {rid} is {'RT' if seq.rt else 'BE'}, asked to grow as the other")
        self._undo, self._touched = [], {}
        if seq is None:
            seq = self.seqs[rid] = _Seq(rt)
            self._undo.append(lambda: self.seqs.pop(rid))
        g = Growth()
        for t in ([t for t, s in enumerate(seq.slots) if s is None] if seq.num_cpu else ()):
            slot = self._take(rid, seq, g)
            if slot is None:
                return self._rollback()
            seq.slots[t] = slot
            seq.num_cpu -= 1
            self._undo.append(lambda t=t: self._set_slot(seq, t, None))
            g.swap_ins.append(SlotCopy(rid, t, *slot))
        while len(seq.slots) < num_tokens:
            slot = self._take(rid, seq, g)
            if slot is None:
                return self._rollback()
            seq.slots.append(slot)
            self._undo.append(seq.slots.pop)
            g.slots.append(slot)
        self._undo = None
        return g

    def _take(self, rid: str, seq: _Seq, g: Growth) -> tuple[int, int] | None:
        return self._take_rt(rid, seq, g) if seq.rt else self._take_be(rid, seq)

    def _take_rt(self, rid: str, seq: _Seq, g: Growth) -> tuple[int, int] | None:
        last = seq.blocks[-1] if seq.blocks else None
        if last is not None and self.blocks[last].rt_id == rid and self.blocks[last].empty(self.size) > 0:
            return self._place_rt(rid, last)
        if self.free_blocks:
            return self._place_rt(rid, self._claim(seq))
        own = self._own_room(rid, seq, rt=True)
        if own is not None:
            return self._place_rt(rid, own)
        if last is not None and self.blocks[last].rt_id == rid and self.blocks[last].be_fill > 0:
            self._overwrite_be(last, g)
            return self._place_rt(rid, last)
        be_only = [i for i, b in enumerate(self.blocks) if b.be_id is not None and b.rt_id is None]
        if not be_only:
            return None
        i = max(be_only, key=lambda i: (self.blocks[i].empty(self.size), -i))
        self._touch_block(i).preempted = True
        self._add_block(seq, i)
        if self.blocks[i].empty(self.size) == 0:
            self._overwrite_be(i, g)
        return self._place_rt(rid, i)

    def _place_rt(self, rid: str, i: int) -> tuple[int, int]:
        b = self._touch_block(i)
        b.rt_id = rid
        slot = b.rt_fill
        b.rt_fill += 1
        return i, slot

    def _overwrite_be(self, i: int, g: Growth) -> None:
        """The meeting point: checkpoint BE's most recent token in block i, freeing its slot."""
        b = self._touch_block(i)
        slot = self.size - b.be_fill
        be = self.seqs[b.be_id]
        t = be.slots.index((i, slot))
        self._set_slot(be, t, None)
        self._undo.append(lambda: self._set_slot(be, t, (i, slot)))
        g.checkpoints.append(SlotCopy(b.be_id, t, i, slot))
        self.preemption_table.append((i, b.rt_id, b.be_id, slot))
        self._undo.append(self.preemption_table.pop)
        b.be_fill -= 1
        b.preempted = True
        if b.be_fill == 0:
            pos = be.blocks.index(i)
            del be.blocks[pos]
            self._undo.append(lambda: be.blocks.insert(pos, i))
            b.be_id = None

    def _take_be(self, rid: str, seq: _Seq) -> tuple[int, int] | None:
        last = seq.blocks[-1] if seq.blocks else None
        if last is not None and self.blocks[last].be_id == rid and self.blocks[last].empty(self.size) > 0:
            return self._place_be(rid, last)
        if self.free_blocks:
            return self._place_be(rid, self._claim(seq))
        own = self._own_room(rid, seq, rt=False)
        if own is not None:
            return self._place_be(rid, own)
        cands = [i for i, b in enumerate(self.blocks) if b.be_id is None and b.empty(self.size) > 0]
        if not cands:
            return None
        i = max(cands, key=lambda i: (self.blocks[i].empty(self.size), -i))
        self._add_block(seq, i)
        return self._place_be(rid, i)

    def _own_room(self, rid: str, seq: _Seq, rt: bool) -> int | None:
        """A block of its own (on its side) with an empty slot, the latest first. Its earlier
        blocks have room once the other side's owner has left: an RT owner that overwrote its
        BE tokens (their swap-in comes back here), or a BE owner that filled the rest of a
        block RT took over. Without this, requests whose blocks have such holes while the pool
        has no free block could not grow at all."""
        for i in reversed(seq.blocks):
            b = self.blocks[i]
            if (b.rt_id if rt else b.be_id) == rid and b.empty(self.size) > 0:
                return i
        return None

    def _place_be(self, rid: str, i: int) -> tuple[int, int]:
        b = self._touch_block(i)
        b.be_id = rid
        b.be_fill += 1
        return i, self.size - b.be_fill

    def _claim(self, seq: _Seq) -> int:
        i = self.free_blocks.pop()
        self.owned.add(i)
        self._undo.append(lambda: (self.free_blocks.add(i), self.owned.discard(i)))
        self._add_block(seq, i)
        return i

    def _add_block(self, seq: _Seq, i: int) -> None:
        seq.blocks.append(i)
        self._undo.append(seq.blocks.pop)

    @staticmethod
    def _set_slot(seq: _Seq, t: int, slot: tuple[int, int] | None) -> None:
        seq.num_cpu += (slot is None) - (seq.slots[t] is None)
        seq.slots[t] = slot

    # ---- release -------------------------------------------------------------------
    def free_request(self, rid: str) -> None:
        """Forget rid: its slots (and checkpointed tokens) are released."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        for i in set(seq.blocks):
            self._leave(rid, i)

    def drop(self, rid: str) -> list[SlotCopy]:
        """Swap rid out whole: every on-device token is to be copied to the CPU, its slots freed."""
        seq = self.seqs[rid]
        out = [SlotCopy(rid, t, *s) for t, s in enumerate(seq.slots) if s is not None]
        for i in set(seq.blocks):
            self._leave(rid, i)
        seq.slots = [None] * len(seq.slots)
        seq.num_cpu = len(seq.slots)
        seq.blocks = []
        return out

    def _leave(self, rid: str, i: int) -> None:
        b = self.blocks[i]
        if b.rt_id == rid:
            b.rt_id, b.rt_fill = None, 0
        if b.be_id == rid:
            b.be_id, b.be_fill = None, 0
        if b.rt_id is None and b.be_id is None:
            b.preempted = False
            self.free_blocks.add(i)
            self.owned.discard(i)

    # ---- transactions: a failed grow leaves everything as it was ------------------------
    # During a grow every change logs its inverse (blocks: a copy on first touch), so undoing
    # costs what the grow changed, not the size of the pool or of the request.
    _undo: list | None = None
    _touched: dict | None = None

    def _touch_block(self, i: int) -> TokenBlock:
        b = self.blocks[i]
        if self._touched is not None and i not in self._touched:
            self._touched[i] = TokenBlock(b.rt_id, b.rt_fill, b.be_id, b.be_fill, b.preempted)
        return b

    def _rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        for i, b in self._touched.items():
            self.blocks[i] = b
        self._undo = self._touched = None

    # ---- invariants ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every slot owned at most once; fills match the slot maps; free blocks are empty;
        RT slots form a prefix from the left, BE slots a prefix from the right; nothing leaks."""
        S = self.size
        owner: dict[tuple[int, int], tuple[str, int]] = {}
        for rid, seq in self.seqs.items():
            if seq.num_cpu != sum(s is None for s in seq.slots):
                raise AssertionError(f"{rid}: checkpointed count {seq.num_cpu} disagrees with its slot map")
            for t, s in enumerate(seq.slots):
                if s is None:
                    continue
                if s in owner:
                    raise AssertionError(f"slot {s} owned by {owner[s]} and {(rid, t)}")
                owner[s] = (rid, t)
                if s[0] not in seq.blocks:
                    raise AssertionError(f"{rid}: token {t} in block {s[0]} not in its block list")
        if self.owned & self.free_blocks or len(self.owned) + len(self.free_blocks) != len(self.blocks):
            raise AssertionError(f"{len(self.owned)} blocks owned and {len(self.free_blocks)} free of "
                                 f"{len(self.blocks)}, {len(self.owned & self.free_blocks)} both")
        for i, b in enumerate(self.blocks):
            if b.rt_fill + b.be_fill > S or b.rt_fill < 0 or b.be_fill < 0:
                raise AssertionError(f"block {i}: fills {b.rt_fill} + {b.be_fill} exceed {S}")
            if (i in self.free_blocks) != (b.rt_id is None and b.be_id is None):
                raise AssertionError(f"block {i}: free-list membership disagrees with its owners")
            for side, rid, fill, expect in (("rt", b.rt_id, b.rt_fill, range(b.rt_fill)),
                                            ("be", b.be_id, b.be_fill, range(S - b.be_fill, S))):
                held = {s for (blk, s), (r, _) in owner.items() if blk == i and r == rid} if rid else set()
                if rid is None and fill:
                    raise AssertionError(f"block {i}: {side} fill {fill} without an owner")
                if rid is not None and held != set(expect):
                    raise AssertionError(f"block {i}: {side} owner {rid} holds {sorted(held)}, fill says "
                                         f"{list(expect)}")
                if rid is not None and (rid not in self.seqs or self.seqs[rid].rt != (side == "rt")):
                    raise AssertionError(f"block {i}: {side} owner {rid} is not a live {side} request")
        used = sum(1 for (blk, _s) in owner)
        if used != sum(b.rt_fill + b.be_fill for b in self.blocks):
            raise AssertionError("slots owned by requests != slots counted in blocks")


class BidirBlockPool(BidirectionalPool):
    """A BidirectionalPool over a device's pool geometry, answering the scheduler's block-pool
    questions in physical blocks (a token-block is a (K, V) pair of blocks). Its blocks are
    never shared between requests' prefixes: no prefix caching."""

    preempts_blocks = True
    prefix = None

    def __init__(self, geometry):
        super().__init__(geometry.num_blocks // 2, geometry.block_size)
        # blocks pair into token-blocks: an odd last block is never used, so the geometry the
        # scheduler and the placement read (capacity, pool usage) leaves it out
        self.geometry = replace(geometry, num_blocks=geometry.num_blocks // 2 * 2)

    @property
    def num_free(self) -> int:
        return 2 * len(self.free_blocks)

    def num_shared(self, rid: str) -> int:
        """No block is shared between two requests' prefixes here (a request's blocks may hold
        another's tokens, which ``foreign_slots`` counts)."""
        return 0

    @property
    def num_be_only(self) -> int:
        """Blocks an RT request could take from BE owners (BE-only token-blocks)."""
        return 2 * sum(1 for i in self.owned if self.blocks[i].be_id is not None and self.blocks[i].rt_id is None)

    @property
    def num_rt_with_room(self) -> int:
        """Blocks a BE request could fill from the other end beside an RT owner (RT-only
        token-blocks with empty slots)."""
        return 2 * sum(1 for b in map(self.blocks.__getitem__, self.owned)
                       if b.be_id is None and b.rt_id is not None and b.empty(self.size))

    def num_blocks_of(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return 2 * len(s.blocks) if s else 0

    def place(self, rid: str, num_tokens: int, cache_type: CacheType, rt: bool) -> Placement | None:
        """The scheduler's contract (cache.block_pool.Placement): slots from the front of a block
        for RT, from the back for BE."""
        self.check_cache_type(cache_type)
        g = self.grow(rid, num_tokens, rt)
        return None if g is None else Placement(slots=g.slots, checkpoints=g.checkpoints, swap_ins=g.swap_ins)

    def check_cache_type(self, cache_type: CacheType) -> None:
        if cache_type is not CacheType.KV:
            raise ValueError("cache_type: bidirectional blocks hold KV caches only")

    def free(self, rid: str) -> int:          # the scheduler's name for free_request
        n = self.num_blocks_of(rid)
        self.free_request(rid)
        return n
