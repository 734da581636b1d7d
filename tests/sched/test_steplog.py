"""The step log (``LLM.log_steps``, ``python -m server --step-log``): one line per model step,
whose tokens add up to what the requests computed. The reference is the requests themselves:
each prompt is computed once (no preemption, no shared prefix) and each output token after
the first takes one decode."""
import random

import pytest

from tandem.engine.params import SamplingParams
from tandem.sched.llm import LLM
from tandem.sched.request import Request, ServiceClass
from tandem.sched.steplog import read_steps

# (class, prompt tokens, output tokens)
WORK = [(ServiceClass.RT, 20, 5), (ServiceClass.RT, 37, 7), (ServiceClass.BE, 50, 4), (ServiceClass.BE, 9, 6)]


@pytest.mark.parametrize("policy", ["bros", "fcfs"])
def test_the_step_log_counts_what_the_requests_computed(tiny_llama, tmp_path, policy):
    path = tmp_path / "steps.jsonl"
    rng = random.Random(0)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=4 << 20, threads_per_worker=1,
             policy=policy, enable_prefix_caching=False) as llm:
        llm.log_steps(path)
        s = llm.scheduler
        for i, (cls, prompt, out) in enumerate(WORK):
            ids = [rng.randrange(3, 200) for _ in range(prompt)]
            s.add(Request(f"r{i}", ids, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), cls))
        while s.has_unfinished():
            s.step()
        ran = s.actors[0].steps_total
        assert s.actors[0].preemptions_by_class.total() == 0
    steps = read_steps(path)
    assert len(steps) == ran
    rt = [w for w in WORK if w[0] is ServiceClass.RT]
    be = [w for w in WORK if w[0] is ServiceClass.BE]
    assert sum(r.rt_prompt_tokens for r in steps) == sum(p for _, p, _ in rt)
    assert sum(r.be_prompt_tokens for r in steps) == sum(p for _, p, _ in be)
    assert sum(r.rt_decodes for r in steps) == sum(o - 1 for _, _, o in rt)
    assert sum(r.be_decodes for r in steps) == sum(o - 1 for _, _, o in be)
    assert all(r.shape.prefill_tokens == r.rt_prompt_tokens + r.be_prompt_tokens
               and r.shape.decode_tokens == r.rt_decodes + r.be_decodes and r.seconds > 0 for r in steps)
    # each prompt computed whole in one step: the longest chunk of a step reaches its prompt's length
    assert sum(r.prompt_chunks for r in steps) == len(WORK)
    assert {r.chunk_context for r in steps if r.prompt_chunks} <= {p for _, p, _ in WORK}
    assert max(r.chunk_context for r in steps) == max(p for _, p, _ in WORK)
    assert all(r.chunk_context == 0 for r in steps if not r.prompt_chunks)
    assert all((r.predicted is not None and r.predicted > 0) is (policy == "bros") for r in steps)


def test_a_step_log_stops_when_asked_and_at_shutdown(tiny_llama, tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=4 << 20, threads_per_worker=1,
             policy="fcfs") as llm:
        llm.log_steps(first)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        llm.log_steps(second)
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        log = llm.scheduler.actors[0].trace
    assert [r.shape.prefill_tokens for r in read_steps(first)] == [3, 0, 0]
    assert [r.shape.prefill_tokens for r in read_steps(second)] == [4, 0]
    assert log.closed
