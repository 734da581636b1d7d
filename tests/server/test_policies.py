"""The server under --policy fcfs, bros, rr, aptserve, fcfs-prefill-first and alise: RT and BE batch work
complete, the greedy replies are HF transformers' (decoded by the model's tokenizer), and /metrics
shows the cost model's error and the pool by owner."""
import json
import urllib.request

import pytest

from tandem.bench.mixed import run_mixed
from tandem.bench.online import server_counters
from tandem.bench.workloads import TraceItem
from tests.server.conftest import API_KEY, hf_texts, start_server, stop_server
from tests.server.test_load import metric

PROMPTS = [[5 + i, 17, 33, 99, 7 * i + 1] for i in range(4)]


@pytest.fixture(scope="module")
def reference(tiny_chat_model) -> list[str]:
    return hf_texts(tiny_chat_model, PROMPTS, 10)


def complete(server, prompt, tier=None) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "service_tier": tier}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


@pytest.mark.parametrize("policy", ["fcfs", "bros", "rr", "aptserve", "aptserve --aptserve-mixed", "fcfs-prefill-first",
                                    "alise --length-predictor max_tokens"])
@pytest.mark.asyncio
async def test_policy_serves_mixed_work(policy, reference, tiny_chat_model, tmp_path):
    s = start_server(tiny_chat_model, tmp_path, "--policy", *policy.split(), "--slo-ttft-ms", "2000",
                     "--slo-tbt-ms", "500")
    try:
        assert [complete(s, p, "flex" if i % 2 else None) for i, p in enumerate(PROMPTS)] == reference
        rt = [TraceItem(0.3 * i, p, 12, "rt") for i, p in enumerate(PROMPTS)]
        be = [TraceItem(0.0, list(range(40, 90 + i)), 6, "be") for i in range(6)]
        recs, be_res = await run_mixed(s.url, s.model, rt, be, "tandem", be_mode="batches", job_size=3,
                                             drain_s=60, api_key=API_KEY)
        assert all(r.ok and r.output_tokens == 12 for r in recs)
        assert be_res.output_tokens == 6 * be_res.completed
        req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        text = urllib.request.urlopen(req).read().decode()
        assert metric(text, "tandem:pool_blocks", owner="free") > 0
        assert metric(text, "tandem:iteration_seconds_avg") > 0     # T_avg is exported (any speed)
        # every token is computed, counted under its cache type, or found in the prefix cache (the
        # BE prompts share their first 50 tokens): at least 4 x (5 + 9) for the completions,
        # 4 x (5 + 11) RT and 50 + i + 5 for each completed BE line, line j sending prompt i = j mod 6
        # (the six are cycled; more after preemptions). On a loaded machine the RT trace may end
        # before the second job starts.
        computed = metric(text, "tandem:cache_tokens_total")
        cached = metric(text, "vllm:prefix_cache_hits_total")
        assert be_res.completed >= 3, "the first BE job completes"
        assert computed + cached >= 4 * 14 + 4 * 16 + sum(55 + j % 6 for j in range(be_res.completed))
        seen = server_counters(s.url)                               # what the bench scrapes
        assert seen["tokens_kv"] + seen.get("tokens_hidden", 0) >= computed
        assert seen["preemptions"] == metric(text, "vllm:num_preemptions_total")
        # 8 RT requests and every completed BE line started (the job cancelled at the end may have
        # started up to 3 more), and each preemption or discarded cache made one start again
        again = metric(text, "vllm:num_preemptions_total") + metric(text, "tandem:cache_switches_total")
        started = 8 + be_res.completed
        assert started <= metric(text, "tandem:starts_by_reason_total") <= started + 3 + again
        if policy == "bros":
            assert metric(text, "tandem:cost_model_observed_steps") > 0
            assert 0 <= metric(text, "tandem:cost_model_error") < 10
    finally:
        assert stop_server(s) == 0
