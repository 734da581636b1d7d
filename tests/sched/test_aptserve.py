"""Apt-Serve's policy on hand-made snapshots where the right plan is known (SPEC §1.4-1.7)."""
from tandem.engine.messages import CacheType
from tandem.sched.aptserve import AptServe
from tandem.sched.policy import Candidate, Limits, Snapshot

B = 4
KV, HID = CacheType.KV, CacheType.HIDDEN


def snap(running=(), waiting=(), free=100, hidden_bpt=1, seqs=8, tokens=512):
    return Snapshot(list(running), list(waiting), free, B, 2, Limits(seqs, tokens, True), 0.0,
                    hidden_blocks_per_token_block=hidden_bpt)


def waiting(rid, tokens, pending, slo=10.0):
    return Candidate(rid, tokens, 0, 0, 0.0, True, slo, pending)


def running(rid, ctx, pending, ct=KV, slo=10.0):
    blocks = -(-ctx // B) * (2 if ct is KV else 1)
    return Candidate(rid, ctx + 1, ctx, blocks, 0.0, True, slo, pending, cache_type=ct)


def test_prefill_gives_hidden_caches_when_memory_is_short():
    # three 8-token prompts: 4 KV blocks or 2 hidden blocks each, 8 blocks free. Hidden steps
    # (densities ~.49, .44, .39 per block) come first (6 blocks), then a's upgrade (.006) fits;
    # b's does not, and b alone (.9) is worth less than the plan
    w = [waiting("a", 8, 1.0), waiting("b", 8, 0.9), waiting("c", 8, 0.8)]
    plan = AptServe(rho=0.001)(snap(waiting=w, free=8))
    assert {d.req_id for d in plan.scheduled} == {"a", "b", "c"}
    assert plan.cache_types == {"a": KV, "b": HID, "c": HID}
    # KV only: a and b (densities .25 and .225), c does not fit
    plan = AptServe(rho=0.001, hybrid=False)(snap(waiting=w, free=8))
    assert [d.req_id for d in plan.scheduled] == ["a", "b"] and set(plan.cache_types.values()) == {KV}


def test_hidden_cache_not_offered_where_it_saves_no_memory():
    w = [waiting("a", 8, 1.0), waiting("b", 8, 0.9), waiting("c", 8, 0.8)]
    plan = AptServe(rho=0.001)(snap(waiting=w, free=8, hidden_bpt=3))
    assert [d.req_id for d in plan.scheduled] == ["a", "b"] and set(plan.cache_types.values()) == {KV}


def test_decode_iteration_switches_and_preempts_by_the_knapsack():
    # running pending 1.0 > waiting 0.2: decode. Each needs 6 KV / 3 hidden blocks for 9 tokens;
    # the pool holds 10. r1 keeps KV, r2 must switch to a hidden cache (recompute)
    r = [running("r1", 8, 0.5), running("r2", 8, 0.5)]
    plan = AptServe(rho=0.001)(snap(running=r, waiting=[waiting("w", 4, 0.2)], free=2))
    assert [d.req_id for d in plan.scheduled] == ["r1"]
    assert plan.cache_types == {"r2": HID} and not plan.preempted
    # KV only: r2 does not fit and is preempted
    plan = AptServe(rho=0.001, hybrid=False)(snap(running=r, waiting=[waiting("w", 4, 0.2)], free=2))
    assert [d.req_id for d in plan.scheduled] == ["r1"] and plan.preempted == ["r2"]


def test_iteration_type_follows_the_larger_cumulative_pending_time():
    r = [running("r1", 8, 0.1)]
    w = [waiting("w1", 8, 0.3)]
    plan = AptServe(rho=0.0)(snap(running=r, waiting=w))
    assert [d.req_id for d in plan.scheduled] == ["w1"]
    plan = AptServe(rho=0.0)(snap(running=[running("r1", 8, 0.5)], waiting=w))
    assert [d.req_id for d in plan.scheduled] == ["r1"]


def test_violated_requests_come_last_unless_decayed():
    # v is past its TTFT (pending 2 > 1): worth ε per block, so fresh f goes first; only one fits
    w = [waiting("v", 8, 2.0, slo=1.0), waiting("f", 8, 0.5, slo=1.0)]
    assert [d.req_id for d in AptServe(0.0, hybrid=False)(snap(waiting=w, free=4)).scheduled] == ["f"]
    # decay 0.4: v is worth 0.8 > 0.5
    assert [d.req_id for d in AptServe(0.0, hybrid=False, decay=0.4)(snap(waiting=w, free=4)).scheduled] == ["v"]


def test_fcfs_ablation_admits_the_head_of_line_request_with_a_hidden_cache():
    # a takes 4 of 6 free blocks; b's KV cache (4) does not fit, its hidden cache (2) does; c waits
    w = [waiting("a", 8, 1.0), waiting("b", 8, 0.1), waiting("c", 8, 0.9)]
    plan = AptServe(rho=0.0, adaptive=False)(snap(waiting=w, free=6))
    assert [d.req_id for d in plan.scheduled] == ["a", "b"]
    assert plan.cache_types == {"b": HID}


def test_mixed_batches_decode_and_prefill_on_the_blocks_left():
    # r1 (8 tokens held in 4 KV blocks) needs 2 more for its 9th token; 6 free leaves 4 for
    # prefills: a and b (8-token prompts, 4 KV or 2 hidden blocks each) both fit as hidden caches
    r = [running("r1", 8, 0.05)]
    w = [waiting("a", 8, 1.0), waiting("b", 8, 0.9)]
    plan = AptServe(rho=0.001, mixed=True)(snap(running=r, waiting=w, free=6))
    assert [d.req_id for d in plan.scheduled] == ["r1", "a", "b"]
    assert plan.cache_types == {"a": HID, "b": HID}
    # KV only: one prompt fits beside the decode, the one waiting longer
    plan = AptServe(rho=0.001, mixed=True, hybrid=False)(snap(running=r, waiting=w, free=6))
    assert [d.req_id for d in plan.scheduled] == ["r1", "a"]
    # the token budget counts the decode: 8 tokens left a 9-token budget, so b is not admitted
    plan = AptServe(rho=0.001, mixed=True)(snap(running=r, waiting=w, free=6, tokens=9))
    assert [d.req_id for d in plan.scheduled] == ["r1", "a"]
    # without mixing the same snapshot runs prefills only (waiting pending time is larger)
    plan = AptServe(rho=0.001)(snap(running=r, waiting=w, free=6))
    assert [d.req_id for d in plan.scheduled] == ["a", "b"]


def test_decode_iteration_finishes_a_chunked_prompt_within_the_token_budget():
    # r2 is a running request halfway through a 20-token prompt (chunked). With 6 tokens per
    # iteration, r1 decodes one token and r2 takes the 5 left, in queue order; r3 gets nothing
    r1 = running("r1", 8, 0.5)
    r2 = Candidate("r2", 20, 10, 6, 0.0, True, 10.0, 0.5)
    r3 = running("r3", 8, 0.5)
    plan = AptServe(rho=0.0)(snap(running=[r1, r2, r3], free=100, tokens=6))
    assert [(d.req_id, d.num_new_tokens, d.sample) for d in plan.scheduled] == [("r1", 1, True), ("r2", 5, False)]
    plan = AptServe(rho=0.0)(snap(running=[r1, r2, r3], free=100, tokens=64))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("r1", 1), ("r2", 10), ("r3", 1)]


