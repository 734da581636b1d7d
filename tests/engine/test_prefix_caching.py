"""Prefix caching end to end: requests that start with tokens computed before reuse those blocks
and still generate exactly HF's greedy tokens; the tokens they skip are counted exactly."""
import random

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.models.loader import load_spec
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy

B = 8
NEW = 8


def shared_prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    """A 'system prompt' of 37 tokens and prompts that begin with it (or with a part of it: 32
    tokens is exactly four blocks, of which three can be reused; 33 tokens can reuse four)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(37)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    return system, prompts + [system[:32], system[:33], system[:5]]


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def block_bytes(model_dir) -> int:
    spec = load_spec(model_dir)
    return spec.num_layers * B * spec.unit * 4


def lockstep(model_dir, num_blocks: int):
    """A lock-step scheduler (FCFS, prefix caching) over one in-process device of ``num_blocks``."""
    import torch
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.scheduler import SchedConfig, Scheduler
    torch.set_num_threads(1)
    spec = load_spec(model_dir)
    dev = InProcessDevice("cpu", WorkerConfig(str(model_dir), spec, "float32", "cpu", B,
                                              num_blocks * block_bytes(model_dir), None, 1, 1, False, False))
    return Scheduler(SchedConfig(policy="fcfs", prefix_caching=True), [dev], spec.eos_token_ids, spec.max_model_len)


def counted(llm) -> dict:
    return dict(llm.scheduler.counts("prefix_tokens"))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_prompts_that_share_a_start_reuse_its_blocks_and_match_hf(family, tiny_llama, tiny_opt):
    model_dir = tiny_llama if family == "llama" else tiny_opt
    system, prompts = shared_prompts(3)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=B,
             kv_cache_bytes=200 * block_bytes(model_dir), threads_per_worker=1) as llm:
        first = llm.generate(prompts[:1], greedy)[0]
        outs = llm.generate(prompts, greedy)
        seen = counted(llm)
        assert_pool_free(llm)
    ref = hf_greedy(model_dir, prompts, NEW)
    assert first.token_ids == ref[0]
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"
    # the first request's blocks (prompt and output) are what the others can find; each may
    # reuse whole blocks of what it shares with them, short of its own last token
    warm = prompts[0] + first.token_ids
    expect = sum(min(common(p, warm), len(p) - 1) // B * B for p in prompts)
    assert seen == {"queried": sum(map(len, prompts[:1] + prompts)), "hits": expect}
    assert [o.num_cached_tokens for o in outs] == [min(common(p, warm), len(p) - 1) // B * B for p in prompts]
    assert expect == 8 * 32 + 24 + 32 + 0


def test_preempted_requests_find_their_blocks_again_and_match_hf(tiny_llama):
    """In a pool too small for everyone, requests preempted to recompute find their own blocks
    (still cached, nobody having needed them) and skip those tokens."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=B,
             kv_cache_bytes=40 * block_bytes(tiny_llama), max_num_batched_tokens=64,
             threads_per_worker=1) as llm:
        outs = llm.generate(prompts, greedy)
        preempted = sum(q.num_preemptions for q in llm.scheduler.queues)
        seen = counted(llm)
        assert_pool_free(llm)
    assert preempted > 0 and seen["hits"] > 0, (preempted, seen)
    for i, (o, r) in enumerate(zip(outs, hf_greedy(tiny_llama, prompts, 24), strict=True)):
        assert o.token_ids == r, f"prompt {i} differs"


