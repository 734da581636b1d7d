"""Apt-Serve's ρ refined online: the cost model's hidden-block coefficient, refitted from measured
steps, converges to the device's true recompute cost, and the aptserve policy uses it."""
import random

import pytest

from tandem.bench.simulator import SimClock, SimDevice
from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType
from tandem.engine.params import SamplingParams
from tandem.sched.cost_model import CostModel, OnlineCostModel, StepShape
from tandem.sched.request import Request
from tandem.sched.scheduler import SchedConfig, Scheduler, make_policy

TRUE = CostModel(base=0.01, per_prefill_token=1e-4, per_prefill_attn=0.0, per_decode_token=1e-3,
                 per_decode_ctx=1e-6)
RHO = 0.002          # the device's seconds per KV block a hidden cache re-projects


def _kv_startup(n=64, seed=0):
    """Start-up samples of KV-only steps (what profile_cost measures): they fix every other term."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = StepShape()
        for _ in range(rng.randint(0, 2)):
            k = rng.randint(1, 256)
            s = s.add(k, k, decode=False)
        for _ in range(rng.randint(0, 16)):
            s = s.add(1, rng.randint(1, 512), decode=True)
        out.append((s, TRUE.predict(s)))
    return out


def test_shape_and_model_carry_hidden_blocks():
    s = StepShape().add(1, 40, decode=True, hidden_blocks=6).add(8, 8, decode=False)
    assert s == StepShape(8, 8 * 9 // 2, 1, 40, 6)        # a whole prompt of 8: 1 + 2 + ... + 8 pairs
    m = CostModel(0.01, 0.0, 0.0, 0.0, 0.0, per_hidden_block=0.5)
    assert m.predict(s) == pytest.approx(0.01 + 3.0)


def test_online_refit_recovers_rho_from_hidden_steps():
    startup = _kv_startup()
    cost = OnlineCostModel(CostModel.fit(startup), startup=startup, refit_every=16)
    assert cost.model.per_hidden_block == 0.0           # nothing in the start-up samples shows it
    clock = SimClock()
    dev = SimDevice("sim0", PoolGeometry(4000, 16, hidden_blocks=1), TRUE, clock, rho=RHO)
    sched = Scheduler(SchedConfig(cache_type=CacheType.HIDDEN), [dev], eos_ids=(), max_model_len=2048,
                      clock=clock, cost=cost)
    rng = random.Random(1)
    for i in range(12):
        sched.add(Request(f"h{i}", [1] * rng.randint(20, 300), SamplingParams(max_tokens=rng.randint(5, 40),
                                                                            ignore_eos=True)))
    while sched.has_unfinished():
        sched.step()
    assert cost.refits >= 1
    assert cost.model.per_hidden_block == pytest.approx(RHO, rel=1e-3)
    assert cost.model.per_decode_token == pytest.approx(TRUE.per_decode_token, rel=1e-3)


def test_aptserve_uses_the_refined_rho_and_falls_back_to_the_profiled_one():
    cfg = SchedConfig(policy="aptserve", rho=0.123)
    assert make_policy(cfg, None).rho == 0.123
    fitted = OnlineCostModel(CostModel(0.01, 0.0, 0.0, 0.0, 0.0, per_hidden_block=0.004))
    assert make_policy(cfg, fitted).rho == 0.004
    assert make_policy(cfg, OnlineCostModel(TRUE)).rho == 0.123     # not fitted on hidden steps yet
