"""The Scheduler driving an in-process device (the profiling path) matches HF too."""
import pytest
import torch

from tandem.engine.models.loader import load_spec
from tandem.engine.params import SamplingParams
from tandem.engine.worker import InProcessDevice, WorkerConfig
from tandem.sched.request import Request
from tandem.sched.scheduler import SchedConfig, Scheduler
from tests.conftest import hf_greedy, mixed_prompts


def test_in_process_device_matches_hf(tiny_opt):
    torch.set_num_threads(1)
    spec = load_spec(tiny_opt)
    cfg = WorkerConfig(str(tiny_opt), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1, False, False)
    dev = InProcessDevice("cpu", cfg)
    sched = Scheduler(SchedConfig(max_num_batched_tokens=48), [dev], spec.eos_token_ids, spec.max_model_len)
    prompts = mixed_prompts(6, 512, seed=5)
    states = [sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
              for i, p in enumerate(prompts)]
    while sched.has_unfinished():
        sched.step()
    assert [s.output_token_ids for s in states] == hf_greedy(tiny_opt, prompts, 12)
    assert sched.queues[0].pool.num_free == dev.pool_info.num_blocks


def test_a_request_must_fit_the_smallest_pool(tiny_llama):
    """Devices whose pools differ (sized by a memory fraction): a request that fits only the
    larger pool is refused, since it could be placed on or moved to the smaller one."""
    torch.set_num_threads(1)
    spec = load_spec(tiny_llama)
    devs = [InProcessDevice(f"cpu#{i}", WorkerConfig(str(tiny_llama), spec, "float32", "cpu", 8, budget, None, 1, 1,
                                                       False, False))
            for i, budget in enumerate((4 << 20, 1 << 20))]
    small = devs[1].pool_info.num_blocks
    assert small < devs[0].pool_info.num_blocks
    sched = Scheduler(SchedConfig(), devs, spec.eos_token_ids, 1 << 16)
    per_block = 8 // sched.actors[1].pool.geometry.blocks_for(8, sched.cfg.cache_type)
    sched.check_fits(small * per_block - 4, 4)                    # exactly the smaller pool
    with pytest.raises(ValueError, match="pool has"):
        sched.check_fits(small * per_block - 4, 5)


def test_short_prompt_chunks_over_a_prefix_go_through_the_compiled_kernel(tiny_llama, monkeypatch):
    """Prompts computed in chunks of at most 16 tokens: every chunk after the first attends over
    its prefix through the compiled kernel (no gather of the prefix), a first chunk through SDPA,
    and the tokens are HF's."""
    import tandem.engine.attention as attention
    from tandem.engine.kernels import cpu_ops
    from tandem.engine.runner import ModelRunner
    assert cpu_ops() is not None, "the CPU kernel must build on the CI machine (gcc + ninja)"
    torch.set_num_threads(1)
    gathered, paged = [], []
    prefill, paged_rows = attention._prefill, ModelRunner._paged

    def spy_prefill(q, k, v, pool, seg, *args, **kw):
        gathered.append(seg.k_ctx is not None)
        return prefill(q, k, v, pool, seg, *args, **kw)

    def spy_paged(self, st, a, b):
        rows = paged_rows(self, st, a, b)
        paged.append(rows is not None)
        return rows
    monkeypatch.setattr(attention, "_prefill", spy_prefill)
    monkeypatch.setattr(ModelRunner, "_paged", spy_paged)
    spec = load_spec(tiny_llama)
    dev = InProcessDevice("cpu", WorkerConfig(str(tiny_llama), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1,
                                              False, True))
    sched = Scheduler(SchedConfig(max_num_batched_tokens=16), [dev], spec.eos_token_ids, spec.max_model_len)
    prompts = mixed_prompts(4, 512, seed=9, lo=40, hi=90)
    states = [sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
              for i, p in enumerate(prompts)]
    while sched.has_unfinished():
        sched.step()
    assert [s.output_token_ids for s in states] == hf_greedy(tiny_llama, prompts, 6)
    assert sum(paged) >= 3 * len(prompts) and not any(gathered) and len(gathered) == len(prompts) * spec.num_layers
