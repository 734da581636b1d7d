"""The simulator drives the real scheduler: hand-checkable timings on a tiny trace."""
import math
from dataclasses import replace

import pytest

from tandem.bench.simulator import SimSetup, simulate
from tandem.bench.workloads import TraceItem
from tandem.cache import PoolGeometry
from tandem.sched.cost_model import CostModel
from tandem.sched.scheduler import SchedConfig

COST = CostModel(base=0.01, per_prefill_token=0.001, per_prefill_attn=0.0, per_decode_token=0.0,
                 per_decode_ctx=0.0)


def setup(num_blocks=1000, **kw):
    return SimSetup(COST, PoolGeometry(num_blocks, 16), SchedConfig(**kw), max_model_len=2048)


def test_single_request_timeline():
    # prefill of 10 tokens: 0.01 + 0.010 = 0.02 s, first token then; 4 more decode steps of 0.01 s
    recs, end = simulate([TraceItem(1.0, list(range(10)), 5, "rt")], setup())
    r = recs[0]
    assert r.ttft == pytest.approx(0.02)
    assert r.gaps == pytest.approx([0.01] * 4)
    assert end == pytest.approx(1.06)


def test_fcfs_preempts_the_later_request_under_memory_pressure():
    # each request grows to 20 tokens = 2 token-blocks = 4 blocks; both start in a 4-block pool
    # (2 blocks each), and at token 16 the later one is preempted and recomputed after the first ends
    trace = [TraceItem(0.0, list(range(10)), 10, "rt"), TraceItem(0.0, list(range(10)), 10, "rt")]
    stats = {}
    (a, b), _ = simulate(trace, setup(num_blocks=4), stats=stats)
    assert stats["preemptions"] == 1 and stats["switches"] == {}
    assert a.ttft == b.ttft == pytest.approx(0.03)              # one prefill step of 20 tokens
    assert max(b.gaps) >= a.end - 0.09, "b stalls until a has finished"
    assert b.end > a.end
    (a8, b8), _ = simulate(trace, setup(num_blocks=8))
    assert b8.gaps == pytest.approx([0.01] * 9) and b8.end == pytest.approx(a8.end)


def test_rejects_impossible_trace():
    with pytest.raises(ValueError):
        simulate([TraceItem(0.0, list(range(100)), 100, "rt")], setup(num_blocks=4))


def test_noise_scales_each_step_by_a_drawn_ratio():
    trace = [TraceItem(0.0, list(range(10)), 50, "rt")]
    base = SimSetup(COST, PoolGeometry(1000, 16), SchedConfig(), max_model_len=2048)
    (r,), _ = simulate(trace, SimSetup(**{**base.__dict__, "noise": (2.0,)}))
    assert r.ttft == pytest.approx(0.04) and r.gaps == pytest.approx([0.02] * 49)
    (r,), _ = simulate(trace, SimSetup(**{**base.__dict__, "noise": (1.0, 3.0), "seed": 7}))
    assert set(round(g, 6) for g in r.gaps) == {0.01, 0.03}       # both ratios drawn, nothing else
    (r2,), _ = simulate(trace, SimSetup(**{**base.__dict__, "noise": (1.0, 3.0), "seed": 7}))
    assert r2.gaps == r.gaps                                      # seeded


def test_be_jobs_are_resubmitted_and_counted_until_the_trace_ends():
    from tandem.bench.simulator import BeJobs
    be = BeJobs([TraceItem(0.0, list(range(10)), 3, "be")], job_size=2)
    (r,), end = simulate([TraceItem(0.5, list(range(10)), 5, "rt")], setup(), be)
    assert r.end == pytest.approx(end)
    # every BE request: one 10-token prefill with its first token, then 2 decodes
    assert be.completed >= 2 and be.output_tokens == 3 * be.completed
    assert be.submitted - be.completed in (0, 2)         # only the last job may be unfinished