def test_a_request_that_just_ran_outranks_violators_in_the_decode_knapsack():
    # right after a step its pending time is 0 (the simulator's clock does not move between the
    # step and the next plan); v has been waiting past its TBT target. The pool holds one of
    # them: the healthy request keeps its blocks, the violator is preempted
    r = [running("v", 8, 0.9, slo=0.1), running("h", 8, 0.0, slo=0.1)]
    plan = AptServe(rho=0.0, hybrid=False)(snap(running=r, free=0))
    assert [d.req_id for d in plan.scheduled] == ["h"] and plan.preempted == ["v"]


def _best_types(cands, budget, u, rho, hidden_bpt=1):
    """Brute force: the cache types of ``cands`` (all of them running) that maximise the summed
    value p - [hidden] U·ρ·m within the block budget."""
    import itertools
    best = None
    for hid in itertools.product((False, True), repeat=len(cands)):
        kv_blocks = [-(-c.num_tokens // B) * 2 for c in cands]
        blocks = sum(m // 2 * hidden_bpt if h else m for m, h in zip(kv_blocks, hid))
        value = sum(c.pending_s - (u * rho * m if h else 0) for c, m, h in zip(cands, kv_blocks, hid))
        if blocks <= budget and (best is None or value > best[0]):
            best = (value, hid)
    return {c.req_id: HID if h else KV for c, h in zip(cands, best[1])}


def test_requests_left_out_by_the_token_limit_do_not_crowd_the_cache_types_of_those_that_run():
    # as in the first test the greedy over a, b and c gives b a hidden cache to leave c room;
    # with 16 tokens per iteration c does not run, and a and b both fit as KV caches
    w = [waiting("a", 8, 1.0), waiting("b", 8, 0.9), waiting("c", 8, 0.8)]
    plan = AptServe(rho=0.001)(snap(waiting=w, free=8, tokens=16))
    assert [d.req_id for d in plan.scheduled] == ["a", "b"]
    assert plan.cache_types == _best_types(w[:2], budget=8, u=3, rho=0.001) == {"a": KV, "b": KV}


def test_a_hidden_cache_is_not_upgraded_while_its_chunked_prompt_is_computed():
    # r holds a hidden cache for 8 of its 20 prompt tokens; the pool has room for a KV cache,
    # but switching now would discard the chunk computed (two such prompts once took turns
    # discarding each other's for ever). It finishes its prompt as it is
    r = Candidate("r", 20, 8, 2, 0.0, True, 10.0, 0.5, cache_type=HID)
    plan = AptServe(rho=0.001)(snap(running=[r], free=100))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("r", 12)] and not plan.cache_types
    # once the prompt is done the knapsack may upgrade it (the paper's switch)
    done = Candidate("r", 21, 20, 5, 0.0, True, 10.0, 0.5, cache_type=HID)
    plan = AptServe(rho=0.001)(snap(running=[done], free=100))
    assert plan.cache_types == {"r": KV}


def test_a_prefill_iteration_leaves_the_blocks_a_running_chunked_prompt_still_needs():
    # r is halfway through a 20-token prompt: it holds 6 KV blocks (10 tokens) and needs 4 more
    # to finish. 6 are free, so a's 8-token prompt fits beside it as a hidden cache (2 blocks),
    # not as a KV cache (4): admitted as KV it would leave r short, and the next decode
    # iteration would move one of them to another cache type, discarding its chunks
    r = Candidate("r", 20, 10, 6, 0.0, True, 10.0, 0.1)
    a = waiting("a", 8, 1.0)
    plan = AptServe(rho=0.001)(snap(running=[r], waiting=[a], free=6))
    assert [d.req_id for d in plan.scheduled] == ["a"] and plan.cache_types == {"a": HID}
    # KV caches only: a does not fit beside r, so r goes on with its prompt
    plan = AptServe(rho=0.001, hybrid=False)(snap(running=[r], waiting=[a], free=6))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("r", 10)] and not plan.cache_types


def test_a_kv_cache_is_not_downgraded_while_its_chunked_prompt_is_computed():
    # r holds a KV cache for 8 of its 20 prompt tokens (4 blocks); its whole prompt needs 10,
    # the whole pool (2 free + r's 4 + h's 4). Hidden caches for both would fit (5 + 3), but
    # switching r now discards its chunk: it keeps its type and h, worth less, gives way
    r = Candidate("r", 20, 8, 4, 0.0, True, 10.0, 0.5)
    h = running("h", 8, 0.1)
    plan = AptServe(rho=0.001)(snap(running=[r, h], free=2))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("r", 12)]
    assert plan.preempted == ["h"] and not plan.cache_types
