"""Greedy output must equal HF transformers generate, token for token."""
import pytest

from tandem import LLM, SamplingParams
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

MAX_NEW = 24


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("workers", [1, 2])
def test_greedy_matches_hf_with_preemption(family, workers, tiny_llama, tiny_opt):
    model_dir = tiny_llama if family == "llama" else tiny_opt
    prompts = mixed_prompts(18, 512, seed=7 + workers)
    # tiny pool: 24 blocks of 8 tokens (12 token-blocks of K+V) per worker forces recompute preemption
    from tandem.engine.models.loader import load_spec
    spec = load_spec(model_dir)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    with LLM(str(model_dir), f"cpu:{workers}", dtype="float32", policy="fcfs", block_size=8,
             kv_cache_bytes=24 * block_bytes, max_num_batched_tokens=64, threads_per_worker=1) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        preemptions = sum(q.num_preemptions for q in llm.scheduler.queues)
        assert_pool_free(llm)
    assert preemptions > 0, "the pool was meant to be small enough to force preemption"
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
        assert o.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_swapped_requests_match_hf(family, tiny_llama, tiny_opt):
    """Preempted requests' caches go to the host pool at full precision and come back into other
    blocks: every request still generates exactly HF's greedy tokens. The default policy runs
    without predicted lengths, whatever predictor this machine has trained: look-ahead admission
    on them may avoid the preemptions this test needs."""
    model_dir = tiny_llama if family == "llama" else tiny_opt
    prompts = mixed_prompts(18, 512, seed=11)
    from tandem.engine.models.loader import load_spec
    spec = load_spec(model_dir)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", block_size=8, kv_cache_bytes=24 * block_bytes,
             max_num_batched_tokens=64, threads_per_worker=1, preemption_mode="swap",
             swap_dtype="auto", tandem_off=("lengths",)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        swaps = llm.scheduler.counts("swaps")
        moved = llm.scheduler.counts("swap_bytes")
        assert_pool_free(llm)
    assert swaps["out"] > 0 and swaps["in"] == swaps["out"], swaps
    assert moved["in"] == moved["out"] > 0
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