def test_bros_keeps_rt_deadlines_that_fcfs_misses_behind_be_prefills():
    """Long BE prompts (FCFS serves them in arrival order) vs BROS packing them around RT deadlines."""
    from tandem.bench.simulator import BeJobs
    from dataclasses import replace
    rt = [TraceItem(0.05 + 0.2 * i, list(range(20)), 20, "rt") for i in range(10)]
    results = {}
    for policy in ("fcfs", "bros"):
        be = BeJobs([TraceItem(0.0, list(range(400)), 4, "be")], job_size=4)
        s = replace(setup(max_num_batched_tokens=2048, policy=policy), slo_ttft_s=0.1, slo_tbt_s=0.05)
        recs, _ = simulate(rt, s, be)
        results[policy] = (sum(r.ttft <= 0.1 and max(r.gaps) <= 0.05 + 1e-9 for r in recs), be.output_tokens)
    # FCFS: an RT arriving behind a 1600-token BE job waits >= 1.6 s of prefill; BROS serves RT first
    assert results["bros"][0] == 10 and results["fcfs"][0] < 10
    assert results["bros"][1] > 0


def test_prefill_steps_draw_from_their_own_ratios():
    base = SimSetup(COST, PoolGeometry(1000, 16), SchedConfig(), max_model_len=2048)
    (r,), _ = simulate([TraceItem(0.0, list(range(10)), 4, "rt")],
                       SimSetup(**{**base.__dict__, "noise": (1.0,), "noise_prefill": (3.0,)}))
    assert r.ttft == pytest.approx(0.06) and r.gaps == pytest.approx([0.01] * 3)


def test_hidden_cache_steps_pay_rho_per_kv_block_of_context():
    # 20-token prompt, 4 tokens out, hidden cache: the prefill re-projects nothing; the decode
    # steps see 20, 21, 22 tokens of context = 2 token-blocks = 4 KV blocks each: +4 rho
    from tandem.engine.messages import CacheType
    rho = 0.002
    trace = [TraceItem(0.0, list(range(20)), 4, "rt")]
    hid = SimSetup(COST, PoolGeometry(100, 16, hidden_blocks=1), SchedConfig(cache_type=CacheType.HIDDEN),
                   max_model_len=2048, rho=rho)
    stats = {}
    (r,), _ = simulate(trace, hid, stats=stats)
    assert stats["tokens"] == {"hidden": 20 + 3}        # the prompt, then one token per decode step
    assert r.ttft == pytest.approx(0.03)
    assert r.gaps == pytest.approx([0.01 + 4 * rho] * 3)
    (k,), _ = simulate(trace, SimSetup(**{**hid.__dict__, "sched": SchedConfig()}))
    assert k.gaps == pytest.approx([0.01] * 3)


def test_a_slower_machine_stretches_every_step_by_its_factor():
    """``sim-tandem --slower``: a device without measured ratios (the paper preset) gets the
    factor as its only ratio; one with ratios (the fitted preset) gets each ratio scaled, the
    prefill steps' own as well. Times by hand from COST: a 10-token prefill 0.02 s, a decode 0.01 s."""
    from tandem.bench.sim_tandem import Device, slowed
    trace = [TraceItem(0.0, list(range(10)), 30, "rt")]
    base = SimSetup(COST, PoolGeometry(1000, 16), SchedConfig(), max_model_len=2048)

    def run(dev):
        (r,), _ = simulate(trace, SimSetup(**{**base.__dict__, "noise": dev.noise,
                                              "noise_prefill": dev.noise_prefill, "seed": 3}))
        return r
    plain = Device(COST, 1000, 1, 0.0, (1, 1), 1e9)
    r = run(slowed(plain, 1.5))
    assert r.ttft == pytest.approx(0.03) and r.gaps == pytest.approx([0.015] * 29)
    assert slowed(plain, 1.0) is plain
    r = run(slowed(Device(COST, 1000, 1, 0.0, (1, 1), 1e9, noise=(1.0, 3.0), noise_prefill=(2.0,)), 1.5))
    assert r.ttft == pytest.approx(0.06)
    assert set(round(g, 6) for g in r.gaps) == {0.015, 0.045}


