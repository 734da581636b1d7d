"""The simulated length-prediction bench: its noisy-predictor systems and its capacity reading."""
import math
import random

import numpy as np
import pytest

from tandem.bench.sim_alise import capacity, expand, noisy_predictions, rank_correlation


def _truth(n: int = 4000) -> dict[str, int]:
    rng = random.Random(7)
    return {f"prompt {i}": rng.randint(1000, 5000) for i in range(n)}


def test_no_noise_predicts_the_truth_with_a_point_spread():
    truth = _truth(50)
    got = noisy_predictions(truth, 0.0, seed=0)
    assert {k: p.length for k, p in got.items()} == truth
    assert all(p.spread == (truth[k],) * 8 for k, p in got.items())


def test_noise_has_the_asked_log_spread_and_its_spread_is_calibrated():
    """log(prediction / truth) has standard deviation σ, and the truth falls below the j-th point
    of the spread (j + ½)/8 of the time, counted over 4,000 prompts."""
    truth = _truth()
    got = noisy_predictions(truth, 0.5, seed=3)
    keys = sorted(truth)
    err = np.log([got[k].length / truth[k] for k in keys])
    assert abs(err.std() - 0.5) < 0.03 and abs(err.mean()) < 0.03
    below = np.array([[truth[k] < x for x in got[k].spread] for k in keys]).mean(axis=0)
    assert np.allclose(below, (np.arange(8) + 0.5) / 8, atol=0.03), below


def test_more_noise_ranks_worse_and_the_seed_fixes_the_draw():
    truth = _truth(1000)
    rho = [rank_correlation(truth, noisy_predictions(truth, s, seed=1)) for s in (0.0, 0.5, 1.0)]
    assert rho[0] == pytest.approx(1.0) and rho[0] > rho[1] > rho[2] > 0
    assert noisy_predictions(truth, 0.5, seed=1) == noisy_predictions(truth, 0.5, seed=1)
    assert noisy_predictions(truth, 0.5, seed=1) != noisy_predictions(truth, 0.5, seed=2)


def test_expand_gives_one_noisy_system_per_sigma():
    assert expand(["fcfs", "alise-noise", "alise"], [0.25, 1.0]) == [
        ("fcfs", "fcfs", None), ("alise-noise0.25", "alise-noise", 0.25),
        ("alise-noise1", "alise-noise", 1.0), ("alise", "alise", None)]


def test_capacity_interpolates_between_the_rates_around_the_bar():
    rows = [{"rate": 3, "norm_latency_s": 0.040}, {"rate": 1, "norm_latency_s": 0.010},
            {"rate": 2, "norm_latency_s": 0.020}]
    assert capacity(rows, 0.030) == (pytest.approx(2.5), True)       # 20 -> 40 ms between 2 and 3
    assert capacity(rows, 0.050) == (3, False)                       # never over it: at least 3
    assert capacity(rows, 0.005) == (0.0, True)                      # over it from the start
    assert math.isclose(capacity(rows, 0.015)[0], 1.5)
