"""Bidirectional blocks: hand-made cases, and random operation sequences checked against a mock
memory that plays the engine (each slot holds the (request, token) written into it)."""
import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cache import PoolGeometry
from tandem.cache.bidir import BidirBlockPool, BidirectionalPool

S = 4


def test_rt_left_be_right_in_one_block():
    p = BidirectionalPool(1, S)
    assert p.grow("be", 2, rt=False).slots == [(0, 3), (0, 2)]
    assert p.grow("rt", 2, rt=True).slots == [(0, 0), (0, 1)]
    assert p.view() == {"rt": 0, "be": 0, "shared": 1, "free": 0, "checkpointed": 0}
    p.check_invariants()


def test_be_takes_the_block_with_most_empty_slots_and_never_overwrites_rt():
    p = BidirectionalPool(2, S)
    p.grow("a", 3, rt=True)                     # block 0: 3 RT slots
    p.grow("b", 1, rt=True)                     # b never shares a's RT side: a free block
    assert p.slots_of("b") == [(1, 0)]
    g = p.grow("be", 3, rt=False)               # block 1 has 3 empty, block 0 has 1
    assert g.slots == [(1, 3), (1, 2), (1, 1)]
    assert p.grow("be", 4, rt=False).slots == [(0, 3)]
    assert p.grow("be", 5, rt=False) is None    # nothing empty left: BE waits
    assert p.num_tokens("be") == 4              # the failed grow changed nothing
    p.check_invariants()


def test_meeting_point_checkpoints_only_the_overwritten_be_token():
    p = BidirectionalPool(1, S)
    p.grow("be", 3, rt=False)                   # slots 3, 2, 1
    p.grow("rt", 1, rt=True)                    # slot 0: the block is full now
    g = p.grow("rt", 2, rt=True)                # meets BE: BE's newest token here (token 2, slot 1) goes out
    assert g.slots == [(0, 1)]
    assert [(c.req_id, c.token, c.block, c.slot) for c in g.checkpoints] == [("be", 2, 0, 1)]
    assert p.slots_of("be") == [(0, 3), (0, 2), None] and p.num_cpu("be") == 1
    assert p.preemption_table == [(0, "rt", "be", 1)]
    p.free_request("rt")
    g = p.grow("be", 3, rt=False)               # swapped back in where there is room
    assert [(c.token, c.block, c.slot) for c in g.swap_ins] == [(2, 0, 1)] and g.slots == []
    p.check_invariants()


def test_rt_preempts_the_be_only_block_with_most_empty_slots():
    p = BidirectionalPool(2, S)
    p.grow("be1", 4, rt=False)                  # block 0 full
    p.grow("be2", 2, rt=False)                  # block 1: 2 empty
    g = p.grow("rt", 1, rt=True)
    assert g.slots == [(1, 0)] and not g.checkpoints
    g = p.grow("rt", 3, rt=True)                # slot 1 empty; then meets be2's newest token (slot 2)
    assert g.slots == [(1, 1), (1, 2)] and [c.token for c in g.checkpoints] == [1]
    p.check_invariants()


def test_be_swaps_back_into_the_room_an_rt_owner_left_in_its_earlier_block():
    """With no free block, a BE request whose earlier block lost tokens to an RT owner that
    has since finished takes that room back (it used to look at its last block only, and
    never grew again while the pool stayed full)."""
    p = BidirectionalPool(2, S)
    p.grow("be", 8, rt=False)                   # both blocks full
    p.grow("rt", 2, rt=True)                    # overwrites two of be's tokens in one block
    lost = [t for t, s in enumerate(p.slots_of("be")) if s is None]
    block = p.seqs["rt"].blocks[0]
    assert len(lost) == 2 and p.seqs["be"].blocks[-1] != block
    p.free_request("rt")
    g = p.grow("be", 8, rt=False)               # swap the two back in: room only in that block
    assert g is not None and sorted(c.token for c in g.swap_ins) == lost
    assert {c.block for c in g.swap_ins} == {block}
    p.check_invariants()


def test_rt_grows_into_room_a_be_owner_left_in_its_earlier_block():
    """An RT request's earlier block that a BE owner has left has room: RT grows there instead
    of overwriting another BE request's token (or failing when there is none)."""
    p = BidirectionalPool(3, S)
    p.grow("be1", 2, rt=False)                  # half a block
    p.grow("be2", 8, rt=False)                  # two full blocks: none free
    p.grow("rt", 2, rt=True)                    # fills be1's block from the left
    shared = p.seqs["rt"].blocks[0]
    p.free_request("be2")
    p.grow("rt", 6, rt=True)                    # a free block of its own, filled
    p.grow("be3", 4, rt=False)                  # the last free block, full
    p.free_request("be1")                       # room in rt's first block again
    g = p.grow("rt", 7, rt=True)
    assert g.slots == [(shared, 2)] and not g.checkpoints
    assert p.num_cpu("be3") == 0
    p.check_invariants()


def test_drop_and_swap_in_whole_request():
    p = BidirectionalPool(2, S)
    p.grow("r", 6, rt=True)
    out = p.drop("r")
    assert [c.token for c in out] == list(range(6)) and p.view()["free"] == 2
    g = p.grow("r", 7, rt=True)
    assert sorted(c.token for c in g.swap_ins) == list(range(6)) and len(g.slots) == 1
    p.check_invariants()


