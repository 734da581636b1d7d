"""The Scheduler driving an in-process device (the profiling path) matches HF too."""
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
