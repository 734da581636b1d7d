"""The engine with its attention on the Triton kernels (under the interpreter on a machine
without a GPU, tests/conftest.py) generates exactly HF transformers' greedy tokens: KV caches with chunked
prefill and preemption by swapping (on a GPU: to page-locked host memory on a side stream, and back),
and hidden caches, preempted by recomputation. (Bidirectional blocks: tests/engine/test_bidir_exactness.py.)"""
import pytest

from tandem import LLM, SamplingParams
from tandem.engine.models.loader import load_spec
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

MAX_NEW = 6
FAMILIES = ("llama", "opt", "qwen2", "qwen3", "mistral", "gemma3_text", "smollm3")
WINDOWS = {"mistral": {"sliding_window": 12},
           "qwen2": {"sliding_window": 12, "use_sliding_window": True, "max_window_layers": 1},
           "gemma3_text": {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"],
                           "tie_word_embeddings": False},
           "smollm3": {"no_rope_layers": [1, 0]}}


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Tiny checkpoints with head_dim 32 (the kernels' smallest): Llama with 2 KV heads for 4
    query heads (a hidden-cache token takes 2 blocks), OPT multi-head (1 block), and the
    Llama-shaped Qwen2 (K/V biases, which the fused hidden-cache kernel adds before rotating; its
    second layer within a 12-token sliding window, its first over the whole context) and
    Qwen3 (per-head K norms, which it lacks: its hidden caches take the projection in torch), and
    Mistral with a 12-token sliding window (the prefill kernel masks by it, the decode kernel is
    given the window's rows; hidden caches take the torch path), Gemma 3 (its own score scale;
    a sliding layer under a full one), and SmolLM3 (its second layer without rotary embeddings:
    the fused hidden-cache kernel rotates K in one layer and not in the other)."""
    from tandem.engine.models.tiny import write_tiny_model
    return {f: write_tiny_model(tmp_path_factory.mktemp(f"wide-{f}"), f, seed=5, d_model=128, num_heads=4,
                                num_kv_heads=2, config=WINDOWS.get(f)) for f in FAMILIES}


def _run(model_dir, prompts, blocks, **kw):
    spec = load_spec(model_dir)
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8,
             kv_cache_bytes=blocks * spec.num_layers * 8 * spec.unit * 4, max_num_batched_tokens=24,
             threads_per_worker=1, triton_attention=True, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        preempted = sum(q.num_preemptions for q in llm.scheduler.queues)
        swaps = llm.scheduler.counts("swaps")
        assert_pool_free(llm)
    return outs, preempted, swaps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_type", ["kv", "hidden"])
def test_triton_attention_matches_hf(family, cache_type, wide_models):
    model_dir = wide_models[family]
    prompts = mixed_prompts(5, 512, seed=31, lo=5, hi=40)
    # 24-token steps split a prompt that does not fit whole (chunked prefill); a pool of 7
    # token-blocks of 8, fewer than the 13 the five requests reach (5-18 prompt tokens and 6 more
    # each), forces preemption. A token-block is K + V blocks, or a hidden cache's m.
    per_token_block = 2 if cache_type == "kv" or family != "opt" else 1
    mode = "swap" if cache_type == "kv" else "recompute"
    outs, preempted, swaps = _run(model_dir, prompts, 7 * per_token_block, cache_type=cache_type,
                                  preemption_mode=mode, swap_dtype="auto")
    assert preempted > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert swaps["out"] > 0 and swaps["in"] == swaps["out"], swaps
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
