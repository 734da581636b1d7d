"""LoRA adapters against PEFT applying them to HF transformers' model: requests on different
adapters and on the base model share steps, through every cache kind, and adapters that this
engine does not compute are refused with a reason."""
from __future__ import annotations

import json
import re

import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.models.tiny import write_tiny_model
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts, write_adapter

MAX_NEW = 10
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8,
               max_num_batched_tokens=32, threads_per_worker=1, **kw)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_adapters_and_the_base_model_share_steps(tiny_llama, tmp_path):
    """Two adapters (every projection; Q and V only, rank-stabilised) and the base model, their
    prompts interleaved in one generate (prefilled in 32-token chunks beside decodes), give
    PEFT's tokens."""
    full = write_adapter(tiny_llama, tmp_path / "full", LLAMA_ALL, r=8, alpha=16, seed=1)
    qv = write_adapter(tiny_llama, tmp_path / "qv", ["q_proj", "v_proj"], r=4, alpha=8, seed=2, use_rslora=True)
    prompts = mixed_prompts(9, 512, seed=11, hi=90)
    adapters = [full, qv, None] * 3
    want = {a: hf_greedy(tiny_llama, prompts[i::3], MAX_NEW, adapter=a) for i, a in enumerate(adapters[:3])}
    assert want[full] != hf_greedy(tiny_llama, prompts[0::3], MAX_NEW)    # the adapter changes the tokens
    assert want[qv] != hf_greedy(tiny_llama, prompts[1::3], MAX_NEW)
    with _llm(tiny_llama) as llm:
        lrs = [None if a is None else LoRARequest(a.name, 1, str(a)) for a in adapters]
        outs = llm.generate(prompts, _greedy(), lora_request=lrs)
        assert_pool_free(llm)
    for i, a in enumerate(adapters[:3]):
        assert [o.token_ids for o in outs[i::3]] == want[a], f"adapter {a}"
    assert outs[0].lora_request == lrs[0] and outs[2].lora_request is None


@pytest.mark.parametrize("family, targets, kw", [
    ("opt", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {"cache_type": "hidden"}),
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),
    ("qwen2", ["k_proj", "v_proj", "up_proj"], {"cache_type": "hidden"}),
    ("llama", ["k_proj", "v_proj"], {"cache_type": "hidden", "triton_attention": True, "num_heads": 2})])
def test_adapters_of_each_projection_layout(family, targets, kw, tmp_path):
    """OPT's own module names, Phi-3's fused projections as PEFT targets them, and hidden caches
    (multi-head OPT; Qwen2 with K and V biases), whose K and V are projected again from stored
    layer inputs at every step, the adapter's updates with them (the Triton kernels: its fused
    hidden-cache kernel projects with the base weights only, so requests with adapters keep
    the torch projection)."""
    kw = dict(kw)
    heads = kw.pop("num_heads", 4)              # the Triton kernels take a head_dim of 32 or more
    model_dir = write_tiny_model(tmp_path / "m", family, seed=7, num_heads=heads, num_kv_heads=heads)
    adapter = write_adapter(model_dir, tmp_path / "a", targets, r=8, alpha=16, seed=3)
    prompts = mixed_prompts(4, 512, seed=12, hi=80)
    want = hf_greedy(model_dir, prompts, MAX_NEW, adapter=adapter)
    assert want != hf_greedy(model_dir, prompts, MAX_NEW)
    with _llm(model_dir, **kw) as llm:
        outs = llm.generate(prompts, _greedy(), lora_request=LoRARequest("a", 1, str(adapter)))
        assert_pool_free(llm)
    assert [o.token_ids for o in outs] == want


def test_prefix_cache_keeps_adapters_apart(tiny_llama, tmp_path):
    """A prompt the base model computed is not reused by an adapter (whose K and V differ); the
    adapter's own earlier prompt is."""
    adapter = write_adapter(tiny_llama, tmp_path / "a", LLAMA_ALL, seed=4)
    prompt = mixed_prompts(1, 512, seed=13, lo=40, hi=41)[0]
    want = hf_greedy(tiny_llama, [prompt], MAX_NEW, adapter=adapter)[0]
    lr = LoRARequest("a", 1, str(adapter))
    with _llm(tiny_llama) as llm:
        base = llm.generate([prompt], _greedy())[0]
        first = llm.generate([prompt], _greedy(), lora_request=lr)[0]
        again = llm.generate([prompt], _greedy(), lora_request=lr)[0]
        assert_pool_free(llm)
    assert base.token_ids != want
    assert first.num_cached_tokens == 0 and first.token_ids == want
    assert again.num_cached_tokens == 32         # whole 8-token blocks, the prompt's last token left to compute
    assert again.token_ids == want


def test_a_request_migrates_with_its_adapter(tiny_llama, tmp_path):
    """Moved to another device mid-generation, by copying its cache or by its tokens (the
    destination computes their cache again, with the adapter), a request goes on with its
    adapter."""
    from tandem.sched.request import Transfer
    from tests.engine.test_migration import MAX_NEW as N, POOL, TWO, run
    adapter = write_adapter(tiny_llama, tmp_path / "a", LLAMA_ALL, seed=8)
    prompts = mixed_prompts(2, 512, seed=14, lo=20, hi=40)
    want = hf_greedy(tiny_llama, prompts, N, adapter=adapter)
    with LLM(str(tiny_llama), TWO, dtype="float32", block_size=8, threads_per_worker=1, kv_cache_bytes=POOL) as llm:
        loaded = llm.load_lora("a", adapter)
        for kind, prompt, expected in zip((Transfer.KV, Transfer.TOKEN), prompts, want):
            seen, st = run(llm, prompt, _greedy(N), kind, f"m-{kind.value}", adapter=loaded)
            assert st.device == 1 and [m.kind for m in llm.scheduler.actors[1].moves][-1] is kind
            assert seen == expected, kind


