"""Apt-Serve's greedy (sched/knapsack.py) against brute force and hand-made cases."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.messages import CacheType
from tandem.sched.knapsack import KnapsackParams, KnapsackRequest, greedy

KV, HID = CacheType.KV, CacheType.HIDDEN


def g(r, mode, p):
    """SPEC §1.4's value, written out here: ε per KV block for a request past its SLO, else its
    pending time (at least 2ε per block); a hidden cache costs U·ρ per KV block it re-projects."""
    base = p.eps * r.kv_blocks if r.violated else max(r.pending_s, 2 * p.eps * r.kv_blocks)
    return base - (p.u_cnt * p.rho * r.kv_blocks if mode is HID else 0.0)


def size(r, mode):
    return r.hidden_blocks if mode is HID else r.kv_blocks


def chosen(reqs, plan):
    by_id = {r.req_id: r for r in reqs}
    return [(by_id[rid], m) for rid, m in plan.items()]


def brute_force(reqs, p):
    """Best plan over every request in {not run, KV, hidden} (violated requests: KV only)."""
    best = 0.0
    choices = [[None, KV] + ([] if r.violated else [HID]) for r in reqs]
    for modes in itertools.product(*choices):
        used = sum(size(r, m) for r, m in zip(reqs, modes) if m is not None)
        if used <= p.budget:
            best = max(best, sum(g(r, m, p) for r, m in zip(reqs, modes) if m is not None))
    return best


@st.composite
def instances(draw):
    hb = draw(st.sampled_from([1, 2, 3]))            # hidden blocks per token-block: r = 1/2, 1, 3/2
    n = draw(st.integers(1, 6))
    reqs = []
    for i in range(n):
        tb = draw(st.integers(1, 5))
        reqs.append(KnapsackRequest(f"r{i}", draw(st.floats(0, 5)), 2 * tb, hb * tb,
                                    draw(st.booleans()) and draw(st.booleans())))
    p = KnapsackParams(draw(st.integers(0, 30)), draw(st.floats(0, 0.05)), n + draw(st.integers(0, 5)))
    return reqs, p


@settings(max_examples=3000, deadline=None)
@given(instances())
def test_greedy_is_within_half_of_the_optimum_and_never_over_budget(inst):
    reqs, p = inst
    plan = greedy(reqs, p)
    assert sum(size(r, m) for r, m in chosen(reqs, plan)) <= p.budget
    assert all(m is KV or not next(r for r in reqs if r.req_id == rid).violated for rid, m in plan.items())
    assert sum(g(r, m, p) for r, m in chosen(reqs, plan)) >= brute_force(reqs, p) / 2 - 1e-9


def test_double_check_takes_the_critical_request_alone():
    # A is denser (1/2 per block) but B alone is worth more and only one of them fits
    a = KnapsackRequest("a", 1.0, 2, 2)
    b = KnapsackRequest("b", 4.5, 10, 10)
    assert greedy([a, b], KnapsackParams(10, 0.0, 2)) == {"b": KV}


def test_hidden_step_first_and_upgrade_only_when_it_fits():
    # p 10, 8 KV blocks or 4 hidden blocks; U rho m = 2 * 0.0625 * 8 = 1: hidden value 9
    x = KnapsackRequest("x", 10.0, 8, 4)
    p = KnapsackParams(4, 0.0625, 2)
    assert greedy([x], p) == {"x": HID}
    assert greedy([x], KnapsackParams(8, 0.0625, 2)) == {"x": KV}
    # a second request (KV only, density 0.75) sits between x's hidden step (9/4) and its
    # upgrade (1/4): with 8 blocks, x stays hidden and y joins (9 + 1.5 beats x alone in KV, 10)
    y = KnapsackRequest("y", 1.5, 2, 2)
    assert greedy([x, y], KnapsackParams(8, 0.0625, 2)) == {"x": HID, "y": KV}


def test_hidden_never_offered_where_it_saves_no_memory():
    # grouped-query model: a hidden cache takes 3 blocks where KV takes 2
    reqs = [KnapsackRequest(f"r{i}", 1.0 + i, 4, 6) for i in range(3)]
    plan = greedy(reqs, KnapsackParams(8, 0.0, 3))
    assert set(plan.values()) == {KV} and set(plan) == {"r1", "r2"}
