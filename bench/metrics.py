"""Latency and SLO metrics, as the four papers define them.

Per request: TTFT, every inter-token gap (TBT), TPOT (mean gap after the first
token), end-to-end latency and normalized latency (latency / output tokens).
SLO attainment:
  - Apt-Serve: TTFT <= ttft_slo and the request's P99 TBT <= tbt_slo;
  - BROS: TTFT <= ttft_slo and TPOT <= tpot_slo.
Effective throughput: the highest request rate at which at least 90% of
requests meet both of their SLOs (searched over the rate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass
class RequestRecord:
    service_class: str              # "rt" | "be"
    arrival: float                  # seconds (any clock shared by the record)
    token_times: list[float] = field(default_factory=list)   # arrival time of each output token
    output_tokens: int = 0          # as the server counted them (usage), or len(token_times)
    end: float | None = None        # when the response finished
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def latency(self) -> float | None:
        return self.end - self.arrival if self.end is not None else None

    @property
    def normalized_latency(self) -> float | None:
        n = self.output_tokens or len(self.token_times)
        return self.latency / n if self.latency is not None and n else None


def record_dict(r: RequestRecord) -> dict:
    """A record as JSON-ready numbers: times relative to its arrival (ms precision for gaps), and
    ``sent``, the arrival itself on the client's clock (time.monotonic: on one machine the clock a
    server's step log keeps, so a late request can be set beside the steps it waited through)."""
    return {"cls": r.service_class, "error": r.error, "output_tokens": r.output_tokens, "sent": r.arrival,
            "ttft": r.ttft, "tpot": r.tpot, "latency": r.latency,
            "gaps": [round(g, 5) for g in r.gaps]}


def percentile(values: Iterable[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_apt(r: RequestRecord, ttft_slo: float, tbt_slo: float) -> bool:
    """Apt-Serve: TTFT and the request's own P99 TBT within their SLOs."""
    if not r.ok or r.ttft is None:
        return False
    gaps = r.gaps
    return r.ttft <= ttft_slo and (not gaps or percentile(gaps, 99) <= tbt_slo)


def meets_bros(r: RequestRecord, ttft_slo: float, tpot_slo: float) -> bool:
    """BROS: TTFT and TPOT within their SLOs."""
    if not r.ok or r.ttft is None:
        return False
    return r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo)


def attainment(records: list[RequestRecord], meets: Callable[[RequestRecord], bool]) -> float:
    """Fraction of records meeting their SLO (failed requests count as misses)."""
    return sum(map(meets, records)) / len(records) if records else math.nan


def effective_throughput(attain_at: Callable[[float], float], lo: float, hi: float,
                         target: float = 0.9, rel_tol: float = 0.05) -> tuple[float, list[tuple[float, float]]]:
    """Highest rate in [lo, hi] with attainment >= target, by bisection.

    ``attain_at(rate)`` runs (or simulates) the trace at that rate. Attainment is
    assumed to fall as the rate grows. Returns (rate, [(rate, attainment) probed]);
    rate is 0.0 when even ``lo`` misses the target, ``hi`` when ``hi`` meets it.
    """
    probes: list[tuple[float, float]] = []

    def probe(rate: float) -> bool:
        a = attain_at(rate)
        probes.append((rate, a))
        return a >= target
    if not probe(lo):
        return 0.0, probes
    if probe(hi):
        return hi, probes
    good, bad = lo, hi
    while bad - good > rel_tol * good:
        mid = (good + bad) / 2
        good, bad = (mid, bad) if probe(mid) else (good, mid)
    return good, probes


def search_bound(rate: float, lo: float, hi: float) -> str | None:
    """Where ``effective_throughput``'s answer is a bound, not a rate it found: "at_least" when
    ``hi`` still met the target, "below" when ``lo`` did not; else None."""
    return "at_least" if rate >= hi else "below" if rate == 0.0 else None


def rate_text(rate: float, lo: float, hi: float) -> str:
    """The search's answer as a reader should take it: ">= 8.00", "< 1.00" or "4.21"."""
    bound = search_bound(rate, lo, hi)
    return f">= {hi:.2f}" if bound == "at_least" else f"< {lo:.2f}" if bound == "below" else f"{rate:.2f}"


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """Percentiles of TTFT, TBT, TPOT, normalized latency; throughput; per class."""
    out = {}
    for cls in sorted({r.service_class for r in records}):
        rs = [r for r in records if r.service_class == cls]
        ok = [r for r in rs if r.ok]
        gaps = [g for r in ok for g in r.gaps]
        tokens = sum(r.output_tokens for r in ok)

        def pct(vals):
            vals = [v for v in vals if v is not None]
            return {p: percentile(vals, p) for p in (50, 90, 99)} if vals else {}
        out[cls] = {"requests": len(rs), "failed": len(rs) - len(ok),
                    "ttft_s": pct(r.ttft for r in ok), "tbt_s": pct(gaps), "tpot_s": pct(r.tpot for r in ok),
                    "normalized_latency_s": pct(r.normalized_latency for r in ok),
                    "normalized_latency_mean_s": (sum(r.normalized_latency for r in ok) / len(ok)
                                                  if ok else math.nan),
                    "requests_per_s": len(ok) / duration_s if duration_s else math.nan,
                    "tokens_per_s": tokens / duration_s if duration_s else math.nan}
    return out