def test_the_same_tokens_with_and_without_the_cache(tiny_llama):
    """Seeded sampling over an int8 resident cache (whose full blocks are compressed: a cached
    block is read as its first owner wrote it) gives the same tokens whether blocks are reused
    or computed again. A request asking for its prompt's log probabilities computes every
    prompt token, so it has all of them, the same either way, and counts no cache lookup."""
    system, prompts = shared_prompts(9)
    sampled = SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for caching in (False, True):
        with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=B,
                 kv_cache_bytes=200 * block_bytes(tiny_llama), threads_per_worker=1,
                 kv_cache_dtype="int8", enable_prefix_caching=caching) as llm:
            llm.generate(prompts[:1], sampled)
            outs = llm.generate(prompts, sampled)
            before = counted(llm)
            lp = llm.generate(prompts[1:2], scored)[0]
            seen = counted(llm)
        assert (seen.get("hits", 0) > 0) == caching
        # it looks nothing up, so it counts no query either (vLLM's hit rate counts lookups only)
        assert seen.get("queried", 0) == before.get("queried", 0) and (before.get("queried", 0) > 0) == caching
        assert len(lp.prompt_logprobs) == len(prompts[1]) and lp.prompt_logprobs[0] is None
        assert all(x is not None for x in lp.prompt_logprobs[1:])
        results[caching] = ([o.token_ids for o in outs], [round(x.logprob, 4) for x in lp.prompt_logprobs[1:]])
    assert results[True] == results[False]


def test_a_salted_prompt_shares_blocks_only_with_prompts_of_its_salt(tiny_llama):
    """Offline prompt dicts with ``cache_salt``: a prompt finds the blocks an earlier prompt with the
    same start computed only when both give the same salt; with another salt or none it computes
    everything. Its tokens are HF's either way."""
    _, prompts = shared_prompts(5)
    a, b = prompts[0], prompts[1]
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=B,
             kv_cache_bytes=200 * block_bytes(tiny_llama), threads_per_worker=1) as llm:
        first = llm.generate({"prompt_token_ids": a, "cache_salt": "tenant-a"}, greedy)[0]
        others = llm.generate([{"prompt_token_ids": b, "cache_salt": "tenant-b"}, b], greedy)
        same = llm.generate([{"prompt_token_ids": b, "cache_salt": "tenant-a"}], greedy)[0]
        assert_pool_free(llm)
    ref = hf_greedy(tiny_llama, [a, b], NEW)
    assert first.token_ids == ref[0]
    assert [o.token_ids for o in others + [same]] == [ref[1]] * 3
    assert [o.num_cached_tokens for o in others] == [0, 0]
    shared = min(common(b, a + first.token_ids), len(b) - 1) // B * B
    assert shared >= 32 and same.num_cached_tokens == shared


def test_caches_back_from_an_int8_swap_are_never_offered_to_others(tiny_llama, monkeypatch):
    """A request swapped out as int8 comes back with values near its own, not equal: from then
    until it recomputes, none of its blocks is named for other requests' prefixes."""
    from tandem.cache import BlockPool
    from tandem.sched.actor import DeviceActor
    events: list[tuple[str, str]] = []
    swap_in, lose, name = DeviceActor._swap_in, DeviceActor._lose_cache, BlockPool.name_full

    def swapped_in(self, st, inp):
        back = self.host is not None and st.req_id in self.host
        swap_in(self, st, inp)
        if back:
            events.append(("in", st.req_id))

    def lost(self, st):
        events.append(("reset", st.req_id))
        lose(self, st)

    def named(self, rid, keys):
        before = self.num_named(rid)
        name(self, rid, keys)
        if self.num_named(rid) > before:
            events.append(("name", rid))
    monkeypatch.setattr(DeviceActor, "_swap_in", swapped_in)
    monkeypatch.setattr(DeviceActor, "_lose_cache", lost)
    monkeypatch.setattr(BlockPool, "name_full", named)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", block_size=B, kv_cache_bytes=24 * block_bytes(tiny_llama),
             max_num_batched_tokens=64, threads_per_worker=1, preemption_mode="swap", swap_dtype="int8",
             tandem_off=("lengths",)) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert any(e == "in" for e, _ in events), "the pool was meant to force swaps"
    inexact = set()
    for e, rid in events:
        if e == "in":
            inexact.add(rid)
        elif e == "reset":
            inexact.discard(rid)
        else:
            assert rid not in inexact, f"{rid} named blocks it got back from an int8 swap"


