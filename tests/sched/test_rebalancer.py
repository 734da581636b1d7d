"""The rebalancer: SPEC §4.4's KV-or-token split against the link and compute budgets, the
re-prefill budget against a brute-force scan of the cost model, and epochs over fake device views."""
import itertools
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as hs

from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType
from tandem.sched.cost_model import CostModel, StepShape
from tandem.sched.placement import Placement
from tandem.sched.rebalancer import Budgets, Candidate, DeviceView, Rebalancer, split
from tandem.sched.request import Transfer
from tandem.sched.runtime import Runtime

# a decode step of b requests at total context c costs 10 ms + 2 ms per request + 1 us per token;
# a prefill token 0.5 ms
COST = CostModel(base=0.010, per_prefill_token=5e-4, per_prefill_attn=0.0, per_decode_token=0.002,
                 per_decode_ctx=1e-6)


def cands(n, kv=1000, tokens=50, dst=1):
    return [Candidate(f"r{i}", 0, dst, kv, tokens) for i in range(n)]


def test_saturated_link_sends_tokens_and_saturated_compute_sends_kv():
    link_full = split(cands(3), comm_bytes=500, comp_tokens={1: 10_000})
    assert [len(x) for x in link_full] == [0, 3, 0]
    compute_full = split(cands(3), comm_bytes=1e9, comp_tokens={1: 0})
    assert [len(x) for x in compute_full] == [3, 0, 0]
    both_full = split(cands(3), comm_bytes=500, comp_tokens={1: 10})
    assert [len(x) for x in both_full] == [0, 0, 3]


def test_split_fills_each_bin_until_it_is_full_then_defers():
    kv, tok, deferred = split(cands(5, kv=1000, tokens=100), comm_bytes=2000, comp_tokens={1: 200})
    assert len(kv) == 2 and len(tok) == 2 and len(deferred) == 1


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 5000), hs.integers(0, 500), hs.integers(1, 3)), max_size=12),
       hs.integers(0, 20_000), hs.integers(0, 1500), hs.integers(0, 1500))
def test_split_respects_budgets_and_defers_only_what_fits_nowhere(items, comm, comp1, comp2):
    cs = [Candidate(f"r{i}", 0, d, kv, t) for i, (kv, t, d) in enumerate(items)]
    comp = {1: comp1, 2: comp2}
    kv, tok, deferred = split(cs, comm, comp)
    assert sorted(c.req_id for c in kv + tok + deferred) == sorted(c.req_id for c in cs)
    assert sum(c.kv_bytes for c in kv) <= comm
    for d in (1, 2, 3):
        assert sum(c.tokens for c in tok if c.dst == d) <= comp.get(d, 0)
    # a deferred move fits neither bin even alone in what is left at the end
    for c in deferred:
        assert (sum(x.kv_bytes for x in kv) + c.kv_bytes > comm
                and sum(x.tokens for x in tok if x.dst == c.dst) + c.tokens > comp.get(c.dst, 0))


@settings(max_examples=100, deadline=None)
@given(hs.integers(0, 40), hs.integers(0, 40_000), hs.floats(0.005, 0.3))
def test_reprefill_budget_is_the_largest_prefill_within_the_tbt(batch, ctx, tbt):
    b = Budgets(1e9, 1.0, COST.predict, tbt, max_batched_tokens=600)
    view = DeviceView(1, {}, {}, batch, ctx)
    got = b.comp_tokens(view)
    base = StepShape(decode_tokens=batch, decode_ctx=ctx)
    brute = max([n for n in range(1, 601) if COST.predict(base.add(n, n, False)) <= tbt], default=0)
    assert got == brute


def rebalancer(link_bytes_per_s, tbt, policy=Placement.LB, devices=2):
    return Rebalancer(policy, devices, capacity=100, block_bytes=1000,
                      budgets=Budgets(link_bytes_per_s, 1.0, COST.predict, tbt), clock=itertools.count().__next__)


def skewed(rb):
    """Six requests placed (LB: worst fit, so both devices get three); those on device 1 finish
    while those on device 0 grow to 30 blocks each: the devices differ by far more than C/10."""
    where = {f"q{i}": rb.arrive(f"q{i}", 2) for i in range(6)}
    on0 = [r for r, d in where.items() if d == 0]
    assert len(on0) == 3
    for r, d in where.items():
        if d == 1:
            rb.depart(r)
    rb.observe(DeviceView(0, {r: 230 for r in on0}, {r: 30 for r in on0}, 3, 690))
    rb.observe(DeviceView(1, {}, {}))
    return rb.epoch()


