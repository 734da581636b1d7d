"""Prometheus metrics: vLLM's names where the meaning is the same, labelled by service class."""
from __future__ import annotations

import math
import threading
import time
from typing import NamedTuple
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tandem.sched.request import Transfer

disable_created_metrics()       # no *_created series beside each counter and histogram, as vLLM's /metrics

# to 7680 s as vLLM's request latencies: a batch line or a chat past capacity may wait minutes
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
CLASSES = ("rt", "be")
SLO_WINDOW_S = 300.0       # the status endpoint's SLO attainment: requests finished in the last 5 minutes
RATE_WINDOW_S = 10.0       # its tokens/s: over the last 10 seconds of steps
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's
# vLLM's 1-2-5 buckets for token counts (it stops them at the context; these reach any context)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
N_BUCKETS = (1, 2, 5, 10, 20)                                       # vLLM's, for n
STATUS_EVERY_S = 0.25      # a device's status view is rebuilt at most this often while its requests stay the same


def token_rate(samples, now: float, window: float = RATE_WINDOW_S) -> float:
    """Tokens per second over the last ``window`` seconds, from (clock, tokens computed so far)
    samples, oldest first: the tokens after the last sample at or before the window's start
    (none of them: all of the first sample's), over the time since. A device idle for the whole
    window computed nothing in it."""
    start = now - window
    before = [s for s in samples if s[0] <= start]
    t0, n0 = (start, before[-1][1]) if before else samples[0]
    return (samples[-1][1] - n0) / (now - t0) if now > t0 else 0.0


