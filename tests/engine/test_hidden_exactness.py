"""Hidden cache (Apt-Serve, SPEC §1.2): requests that keep each layer's input instead of K and V,
and recompute K and V at every step, produce exactly HF transformers' greedy tokens -- alone,
in batches mixed with KV-cache requests, and when they switch cache type mid-generation."""
import pytest

from tandem import LLM, SamplingParams
from tandem.engine.messages import CacheType
from tandem.engine.models.loader import load_spec
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

MAX_NEW = 20


def _pool_bytes(model_dir, blocks: int, block_size: int = 8) -> int:
    spec = load_spec(model_dir)
    return blocks * spec.num_layers * block_size * spec.unit * 4


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_hidden_cache_matches_hf_with_chunks_and_preemption(family, tiny_llama, tiny_opt):
    model_dir = tiny_llama if family == "llama" else tiny_opt
    prompts = mixed_prompts(12, 512, seed=21, hi=90)
    # 16-token chunks: prompts are prefilled in pieces that attend over a stored prefix; a pool
    # of about one longest request (15 token-blocks of 8: 2 blocks each for Llama, 1 for OPT)
    # forces preemption (recompute)
    blocks = 15 * (2 if family == "llama" else 1)
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8,
             kv_cache_bytes=_pool_bytes(model_dir, blocks), max_num_batched_tokens=16, threads_per_worker=1,
             cache_type="hidden") as llm:
        g = llm.scheduler.queues[0].pool.geometry
        assert g.blocks_per_token_block(CacheType.HIDDEN) == (1 if family == "opt" else 2)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert sum(q.num_preemptions for q in llm.scheduler.queues) > 0
        assert_pool_free(llm)
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


class Switcher:
    """Wraps the policy: half the requests start with a hidden cache; at given iterations some
    running requests switch type (hidden -> KV and KV -> hidden)."""

    def __init__(self, policy, switches: dict[int, list[int]]):
        self.policy, self.switches = policy, switches
        self.order: list[str] = []
        self.iteration = 0
        self.mixed_steps = 0
        self.num_switched = 0

    def __call__(self, snap):
        self.iteration += 1
        cands = snap.running + snap.waiting
        if not self.order:
            self.order = [c.req_id for c in sorted(cands, key=lambda c: c.arrival)]
        plan = self.policy(snap)
        if self.iteration == 1:
            plan.cache_types = {rid: CacheType.HIDDEN for rid in self.order[::2]}
            plan.scheduled = []
            return plan
        by_id = {c.req_id: c for c in snap.running}
        for i in self.switches.get(self.iteration, []):
            c = by_id.get(self.order[i])
            if c is not None:
                other = CacheType.KV if c.cache_type is CacheType.HIDDEN else CacheType.HIDDEN
                plan.cache_types[c.req_id] = other
                self.num_switched += 1
        types = {c.cache_type for c in snap.running if c.req_id in {d.req_id for d in plan.scheduled}}
        self.mixed_steps += len(types) == 2
        return plan


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_mixed_cache_types_and_switches_match_hf(family, tiny_llama, tiny_opt):
    model_dir = tiny_llama if family == "llama" else tiny_opt
    prompts = mixed_prompts(8, 512, seed=5, lo=4, hi=40)
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8, max_num_batched_tokens=64,
             threads_per_worker=1) as llm:
        sw = Switcher(llm.scheduler.policy, {6: [0, 1, 2], 12: [3, 4], 15: [0]})
        llm.scheduler.policy = sw
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert_pool_free(llm)
    assert sw.mixed_steps > 0, "no step mixed the two cache types"
    assert sw.num_switched >= 4, "requests were meant to switch cache type mid-generation"
    # each switch asked of a running request discarded its cache, and the scheduler counted it
    assert sum(llm.scheduler.cache_switches.values()) == sw.num_switched
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


def test_hidden_cache_bookkeeping_uses_the_real_ratio(tiny_llama):
    from tandem.cache import PoolGeometry
    spec = load_spec(tiny_llama)                      # d_model 64, 2 KV heads of 16: unit 32
    assert spec.d_model // spec.unit == 2
    g = PoolGeometry(100, 8, spec.d_model // spec.unit)
    assert g.blocks_for(17, CacheType.HIDDEN) == 6 and g.blocks_for(17, CacheType.KV) == 6
    assert g.hidden_ratio == 1.0
    assert PoolGeometry(100, 8, 1).hidden_ratio == 0.5  # multi-head attention: half of KV
    with pytest.raises(ValueError):
        PoolGeometry(100, 8).blocks_for(1, CacheType.HIDDEN)
    with pytest.raises(ValueError, match="cache_type"):
        LLM(str(tiny_llama), ONE_DEVICE, policy="bros", bidirectional_blocks=True, cache_type="hidden")
    with pytest.raises(ValueError, match="cache_type"):
        LLM(str(tiny_llama), ONE_DEVICE, cache_type="int8")


@pytest.mark.parametrize("mixed", [False, True], ids=["iteration-types", "mixed-batches"])
def test_aptserve_policy_end_to_end_matches_hf(tiny_opt, mixed):
    """--policy aptserve on a multi-head model with a small pool: the knapsack hands out hidden
    caches, switches and preempts; every output is still HF's greedy output."""
    prompts = mixed_prompts(16, 512, seed=33, lo=8, hi=60)
    with LLM(str(tiny_opt), ONE_DEVICE, dtype="float32", block_size=8, kv_cache_bytes=_pool_bytes(tiny_opt, 24),
             max_num_batched_tokens=128, threads_per_worker=1, policy="aptserve", mixed_batches=mixed) as llm:
        seen = set()
        actor = llm.scheduler.actors[0]
        plan = actor.plan

        def watched():          # on the actor's thread, before each of its steps
            seen.update(st.cache_type for st in actor.states.values())
            return plan()
        actor.plan = watched
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert_pool_free(llm)
        # ρ is refined online: every measured step of the run was checked against the cost model
        assert llm.scheduler.policy.cost is llm.scheduler.cost and llm.scheduler.cost.observed > 0
        assert any(shape.hidden_blocks for shape, _ in llm.scheduler.cost.startup)
        switched, preempted = sum(llm.scheduler.cache_switches.values()), sum(llm.scheduler.preemptions_by_class.values())
    assert switched > 0 and preempted > 0, (switched, preempted)
    assert CacheType.HIDDEN in seen, "the pool was meant to be tight enough for hidden caches"
    ref = hf_greedy(tiny_opt, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