def test_rebalancer_moves_as_kv_when_compute_is_busy():
    rb = rebalancer(link_bytes_per_s=1e9, tbt=0.001)                   # no step fits 1 ms: compute full
    orders = skewed(rb)
    assert orders and all(o.transfer is Transfer.KV and (o.src, o.dst) == (0, 1) for o in orders)
    assert rb.idle == {1} and rb.max_active == 1, "device 1 held nothing at that epoch"


def test_rebalancer_moves_as_tokens_when_the_link_is_busy():
    orders = skewed(rebalancer(link_bytes_per_s=0, tbt=1.0))
    assert orders and all(o.transfer is Transfer.TOKEN and (o.src, o.dst) == (0, 1) for o in orders)


def test_where_both_fit_a_move_goes_the_way_that_pauses_it_less():
    # best fit alone sends the first as tokens (it leaves 10% of the compute budget, 90% of the
    # link's) and the second as KV (9% of the link's, 91% of compute's)
    tight_comp = Candidate("a", 0, 1, kv_bytes=100, tokens=90)
    tight_link = Candidate("b", 0, 1, kv_bytes=100, tokens=90)
    assert [len(x) for x in split([tight_comp], 1000, {1: 100})] == [0, 1, 0]
    assert [len(x) for x in split([tight_link], 110, {1: 1000})] == [1, 0, 0]
    fast_copy = Candidate("a", 0, 1, 100, 90, kv_s=0.01, tok_s=0.5)
    fast_prefill = Candidate("b", 0, 1, 100, 90, kv_s=0.5, tok_s=0.01)
    assert [len(x) for x in split([fast_copy], 1000, {1: 100})] == [1, 0, 0]
    assert [len(x) for x in split([fast_prefill], 110, {1: 1000})] == [0, 1, 0]
    # the faster way full: the other one, as before
    assert [len(x) for x in split([fast_copy], 50, {1: 100})] == [0, 1, 0]


def test_rebalancer_estimates_each_way_from_the_link_and_the_cost_model():
    # each moved request: 30 blocks of 1,000 bytes, 230 tokens; device 1 decodes nothing.
    # A re-prefill adds 230 x 0.5 ms = 115 ms to its step (budget at a 1 s TBT: 1,980 tokens).
    # At 1 GB/s the copy takes 30 us: KV. At 40 kB/s it takes 0.75 s (and fits the link's
    # 40,000-byte epoch budget): tokens.
    fast = skewed(rebalancer(link_bytes_per_s=1e9, tbt=1.0))
    assert fast and all(o.transfer is Transfer.KV for o in fast)
    slow = skewed(rebalancer(link_bytes_per_s=40_000, tbt=1.0))
    assert slow and all(o.transfer is Transfer.TOKEN for o in slow)
    b = Budgets(40_000, 1.0, COST.predict, 1.0)
    assert b.kv_seconds(30_000) == 0.75
    assert abs(b.reprefill_seconds(DeviceView(1, {}, {}), 230) - 0.115) < 1e-12
    assert abs(b.reprefill_seconds(DeviceView(1, {}, {}, 3, 690), 230) - 0.115) < 1e-12


def test_rebalancer_defers_what_fits_neither_and_sends_it_later():
    rb = rebalancer(link_bytes_per_s=0, tbt=0.001)
    assert skewed(rb) == [] and rb.deferred_total > 0
    rb.budgets.link_bytes_per_s = 1e9                                # the link frees up
    later = rb.epoch()
    assert later and all(o.transfer is Transfer.KV for o in later)


def test_sent_moves_are_not_repeated_and_departures_drop_them():
    rb = rebalancer(link_bytes_per_s=1e9, tbt=1.0)
    first = skewed(rb)
    assert first
    assert rb.epoch() == []                   # still seen on device 0: in flight, not sent again
    for o in first:
        rb.depart(o.req_id)
    rb.epoch()
    assert not any(o.req_id in rb.pending for o in first)
    assert not any(o.req_id in rb.cluster.where for o in first)


