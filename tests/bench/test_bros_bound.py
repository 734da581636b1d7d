"""The BE-throughput bound of bench/bros_bound.py against hand-computed cases."""
import pytest

from tandem.bench.bros_bound import be_bound, load_of
from tandem.sched.cost_model import CostModel

COST = CostModel(base=0.01, per_prefill_token=1e-4, per_prefill_attn=0.0, per_decode_token=1e-3, per_decode_ctx=0.0)


def test_bound_by_hand():
    # every "seconds" here is work predicted by the hand-made COST above, not a clock reading
    # RT: 1 req/s, 100-token prompts, 10 tokens out; a step every 0.1 s holds 1 RT decode on
    # average: 0.011 s per step = 11% of each second, RT prefills 1% more. A BE request (200 in,
    # 20 out) costs 0.02 + 0.02 s: the 88% left makes 22 BE requests/s = 440 tokens/s
    load = load_of(COST, 1.0, [(100, 10)], [(200, 20)])
    assert load.rt_out == 10 and load.rt_prefill_s == pytest.approx(0.01)
    assert load.be_request_s == pytest.approx(0.04)
    assert be_bound(COST, load, 0.1) == pytest.approx(440)
    # half the step time: the per-step cost doubles (20% instead of 10%), the RT decode work
    # per second does not: 0.78 / 0.04 x 20
    assert be_bound(COST, load, 0.05) == pytest.approx(390)
    # a machine the RT load alone fills leaves nothing
    assert be_bound(COST, load_of(COST, 60.0, [(100, 10)], [(200, 20)]), 0.1) == 0.0


def test_rt_context_is_weighted_by_output_length():
    # decode context averaged over decode steps: (10 x (0 + 5) + 30 x (100 + 15)) / 40
    load = load_of(COST, 1.0, [(0, 10), (100, 30)], [(1, 1)])
    assert load.rt_ctx == pytest.approx((10 * 5 + 30 * 115) / 40)