def test_workers_forget_unused_adapters_and_get_them_again(tiny_llama, tmp_path, monkeypatch):
    """Past the adapters a worker keeps (one, here), those no request runs with are dropped
    there, and sent again with the next request that needs one."""
    import tandem.sched.actor as actor_module
    monkeypatch.setattr(actor_module, "KEPT_ADAPTERS", 1)
    a = write_adapter(tiny_llama, tmp_path / "a", LLAMA_ALL, seed=9)
    b = write_adapter(tiny_llama, tmp_path / "b", ["q_proj", "v_proj"], seed=10)
    prompts = mixed_prompts(3, 512, seed=15, hi=40)
    want = {x: hf_greedy(tiny_llama, prompts, MAX_NEW, adapter=x) for x in (a, b)}
    with _llm(tiny_llama) as llm:
        actor = llm.scheduler.actors[0]
        for x in (a, b, a):
            outs = llm.generate(prompts, _greedy(), lora_request=LoRARequest(x.name, 1, str(x)))
            assert [o.token_ids for o in outs] == want[x], x
            assert {ref.name for ref in actor._adapters_sent} == {x.name}
        assert_pool_free(llm)


def test_each_step_tells_the_cost_model_how_many_adapters_it_ran(tiny_llama, tmp_path):
    """Three 8-token prompts run together in every step (24 tokens within the 32 a step takes,
    then three decodes). The shape each step reports to the cost model counts the distinct
    adapters among them: two on one adapter and one on the base model, 1; on two adapters and
    the base model, 2; on the base model alone, 0; and the rows run with an adapter: the two
    prompts' 16, then their two decodes (0 on the base model). The policy sees each request's
    adapter."""
    a = write_adapter(tiny_llama, tmp_path / "a", LLAMA_ALL, seed=11)
    b = write_adapter(tiny_llama, tmp_path / "b", ["q_proj", "v_proj"], seed=12)
    prompts = mixed_prompts(3, 512, seed=16, lo=8, hi=9)
    with _llm(tiny_llama) as llm:
        actor, seen = llm.scheduler.actors[0], []
        policy = actor.policy

        def watched(snap):
            seen.append(sorted((c.adapter.name if c.adapter else "") for c in snap.running + snap.waiting))
            return policy(snap)
        actor.policy = watched
        for adapters, want in (((a, a, None), 1), ((a, b, None), 2), ((None, None, None), 0)):
            llm.scheduler.step_log = log = []
            seen.clear()
            lrs = [None if x is None else LoRARequest(x.name, 1, str(x)) for x in adapters]
            llm.generate(prompts, _greedy(), lora_request=lrs)
            assert len(log) == MAX_NEW and [shape.adapters for shape, _ in log] == [want] * MAX_NEW, adapters
            on = sum(x is not None for x in adapters)
            assert [shape.adapter_rows for shape, _ in log] == [8 * on] + [on] * (MAX_NEW - 1), adapters
            assert seen[0] == sorted(x.name if x else "" for x in adapters), seen


@pytest.fixture(scope="module")
def llama_llm(tiny_llama):
    with _llm(tiny_llama) as llm:
        yield llm


@pytest.mark.parametrize("config, targets, message", [
    ({"use_dora": True}, ["q_proj"], "DoRA (use_dora) is not supported"),
    ({}, ["embed_tokens"], "is not a LoRA matrix of a decoder layer's projection"),
    ({}, ["lm_head"], "is not a LoRA matrix of a decoder layer's projection"),
    ({"bias": "lora_only"}, ["q_proj"], "bias='lora_only' (trained base biases) is not supported")])
def test_adapters_not_computed_here_are_refused(llama_llm, tiny_llama, tmp_path, config, targets, message):
    adapter = write_adapter(tiny_llama, tmp_path / "a", targets, **config)
    with pytest.raises(ValueError, match=f"^LoRA adapter 'x': {re.escape(str(adapter))}: .*{re.escape(message)}"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=LoRARequest("x", 1, str(adapter)))


def test_an_adapter_of_another_model_is_refused(llama_llm, tmp_path):
    other = write_tiny_model(tmp_path / "wide", "llama", d_model=96, num_heads=4)
    adapter = write_adapter(other, tmp_path / "a", ["q_proj"])
    with pytest.raises(ValueError, match=r"layer 0 q_proj: A \(8, 96\) and B \(96, 8\) do not fit a projection "
                                         r"64 -> 64 \(an adapter for another model\?\)"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=LoRARequest("x", 1, str(adapter)))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="a PREFIX_TUNING adapter; only LoRA adapters are served"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=LoRARequest("y", 1, str(tmp_path / "cfg")))
    with pytest.raises(ValueError, match="no such directory"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=LoRARequest("z", 1, str(tmp_path / "none")))
    with pytest.raises(ValueError, match="^lora_request: 2 given for 1 prompts$"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=[None, None])
    with pytest.raises(ValueError, match="^lora_request: must be a LoRARequest, a list of them, or None$"):
        llama_llm.generate([[1, 2, 3]], _greedy(2), lora_request=str(tmp_path))
    assert llama_llm.generate([[1, 2, 3]], _greedy(2))[0].token_ids     # and it serves on