def test_grow_as_the_other_class_is_an_error():
    p = BidirectionalPool(1, S)
    p.grow("r", 1, rt=True)
    with pytest.raises(ValueError):
        p.grow("r", 2, rt=False)


ops = st.lists(st.tuples(st.sampled_from(["grow", "grow", "grow", "free", "drop"]),
                         st.integers(0, 5), st.integers(1, 9)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 6))
def test_random_operations_keep_invariants_and_data(operations, num_blocks):
    p = BidirBlockPool(PoolGeometry(num_blocks=2 * num_blocks, block_size=S))
    memory: dict[tuple[int, int], tuple[str, int]] = {}      # what the engine's pool would hold
    cpu: dict[tuple[str, int], tuple[str, int]] = {}         # the CPU checkpoint store
    want: dict[str, int] = {}                                # tokens each live request holds
    for op, r, k in operations:
        rid, rt = f"q{r}", r % 2 == 0
        if op == "grow":
            g = p.grow(rid, want.get(rid, 0) + k, rt)
            if g is None:
                assert p.num_tokens(rid) == want.get(rid, 0)
                continue
            for c in g.checkpoints:                          # copy out before anything is written
                assert memory[(c.block, c.slot)] == (c.req_id, c.token)
                cpu[(c.req_id, c.token)] = memory.pop((c.block, c.slot))
            for c in g.swap_ins:
                assert (c.block, c.slot) not in memory, "swap-in onto a live slot"
                memory[(c.block, c.slot)] = cpu.pop((c.req_id, c.token))
            for t, s in enumerate(g.slots, start=want.get(rid, 0)):
                assert s not in memory, "new token onto a live slot"
                memory[s] = (rid, t)
            want[rid] = want.get(rid, 0) + k
        elif op == "free" and rid in want:
            p.free_request(rid)
            for key in [m for m, v in memory.items() if v[0] == rid]:
                del memory[key]
            for key in [c for c in cpu if c[0] == rid]:
                del cpu[key]
            del want[rid]
        elif op == "drop" and rid in want:
            for c in p.drop(rid):
                cpu[(rid, c.token)] = memory.pop((c.block, c.slot))
        p.check_invariants()
        assert _counts(p) == _counts_over_every_block(p)
        for q, n in want.items():                            # every token is in the pool or on the CPU
            slots = p.slots_of(q)
            assert len(slots) == n
            for t, s in enumerate(slots):
                assert (memory.get(s) == (q, t)) if s is not None else ((q, t) in cpu)
    for q in list(want):
        p.free_request(q)
    p.check_invariants()
    assert p.view()["free"] == num_blocks and not p.seqs


def _counts(p: BidirBlockPool) -> tuple:
    """What the scheduler reads of the pool each step (counted over the blocks in use)."""
    v = p.view()
    return p.num_be_only // 2, p.num_rt_with_room // 2, p.empty_slots(), v["rt"], v["be"], v["shared"]


def _counts_over_every_block(p: BidirBlockPool) -> tuple:
    """The same, from every block's owners and fills."""
    bs = p.blocks
    return (sum(b.be_id is not None and b.rt_id is None for b in bs),
            sum(b.be_id is None and b.rt_id is not None and b.rt_fill + b.be_fill < S for b in bs),
            sum(S - b.rt_fill - b.be_fill for b in bs), sum(b.rt_id is not None and b.be_id is None for b in bs),
            sum(b.be_id is not None and b.rt_id is None for b in bs),
            sum(b.be_id is not None and b.rt_id is not None for b in bs))


def _fits_in_its_own_blocks(p: BidirectionalPool, rid: str, num_tokens: int) -> bool:
    """Whether a copy of the pool, with no free block to claim, grows ``rid`` to ``num_tokens``
    tokens within the blocks it holds now."""
    probe = copy.deepcopy(p)
    probe.free_blocks = set()
    own = set(probe.seqs[rid].blocks)
    g = probe.grow(rid, num_tokens, probe.seqs[rid].rt)
    return g is not None and all(s[0] in own for s in [*g.slots, *((c.block, c.slot) for c in g.swap_ins)])


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 6))
def test_foreign_slots_are_what_a_batch_request_cannot_fill_in_its_own_blocks(operations, num_blocks):
    """A BE request of k token-blocks can hold k·S tokens minus ``foreign_slots`` before it
    needs another block (the scheduler counts its blocks that way): checked by growing it."""
    p = BidirectionalPool(num_blocks, S)
    for op, r, k in operations:
        rid, rt = f"q{r}", r % 2 == 0
        if op == "grow":
            p.grow(rid, p.num_tokens(rid) + k, rt)
        elif op == "free":
            p.free_request(rid)
        elif op == "drop" and rid in p.seqs:
            p.drop(rid)
    for rid, seq in p.seqs.items():
        if seq.rt:
            continue
        room = S * len(seq.blocks) - p.foreign_slots(rid)
        if room >= p.num_tokens(rid):
            assert _fits_in_its_own_blocks(p, rid, room) and not _fits_in_its_own_blocks(p, rid, room + 1)
        else:
            assert not _fits_in_its_own_blocks(p, rid, p.num_tokens(rid))
