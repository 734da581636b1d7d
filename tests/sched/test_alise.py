"""ALISE's policy against hand-computed references: remaining time from the cost model,
levels, SRPT order (checked against a brute-force sort), doubling on misprediction,
aging, RT before BE, and preemption only of requests ranked lower."""
from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tandem.sched.alise import Alise
from tandem.sched.cost_model import CostModel
from tandem.sched.policy import Candidate, Limits, Snapshot

COST = CostModel(base=0.01, per_prefill_token=1e-4, per_prefill_attn=0.0, per_decode_token=1e-3, per_decode_ctx=1e-6)


def cost(shape, swap_slots=0):
    return COST.predict(shape)


def cand(rid, prompt, out_done, predicted, *, computed=None, rt=True, pending=0.0, blocks=None, arrival=0.0, slo=None,
         stalled=0.0):
    n = prompt + out_done
    c = n if computed is None else computed
    return Candidate(rid, n, c, blocks if blocks is not None else -(-c // 16) * 2, arrival, rt, slo, pending,
                     num_output=out_done, predicted=predicted, stalled_s=stalled)


def snap(running, waiting, free=10_000, seqs=64, tokens=2048):
    return Snapshot(running, waiting, free, 16, 2, Limits(seqs, tokens, True))


def test_remaining_time_and_levels_by_hand():
    a = Alise(cost, levels=5, theta1_s=0.1, age_s=1000)
    c = cand("a", 100, 10, 50)                       # decoding: 40 tokens left at context 110
    step = 0.01 + 1e-3 + 1e-6 * 110
    assert math.isclose(a.t_rem(c), 40 * step)
    # 0.444 s: above θ_3 = 0.4, within θ_4 = 0.8
    assert a.level(c) == 4
    w = cand("w", 100, 0, 50, computed=0)            # waiting: prefill 100 tokens, then 50 steps
    pre = 0.01 + 1e-4 * 100
    assert math.isclose(a.t_rem(w), pre + 50 * (0.01 + 1e-3 + 1e-6 * 100))
    big = cand("b", 100, 0, 10_000, computed=0)
    assert a.level(big) == 5                         # capped at h


def test_misprediction_doubles_and_demotes():
    a = Alise(cost, levels=8, theta1_s=0.05, age_s=1000)
    ok = cand("ok", 10, 5, 8)
    over = cand("over", 10, 8, 8)                    # generated as many as predicted
    assert a.predicted(ok) == (8, 0)
    assert a.predicted(over) == (16, 1)
    assert a.predicted(cand("x", 10, 40, 8)) == (64, 3)
    # over: 8 tokens left -> the same T_rem as a correctly predicted request with 8 left, one level lower
    twin = cand("twin", 10, 8, 16)
    assert math.isclose(a.t_rem(over), a.t_rem(twin))
    assert a.level(over) == a.level(twin) + 1


def test_aging_lifts_a_waiting_request_to_level_zero():
    a = Alise(cost, levels=4, theta1_s=0.05, age_s=1.0)
    long = cand("long", 10, 0, 5000, computed=0, pending=0.5)
    assert a.level(long) == 4
    assert a.level(cand("long", 10, 0, 5000, computed=0, pending=2.5)) == 2
    aged = cand("long", 10, 0, 5000, computed=0, pending=9.0, arrival=5.0)
    assert a.level(aged) == 0
    shorts = [cand(f"s{i}", 10, 0, 2, computed=0, arrival=6.0 + i) for i in range(3)]
    plan = a(snap([], shorts + [aged], seqs=1))
    assert [d.req_id for d in plan.scheduled] == ["long"]


def test_order_is_srpt_inside_levels_brute_force():
    import random
    rng = random.Random(0)
    a = Alise(cost, levels=6, theta1_s=0.05, age_s=1e9)
    cs = [cand(f"r{i}", rng.randint(5, 300), rng.randint(0, 50), rng.randint(1, 400), rt=rng.random() < 0.7,
               arrival=rng.random()) for i in range(60)]
    plan = a(snap(cs, [], seqs=20))
    got = [d.req_id for d in plan.scheduled]

    def key(c):
        L = c.predicted
        d = 0
        while c.num_output >= L:
            L, d = 2 * L, d + 1
        t = max(L - c.num_output, 1) * (0.01 + 1e-3 + 1e-6 * c.num_tokens)
        lvl = next((i for i in range(1, 7) if t <= 0.05 * 2 ** (i - 1)), 6)
        lvl = min(6, lvl + d)
        return (not c.rt, lvl, t)
    assert got == [c.req_id for c in sorted(cs, key=key)[:20]]
    assert not plan.preempted                        # room for all: the rest pause with their blocks


def test_preempts_only_lower_ranked_requests():
    a = Alise(cost, levels=6, theta1_s=0.05, age_s=1e9)
    long = cand("long", 64, 10, 1000, blocks=10)     # running, far from done
    short = cand("short", 64, 0, 3, computed=0)      # waiting, nearly nothing to do: needs 10 blocks
    plan = a(snap([long], [short], free=0))
    assert plan.preempted == ["long"]
    assert [d.req_id for d in plan.scheduled] == ["short"]
    # the reverse: a long waiting request never takes a short running one's blocks
    plan = a(snap([cand("short", 64, 1, 3, blocks=10)], [cand("long", 64, 0, 1000, computed=0)], free=0))
    assert plan.preempted == [] and [d.req_id for d in plan.scheduled] == ["short"]


def test_rt_before_be_and_be_kept_within_the_rt_slack():
    a = Alise(cost, levels=6, theta1_s=0.05, age_s=1e9)
    be = cand("be", 10, 5, 6, rt=False)              # BE nearly done
    rt = cand("rt", 10, 0, 500, computed=0, slo=0.5)   # RT with plenty left
    plan = a(snap([be], [rt]))
    assert [d.req_id for d in plan.scheduled] == ["rt", "be"]
    # an RT request whose deadline only allows the smallest step: a BE prefill does not join
    tight = cand("rt", 10, 3, 500, slo=0.0125)
    big_be = cand("be2", 2000, 0, 5, computed=0, rt=False)
    plan = a(snap([tight], [big_be]))
    assert [d.req_id for d in plan.scheduled] == ["rt"]
    assert "SLO" in plan.reasons["be2"]


def test_be_work_within_the_rt_slack_counts_each_lora_adapter_once():
    """A chat on adapter x has 18 ms left; an adapter costs 4 ms a step. A BE decode on adapter y
    would make the step 0.0150 + 0.0010 + 0.004 = 20.0 ms and waits; on x it adds no adapter
    (16.0 ms) and joins; with adapters unpriced it joins on y too (12.0 ms)."""
    priced = replace(COST, per_adapter=0.004)
    rt = replace(cand("rt", 10, 3, 500, slo=0.018), adapter="x")

    def joins(adapter, model=priced):
        a = Alise(lambda shape, slots=0: model.predict(shape), levels=6, theta1_s=0.05, age_s=1e9)
        be = replace(cand("be", 10, 5, 6, rt=False), adapter=adapter)
        return "be" in {d.req_id for d in a(snap([rt, be], [])).scheduled}
    assert not joins("y") and joins("x") and joins("y", COST)


def test_estimated_wait_of_preempted_requests_by_hand():
    """EWT = min(sum of T_rem ahead / batch size, time until aging lifts it to level 0)."""
    a = Alise(cost, levels=6, theta1_s=0.05, age_s=1e9)
    s1, s2 = cand("s1", 64, 0, 3, computed=0), cand("s2", 64, 0, 4, computed=0)   # need 10 blocks each
    mid = cand("mid", 64, 10, 200, blocks=10)
    long = cand("long", 64, 10, 1000, blocks=10)
    plan = a(snap([mid, long], [s1, s2], free=0))
    assert sorted(plan.preempted) == ["long", "mid"]
    assert [d.req_id for d in plan.scheduled] == ["s1", "s2"]
    width = 2
    assert math.isclose(plan.ewt["mid"], (a.t_rem(s1) + a.t_rem(s2)) / width)
    assert math.isclose(plan.ewt["long"], (a.t_rem(s1) + a.t_rem(s2) + a.t_rem(mid)) / width)
    # aging bounds it: with a short aging period, "long" reaches level 0 sooner than the queue empties
    b = Alise(cost, levels=6, theta1_s=0.05, age_s=0.01)
    old = cand("long", 64, 10, 1000, blocks=10, pending=0.004)
    plan = b(snap([mid, old], [s1, s2], free=0))
    lvl = b.level(old)
    assert lvl > 0 and math.isclose(plan.ewt["long"], 0.006 + (lvl - 1) * 0.01)


def test_promotion_stays_once_the_request_runs_again():
    """A request lifted by aging keeps its level after its next token (its past waits count), so
    it and the request it displaced do not take each other's blocks in turn."""
    a = Alise(cost, levels=6, theta1_s=0.05, age_s=1.0)
    waiting = cand("old", 64, 10, 1000, blocks=0, computed=0, pending=6.5)
    assert a.level(waiting) == 0
    ran = cand("old", 64, 11, 1000, blocks=10, pending=0.01, stalled=6.5)   # its token came after that wait
    assert a.level(ran) == 0
    fresh = cand("new", 64, 0, 3, computed=0)
    plan = a(snap([ran], [fresh], free=0))
    assert plan.preempted == [] and [d.req_id for d in plan.scheduled] == ["old"]


def _best_first_jobs(spreads):
    """Brute force: the jobs that an optimal preemptive schedule may run first, one server, no
    arrivals, minimising the expected sum of completion times, each job's length one of its
    spread's points with equal chance. Dynamic programming over (tokens run per job, done)."""
    from functools import lru_cache
    from fractions import Fraction

    @lru_cache(maxsize=None)
    def value(state):                     # state: per job, tokens run so far, or None when done
        alive = [j for j, a in enumerate(state) if a is not None]
        if not alive:
            return Fraction(0)
        return min(step(state, j) for j in alive)

    def step(state, j):
        a = state[j]
        surv = [x for x in spreads[j] if x > a]
        p_end = Fraction(sum(1 for x in surv if x == a + 1), len(surv))
        alive = sum(1 for s in state if s is not None)
        ended = state[:j] + (None,) + state[j + 1:]
        goes = state[:j] + (a + 1,) + state[j + 1:]
        return alive + p_end * value(ended) + ((1 - p_end) * value(goes) if p_end < 1 else 0)

    start = tuple(0 for _ in spreads)
    best = value(start)
    return {j for j in range(len(spreads)) if step(start, j) == best}


def test_gittins_order_is_optimal_brute_force():
    """The request with the least Gittins remaining r(a) is one an optimal schedule runs first,
    on random small instances, at their start and after some tokens; shortest expected
    remaining time is not (the by-hand case at the end)."""
    import random

    from tandem.sched.alise import gittins_remaining
    rng = random.Random(4)
    for _ in range(150):
        spreads = [tuple(sorted(rng.randint(1, 7) for _ in range(rng.choice([1, 2, 3, 4])))) for _ in range(3)]
        ran = [rng.randint(0, s[-1] - 1) if rng.random() < 0.5 else 0 for s in spreads]
        # run a_j tokens so far: the same problem with the points above a_j, shifted down by it
        shifted = [tuple(x - a for x in s if x > a) for s, a in zip(spreads, ran)]
        r = [gittins_remaining(s, a) for s, a in zip(spreads, ran)]
        assert r.index(min(r)) in _best_first_jobs(shifted), (spreads, ran, r)
    # a job that ends after 1 token or after 100, equally likely, against one that needs 30: run
    # the gamble first (a mean of 50.5 would put it second)
    assert _best_first_jobs([(1, 100), (30,)]) == {0}
    assert gittins_remaining((1, 100), 0) == 2.0 and gittins_remaining((1, 100), 1) == 99.0


def test_spread_ranks_by_gittins_and_outliving_it_doubles_its_longest():
    a = Alise(cost, levels=8, theta1_s=0.05, age_s=1e9)
    step = lambda n: 0.01 + 1e-3 + 1e-6 * n            # noqa: E731  a decode step at context n
    gamble = replace(cand("g", 10, 0, 50), spread=(1, 100))
    assert Alise.remaining(gamble) == (2.0, 0)
    steady = cand("s", 10, 0, 30)
    plan = a(snap([gamble, steady], [], seqs=1))
    assert [d.req_id for d in plan.scheduled] == ["g"]
    outlived = replace(cand("g", 10, 1, 50), spread=(1, 100))
    assert Alise.remaining(outlived) == (99.0, 0)
    assert math.isclose(a.t_rem(outlived), 99 * step(11))
    assert [d.req_id for d in a(snap([outlived, steady], [], seqs=1)).scheduled] == ["s"]
    # past every point: the longest doubles, one demotion each time
    past = replace(cand("p", 10, 250, 50), spread=(1, 100))
    assert Alise.remaining(past) == (150, 2)           # 100 -> 200 -> 400


def _peak_by_steps(items, block_size=16):
    """Blocks held at the worst step, walked step by step: at step k every item with more than k
    tokens to go holds b (x + k) / B + b / 2 blocks (b blocks per token-block, its last block
    half full on average); the others have ended."""
    longest = max(r for _, r, _ in items)
    return max([0.0] + [sum(b * (x + k) / block_size + b / 2 for x, r, b in items if r > k) for k in range(longest)])


@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300), st.booleans(), st.integers(0, 3),
                          st.booleans()), min_size=0, max_size=12),
       st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300), st.booleans(), st.integers(0, 3),
                          st.booleans(), st.integers(0, 8)), min_size=1, max_size=6),
       st.integers(0, 400))
