"""The pool's view by owner counts each physical block once, however many requests share it."""
from types import SimpleNamespace

from tandem.cache import BlockPool, PoolGeometry
from tandem.cache.prefix import block_keys
from tandem.engine.messages import CacheType
from tandem.sched.request import ServiceClass
from tandem.sched.scheduler import load_by_class, pool_view

B = 4


def test_blocks_shared_by_rt_and_be_requests_count_once_as_shared():
    """An RT request computes 3 full token-blocks (6 blocks) and one more token; a BE request and
    a second RT request attach its first 2 token-blocks and grow by one token-block each. By
    hand: 4 blocks RT and BE hold (shared), RT alone 4 (the first's last two token-blocks) + 2,
    BE alone 2, free the rest."""
    pool = BlockPool(PoolGeometry(num_blocks=40, block_size=B, hidden_blocks=0), prefix_caching=True)
    toks = list(range(13))
    keys = block_keys(toks, B, [], 12)
    pool.grow("rt1", 13, CacheType.KV)
    pool.name_full("rt1", keys)
    for rid in ("be", "rt2"):
        pool.attach(rid, keys[:2])
        pool.grow(rid, 3 * B, CacheType.KV)
    cls = {"rt1": ServiceClass.RT, "rt2": ServiceClass.RT, "be": ServiceClass.BE}
    actor = SimpleNamespace(pool=pool, running=list(cls),
                            states={r: SimpleNamespace(request=SimpleNamespace(service_class=c)) for r, c in cls.items()})
    pool.check_invariants()
    assert pool_view([actor]) == {"rt": 6, "be": 2, "shared": 4, "checkpointed": 0, "free": 40 - 12}
    # blocks each class holds (the metrics' and status's per-class count), each once: RT 6 + 4
    actor.waiting = []
    assert load_by_class([actor]) == {ServiceClass.RT: (2, 0, 10), ServiceClass.BE: (1, 0, 6)}