def test_mell_packs_arrivals_onto_one_device_until_it_is_full():
    rb = rebalancer(link_bytes_per_s=1e9, tbt=1.0, policy=Placement.MELL)
    placed = [rb.arrive(f"m{i}", 10) for i in range(5)]                # 5 x 10 of 100 blocks
    assert len(set(placed)) == 1
    worst = rebalancer(link_bytes_per_s=1e9, tbt=1.0, policy=Placement.WF)
    assert len({worst.arrive(f"w{i}", 10) for i in range(5)}) == 2


def fake_runtime(rb, *serving: bool, dead: int | None = None):
    """What ``Runtime._placed`` reads: each device's thread (``serving``; one is ``dead``), the
    rebalancer, and the dispatcher's pick (the first serving device)."""
    geometry = PoolGeometry(100, 16)
    threads = [SimpleNamespace(serving=up, actor=SimpleNamespace(dead="gone" if i == dead else None, index=i,
                                                                 pool=SimpleNamespace(geometry=geometry)))
               for i, up in enumerate(serving)]
    return SimpleNamespace(threads=threads, rebalancer=rb, serving=lambda: any(serving),
                           accepting=lambda: any(t.actor.dead is None for t in threads),
                           dispatch=lambda cached: threads[serving.index(True)].actor)


def arrival(rid: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, num_tokens=160, cache_type=CacheType.KV)     # 10 blocks


def test_an_arrival_sent_elsewhere_during_a_restart_moves_to_its_device_once_it_serves():
    """LB puts the second arrival on the empty device 1, which is restarting its worker, so it
    runs on device 0. It was dropped from the placement's books: they showed device 1 empty (so
    every later arrival was placed there and sent away too), and nothing ever spread the requests
    after the restart. It stays in the books on device 1 and moves there once device 1 serves,
    not while it restarts."""
    rb = rebalancer(link_bytes_per_s=1e9, tbt=1.0)
    rt = fake_runtime(rb, True, False)
    assert [Runtime._placed(rt, arrival(r), {}) for r in ("a", "b")] == [0, 0]
    assert rb.cluster.where == {"a": 0, "b": 1}
    rb.observe(DeviceView(0, {"a": 160, "b": 160}, {"a": 10, "b": 10}, 2, 320))
    rb.observe(DeviceView(1, {}, {}))
    assert rb.epoch(restarting=frozenset({1})) == []
    assert [(o.req_id, o.src, o.dst) for o in rb.epoch()] == [("b", 0, 1)]


def test_a_device_down_for_good_leaves_the_placement_and_arrivals_spread_over_the_others():
    """LB spreads arrivals over three devices; device 1 is down for good. The placement chose it
    for every other arrival, which then ran where the dispatcher sent it and left the books: the
    books showed the dead device empty and the others emptier than they were, so nothing spread
    the load. Device 1 now leaves the books once an arrival is placed there, and arrivals
    alternate between devices 0 and 2 as worst fit over those two does."""
    rb = rebalancer(link_bytes_per_s=1e9, tbt=1.0, devices=3)
    rt = fake_runtime(rb, True, False, True, dead=1)
    assert [Runtime._placed(rt, arrival(r), {}) for r in "abcd"] == [0, 2, 0, 2]
    assert rb.cluster.where == {"a": 0, "b": 2, "c": 0, "d": 2} and rb.cluster.down == {1}


def test_an_arrival_held_for_a_device_that_then_dies_is_placed_again_among_the_others():
    """Booked on device 1 while it restarted, and run on device 0; device 1's restart fails for
    good. The arrival stays in the books, placed again as worst fit does over the devices left:
    the empty device 2, to which it then moves (it was dropped, so the books showed device 0
    emptier than it was, and it never moved)."""
    rb = rebalancer(link_bytes_per_s=1e9, tbt=1.0, devices=3)
    rt = fake_runtime(rb, True, False, True)
    assert [Runtime._placed(rt, arrival(r), {}) for r in "ab"] == [0, 0]
    assert rb.cluster.where == {"a": 0, "b": 1}
    rb.observe(DeviceView(0, {"a": 160, "b": 160}, {"a": 10, "b": 10}, 2, 320))
    rb.observe(DeviceView(1, {}, {}))
    rb.observe(DeviceView(2, {}, {}))
    assert [(o.req_id, o.src, o.dst) for o in rb.epoch(down=frozenset({1}))] == [("b", 0, 2)]
    assert rb.cluster.where == {"a": 0, "b": 2}
