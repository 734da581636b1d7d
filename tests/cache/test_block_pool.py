"""Block pool bookkeeping: exact counts, no double ownership, nothing leaks."""
import pytest
from hypothesis import given, settings, strategies as st

from tandem.cache import BlockPool, PoolGeometry
from tandem.engine.messages import CacheType


def test_grow_free_counts():
    pool = BlockPool(PoolGeometry(num_blocks=10, block_size=4))
    a = pool.grow("a", 5)                     # 2 token-blocks -> 4 blocks (K, V each)
    assert len(a.block_ids) == 4 and pool.num_free == 6
    assert pool.grow("a", 8).block_ids == []  # still fits in 2 token-blocks
    assert len(pool.grow("a", 9).block_ids) == 2
    assert pool.grow("b", 9) is None and pool.num_free == 4, "a failed grow changes nothing"
    assert pool.free("a") == 6 and pool.num_free == 10
    pool.check_invariants()


def test_blocks_given_back_are_handed_out_again_first_then_the_lowest_never_used():
    pool = BlockPool(PoolGeometry(num_blocks=1 << 20, block_size=4))
    assert pool.grow("a", 8).block_ids == [0, 1, 2, 3] and pool.grow("b", 4).block_ids == [4, 5]
    pool.free("a")
    assert pool.grow("c", 12).block_ids == [0, 1, 2, 3, 6, 7]
    assert pool.num_free == (1 << 20) - 8 and pool.num_used == 8
    pool.check_invariants()


@pytest.mark.parametrize("damage", ["free twice", "free and held", "count off", "never handed out"])
def test_the_invariant_check_finds_damaged_books(damage):
    """Every test checks the pools after each step: the check must see what it guards."""
    pool = BlockPool(PoolGeometry(num_blocks=64, block_size=4))
    pool.grow("a", 8)
    pool.grow("b", 8)
    pool.free("b")
    if damage == "free twice":
        pool._free.append(pool._free[0])
    elif damage == "free and held":
        pool._free.append(pool.table("a")[0])
    elif damage == "count off":
        pool._refs[pool.table("a")[0]] = 2
    else:
        pool._tables["a"].block_ids.append(40)
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_geometry_blocks_for():
    g = PoolGeometry(num_blocks=100, block_size=16)
    assert g.blocks_for(1) == 2 and g.blocks_for(16) == 2 and g.blocks_for(17) == 4
    assert g.blocks_for(0, CacheType.KV) == 0


ops = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(seq):
    pool = BlockPool(PoolGeometry(num_blocks=24, block_size=4))
    held: dict[str, int] = {}          # independent model: tokens each request holds room for
    for op, rid_n, tokens in seq:
        rid = f"r{rid_n}"
        if op == "grow":
            want = max(tokens, held.get(rid, 0))
            need = -(-want // 4) * 2 - -(-held.get(rid, 0) // 4) * 2
            free_before = pool.num_free
            got = pool.grow(rid, want)
            if need > free_before:
                assert got is None and pool.num_free == free_before
            else:
                assert got is not None and len(got.block_ids) == need
                held[rid] = want
        else:
            freed = pool.free(rid)
            assert freed == -(-held.pop(rid, 0) // 4) * 2
        pool.check_invariants()
        assert pool.num_used == sum(-(-t // 4) * 2 for t in held.values())
        tables = [pool.table(r) for r in held]
        ids = [b for t in tables for b in t]
        assert len(set(ids)) == len(ids) and set(ids) <= set(range(24)), "a block held twice, or not the pool's"
    for rid in list(held):
        pool.free(rid)
    assert pool.num_free == 24


def test_both_pool_kinds_answer_the_schedulers_contract():
    """place() in a whole-block pool appends blocks; in a bidirectional pool it hands out slots
    from the front (RT) or the back (BE) of a block; neither takes a hidden cache it cannot
    hold, and only the bidirectional pool preempts blocks."""
    from tandem.cache.bidir import BidirBlockPool
    g = PoolGeometry(num_blocks=8, block_size=4)
    plain, bidir = BlockPool(g), BidirBlockPool(g)
    p = plain.place("a", 5, CacheType.KV, rt=True)
    assert len(p.block_ids) == 4 and p.slots is None and plain.num_free == 4
    assert plain.num_cpu("a") == 0 and not plain.preempts_blocks
    with pytest.raises(TypeError):
        plain.drop("a")
    with pytest.raises(ValueError, match="cache type hidden"):
        plain.check_cache_type(CacheType.HIDDEN)
    rt = bidir.place("r", 2, CacheType.KV, rt=True)
    be = bidir.place("b", 2, CacheType.KV, rt=False)
    assert rt.block_ids == [] and [s for _b, s in rt.slots] == [0, 1]
    assert [s for _b, s in be.slots] == [3, 2]
    assert bidir.preempts_blocks and bidir.num_free == 4      # two token-blocks (K, V pairs) taken
    with pytest.raises(ValueError, match="KV caches only"):
        bidir.place("h", 2, CacheType.HIDDEN, rt=True)


@pytest.mark.parametrize("num_blocks", [8, 9])
def test_a_pool_says_how_many_blocks_it_can_hand_out(num_blocks):
    """The geometry a pool reports (the scheduler's capacity, the placement's C, pool usage) is
    what it can really give out: KV requests of one token-block (a K and a V block) until none
    fits, then, in a whole-block pool, a hidden cache of one block (multi-head attention) in an
    odd block left over. A bidirectional pool pairs its blocks and holds KV only."""
    from tandem.cache.bidir import BidirBlockPool
    g = PoolGeometry(num_blocks=num_blocks, block_size=4, hidden_blocks=1)
    for pool in (BlockPool(g), BidirBlockPool(g)):
        given = 0
        while pool.place(f"r{given}", 4, CacheType.KV, rt=True) is not None:
            given += 2
        if not pool.preempts_blocks and pool.place("h", 4, CacheType.HIDDEN, rt=True) is not None:
            given += 1
        assert given == pool.geometry.num_blocks and pool.num_free == 0, type(pool).__name__
