"""/metrics counts the device steps and the tokens each computed, by class and phase: checked
against what the test itself sent (prompt ids it chose, max_tokens it fixed); step times against
the requests' own latencies, whatever the machine's speed; vLLM's request phases from timestamps the test gives."""
import json
import urllib.request

from tandem.bench.online import server_counters
from tests.server.conftest import API_KEY, start_server, stop_server
from tests.server.test_load import metric

MAX_TOKENS = 7
RT_PROMPTS = [[5 + i, 17, 33, 99, 7 * i + 1][: 3 + i] for i in range(3)]
BE_PROMPTS = [list(range(40, 52 + 5 * i)) for i in range(2)]


def complete(server, prompt: list[int], tier: str | None) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "service_tier": tier}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_steps_and_their_tokens_are_counted_by_class_and_phase(tiny_chat_model, tmp_path):
    """One request at a time, so no two share a step and none is preempted: each takes one
    prefill step for its whole prompt and one decode step per further token."""
    s = start_server(tiny_chat_model, tmp_path, "--policy", "fcfs")
    try:
        for p in RT_PROMPTS:
            assert complete(s, p, None)["usage"]["completion_tokens"] == MAX_TOKENS
        for p in BE_PROMPTS:
            assert complete(s, p, "flex")["usage"]["completion_tokens"] == MAX_TOKENS
        req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        text = urllib.request.urlopen(req).read().decode()
        tokens = {(cls, phase): metric(text, "tandem:step_tokens_total", service_class=cls, phase=phase)
                  for cls in ("rt", "be") for phase in ("prefill", "decode")}
        assert tokens == {("rt", "prefill"): sum(map(len, RT_PROMPTS)),
                          ("rt", "decode"): len(RT_PROMPTS) * (MAX_TOKENS - 1),
                          ("be", "prefill"): sum(map(len, BE_PROMPTS)),
                          ("be", "decode"): len(BE_PROMPTS) * (MAX_TOKENS - 1)}
        requests = len(RT_PROMPTS) + len(BE_PROMPTS)
        assert metric(text, "tandem:step_seconds_count") == requests * MAX_TOKENS
        assert metric(text, "vllm:iteration_tokens_total_count") == requests * MAX_TOKENS
        assert metric(text, "vllm:iteration_tokens_total_sum") == sum(tokens.values())
        # a prefill step of a 3-token prompt holds 3 tokens; a decode step of one request, one
        assert metric(text, "vllm:iteration_tokens_total_bucket", le="1.0") == requests * (MAX_TOKENS - 1)
        # every step ran inside the lifetime of the one request it served: no step time is lost
        # or counted twice (a bound, not a speed: both sides scale with the machine)
        assert 0 < metric(text, "tandem:step_seconds_sum") <= metric(text, "vllm:e2e_request_latency_seconds_sum")
        seen = server_counters(s.url)                               # what the bench scrapes
        assert seen["steps"] == requests * MAX_TOKENS
        assert seen["tokens_be_prefill"] == tokens["be", "prefill"]
        assert seen["tokens_rt_decode"] == tokens["rt", "decode"]
        tokens_counted_as_they_come(s, text)
    finally:
        assert stop_server(s) == 0


def tokens_counted_as_they_come(s, before: str) -> None:
    """A stream read three chunks in: vLLM's token counters already have its prompt and the
    tokens sent (as vLLM counts them each step, not at the end)."""
    import http.client
    prompt = list(range(60, 75))
    conn = http.client.HTTPConnection("127.0.0.1", int(s.url.rsplit(":", 1)[1]), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": s.model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json", **s.headers()})
    r = conn.getresponse()
    chunks = 0
    while chunks < 3:
        chunks += r.readline().startswith(b"data: {")
    req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    now = urllib.request.urlopen(req).read().decode()
    grown = {k: metric(now, f"vllm:{k}_tokens_total", service_class="rt") -
             metric(before, f"vllm:{k}_tokens_total", service_class="rt") for k in ("prompt", "generation")}
    assert grown["prompt"] == len(prompt) and 3 <= grown["generation"] < 200, grown
    conn.close()


def test_counters_with_known_labels_are_there_at_zero_before_anything_happens():
    """Read with Prometheus' own text parser: a fresh server's migrations, swaps, predictions and
    refusals are series at 0, not missing until their first event."""
    from prometheus_client.parser import text_string_to_metric_families
    from tandem.server.metrics import Metrics
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(Metrics("m").render().decode())
               for s in f.samples}
    for name, labels in (("tandem:migrations_total", {"kind": "kv"}), ("tandem:migrations_total", {"kind": "token"}),
                         ("tandem:swaps_total", {"event": "evicted"}), ("tandem:swap_bytes_total", {"direction": "in"}),
                         ("tandem:length_predictions_total", {"path": "retrieval"}),
                         ("tandem:length_prediction_abs_error_tokens_count", {}), ("tandem:chats_refused_total", {}),
                         ("vllm:num_preemptions_total", {"service_class": "be"}),
                         ("vllm:generation_tokens_total", {"service_class": "rt"}),
                         ("vllm:request_success_total", {"service_class": "rt", "finished_reason": "abort"}),
                         ("vllm:request_success_total", {"service_class": "be", "finished_reason": "stop"}),
                         ("tandem:slo_requests_total", {"service_class": "rt", "slo": "ttft", "met": "false"})):
        assert samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))] == 0, (name, labels)


