"""The default policy, with its memory mechanisms engaged, still generates HF's greedy tokens."""
from tandem import LLM, SamplingParams
from tandem.engine.messages import CacheType
from tandem.sched.lengths import LengthSource
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

MAX_NEW = 24


class ShortGuess(LengthSource):
    """A predictor that takes every request for a two-token answer: the policy admits more than
    the pool will hold and has to preempt as the requests outgrow their predictions."""

    def __init__(self):
        super().__init__("max_tokens")

    def assign(self, reqs, texts):
        for r in reqs:
            r.predicted_len = 2


def test_tandem_with_hidden_caches_and_swaps_matches_hf(tiny_opt):
    """On a multi-head model (a hidden cache is half a KV cache) with a pool of 24 blocks, tandem
    gives some requests hidden caches and swaps preempted ones to host memory at full precision;
    every request's tokens equal HF's."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_opt)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    prompts = mixed_prompts(40, 512, seed=13)     # enough that some wait long enough for a hidden cache to pay
    with LLM(str(tiny_opt), ONE_DEVICE, dtype="float32", block_size=8, kv_cache_bytes=24 * block_bytes,
             max_num_batched_tokens=64, threads_per_worker=1, swap_dtype="auto",
             length_predictor="max_tokens") as llm:
        assert llm.scheduler.cfg.policy == "tandem"
        llm.lengths = ShortGuess()
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        tokens = llm.scheduler.tokens_by_cache_type
        swaps = llm.scheduler.counts("swaps")
        assert_pool_free(llm)
    assert tokens[CacheType.HIDDEN] > 0, f"no request was given a hidden cache: {tokens}"
    assert swaps["out"] > 0 and swaps["in"] == swaps["out"], swaps
    ref = hf_greedy(tiny_opt, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
        assert o.finish_reason == "length"


def test_tandem_options_reach_the_policy_and_it_serves(tiny_llama):
    """Switches and the mean-gap target go through LLM to every device's policy (the start-up
    profile runs under FCFS meanwhile), and outputs stay HF's."""
    from tandem.sched.tandem import Mechanism
    prompts = mixed_prompts(4, 512, seed=3)
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", threads_per_worker=1, length_predictor="max_tokens",
             tandem_off=("slo", "hidden"), slo_tbt_mean=True) as llm:
        p = llm.scheduler.policy
        assert p.off == {Mechanism.SLO, Mechanism.HIDDEN} and p.mean_tbt
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for o, r in zip(outs, hf_greedy(tiny_llama, prompts, 8), strict=True):
        assert o.token_ids == r