def test_a_side_link_copies_swap_outs_beside_the_steps_and_a_swap_in_waits_for_it():
    """Two 10-token prompts growing to 20 tokens in a 4-block pool: at token 17 the later one is
    swapped out (16 tokens: 2 blocks of 400 bytes, int8) and back in once the first ends. At
    1,000 bytes/s each way takes 0.8 s. Within the step (a CPU worker) the swap-out stalls the
    step that makes it; on a side link (a GPU worker) that step takes its 0.01 s, and the swap-in
    waits until the link has copied the swap-out, then copies its own bytes."""
    trace = [TraceItem(0.0, list(range(10)), 10, "rt"), TraceItem(0.0, list(range(10)), 10, "rt")]
    times = {}
    for side in (False, True):
        s = SimSetup(COST, PoolGeometry(4, 16), SchedConfig(preemption_mode="swap"), max_model_len=2048,
                     block_bytes=(800, 400), host_bw=1000.0, side_link=side)
        stats = {}
        (a, b), _ = simulate(trace, s, stats=stats)
        assert stats["swaps"] == {"out": 1, "in": 1} and stats["swap_bytes"] == {"out": 800, "in": 800}
        assert a.token_times[:7] == b.token_times[:7] == pytest.approx([0.03 + 0.01 * i for i in range(7)])
        times[side] = a.token_times[7:], b.token_times[7:]
    # serial: the step from 0.09 takes 0.01 + 0.8; b's swap-in step after a's last token 0.01 + 0.8
    assert times[False][0] == pytest.approx([0.9, 0.91, 0.92])
    assert times[False][1] == pytest.approx([0.92 + 0.81, 1.74, 1.75])
    # side link: the copy runs 0.09 -> 0.89 while a finishes at 0.12; b's step from 0.12 waits
    # 0.77 for the link, copies 0.8 and computes 0.01
    assert times[True][0] == pytest.approx([0.10, 0.11, 0.12])
    assert times[True][1] == pytest.approx([0.12 + 0.77 + 0.8 + 0.01, 1.71, 1.72])


def test_a_swapped_out_request_shows_its_bytes_to_the_policy_and_the_step_that_copies_them_back():
    """The trace above on the real Scheduler: once the later request is swapped out, its
    candidate carries the bytes the host holds for it (16 tokens: 2 blocks of 400 bytes, int8),
    and the one step that copies them back logs them in its shape (the cost model's B_in)."""
    from tandem.bench.simulator import SimClock, SimDevice
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request, ServiceClass
    from tandem.sched.scheduler import Scheduler
    clock = SimClock()
    dev = SimDevice("sim0", PoolGeometry(4, 16), COST, clock, block_bytes=(800, 400), host_bw=1000.0)
    s = Scheduler(SchedConfig(preemption_mode="swap"), [dev], eos_ids=(), max_model_len=2048, clock=clock)
    for rid in ("a", "b"):
        s.add(Request(rid, list(range(10)), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                      ServiceClass.RT, arrival_time=0.0))
    s.step_log = log = []
    seen = []
    while s.has_unfinished():
        s.step()
        seen.append({c.req_id: c.host_bytes for c in s.actors[0].snapshot().waiting})
    assert {"b": 800} in seen and all(v in ({}, {"b": 800}) for v in seen)
    assert sorted(shape.swap_in_bytes for shape, _ in log)[-2:] == [0, 800]


def test_a_pricing_policy_plans_with_what_the_device_charges_for_a_copy_back():
    """BROS on the trace above (one 10-token prompt swapped out, 800 bytes at 1,000 bytes/s): the
    step that copies the cache back takes 0.8 s more on the serial device, and the cost model the
    simulator gives the policy prices that step, its shape as logged, at what the device charged."""
    from tandem.bench.simulator import SimClock, SimDevice, policy_cost
    from tandem.engine.params import SamplingParams
    from tandem.sched.request import Request, ServiceClass
    from tandem.sched.scheduler import Scheduler
    cfg = SchedConfig(policy="bros", preemption_mode="swap")
    sim = SimSetup(COST, PoolGeometry(4, 16), cfg, max_model_len=2048, block_bytes=(800, 400), host_bw=1000.0)
    cost = policy_cost(sim)
    clock = SimClock()
    dev = SimDevice("sim0", sim.geometry, COST, clock, block_bytes=sim.block_bytes, host_bw=sim.host_bw)
    s = Scheduler(replace(cfg, rt_budget_s=1.0), [dev], eos_ids=(), max_model_len=2048, clock=clock, cost=cost)
    for rid in ("a", "b"):
        s.add(Request(rid, list(range(10)), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                      ServiceClass.RT, arrival_time=0.0))
    s.step_log = log = []
    while s.has_unfinished():
        s.step()
    back = [(shape, seconds) for shape, seconds in log if shape.swap_in_bytes]
    assert [shape.swap_in_bytes for shape, _ in back] == [800]
    # seconds on the simulator's clock, not measured: equal but for the float rounding of the
    # clock's end - start (0.8099999999999999 for 0.81)
    shape, simulated = back[0]
    assert math.isclose(simulated, COST.predict(shape) + 0.8, rel_tol=1e-12)
    assert math.isclose(cost(shape), simulated, rel_tol=1e-12)