@example([(16, 1, False, 0, False)], [(16, 1, False, 0, False, 0)], 4)      # a peak of 6 in a pool of 6: it fits
@settings(max_examples=300, deadline=None)
def test_look_ahead_admission_against_the_peak_walked_step_by_step(holders, arrivals, free):
    """Holders and arrivals of random size, remaining length, cache type, class and level; the
    arrivals asked in turn, each admitted one counted from then on, and one holder dropped after
    each question: every answer is whether the step-by-step peak of the arrival and the holders
    of its class and level or better fits the pool."""
    from tandem.engine.messages import CacheType
    from tandem.sched.alise import Footprint

    def candidate(rid, x, r, hidden, level, be, blocks=0):
        c = Candidate(rid, x, x, blocks, 0.0, not be, num_output=0, predicted=r,
                      cache_type=CacheType.HIDDEN if hidden else CacheType.KV)
        return c, (be, level, 0)

    running = [candidate(f"h{i}", *h, blocks=-(-h[0] // 16) * 2) for i, h in enumerate(holders)]
    waiting = [candidate(f"a{i}", *a[:5], blocks=a[5]) for i, a in enumerate(arrivals)]
    rank = {c.req_id: k for c, k in running + waiting}
    s = Snapshot([c for c, _ in running], [], free, 16, 2, Limits(64, 2048, True), hidden_blocks_per_token_block=1)
    fp = Footprint(s, s.running, rank)
    held = {c.req_id: c for c in s.running}
    total = free + sum(c.num_blocks for c in s.running)
    for (c, mine), h in zip(waiting, [c.req_id for c, _ in running] + [None] * len(waiting)):
        per = lambda x: 1 if x.cache_type is CacheType.HIDDEN else 2  # noqa: E731
        items = [(x.num_tokens, x.predicted, per(x)) for x in held.values() if rank[x.req_id][:2] <= mine[:2]]
        want = not items or _peak_by_steps(items + [(c.num_tokens, c.predicted, per(c))]) <= total + c.num_blocks
        assert fp.admits(c) == want
        if want:
            fp.add(c)
            held[c.req_id] = c
            total += c.num_blocks
        if h is not None:
            fp.drop(h)
            held.pop(h)


@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300), st.booleans(), st.integers(0, 3),
                          st.booleans()), min_size=0, max_size=10),
       st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300), st.booleans(), st.integers(0, 3),
                          st.booleans(), st.integers(0, 8)), min_size=1, max_size=10),
       st.integers(0, 400), st.sampled_from([16, 8, 12, 1]))
