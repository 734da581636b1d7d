"""The resident int8 pool (kv_cache_dtype="int8"): every full block compressed channel-wise,
the open block exact. The reference is HF transformers decoding with its own cache, whose full
blocks a numpy implementation of the quantizer replaces as they fill."""
import numpy as np
import pytest
import torch

from tandem.engine.kvquant import int8_block_bytes
from tandem.engine.models.loader import load_spec
from tandem.engine.params import SamplingParams
from tandem.engine.worker import InProcessDevice, WorkerConfig
from tandem.sched.request import Request
from tandem.sched.scheduler import SchedConfig, Scheduler
from tandem import LLM
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

B = 8
MAX_NEW = 32


def np_fake_quant(x: np.ndarray) -> np.ndarray:
    """x [heads, B, head_dim] float32 -> the values an 8-bit channel-wise asymmetric code keeps."""
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    step = (hi - lo) / np.float32(255)
    q = np.clip(np.round((x - lo) / np.where(step > 0, step, np.float32(1))), 0, 255)
    return (lo + step * q.astype(np.float32)).astype(np.float32)


def hf_greedy_int8(model_dir, prompts, max_new: int, hidden: bool = False,
                   chunk: int | None = None) -> list[list[int]]:
    """HF greedy decoding where each block of B cached tokens is replaced by its int8 code
    once it is full (the prompt itself is attended at full precision, as in one prefill).
    hidden (OPT): the code is taken of each layer's attention input instead, and the block's
    K and V are projected from it, as a hidden cache recomputes them. chunk: the prompt is fed
    that many tokens at a time, blocks compressed after each piece (chunked prefill)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    attns = [layer.self_attn for layer in hf.model.decoder.layers] if hidden else []
    inputs: list[list[torch.Tensor]] = [[] for _ in attns]
    for i, a in enumerate(attns):
        a.register_forward_pre_hook(lambda m, args, kw, i=i: inputs[i].append(kw["hidden_states"][0]),
                                    with_kwargs=True)
    outs = []
    for p in prompts:
        cache, closed, toks = DynamicCache(), 0, []
        step = chunk or len(p)
        feed = [torch.tensor([p[i:i + step]]) for i in range(0, len(p), step)]   # prompt pieces, then tokens
        for x in inputs:
            x.clear()
        with torch.no_grad():
            while len(toks) < max_new:
                logits = hf(feed.pop(0), past_key_values=cache, use_cache=True).logits
                if not feed:
                    toks.append(int(logits[0, -1].argmax()))
                    feed.append(torch.tensor([[toks[-1]]]))
                while (closed + 1) * B <= cache.get_seq_length():
                    _close(cache, closed, attns, inputs)
                    closed += 1
        outs.append(toks)
    return outs


def _close(cache, block: int, attns, inputs) -> None:
    span = slice(block * B, (block + 1) * B)
    for li, layer in enumerate(cache.layers):
        if not attns:
            for t in (layer.keys, layer.values):
                t[0, :, span] = torch.from_numpy(np_fake_quant(t[0, :, span].numpy()))
            continue
        a, x = attns[li], torch.cat(inputs[li])[span]                      # [B, d_model]
        xq = torch.from_numpy(np_fake_quant(x.numpy()[None]))[0]
        for t, proj in ((layer.keys, a.k_proj), (layer.values, a.v_proj)):
            t[0, :, span] = proj(xq).view(B, t.shape[1], t.shape[3]).transpose(0, 1)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_int8_pool_matches_hf_with_quantized_cache(family, tiny_llama, tiny_opt):
    model_dir = tiny_llama if family == "llama" else tiny_opt
    prompts = mixed_prompts(10, 512, seed=23)
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", block_size=B, kv_cache_bytes=1 << 20,
             max_num_batched_tokens=512, threads_per_worker=1, kv_cache_dtype="int8") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        spec = load_spec(model_dir)
        channels = spec.num_layers * spec.num_kv_heads * spec.head_dim
        # a resident block: B int8 values per channel plus its fp32 λ and lo; at fp32, 4 B bytes
        assert llm._workers[0].pool_info.block_bytes == channels * (B + 8) < channels * B * 4
        assert_pool_free(llm)
    ref = hf_greedy_int8(model_dir, prompts, MAX_NEW)
    assert ref != hf_greedy(model_dir, prompts, MAX_NEW), "int8 was meant to change some tokens"
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


def test_int8_chunked_prefill_matches_hf(tiny_llama):
    """A prompt fed in 12-token chunks: each chunk attends to the compressed blocks before it
    and to itself as computed; blocks a chunk fills whole are compressed as they are written."""
    prompts = mixed_prompts(6, 512, seed=30, lo=30, hi=60)
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", block_size=B, kv_cache_bytes=1 << 20,
             max_num_batched_tokens=12, max_model_len=128, threads_per_worker=1, kv_cache_dtype="int8") as llm:
        outs = [llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0]
                for p in prompts]
        assert_pool_free(llm)
    ref = hf_greedy_int8(tiny_llama, prompts, MAX_NEW, chunk=12)
    assert ref != hf_greedy_int8(tiny_llama, prompts, MAX_NEW), "chunking was meant to change some tokens"
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


def test_int8_hidden_cache_matches_hf(tiny_opt):
    """Hidden caches (OPT) keep each layer's input: their full blocks are compressed the same
    way, and K and V are recomputed from the compressed inputs."""
    prompts = mixed_prompts(10, 512, seed=23)
    with LLM(str(tiny_opt), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=B, kv_cache_bytes=1 << 20,
             max_num_batched_tokens=512, threads_per_worker=1, kv_cache_dtype="int8", cache_type="hidden") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert_pool_free(llm)
    ref = hf_greedy_int8(tiny_opt, prompts, MAX_NEW, hidden=True)
    assert ref != hf_greedy_int8(tiny_opt, prompts, MAX_NEW), "hidden and KV codes were meant to differ"
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


def test_quant_pool_blocks_open_close_and_grow():
    """A block reads back exactly while open; once closed each value is within half a step of
    what was written (numpy's min and max per channel); staging slots are reused, and grow."""
    from tandem.engine.quantpool import QuantPool
    torch.manual_seed(3)
    pool = QuantPool(2, 3, 10, B, 16, torch.float32, open_capacity=1)
    x = torch.randn(2, 3, 4 * B, 16) * 5
    rows = torch.arange(2 * B, 6 * B)                 # blocks 2..5
    pool.open(torch.tensor([2, 3, 4, 5]))
    pool.write(rows, x)
    assert pool.num_open == 4 and pool.peak_open == 4
    assert torch.equal(pool.read(rows), x)
    pool.close(torch.tensor([3, 4]))
    pool.release(torch.tensor([5]))
    assert pool.num_open == 1
    got = pool.read(rows[B:3 * B]).numpy()
    ref = x[:, :, B:3 * B].numpy().reshape(2, 3, 2, B, 16)
    half_step = (ref.max(axis=3) - ref.min(axis=3)) / 255 / 2
    err = np.abs(got.reshape(2, 3, 2, B, 16) - ref).max(axis=3)
    assert (err <= half_step * (1 + 1e-4) + 1e-6).all()
    assert (err > 0).any(), "closed blocks were meant to be compressed"
    assert torch.equal(pool.read(rows[:B]), x[:, :, :B])      # block 2 still open
    pool.open(torch.tensor([7, 8, 9]))
    assert pool.num_open == 4 and pool.stage.shape[2] >= 4 * B
    assert torch.equal(pool.read(rows[:B]), x[:, :, :B]), "growing moved an open block's rows"
    # rows of closed blocks are compressed as written, and only whole blocks may be
    pool.write(torch.arange(0, B).flip(0), x[:, :, :B])
    first = x[:, :, :B].flip(2)
    bound = (first.amax(dim=2) - first.amin(dim=2)) / 255 / 2 * (1 + 1e-4) + 1e-6
    assert ((pool.read(torch.arange(0, B)) - first).abs().amax(dim=2) <= bound).all()
    assert pool.num_open == 4
    with pytest.raises(RuntimeError, match="whole blocks"):
        pool.write(torch.arange(B, B + 3), x[:, :, :3])


def test_int8_pool_releases_staging_under_preemption(tiny_opt):
    """Preempted (recompute or swap) and finished requests give their open blocks back: after
    every step, the staged blocks are exactly the partial blocks of the requests the worker knows."""
    torch.set_num_threads(1)
    spec = load_spec(tiny_opt)
    seqs = 8
    # 22 int8 blocks after the open blocks of 8 requests (K and V each): preemption is certain
    budget = 22 * int8_block_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, B) \
        + 2 * seqs * spec.num_layers * B * spec.unit * 4
    for mode in ("recompute", "swap"):
        cfg = WorkerConfig(str(tiny_opt), spec, "float32", "cpu", B, budget, None, 1, 1, False, True, None, "int8",
                           seqs)
        dev = InProcessDevice("cpu", cfg)
        assert dev.pool_info.num_blocks == 22
        sched = Scheduler(SchedConfig(max_num_seqs=seqs, max_num_batched_tokens=64, preemption_mode=mode,
                                      kv_cache_dtype="int8"),
                          [dev], spec.eos_token_ids, spec.max_model_len)
        prompts = mixed_prompts(12, 512, seed=5)
        states = [sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
                  for i, p in enumerate(prompts)]
        runner = dev.runner
        while sched.has_unfinished():
            sched.step()
            assert _staged(runner) == _partial_blocks(runner), mode
        assert sched.queues[0].num_preemptions > 0, mode
        assert all(len(s.output_token_ids) == 24 for s in states)
        assert runner.pool.peak_open > len(_partial_blocks(runner))


def _staged(runner) -> set[int]:
    return set((runner.pool.stage_of >= 0).nonzero().flatten().tolist())


def _partial_blocks(runner) -> set[int]:
    """The blocks of each known request's last, partly filled token-block."""
    out = set()
    for st in runner.reqs.values():
        if st.num_computed % B:
            out.update((st.slots[:, st.num_computed // B * B] // B).tolist())
    return out


def test_int8_pool_refuses_bidirectional_blocks():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        SchedConfig(policy="bros", bidirectional=True, kv_cache_dtype="int8").check()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        SchedConfig(kv_cache_dtype="fp8").check()
