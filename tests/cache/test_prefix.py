"""Prefix caching in the block pool, against a model of what each physical slot holds.

A slot's K/V at position p is a function of the tokens 0..p, so the model records, for every
write, the tuple of tokens it was computed from. A request reading a cached block must find its
own tokens there; nothing else proves the reuse right."""
import random

from hypothesis import given, settings, strategies as st

from tandem.cache import BlockPool, PoolGeometry
from tandem.cache.prefix import block_keys

B = 4


class Model:
    """The pool plus what its slots hold; drives requests as the scheduler does (look up, attach,
    grow, compute, name)."""

    def __init__(self, num_blocks: int):
        self.pool = BlockPool(PoolGeometry(num_blocks, B), prefix_caching=True)
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}   # (K block, offset) -> tokens it encodes
        self.live: dict[str, list[int]] = {}                      # request -> its computed tokens
        self.named: set[tuple[int, ...]] = set()                  # token prefixes ever named (whole blocks)
        self.evictions = 0
        evict = self.pool.prefix.evict

        def counted():
            self.evictions += 1
            return evict()
        self.pool.prefix.evict = counted

    def keys(self, tokens, n):
        return block_keys(tokens, B, [], n)

    def start(self, rid: str, tokens: list[int]) -> int | None:
        """Admit a request: its cached token-blocks, or None when the pool cannot hold it."""
        hit = self.pool.cached_prefix(self.keys(tokens, len(tokens)), (len(tokens) - 1) // B)
        assert hit <= (len(tokens) - 1) // B, "the last token is always left to compute"
        if not self.evictions:      # nothing forgotten yet: the longest named prefix is found
            best = max((k for k in range((len(tokens) - 1) // B + 1) if tuple(tokens[:k * B]) in self.named),
                       default=0)
            assert hit == best, (hit, best)
        if hit:
            got = self.pool.attach(rid, self.keys(tokens, len(tokens) - 1)[:hit])
            assert len(got.block_ids) == 2 * hit
        free, need = self.pool.num_free, self.pool.geometry.blocks_for(len(tokens)) - 2 * hit
        if self.pool.grow(rid, len(tokens)) is None:
            assert need > free, "refused although the blocks it needs were free"
            self.pool.free(rid)
            return None
        self.compute(rid, tokens, hit * B)
        return hit

    def compute(self, rid: str, tokens: list[int], start: int) -> None:
        """The request's tokens [start, len) are computed into its slots; its full blocks are named."""
        table = self.pool.table(rid)
        for p in range(start, len(tokens)):
            self.slots[table[2 * (p // B)], p % B] = tuple(tokens[:p + 1])
        self.live[rid] = list(tokens)
        self.pool.name_full(rid, self.keys(tokens, len(tokens)))
        self.named.update(tuple(tokens[:k * B]) for k in range(1, len(tokens) // B + 1))

    def extend(self, rid: str, token: int) -> bool:
        tokens = self.live[rid] + [token]
        free, need = self.pool.num_free, self.pool.geometry.blocks_for(len(tokens)) - len(self.pool.table(rid))
        if self.pool.grow(rid, len(tokens)) is None:
            assert need > free, "refused although the blocks it needs were free"
            return False
        self.compute(rid, tokens, len(tokens) - 1)
        return True

    def free(self, rid: str) -> None:
        self.pool.free(rid)
        self.live.pop(rid, None)

    def check(self) -> None:
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for rid in self.live:
            for b in self.pool.table(rid):
                holders[b] = holders.get(b, 0) + 1
        for rid, tokens in self.live.items():
            table = self.pool.table(rid)
            assert self.pool.num_shared(rid) == sum(holders[b] > 1 for b in table), f"{rid}'s shared blocks"
            for p in range(len(tokens)):
                assert self.slots.get((table[2 * (p // B)], p % B)) == tuple(tokens[:p + 1]), \
                    f"{rid} reads position {p} from a block that holds other tokens"


token_lists = st.lists(st.integers(1, 2), min_size=1, max_size=22)
ops = st.lists(st.one_of(st.tuples(st.just("start"), st.integers(0, 5), token_lists),
                         st.tuples(st.just("extend"), st.integers(0, 5), st.integers(1, 2)),
                         st.tuples(st.just("free"), st.integers(0, 5), st.none())), max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops, st.sampled_from([16, 40, 200]))
def test_cached_blocks_hold_the_tokens_of_whoever_reads_them(seq, num_blocks):
    """Requests over a two-token alphabet share prefixes all the time; in small pools named
    blocks are forgotten and handed out again. Every live request's slots hold its own tokens,
    the books balance, and until something is forgotten the longest named prefix is found."""
    m = Model(num_blocks)
    for op, i, arg in seq:
        rid = f"r{i}"
        if op == "start" and rid not in m.live:
            m.start(rid, arg)
        elif op == "extend" and rid in m.live:
            m.extend(rid, arg)
        elif op == "free":
            m.free(rid)
        m.check()
    for rid in list(m.live):
        m.free(rid)
    m.check()
    assert m.pool.num_free == num_blocks


def test_idle_blocks_count_as_free_and_the_start_of_a_prefix_goes_last():
    """A finished request's named blocks stay findable while the pool has other room; when it
    needs them, the end of the prefix goes first, so what stays is still a usable prefix."""
    m = Model(8)                              # 4 token-blocks of 4 tokens
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]     # 3 full token-blocks and one token
    assert m.start("a", a) == 0
    m.free("a")
    assert m.pool.num_free == 8 and len(m.pool.prefix) == 3
    assert m.start("b", a + [1]) == 3, "all three blocks are found again"
    m.free("b")
    assert m.start("x", [1] * 9) == 0         # needs 3 token-blocks: 1 never named, 2 forgotten ...
    assert m.evictions == 2
    m.free("x")
    assert m.start("c", a) == 1, "... the last two of a's prefix, so its first block remains"
    m.check()


def test_a_shared_block_is_freed_by_its_last_holder_only():
    m = Model(12)
    prefix = list(range(1, 9))                # two full blocks
    m.start("a", prefix + [20, 21])
    assert m.start("b", prefix + [30]) == 2
    shared = m.pool.table("a")[:4]
    assert m.pool.table("b")[:4] == shared
    m.free("a")
    assert m.pool.num_free == 12 - 6          # b's 3 token-blocks, two of them shared
    assert m.extend("b", 31)
    m.check()
    m.free("b")
    assert m.pool.num_free == 12
    m.check()


def test_keys_name_the_whole_prefix_not_just_the_block():
    """Equal blocks after different starts are different blocks."""
    rng = random.Random(0)
    tail = [rng.randrange(100) for _ in range(B)]
    k1 = block_keys([1, 2, 3, 4] + tail, B, [], 2 * B)
    k2 = block_keys([4, 3, 2, 1] + tail, B, [], 2 * B)
    assert k1[1] != k2[1]
    assert block_keys([1, 2, 3, 4] + tail, B, [], 2 * B) == k1
    assert block_keys([1, 2, 3, 4] + tail + [9], B, k1[:1], 2 * B + 1) == k1, "a chain extends in place"


def test_a_cache_salt_gives_its_own_chain():
    """The same tokens under another salt, or none, share no key at any block; under the same salt
    they share every one, however the chain was extended."""
    rng = random.Random(1)
    toks = [rng.randrange(100) for _ in range(4 * B)]
    plain = block_keys(toks, B, [], 4 * B)
    a = block_keys(toks, B, [], 4 * B, "a")
    b = block_keys(toks, B, [], 4 * B, "b")
    assert len(a) == 4 and not (set(a) & set(b)) and not (set(a) & set(plain)) and not (set(b) & set(plain))
    assert block_keys(toks, B, block_keys(toks, B, [], B, "a"), 4 * B, "a") == a
