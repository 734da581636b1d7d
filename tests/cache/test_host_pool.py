"""The host pool's books: bytes held, and eviction of the longest estimated waits only."""
import itertools

import pytest

from tandem.cache.host_pool import HostPool


def test_admits_until_full_then_evicts_longer_waits_only():
    h = HostPool(100)
    assert h.admit("a", 40, ewt=5.0) == []
    assert h.admit("b", 40, ewt=10.0) == []
    assert h.admit("c", 40, ewt=1.0) == ["b"]          # b would wait longest: it recomputes
    assert h.used == 80 and "b" not in h
    assert h.admit("d", 40, ewt=20.0) is None           # nobody waits longer than d: refused, nothing changed
    assert h.used == 80 and len(h) == 2
    assert h.admit("e", 40, ewt=0.5, keep=frozenset({"a"})) == ["c"]   # a is protected
    assert h.release("a") == 40 and h.release("a") == 0
    h.check_invariants()


def test_eviction_is_minimal_brute_force():
    """Evicted = the shortest run of longer-waiting holders, longest first, that makes room."""
    sizes = {"a": 30, "b": 20, "c": 25, "d": 10}
    waits = {"a": 4.0, "b": 9.0, "c": 7.0, "d": 2.0}
    for new_size, new_wait in itertools.product((10, 30, 50, 80), (1.0, 5.0, 8.0)):
        h = HostPool(90)
        for r in sizes:
            assert h.admit(r, sizes[r], waits[r]) == []
        got = h.admit("new", new_size, new_wait)
        longer = sorted((r for r in sizes if waits[r] > new_wait), key=lambda r: -waits[r])
        free = 90 - sum(sizes.values())
        want = None
        for k in range(len(longer) + 1):          # the shortest prefix, longest wait first, that fits
            if new_size <= free + sum(sizes[r] for r in longer[:k]):
                want = longer[:k]
                break
        assert got == want, (new_size, new_wait)
        h.check_invariants()


def test_rejects_negative_capacity():
    with pytest.raises(ValueError):
        HostPool(-1)