@settings(max_examples=100, deadline=None)
def test_look_ahead_admission_asked_of_every_arrival_between_changes(holders, arrivals, free, block_size):
    """Every arrival still waiting asked at each state of the holders (the kept sums are reused
    between changes), then the first that fits counted and a holder dropped: each answer is
    whether the step-by-step peak, in exact fractions, fits the pool, for any block size."""
    from fractions import Fraction

    from tandem.engine.messages import CacheType
    from tandem.sched.alise import Footprint

    def candidate(rid, x, r, hidden, level, be, blocks=0):
        c = Candidate(rid, x, x, blocks, 0.0, not be, num_output=0, predicted=r,
                      cache_type=CacheType.HIDDEN if hidden else CacheType.KV)
        return c, (be, level, 0)

    def peak(items):
        return max([0] + [sum(Fraction(b * (x + k), block_size) + Fraction(b, 2) for x, r, b in items if r > k)
                          for k in range(max(r for _, r, _ in items))])

    per = lambda x: 1 if x.cache_type is CacheType.HIDDEN else 2  # noqa: E731
    running = [candidate(f"h{i}", *h, blocks=-(-h[0] // block_size) * 2) for i, h in enumerate(holders)]
    waiting = [candidate(f"a{i}", *a[:5], blocks=a[5]) for i, a in enumerate(arrivals)]
    rank = {c.req_id: k for c, k in running + waiting}
    s = Snapshot([c for c, _ in running], [], free, block_size, 2, Limits(64, 2048, True),
                 hidden_blocks_per_token_block=1)
    fp = Footprint(s, s.running, rank)
    held = {c.req_id: c for c in s.running}
    total = free + sum(c.num_blocks for c in s.running)
    drops = [c.req_id for c, _ in running]
    while waiting:
        fits = []
        for c, mine in waiting:
            items = [(x.num_tokens, x.predicted, per(x)) for x in held.values() if rank[x.req_id][:2] <= mine[:2]]
            want = not items or peak(items + [(c.num_tokens, c.predicted, per(c))]) <= total + c.num_blocks
            assert fp.admits(c) == want
            fits.append(want)
        if True in fits:
            c, _ = waiting.pop(fits.index(True))
            fp.add(c)
            held[c.req_id] = c
            total += c.num_blocks
        if drops:
            h = drops.pop()
            fp.drop(h)
            held.pop(h)
        elif True not in fits:
            break


def _gittins_by_definition(spread, a):
    """min over horizons Δ of E[min(L - a, Δ) | L > a] / P(L - a <= Δ | L > a), exactly."""
    from fractions import Fraction
    surv = [x - a for x in spread if x > a]
    return min(Fraction(sum(min(d, h) for d in surv), sum(1 for d in surv if d <= h))
               for h in range(1, max(surv) + 1) if any(d <= h for d in surv))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 700), st.integers(0, 3), st.none() | st.integers(0, 500),
                          st.lists(st.integers(1, 500), max_size=8), st.floats(0, 30), st.booleans(),
                          st.sampled_from([None, "x"])),
                min_size=1, max_size=25))
