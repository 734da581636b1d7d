"""Prometheus metrics: vLLM's names where the meaning is the same, labelled by service class."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
CLASSES = ("rt", "be")


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lab = ["model_name", "service_class"]
        self.model = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled",
                               lab, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"],
                                registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding cache", ["model_name"], registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of pool blocks in use (0-1)",
                              ["model_name"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (cache discarded)", ["model_name"],
                                   registry=r)
        self.slo = Counter("tandem:slo_requests", "Finished requests by SLO outcome",
                           lab + ["slo", "met"], registry=r)
        self._preempt_seen = 0

    def engine_step(self, scheduler) -> None:
        """Gauges from the scheduler; called on the engine thread after each step."""
        qs = scheduler.queues
        self.running.labels(self.model).set(sum(len(q.running) for q in qs))
        self.waiting.labels(self.model).set(sum(len(q.waiting) for q in qs))
        used = sum(q.pool.num_used for q in qs)
        total = sum(q.pool.geometry.num_blocks for q in qs)
        self.kv_usage.labels(self.model).set(used / max(1, total))
        n = sum(q.num_preemptions for q in qs)
        if n > self._preempt_seen:
            self.preemptions.labels(self.model).inc(n - self._preempt_seen)
            self._preempt_seen = n

    def request_done(self, cls: str, *, prompt_tokens: int, token_times: list[float], arrival: float,
                     end: float, queue_s: float | None, finish_reason: str,
                     slo_ttft_s: float | None, slo_tbt_s: float | None) -> None:
        """Per-request observations; token_times are the monotonic arrival times of each token."""
        m = (self.model, cls)
        self.prompt_tokens.labels(*m).inc(prompt_tokens)
        self.generation_tokens.labels(*m).inc(len(token_times))
        self.e2e.labels(*m).observe(end - arrival)
        self.requests.labels(*m, finish_reason).inc()
        if queue_s is not None:
            self.queue.labels(*m).observe(queue_s)
        if not token_times:
            return
        ttft = token_times[0] - arrival
        self.ttft.labels(*m).observe(ttft)
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        for g in gaps:
            self.itl.labels(*m).observe(g)
        ttft_ok = slo_ttft_s is None or ttft <= slo_ttft_s
        p99 = sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
        tbt_ok = slo_tbt_s is None or p99 <= slo_tbt_s
        for name, ok in (("ttft", ttft_ok), ("tbt", tbt_ok), ("both", ttft_ok and tbt_ok)):
            self.slo.labels(*m, name, str(ok).lower()).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