def test_a_prefix_that_running_requests_hold_costs_a_newcomer_nothing(tiny_llama):
    """A request whose prompt starts with 40 tokens a running request computed shares those
    blocks: it starts beside that request although the pool could not hold its whole prompt
    again, and finishes first. Both match HF."""
    from tandem.engine.messages import CacheType
    from tandem.sched.request import Request
    sched = lockstep(tiny_llama, 21)
    pool = sched.actors[0].pool
    rng = random.Random(4)
    a_prompt = [rng.randrange(3, 500) for _ in range(40)]
    b_prompt = a_prompt + [rng.randrange(3, 500) for _ in range(4)]
    a = sched.add(Request("a", a_prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    sched.step()                                   # a's prompt: 5 full blocks, named
    b = sched.add(Request("b", b_prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    per = pool.geometry.blocks_per_token_block(CacheType.KV)
    # the premise: b's whole prompt does not fit the free blocks; what it adds to the shared five does
    assert (len(b_prompt) + B - 1) // B * per > pool.num_free >= per
    while b.finish_reason is None:
        sched.step()
    assert a.finish_reason is None, "b waited for a to end"
    assert b.cached_tokens == 40
    while sched.has_unfinished():
        sched.step()
    assert pool.num_free == pool.geometry.num_blocks
    assert [a.output_token_ids, b.output_token_ids] == [hf_greedy(tiny_llama, [a_prompt], 30)[0],
                                                        hf_greedy(tiny_llama, [b_prompt], 2)[0]]


def test_a_plan_never_counts_a_cached_prefix_as_room_and_as_a_newcomer_s_own(tiny_llama):
    """A running request alone holds a prompt's cached blocks; a waiting request with the same
    prompt would reuse them at no cost. A plan that preempts the first to admit the second must
    not also count those blocks as given back: what the snapshot says the two leave free is
    checked against the pool itself, the first freed and the second attached and grown."""
    from tandem.sched.request import Request
    sched = lockstep(tiny_llama, 40)
    actor, pool = sched.actors[0], sched.actors[0].pool
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(44)]            # five full blocks and four tokens
    sched.add(Request("v", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    sched.step()                                                   # v's prompt computed, its blocks named
    sched.add(Request("w", list(prompt), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    actor._hits = actor._cached_prefixes()
    snap = actor.snapshot()
    (v,), (w,) = snap.running, snap.waiting
    assert w.num_blocks > 0, "the premise: w counts v's cached blocks as its own"
    # the plan's arithmetic: v's blocks come back, w takes what its prompt needs beyond its own
    planned = snap.num_free_blocks + v.freed() - (pool.geometry.blocks_for(w.num_tokens) - w.num_blocks)
    pool.free("v")
    pool.attach("w", actor._keys["w"][:actor._hits["w"]])
    assert pool.grow("w", w.num_tokens) is not None
    assert planned <= pool.num_free


def test_the_kv_cache_use_counts_a_shared_block_once(tiny_llama):
    """Three requests share a prompt's first five blocks: vLLM's kv_cache_usage_perc is the share
    of the pool's blocks not free, as the pool counts them, and so are its RT and BE parts
    together."""
    from tandem.sched.request import Request, ServiceClass
    from tandem.server.metrics import Metrics
    sched = lockstep(tiny_llama, 60)
    actor, pool = sched.actors[0], sched.actors[0].pool
    rng = random.Random(6)
    system = [rng.randrange(3, 500) for _ in range(40)]
    sched.add(Request("first", system + [7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    sched.step()
    for i, cls in enumerate((ServiceClass.RT, ServiceClass.BE)):
        sched.add(Request(f"more{i}", system + [8 + i], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                          cls))
    for _ in range(3):
        sched.step()
    assert sum(pool.num_shared(r) for r in actor.running) > 0, "the premise: blocks are shared"
    m = Metrics("m")
    m.engine_step(actor)
    use = {c: m.registry.get_sample_value("tandem:kv_cache_usage_perc", {"model_name": "m", "service_class": c})
           for c in ("rt", "be")}
    held = 1 - pool.num_free / pool.geometry.num_blocks
    assert use["rt"] + use["be"] == pytest.approx(held)
    assert m.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "m"}) == pytest.approx(held)
    assert use["be"] > 0