def test_remaining_time_levels_and_order_against_their_definitions(rows):
    """Every candidate's T_rem and level (priced together, in numpy, with the cost model the
    server uses) against the module docstring's formulas worked one request at a time: L̂
    doubled until it exceeds g, the Gittins remaining from its definition over every horizon,
    the first level whose θ_i holds T_rem, aging; and the order by (class, level, T_rem). A
    request on a LoRA adapter prices its steps with the adapter and its rows."""
    from tandem.sched.cost_model import OnlineCostModel, StepShape
    priced = replace(COST, per_adapter=0.004, per_adapter_row=1e-4)
    a = Alise(OnlineCostModel(priced), levels=6, theta1_s=0.05, age_s=7.0)
    cs = []
    for i, (prompt, out, todo, pred, spread, waited, rt, adapter) in enumerate(rows):
        n = prompt + out
        cs.append(replace(cand(f"r{i}", prompt, out, pred, computed=max(0, n - todo), rt=rt, arrival=i % 5,
                               stalled=waited / 2, pending=waited / 2), spread=tuple(sorted(spread)), adapter=adapter))
    t, lvl = a.estimates(cs)
    for c, got_t, got_lvl in zip(cs, t.tolist(), lvl.tolist()):
        g, todo = c.num_output, c.num_tokens - c.num_computed
        L, demotions = (c.spread[-1] if c.spread else c.predicted if c.predicted is not None else 256), 0
        if c.spread and c.spread[-1] > g:
            left = _gittins_by_definition(c.spread, g)
        else:
            L = max(L, 1)
            while g >= L:
                L, demotions = 2 * L, demotions + 1
            left = L - g
        lora = int(c.adapter is not None)
        pre = priced.predict(StepShape(todo, todo * c.num_tokens, adapters=lora, adapter_rows=lora * todo)) \
            if todo > 1 else 0.0
        want = pre + max(left, 1) * priced.predict(StepShape(decode_tokens=1, decode_ctx=c.num_tokens, adapters=lora,
                                                             adapter_rows=lora))
        assert math.isclose(got_t, want, rel_tol=1e-12)
        if any(math.isclose(want, 0.05 * 2 ** i, rel_tol=1e-9) for i in range(6)):
            continue                                   # on a level's boundary: rounding may go either way
        base = next((i for i in range(1, 7) if want <= 0.05 * 2 ** (i - 1)), 6)
        assert got_lvl == max(min(6, base + demotions) - int((c.stalled_s + c.pending_s) // 7.0), 0)
    key = {c.req_id: (not c.rt, lv, c.arrival if lv == 0 else tt, c.arrival) for c, tt, lv in zip(cs, t, lvl)}
    order = [c.req_id for _, c, _ in a.order(snap(cs, []))]
    assert [key[r] for r in order] == sorted(key.values())
