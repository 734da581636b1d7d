"""The multi-device simulator's floor: the fewest devices any placement could use."""
import random

import pytest

from tandem.bench.sim_mell import BLOCK_TOKENS, SimRequest, simulate
from tandem.sched.placement import Placement


def test_floor_is_kv_in_use_over_capacity_by_hand():
    """Capacity 10 blocks. Two 100-token prompts (7 blocks each with their first token) arrive in
    the first epoch: 14 blocks need 2 devices. At 0.1 s per token each gains 10 tokens an epoch:
    at the second epoch each holds 111 tokens (still 7 blocks); by the third both have their 20
    tokens and leave, so that epoch holds nothing."""
    reqs = [SimRequest(0.0, 100, 20), SimRequest(0.5, 100, 20)]
    res = simulate(reqs, Placement.BF, tbt_s=0.1, capacity=10)
    assert res["floor"] == [2, 2, 0]
    assert res["floor_peak"] == 2


@pytest.mark.parametrize("policy", list(Placement))
def test_no_placement_uses_fewer_devices_than_the_floor(policy):
    """Random arrivals onto small devices: every policy's active devices are at least the floor
    in every epoch (a placement below it would have overfilled a device), and the floor is
    reached by the devices' total load, so it is not trivially zero."""
    rng = random.Random(3)
    reqs = [SimRequest(rng.uniform(0, 30), rng.randint(1, 40) * BLOCK_TOKENS // 2, rng.randint(5, 60))
            for _ in range(60)]
    res = simulate(reqs, policy, tbt_s=0.05, capacity=24)
    assert len(res["timeline"]) == len(res["floor"])
    assert all(active >= floor for active, floor in zip(res["timeline"], res["floor"]))
    assert res["floor_peak"] >= 3


def test_migrated_bytes_are_the_moved_requests_kv_by_hand():
    """Capacity 10 blocks, 0.1 s per token. Two 79-token prompts arrive in the first epoch (5
    blocks each with their first token: one device, full). In the second each has 11 tokens, 90
    in all, 6 blocks: 12 > 10, so LB moves the newer one, 6 blocks, onto a new device. Then both
    grow to 9 blocks each on their own device and leave at the sixth epoch: one migration of 6
    blocks. ``simulated_s`` is simulated time (epochs of 1 s), so per-second rates times it are the
    counts; no clock is read."""
    from tandem.bench.sim_mell import KV_BYTES_PER_TOKEN
    reqs = [SimRequest(0.0, 79, 50), SimRequest(0.5, 79, 50)]
    res = simulate(reqs, Placement.LB, tbt_s=0.1, capacity=10)
    assert res["timeline"] == [1, 2, 2, 2, 2, 0]
    assert res["simulated_s"] == len(res["timeline"]) == 6
    assert round(res["migrations_per_s"] * res["simulated_s"]) == 1
    moved = res["migrated_gb_per_s"] * res["simulated_s"] * 1e9
    assert moved == pytest.approx(6 * BLOCK_TOKENS * KV_BYTES_PER_TOKEN)