class DeviceSample(NamedTuple):
    """One device's books after its last step, summed over devices into the gauges."""
    load: dict              # service class value -> (running, waiting, blocks held)
    pool: dict              # pool blocks by owner (sched.scheduler.pool_view)
    blocks: int             # the pool's size
    t_avg: float            # its moving average step time
    busy: bool              # it holds requests
    swapped: int            # requests whose cache is in its host pool
    host_used: int          # bytes of that pool in use
    host_capacity: int      # and its size (0: none)


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
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request",
                                        lab, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Tokens each finished request "
                                            "generated", lab, buckets=TOKEN_BUCKETS, registry=r)
        self.request_max_tokens = Histogram("vllm:request_params_max_tokens", "max_tokens of each finished "
                                            "request (filled in from the context where it set none)", lab,
                                            buckets=TOKEN_BUCKETS, registry=r)
        self.request_n = Histogram("vllm:request_params_n", "n (choices per prompt) of each finished request "
                                   "(counted once for its n choices)", lab, buckets=N_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "From first scheduled to the first "
                                      "token", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "From the first token to the last",
                                     lab, buckets=LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "From first scheduled to the "
                                        "end", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Each request's mean time between "
                              "its tokens (decode time / (tokens - 1))", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"],
                                registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding cache", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", lab, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of pool blocks held (0-1), over all devices",
                              ["model_name"], registry=r)
        self.kv_usage_by_class = Gauge("tandem:kv_cache_usage_perc", "Fraction of pool blocks held (0-1), by "
                                       "class (a block RT and BE requests share counts as RT's)", lab, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (the cache swapped to host memory, or "
                                   "discarded to be recomputed)", lab, registry=r)
        self.swapped = Gauge("vllm:num_requests_swapped", "Requests whose cache is swapped out to host memory "
                             "(counted among the waiting too)", ["model_name"], registry=r)
        self.host_usage = Gauge("vllm:cpu_cache_usage_perc", "Fraction of the host memory for swapped caches in "
                                "use (0-1; 0 where nothing swaps)", ["model_name"], registry=r)
        self.slo = Counter("tandem:slo_requests", "Finished requests by SLO outcome",
                           lab + ["slo", "met"], registry=r)
        self.cost_error = Gauge("tandem:cost_model_error", "Each device's iteration cost model: mean relative "
                                "error |predicted - measured| / measured (EWMA over steps)", ["model_name", "device"],
                                registry=r)
        self.cost_steps = Gauge("tandem:cost_model_observed_steps", "Steps each device's cost model has "
                                "been checked against (and refitted from)", ["model_name", "device"], registry=r)
        self.step_seconds = Histogram("tandem:step_seconds", "Wall time of each device step (plan to "
                                      "results)", ["model_name"], buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per device step "
                                          "(prompt tokens plus one per decoding request)", ["model_name"],
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.step_tokens = Counter("tandem:step_tokens", "Tokens computed in steps, by class and phase (prefill: "
                                   "prompt tokens, recomputed ones included; decode: one per decoding request)",
                                   lab + ["phase"], registry=r)
        self.t_avg = Gauge("tandem:iteration_seconds_avg", "Moving average of the iteration time (T_avg), of "
                           "the device where it is longest", ["model_name"], registry=r)
        self.pool_blocks = Gauge("tandem:pool_blocks", "Pool blocks by owner: rt, be, shared, checkpointed "
                                 "(slots on the CPU), free", ["model_name", "owner"], registry=r)
        self.cache_tokens = Counter("tandem:cache_tokens", "Tokens computed into each cache type (kv, "
                                    "hidden: Apt-Serve's hidden-state cache)", ["model_name", "cache_type"], registry=r)
        self.cache_switches = Counter("tandem:cache_switches", "Cache-type changes that discarded a "
                                      "request's cache to recompute it in the new type, by new type",
                                      ["model_name", "cache_type"], registry=r)
        self.rho = Gauge("tandem:aptserve_rho_seconds", "Apt-Serve's rho in use on each device: extra seconds "
                         "per KV block of context a hidden-cache request re-projects (profiled, refined online)",
                         ["model_name", "device"], registry=r)
        self.migrations = Counter("tandem:migrations", "Requests migrated between devices, by how they "
                                  "travelled: kv (cache copied) or token (prefilled again)",
                                  ["model_name", "kind"], registry=r)
        self.migration_pause = Histogram("tandem:migration_pause_seconds", "Pause a migrated request saw: "
                                         "from leaving its device to its next token on the new one (a "
                                         "request that ends or moves again before it has none)",
                                         ["model_name", "kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.connections = Gauge("tandem:http_connections", "Open HTTP connections: open (all), idle "
                                 "(no request in progress)", ["state"], registry=r)
        self.connections_closed = Counter("tandem:http_connections_closed", "Connections the server "
                                          "closed itself: refused (503 at the cap, all busy), evicted (the "
                                          "oldest idle one, to admit a new one), timed_out (head or body late)",
                                          ["reason"], registry=r)
        self._closed_seen: dict[str, int] = {}
        self.chats_refused = Counter("tandem:chats_refused", "New chats refused (429) while every device "
                                     "held a chat waiting more than --shed-chats-after TTFT targets for its "
                                     "first token", ["model_name"], registry=r)
        self.queue_full = Counter("tandem:queue_full_refusals", "Requests refused (429) because --max-waiting "
                                  "requests were waiting already", ["model_name"], registry=r)
        self.devices_active = Gauge("tandem:devices_active", "Devices holding at least one request "
                                    "(the others are idle)", ["model_name"], registry=r)
        self.device_pool = Gauge("tandem:device_pool_usage_perc", "Fraction of each device's pool blocks "
                                 "held (0-1)", ["model_name", "device"], registry=r)
        self.predictions = Counter("tandem:length_predictions", "Output lengths predicted, by path: retrieval "
                                   "(similar past prompts) or mlp", ["model_name", "path"], registry=r)
        self.prediction_error = Histogram("tandem:length_prediction_abs_error_tokens", "|predicted - real| "
                                          "output tokens of requests that ended by themselves",
                                          ["model_name"], buckets=(4, 16, 32, 64, 128, 256, 512, 1024, 2048),
                                          registry=r)
        self.swap_bytes = Counter("tandem:swap_bytes", "Bytes of preempted requests' caches moved to host "
                                  "memory (out) and back (in)", ["model_name", "direction"], registry=r)
        self.swaps = Counter("tandem:swaps", "Preempted requests' caches swapped out, back in, or evicted "
                             "from host memory to be recomputed", ["model_name", "event"], registry=r)
        self.preemption_reasons = Counter("tandem:preemptions_by_reason", "Preemptions by the policy's reason "
                                          "(whom the blocks went to)", ["model_name", "reason"], registry=r)
        self.start_reasons = Counter("tandem:starts_by_reason", "Requests started, or resumed after a preemption, "
                                     "by the policy's reason", ["model_name", "reason"], registry=r)
        self.waiting_reasons = Gauge("tandem:requests_waiting_by_reason", "Waiting requests by class and by "
                                     "the policy's reason for not running them", ["model_name", "service_class",
                                     "reason"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "The LoRA adapters of the requests running and waiting "
                               "(comma-separated names in its labels); its value: when they were last seen",
                               ["running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "when their requests started", ["model_name"], registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "computed again)", ["model_name"], registry=r)
        self.prefix_routed = Counter("tandem:prefix_routed_requests", "Requests sent to a device because its "
                                     "prefix cache held the start of their prompt (several devices)", ["model_name"],
                                     registry=r)
        self.cache_config = Gauge("vllm:cache_config_info", "The resident cache: block size, dtype (int8: "
                                  "full blocks compressed) and blocks over all devices", ["model_name", "block_size",
                                  "cache_dtype", "num_gpu_blocks"], registry=r)
        self.lengths = None                      # the engine's LengthSource, when it predicts
        self._zeros()
        self._seen: dict = {}
        self._devices: dict[int, DeviceSample] = {}     # device index -> its books after its last step
        self._status: dict[int, dict] = {}       # device index -> sched.status.device_status after its step
        self._status_at: dict[int, tuple] = {}   # device index -> (when that view was built, its request count)
        self._token_samples: dict[int, deque] = {}   # device index -> (clock, tokens computed) samples
        self._slo_window: deque = deque()        # (clock, class, ttft met, tbt met) of finished requests
        self._lock = threading.Lock()

    def cache_configured(self, block_size: int, cache_dtype: str, num_blocks: int) -> None:
        self.cache_config.labels(self.model, str(block_size), cache_dtype, str(num_blocks)).set(1)

    def engine_step(self, actor) -> None:
        """Gauges and counters from one device actor, summed over devices; called on that actor's
        thread after each of its steps (it alone changes its books)."""
        from tandem.sched.scheduler import load_by_class, pool_view
        load = {c.value: v for c, v in load_by_class([actor]).items()}
        now = time.monotonic()
        status = self._view(actor, now)
        with self._lock:
            if status is not None:
                self._keep_view(actor, status, now)
            samples = self._token_samples.setdefault(actor.index, deque())
            samples.append((now, actor.tokens_computed))
            while len(samples) > 2 and samples[1][0] < now - RATE_WINDOW_S:
                samples.popleft()
            host = actor.host
            self._devices[actor.index] = DeviceSample(
                load, pool_view([actor]), actor.pool.geometry.num_blocks, actor.t_avg, bool(actor.states),
                *((0, 0, 0) if host is None else (len(host), host.used, host.capacity)))
            devices = list(self._devices.values())
            self.devices_active.labels(self.model).set(sum(d.busy for d in devices))
            self.device_pool.labels(self.model, actor.device.name).set(
                1 - actor.pool.num_free / max(1, actor.pool.geometry.num_blocks))
            self._count_moves(actor)
            self._count_steps(actor)
            # each block once, however many requests share it (prefix caching); one that RT and BE
            # requests share counts as RT's, so the two add up to the pool's use
            held = {"rt": sum(d.pool["rt"] + d.pool["shared"] for d in devices),
                    "be": sum(d.pool["be"] for d in devices)}
            blocks = max(1, sum(d.blocks for d in devices))
            for cls in CLASSES:
                running = sum(d.load.get(cls, (0, 0, 0))[0] for d in devices)
                waiting = sum(d.load.get(cls, (0, 0, 0))[1] for d in devices)
                self.running.labels(self.model, cls).set(running)
                self.waiting.labels(self.model, cls).set(waiting)
                self.kv_usage_by_class.labels(self.model, cls).set(held[cls] / blocks)
            self.kv_usage.labels(self.model).set((held["rt"] + held["be"]) / blocks)
            for owner in devices[0].pool:
                self.pool_blocks.labels(self.model, owner).set(sum(d.pool[owner] for d in devices))
            self.t_avg.labels(self.model).set(max(d.t_avg for d in devices))
            self.swapped.labels(self.model).set(sum(d.swapped for d in devices))
            host_bytes = max(1, sum(d.host_capacity for d in devices))
            self.host_usage.labels(self.model).set(sum(d.host_used for d in devices) / host_bytes)
            cost, name = actor.cost, actor.device.name
            if cost is not None and cost.error_ewma is not None:
                self.cost_error.labels(self.model, name).set(cost.error_ewma)
                self.cost_steps.labels(self.model, name).set(cost.observed)
            if (rho := getattr(actor.policy, "rho", None)) is not None:
                self.rho.labels(self.model, name).set(rho)
            self._count(self.preemptions, actor.index, actor.preemptions_by_class)
            self._count(self.cache_tokens, actor.index, actor.tokens_by_cache_type)
            self._count(self.cache_switches, actor.index, actor.cache_switches)
            self._count(self.swap_bytes, actor.index, actor.swap_bytes)
            self._count(self.swaps, actor.index, actor.swaps)
            self._count(self.preemption_reasons, actor.index, actor.preemption_reasons)
            self._count(self.start_reasons, actor.index, actor.start_reasons)
            self._count(self.prefix_queries, actor.index, {(): actor.prefix_tokens["queried"]})
            self._count(self.prefix_hits, actor.index, {(): actor.prefix_tokens["hits"]})
            self._count(self.prefix_routed, actor.index, {(): actor.prefix_routed})

    def device_planned(self, actor) -> None:
        """The device's view once its step is planned, before the step runs: a step of many
        seconds (a long prompt chunk on a CPU) has its requests listed while it runs, not once
        it ended. Called on that actor's thread."""
        now = time.monotonic()
        status = self._view(actor, now)
        if status is not None:
            with self._lock:
                self._keep_view(actor, status, now)

    def _view(self, actor, now: float) -> dict | None:
        """The device's status view, where the last one is stale: the view lists every request, so
        progress alone (the same requests, more tokens) refreshes it a few times a second, what a
        person (or a poll) can read; a request arriving or leaving, the device going idle
        included, shows at once."""
        from tandem.sched.status import device_status
        built, count = self._status_at.get(actor.index, (-math.inf, -1))
        if len(actor.states) == count and now - built < STATUS_EVERY_S:
            return None
        return device_status(actor, now) | {"migrations_in": actor.moves_total}

    def _keep_view(self, actor, status: dict, now: float) -> None:
        """``status`` as the device's view, and the gauges read from every device's (under the lock)."""
        self._status[actor.index] = status
        self._status_at[actor.index] = (now, len(actor.states))
        self._set_waiting_reasons()
        self._set_lora_info()

    def _set_waiting_reasons(self) -> None:
        """The waiting-by-reason gauge from every device's latest view (reasons gone drop to 0)."""
        totals: dict = {}
        for st in self._status.values():
            for row in st.get("waiting_reasons", ()):
                key = (row["class"], row["why"])
                totals[key] = totals.get(key, 0) + row["requests"]
        for key in self._seen.get("waiting_reasons", set()) - set(totals):
            self.waiting_reasons.labels(self.model, *key).set(0)
        for key, n in totals.items():
            self.waiting_reasons.labels(self.model, *key).set(n)
        self._seen["waiting_reasons"] = set(totals)

    def _set_lora_info(self) -> None:
        """vLLM's adapter gauge from every device's latest view: one series, whose labels name the
        adapters in use (set again, as vLLM sets it, at each view; none until an adapter is used)."""
        names = {state: sorted({n for st in self._status.values() for n in st.get("adapters", {}).get(state, ())})
                 for state in ("running", "waiting")}
        seen = self._seen.get("lora_info")
        if seen is None and not names["running"] and not names["waiting"]:
            return
        labels = (",".join(names["running"]), ",".join(names["waiting"]))
        if seen is not None and seen != labels:
            self.lora_info.remove(*seen)
        self.lora_info.labels(*labels).set_to_current_time()
        self._seen["lora_info"] = labels

    def _fresh(self, key: tuple, log: deque, total: int) -> list:
        """What a device appended to a bounded ``log`` (``total`` entries ever) since the last call."""
        new = total - self._seen.get(key, 0)
        self._seen[key] = total
        n = len(log)
        return [log[i] for i in range(n - min(new, n), n)] if new > 0 else []   # O(new) at a deque's end

    def _count_moves(self, actor) -> None:
        """Migrations that left this device since the last call (each once, whether or not the
        request goes on to a token where it went: a cancel, a failure or a second move may come
        first), and the pauses of those that arrived here (its ``moves`` log)."""
        self._count(self.migrations, actor.index, actor.moved_out)
        for m in self._fresh(("moves", actor.index), actor.moves, actor.moves_total):
            self.migration_pause.labels(self.model, m.kind.value).observe(m.pause_s)

    def _count_steps(self, actor) -> None:
        """Steps this device finished since the last call (its ``steps`` log), and its tokens by
        class and phase."""
        for seconds, tokens in self._fresh(("steps", actor.index), actor.steps, actor.steps_total):
            self.step_seconds.labels(self.model).observe(seconds)
            self.iteration_tokens.labels(self.model).observe(tokens)
        self._count(self.step_tokens, actor.index, actor.tokens_by_phase)

    def _zeros(self) -> None:
        """The series whose labels are known in advance, at 0 from the start (Prometheus' advice): a
        dashboard or an alert sees "none yet", not "no such metric"."""
        m = self.model
        for kind in Transfer:
            self.migrations.labels(m, kind.value)
            self.migration_pause.labels(m, kind.value)
        for path in ("retrieval", "mlp"):
            self.predictions.labels(m, path)
        for direction in ("out", "in"):
            self.swap_bytes.labels(m, direction)
        for event in ("out", "in", "evicted"):
            self.swaps.labels(m, event)
        for c in (self.prediction_error, self.chats_refused, self.queue_full, self.prefix_queries, self.prefix_hits,
                  self.prefix_routed):
            c.labels(m)
        self._token_counters = {cls: (self.prompt_tokens.labels(m, cls), self.generation_tokens.labels(m, cls))
                                for cls in CLASSES}
        for cls in CLASSES:                 # a rate() over vLLM's counters answers 0, not nothing
            self.preemptions.labels(m, cls)
            for reason in FINISH_REASONS:
                self.requests.labels(m, cls, reason)
            for slo in ("ttft", "tbt", "both"):
                for met in ("true", "false"):
                    self.slo.labels(m, cls, slo, met)

    def activity(self) -> dict[str, float]:
        """The totals the periodic log line reads: tokens computed by phase so far, requests
        running and waiting, the pool's use, prefix-cache tokens looked up and found."""
        get, m = self.registry.get_sample_value, self.model

        def by_class(name: str, **labels) -> float:
            return sum(get(name, {"model_name": m, "service_class": c, **labels}) or 0 for c in CLASSES)
        return {"prefill": by_class("tandem:step_tokens_total", phase="prefill"),
                "decode": by_class("tandem:step_tokens_total", phase="decode"),
                "running": by_class("vllm:num_requests_running"), "waiting": by_class("vllm:num_requests_waiting"),
                "kv": get("vllm:kv_cache_usage_perc", {"model_name": m}) or 0,
                "queried": get("vllm:prefix_cache_queries_total", {"model_name": m}) or 0,
                "hits": get("vllm:prefix_cache_hits_total", {"model_name": m}) or 0}

    def _count(self, counter: Counter, device: int, totals) -> None:
        """Bring a Prometheus counter up to one device's running totals (key -> count; a key is an
        enum, a string or a tuple of them, one per label after the model's)."""
        for key, n in list(totals.items()):
            seen = self._seen.get((counter, device, key), 0)
            if n > seen:
                labels = key if isinstance(key, tuple) else (key,)
                counter.labels(self.model, *(getattr(k, "value", k) for k in labels)).inc(n - seen)
                self._seen[(counter, device, key)] = n

    def tokens_out(self, cls: str, prompt_tokens: int, new_tokens: int, counted: int) -> None:
        """Tokens a request generated as they come (vLLM counts them each step, so a long reply's
        throughput shows while it is written): its prompt's with its first, ``counted`` before."""
        prompt, generation = self._token_counters[cls]         # each event's: no label lookup
        if counted == 0 and new_tokens:
            prompt.inc(prompt_tokens)
        generation.inc(new_tokens)

    def request_done(self, cls: str, *, prompt_tokens: int, token_times: list[float], arrival: float,
                     end: float, queue_s: float | None, finish_reason: str,
                     slo_ttft_s: float | None, slo_tbt_s: float | None, max_tokens: int = 0,
                     n: int | None = None, counted: int = 0) -> None:
        """Per-request observations; token_times are the monotonic arrival times of each token.
        vLLM's phases: prefill from first scheduled (arrival + queue_s) to the first token, decode
        from there to the last, inference the two together (to the end where no token came).
        ``n``: given for one choice of each prompt (vLLM counts n once per request). ``counted``:
        its tokens ``tokens_out`` counted already. A request that ended with no token past its
        first-token target missed it (a client that gave up waiting is the worst miss)."""
        m = (self.model, cls)
        prompt, generation = self._token_counters[cls]
        if counted == 0:                  # none came while it ran (no token, or a beam search's at its end)
            prompt.inc(prompt_tokens)
        generation.inc(len(token_times) - counted)
        self.request_prompt.labels(*m).observe(prompt_tokens)
        self.request_generation.labels(*m).observe(len(token_times))
        self.request_max_tokens.labels(*m).observe(max_tokens)
        if n is not None:
            self.request_n.labels(*m).observe(n)
        self.e2e.labels(*m).observe(end - arrival)
        self.requests.labels(*m, finish_reason).inc()
        if queue_s is not None:
            self.queue.labels(*m).observe(queue_s)
            started = arrival + queue_s
            self.inference_time.labels(*m).observe((token_times[-1] if token_times else end) - started)
            if token_times:
                self.prefill_time.labels(*m).observe(token_times[0] - started)
        if not token_times:
            if slo_ttft_s is not None and end - arrival > slo_ttft_s:
                self._slo_outcome(cls, False, True)
            return
        ttft = token_times[0] - arrival
        self.ttft.labels(*m).observe(ttft)
        self.decode_time.labels(*m).observe(token_times[-1] - token_times[0])
        if len(token_times) > 1:
            self.tpot.labels(*m).observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        for g in gaps:
            self.itl.labels(*m).observe(g)
        if slo_ttft_s is None and slo_tbt_s is None:     # best-effort work without targets
            return
        p99 = sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
        self._slo_outcome(cls, slo_ttft_s is None or ttft <= slo_ttft_s, slo_tbt_s is None or p99 <= slo_tbt_s)

    def _slo_outcome(self, cls: str, ttft_ok: bool, tbt_ok: bool) -> None:
        with self._lock:
            self._slo_window.append((time.monotonic(), cls, ttft_ok, tbt_ok))
        for name, ok in (("ttft", ttft_ok), ("tbt", tbt_ok), ("both", ttft_ok and tbt_ok)):
            self.slo.labels(self.model, cls, name, str(ok).lower()).inc()

    def _count_predictions(self) -> None:
        src = self.lengths
        if src is None or src.predictor is None:
            return
        for path, n in (("retrieval", src.retrieved), ("mlp", src.predicted - src.retrieved)):
            seen = self._seen.get(("pred", path), 0)
            if n > seen:
                self.predictions.labels(self.model, path).inc(n - seen)
                self._seen[("pred", path)] = n
        for pred, real in src.drain():
            self.prediction_error.labels(self.model).observe(abs(pred - real))

    def http_connections(self, counts: dict[str, int]) -> None:
        """The connection guard's books (server.connections.ConnectionGuard.counts)."""
        for state in ("open", "idle"):
            self.connections.labels(state).set(counts[state])
        for reason in ("refused", "evicted", "timed_out"):
            self.connections_closed.labels(reason).inc(counts[reason] - self._closed_seen.get(reason, 0))
            self._closed_seen[reason] = counts[reason]

    def status(self) -> dict:
        """Per device state (pool, classes, requests, tokens/s over the last RATE_WINDOW_S) and SLO
        attainment per class over the last SLO_WINDOW_S: the status endpoint's data."""
        now = time.monotonic()
        with self._lock:
            while self._slo_window and self._slo_window[0][0] < now - SLO_WINDOW_S:
                self._slo_window.popleft()
            window = list(self._slo_window)
            devices = []
            for index in sorted(self._status):
                rate = token_rate(self._token_samples[index], now)
                devices.append(self._status[index] | {"tokens_per_s": round(rate, 1)})
        slo = {}
        for cls in CLASSES:
            rows = [w for w in window if w[1] == cls]
            n = len(rows)
            slo[cls] = {"requests": n, "ttft": sum(w[2] for w in rows) / n if n else None,
                        "tbt": sum(w[3] for w in rows) / n if n else None,
                        "both": sum(w[2] and w[3] for w in rows) / n if n else None}
        return {"model": self.model, "devices": devices, "slo_window_s": SLO_WINDOW_S, "slo": slo,
                "tokens_per_s": round(sum(d["tokens_per_s"] for d in devices), 1)}

    def render(self) -> bytes:
        """The registry in Prometheus' text format, read under the lock the devices set their gauges
        under: the gauges of one step are read together (a scrape between two of them saw a
        request swapped out with no host memory in use)."""
        with self._lock:
            self._count_predictions()
            return generate_latest(self.registry)
