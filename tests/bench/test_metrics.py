"""Metric functions against hand-computed cases."""
import math

import numpy as np
import pytest

from tandem.bench.metrics import (RequestRecord, attainment, effective_throughput, meets_apt, meets_bros,
                           percentile, summarize)


def rec(arrival, times, cls="rt", end=None, n=None):
    return RequestRecord(cls, arrival, list(times), n if n is not None else len(times),
                         end if end is not None else (times[-1] if times else arrival))


def test_percentile_hand_cases():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5          # halfway between 2 and 3
    assert percentile([10, 20], 99) == pytest.approx(19.9)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))
    xs = [0.3, 7.1, 2.2, 9.9, 4.4, 1.0]
    for q in (0, 10, 33, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_request_fields():
    r = rec(10.0, [10.5, 10.6, 10.8, 11.1], end=11.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.gaps == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx(0.2)                   # (11.1 - 10.5) / 3
    assert r.latency == pytest.approx(1.2)
    assert r.normalized_latency == pytest.approx(0.3)     # 1.2 s / 4 tokens


def test_slo_definitions_differ_as_the_papers_do():
    # one long stall: P99 TBT fails a 0.5 s TBT SLO, but the mean (TPOT) passes it
    times = [1.0] + [1.0 + 0.1 * i for i in range(1, 20)] + [3.9]
    r = rec(0.0, times)
    assert r.ttft == 1.0
    assert not meets_apt(r, ttft_slo=2.0, tbt_slo=0.5)
    assert meets_bros(r, ttft_slo=2.0, tpot_slo=0.5)
    assert not meets_bros(r, ttft_slo=0.9, tpot_slo=0.5)
    failed = RequestRecord("rt", 0.0, [0.1], 1, None, error="boom")
    assert not meets_apt(failed, 10, 10) and not meets_bros(failed, 10, 10)


def test_attainment_and_summary():
    rs = [rec(0, [0.1, 0.2]), rec(0, [0.5, 0.6]), rec(0, [0.2, 0.9], cls="be"), rec(0, [3.0, 3.1])]
    assert attainment(rs, lambda r: meets_apt(r, 1.0, 0.5)) == 0.5
    s = summarize(rs, duration_s=4.0)
    assert s["rt"]["requests"] == 3 and s["be"]["requests"] == 1
    assert s["rt"]["ttft_s"][50] == pytest.approx(0.5)
    assert s["rt"]["tokens_per_s"] == pytest.approx(6 / 4)


def test_effective_throughput_bisection_finds_the_knee():
    knee = 3.7
    curve = lambda rate: 1.0 if rate <= knee else 0.5     # noqa: E731
    rate, probes = effective_throughput(curve, 0.5, 10.0, rel_tol=0.01)
    assert knee * 0.99 <= rate <= knee
    assert all(curve(r) == a for r, a in probes)
    assert effective_throughput(lambda r: 0.2, 1, 8)[0] == 0.0
    assert effective_throughput(lambda r: 0.95, 1, 8)[0] == 8


def test_stream_decode_gaps_start_once_every_stream_has_its_first_token():
    from tandem.bench.metrics import RequestRecord
    from tandem.bench.streams import decode_tbt_s
    early = RequestRecord("rt", 0.0, token_times=[1.0, 1.5, 2.0, 2.5, 3.0])
    late = RequestRecord("rt", 0.0, token_times=[2.0, 2.25, 2.5])      # first token at 2.0
    # before 2.0 the early stream shares steps with the late one's prefill: those gaps are left out
    assert sorted(decode_tbt_s([early, late])) == [0.25, 0.25, 0.5, 0.5]