def test_vllms_request_phases_from_given_timestamps():
    """vLLM's phase histograms for requests whose times are given (no clock is read): arrival at
    10 s, first scheduled after 0.5 s in the queue, tokens at 11.0, 11.2 and 11.6 s, the end at
    11.7 s; and one that ended before any token. Values worked out by hand: prefill 0.5 s (first
    scheduled to first token), decode 0.6 s (first token to last), inference 1.1 s (their sum;
    to the end where no token came: 0.7 s), mean time per output token 0.3 s (0.6 s over 2 gaps),
    time to first token 1.0 s (= prefill + queue)."""
    import pytest
    from prometheus_client.parser import text_string_to_metric_families
    from tandem.server.metrics import Metrics
    m = Metrics("m")
    common = dict(prompt_tokens=4, arrival=10.0, queue_s=0.5, finish_reason="length", slo_ttft_s=None,
                  slo_tbt_s=None, max_tokens=3)
    m.request_done("rt", token_times=[11.0, 11.2, 11.6], end=11.7, n=1, **common)
    m.request_done("be", token_times=[], end=11.2, **common)
    got = {(s.name, s.labels["service_class"]): s.value for f in text_string_to_metric_families(m.render().decode())
           for s in f.samples if s.name.endswith(("_sum", "_count")) and "service_class" in s.labels}
    want = {"vllm:request_prefill_time_seconds": (0.5, 0), "vllm:request_decode_time_seconds": (0.6, 0),
            "vllm:request_inference_time_seconds": (1.1, 0.7),
            "vllm:request_time_per_output_token_seconds": (0.3, 0), "vllm:time_to_first_token_seconds": (1.0, 0),
            "vllm:request_queue_time_seconds": (0.5, 0.5), "vllm:e2e_request_latency_seconds": (1.7, 1.2)}
    for name, (rt, be) in want.items():
        assert got[(name + "_sum", "rt")] == pytest.approx(rt, abs=1e-12), name
        assert got[(name + "_count", "rt")] == 1, name
        assert got.get((name + "_sum", "be"), 0.0) == pytest.approx(be, abs=1e-12), name   # no series: none
        assert got.get((name + "_count", "be"), 0) == (1 if be else 0), name
    assert got[("vllm:request_params_n_count", "rt")] == 1 and got.get(("vllm:request_params_n_count", "be"), 0) == 0


def test_a_request_that_got_no_token_past_its_target_missed_it():
    """One that ended (a client that gave up waiting) with no token after its first-token target
    counts as a TTFT miss; one that ended before its target counts nothing; a best-effort one
    without targets, nothing."""
    from tandem.server.metrics import Metrics
    m = Metrics("m")
    common = dict(prompt_tokens=4, arrival=10.0, queue_s=None, finish_reason="abort", token_times=[],
                  slo_tbt_s=0.1)
    m.request_done("rt", end=11.5, slo_ttft_s=1.0, **common)
    m.request_done("rt", end=10.5, slo_ttft_s=1.0, **common)
    m.request_done("be", end=20.0, slo_ttft_s=None, **(common | {"slo_tbt_s": None}))
    count = lambda cls, slo, met: m.registry.get_sample_value(  # noqa: E731
        "tandem:slo_requests_total", {"model_name": "m", "service_class": cls, "slo": slo, "met": met})
    assert [count("rt", "ttft", "false"), count("rt", "both", "false"), count("rt", "ttft", "true")] == [1, 1, 0]
    assert count("be", "ttft", "false") == count("be", "ttft", "true") == 0
    assert m.registry.get_sample_value("vllm:prompt_tokens_total", {"model_name": "m", "service_class": "rt"}) == 8


def test_tokens_per_second_is_over_the_last_window_and_zero_once_idle():
    """Samples (clock, tokens so far) by hand, a 10 s window: at 15 s, the 300 tokens computed
    since the 5 s sample's 100 over those 10 s; at 25 s, the last step at 14 s, 0 (before, the
    rate shrank as 1/t after the work stopped); before a window has passed, from the first."""
    from tandem.server.metrics import token_rate
    samples = [(2.0, 0), (5.0, 100), (9.0, 250), (14.0, 400)]
    assert token_rate(samples, 15.0, 10.0) == 30.0
    assert token_rate(samples, 25.0, 10.0) == 0.0
    assert token_rate(samples[:3], 9.5, 10.0) == 250 / 7.5


def test_each_device_reports_its_own_cost_model(tiny_llama):
    """Two devices, each refining its own iteration cost model from its own steps: /metrics gives
    each one's, labelled by device (not the first device's alone)."""
    from tandem import LLM, SamplingParams
    from tandem.server.metrics import Metrics
    with LLM(str(tiny_llama), "cpu:2", dtype="float32", policy="bros", threads_per_worker=1) as llm:
        llm.generate([[3 + i] * (10 + 7 * i) for i in range(8)],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        m = Metrics("m")
        actors = llm.scheduler.actors
        for a in actors:
            m.engine_step(a)
        for a in actors:
            got = {name: m.registry.get_sample_value(name, {"model_name": "m", "device": a.device.name})
                   for name in ("tandem:cost_model_observed_steps", "tandem:cost_model_error")}
            assert a.cost.observed > 0, "the premise: each device stepped"
            assert got == {"tandem:cost_model_observed_steps": a.cost.observed,
                           "tandem:cost_model_error": a.cost.error_ewma}, a.device.name
        assert actors[0].cost is not actors[1].cost
