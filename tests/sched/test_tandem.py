"""The tandem policy on hand-built snapshots: RT before BE, shortest predicted remaining time
first inside a class (checked against a brute-force sort), BE never pushing an RT step past its
deadline, a hidden cache only where KV does not fit and a hidden cache is smaller and pays,
look-ahead admission, estimated waits for what it preempts, and each mechanism's switch."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tandem.engine.messages import CacheType
from tandem.sched.bros import Bros
from tandem.sched.cost_model import CostModel, OnlineCostModel, StepShape
from tandem.sched.policy import Candidate, Limits, Snapshot
from tandem.sched.tandem import STARTED_AHEAD, STARTED_LATE, Mechanism, Tandem
from tests.sched.test_bros import overrunning_cost

COST = CostModel(base=0.01, per_prefill_token=1e-4, per_prefill_attn=0.0, per_decode_token=1e-3,
                 per_decode_ctx=1e-6, per_hidden_block=1e-4)


def cost(shape, swap_slots=0):
    return COST.predict(shape)


def cand(rid, prompt, predicted, *, out=0, rt=False, computed=None, arrival=0.0, slo=None, pending=0.0,
         blocks=None):
    n = prompt + out
    c = (n - 1 if out else n) if computed is None else computed     # a decoding request's last token is new
    return Candidate(rid, n, c, blocks if blocks is not None else -(-c // 16) * 2, arrival, rt, slo, pending,
                     num_output=out, predicted=predicted)


def snap(running, waiting, free=10_000, seqs=64, hidden=0, t_avg=0.0):
    return Snapshot(running, waiting, free, 16, 2, Limits(seqs, 2048, True), t_avg=t_avg,
                    hidden_blocks_per_token_block=hidden)


def policy(max_num_seqs=64, **kw):
    return Tandem(cost, max_num_seqs=max_num_seqs, rho=1e-4, **kw)


def chunks(plan):
    """(request, tokens) of each scheduled chunk, in plan order."""
    return [(d.req_id, d.num_new_tokens) for d in plan.scheduled]


def test_be_in_order_of_predicted_remaining_time_as_a_brute_force_sort():
    """Eight BE prompts arriving in one order, predicted lengths in another: with room for one
    (a first iteration's batch size is half of max_num_seqs), the one admitted is the one with
    the least remaining time (computed by hand from the cost model), whatever its arrival."""
    import random
    rng = random.Random(4)
    preds = [rng.randrange(5, 2000) for _ in range(8)]
    prompts = [rng.randrange(8, 600) for _ in range(8)]
    waiting = [cand(f"b{i}", n, p, computed=0, arrival=float(i)) for i, (n, p) in enumerate(zip(prompts, preds))]
    plan = policy(max_num_seqs=2)(snap([], waiting))

    def t_rem(c):
        pre = COST.predict(StepShape().add(c.num_tokens, c.num_tokens, False))
        return pre + c.predicted * COST.predict(StepShape().add(1, c.num_tokens, True))
    assert [d.req_id for d in plan.scheduled] == [min(waiting, key=t_rem).req_id]


def test_lengths_off_admits_be_in_arrival_order():
    waiting = [cand("long", 32, 1900, computed=0, arrival=0.0), cand("short", 32, 5, computed=0, arrival=1.0)]
    on = policy(max_num_seqs=2)(snap([], waiting))
    off = policy(max_num_seqs=2, off=frozenset({Mechanism.LENGTHS}))(snap([], waiting))
    assert [d.req_id for d in on.scheduled] == ["short"]
    assert [d.req_id for d in off.scheduled] == ["long"]


def test_rt_before_be_and_within_rt_by_level_then_slack():
    """Room for two (and an average iteration longer than any RT slack, so BROS may not trade an
    RT request for a BE one): the two short RT requests, the one with less slack first; neither
    the shorter, earlier BE request nor the long RT one."""
    be = cand("be", 32, 5, computed=0, arrival=0.0)
    rt_long = cand("rt-long", 32, 1900, rt=True, computed=0, arrival=1.0, slo=10.0)
    rt_short_a = cand("rt-a", 32, 6, rt=True, computed=0, arrival=2.0, slo=10.0, pending=0.5)
    rt_short_b = cand("rt-b", 32, 6, rt=True, computed=0, arrival=3.0, slo=10.0, pending=2.0)
    plan = policy(max_num_seqs=4)(snap([], [be, rt_long, rt_short_a, rt_short_b], t_avg=20.0))
    assert [d.req_id for d in plan.scheduled] == ["rt-b", "rt-a"]


def test_a_decoding_chat_whose_token_is_due_runs_before_a_shorter_prompt_with_slack():
    """A chat decoding a long reply (predicted 1,900 tokens), its next token due in 30 ms, and a
    new 800-token chat predicted to reply in 6, with 10 s of TTFT slack. Its level puts the new
    chat first, but its whole prompt takes 10 + 0.1 x 800 ms: started first, it would fill the
    iteration and the decoding chat's token would come past its target. The decoding chat runs,
    and the prompt gets a chunk that keeps the step within the 30 ms (priced by hand)."""
    d = cand("d", 100, 1900, rt=True, out=3, slo=0.05, pending=0.02)
    w = cand("w", 800, 6, rt=True, computed=0, blocks=0, slo=10.0, arrival=1.0)
    sizes = dict(chunks(policy()(snap([d], [w], t_avg=0.02))))
    assert sizes["d"] == 1
    assert 0 < sizes["w"] < 800
    shape = StepShape().add(1, 103, True).add(sizes["w"], sizes["w"], False)
    assert COST.predict(shape) <= 0.03 + 1e-9
    assert COST.predict(shape.add(1, sizes["w"] + 1, False)) > 0.03      # the longest chunk that fits


def test_a_prompt_whose_first_token_is_due_keeps_its_place_before_a_decoding_chat():
    """The same two chats, the new one's TTFT 100 ms away and its whole prompt 90 ms of
    compute (10 + 0.1 x 800, by hand): it can make its target only by running whole now, so it
    does not leave the decoding chat's time, and runs alone (the decoding chat's 30 ms budget
    cannot hold both)."""
    d = cand("d", 100, 1900, rt=True, out=3, slo=0.05, pending=0.02)
    w = cand("w", 800, 6, rt=True, computed=0, blocks=0, slo=0.1, arrival=1.0)
    assert COST.predict(StepShape().add(800, 800, False)) <= 0.1
    assert chunks(policy()(snap([d], [w], t_avg=0.06))) == [("w", 800)]


def test_a_prompt_that_cannot_make_its_first_token_leaves_the_due_decode_its_time():
    """The same two chats, the new one's TTFT 70, 50 or 30 ms away: its whole prompt takes 90 ms
    alone (by hand), so it misses its target whatever runs, at any recent iteration length.
    Running first it would only make the decoding chat's token late too: it leaves that token
    its time, as a prompt with slack does, and gets the longest chunk that keeps the step within
    the decode's 30 ms. With 100 ms it can still make it, and runs whole (the test above)."""
    d = cand("d", 100, 1900, rt=True, out=3, slo=0.05, pending=0.02)
    for ttft in (0.07, 0.05, 0.03):
        for t_avg in (0.02, 0.06, 0.09, 0.1):
            w = cand("w", 800, 6, rt=True, computed=0, blocks=0, slo=ttft, arrival=1.0)
            assert COST.predict(StepShape().add(800, 800, False)) > ttft
            sizes = dict(chunks(policy()(snap([d], [w], t_avg=t_avg))))
            assert sizes["d"] == 1, (ttft, t_avg)
            shape = StepShape().add(1, 103, True).add(sizes["w"], sizes["w"], False)
            assert COST.predict(shape) <= 0.03 + 1e-9 < COST.predict(shape.add(1, sizes["w"] + 1, False))
    w = cand("w", 800, 6, rt=True, computed=0, blocks=0, slo=0.1, arrival=1.0)
    for t_avg in (0.02, 0.06, 0.09, 0.1):
        assert chunks(policy()(snap([d], [w], t_avg=t_avg))) == [("w", 800)]


def test_be_never_makes_the_rt_step_late():
    """A decoding RT request with 30 ms of slack and a BE prompt whose prefill alone takes
    10 + 0.1 x 800 ms: the BE prompt joins only as a chunk that keeps the step within 30 ms."""
    rt = cand("rt", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    be = cand("be", 800, 40, computed=0)
    plan = policy()(snap([rt], [be]))
    sizes = {d.req_id: d.num_new_tokens for d in plan.scheduled}
    assert sizes["rt"] == 1
    shape = StepShape().add(1, 103, True).add(sizes.get("be", 0), sizes.get("be", 0), False)
    assert COST.predict(shape) <= 0.03 + 1e-9
    assert 0 < sizes.get("be", 0) < 800


def test_a_swapped_out_chat_coming_back_prices_its_copy_into_the_step():
    """A decoding chat with 30 ms left, a chat swapped out to host memory (5 MB at 1 GB/s: 5 ms
    to copy back before the forward) and a BE prompt: both chats decode, and the BE chunk is the
    longest that keeps the step, copy included, within 30 ms (priced by hand)."""
    per_byte = 1e-9
    priced = replace(COST, per_swap_in_byte=per_byte)
    d = cand("d", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    s = replace(cand("s", 100, 50, rt=True, out=3, slo=0.05, blocks=0, arrival=0.5), host_bytes=5_000_000)
    be = cand("be", 800, 40, computed=0)
    plan = Tandem(lambda shape, slots=0: priced.predict(shape), max_num_seqs=64)(snap([d], [s, be]))
    sizes = dict(chunks(plan))
    assert sizes["d"] == sizes["s"] == 1
    n = sizes["be"]
    decodes = 0.01 + 2 * 1e-3 + 2 * 103 * 1e-6           # base, two decodes at context 103
    assert decodes + 5e-3 + n * 1e-4 <= 0.03 + 1e-9 < decodes + 5e-3 + (n + 1) * 1e-4
    unpriced = dict(chunks(Tandem(cost, max_num_seqs=64)(snap([d], [s, be]))))
    assert unpriced["be"] > n                            # the copy's 5 ms go to the BE chunk


def _be_chunk_beside_chats_on_x(adapter, model) -> int:
    """The BE chunk the policy packs, priced by ``model``, for a BE prompt on ``adapter`` beside
    two decoding chats on adapter x with 30 ms left; each chat keeps its decode."""
    d1 = replace(cand("d1", 100, 50, rt=True, out=3, slo=0.05, pending=0.02), adapter="x")
    d2 = replace(cand("d2", 100, 50, rt=True, out=3, slo=0.05, pending=0.02), adapter="x")
    be = replace(cand("be", 800, 40, computed=0), adapter=adapter)
    sizes = dict(chunks(Tandem(lambda shape, slots=0: model.predict(shape), max_num_seqs=64)(snap([d1, d2], [be]))))
    assert sizes["d1"] == sizes["d2"] == 1
    return sizes["be"]


def test_a_step_prices_each_lora_adapter_of_its_requests_once():
    """Two decoding chats on adapter x, 30 ms left, and a BE prompt on adapter y; an adapter
    costs 4 ms a step whatever its rows: the BE chunk is the longest that keeps the decodes, two
    adapters (not three) and the chunk within 30 ms, priced by hand. On x as well, it costs
    one adapter, and the chunk grows by the 4 ms; unpriced, it is longer still."""
    priced = replace(COST, per_adapter=0.004)
    decodes = 0.01 + 2 * 1e-3 + 2 * 103 * 1e-6           # base, two decodes at context 103
    n = _be_chunk_beside_chats_on_x("y", priced)
    assert decodes + 2 * 0.004 + n * 1e-4 <= 0.03 + 1e-9 < decodes + 2 * 0.004 + (n + 1) * 1e-4
    assert _be_chunk_beside_chats_on_x("x", priced) == n + 40      # 4 ms of one adapter fewer: 40 more tokens
    assert _be_chunk_beside_chats_on_x("y", COST) == n + 80


def test_a_step_prices_each_row_run_with_a_lora_adapter():
    """The chats and the BE prompt of the test above, an adapter now costing 4 ms a step plus
    0.05 ms for each token row run with it: the decodes' two rows on x count too, and each BE
    token on an adapter costs 0.15 ms, so the chunk is the longest that fits the 30 ms priced by
    hand; on the base model its tokens cost 0.1 ms and it brings no adapter."""
    priced = replace(COST, per_adapter=0.004, per_adapter_row=5e-5)
    decodes = 0.01 + 2 * 1e-3 + 2 * 103 * 1e-6 + 2 * 5e-5      # base, two decodes at context 103, their rows on x
    for adapter, adapters, per_token, want in (("y", 2, 1.5e-4, 64), ("x", 1, 1.5e-4, 91), (None, 1, 1e-4, 136)):
        left = 0.03 - decodes - adapters * 0.004
        assert want * per_token < left - 1e-6 and (want + 1) * per_token > left + 1e-6       # off float ties
        assert _be_chunk_beside_chats_on_x(adapter, priced) == want, adapter
    unpriced_rows = replace(priced, per_adapter_row=0.0)
    assert _be_chunk_beside_chats_on_x("y", unpriced_rows) == 97       # (30 - 20.2) ms / 0.1 ms


def test_hidden_cache_only_where_kv_does_not_fit_and_it_pays():
    """Multi-head geometry (a hidden cache takes 1 block per 16 tokens, KV 2). 14 free blocks:
    a 64-token request (KV 8 blocks) goes first and keeps KV; the next one (KV 8, hidden 4)
    no longer fits as KV, has waited long enough for the hidden cache to pay, and gets one; a
    third fits neither way, keeps KV and waits."""
    first = cand("first", 64, 1, computed=0, blocks=0, arrival=0.0, pending=100.0)
    second = cand("second", 64, 1, computed=0, blocks=0, arrival=1.0, pending=100.0)
    third = cand("third", 64, 1, computed=0, blocks=0, arrival=2.0, pending=100.0)
    plan = policy()(snap([], [first, second, third], free=14, hidden=1))
    assert {d.req_id for d in plan.scheduled} == {"first", "second"}
    assert plan.cache_types == {"second": CacheType.HIDDEN}


def test_hidden_cache_that_does_not_pay_waits():
    """The same pool, but the second request has waited less than its recompute would cost
    over its predicted life (1 running x ρ = 1e-4 s per block x 8 blocks x 1 token = 0.8 ms):
    it keeps KV and waits; once it has waited 2 ms it gets the hidden cache."""
    first = cand("first", 64, 1, computed=0, blocks=0, arrival=0.0, pending=100.0)
    second = cand("second", 64, 1, computed=0, blocks=0, arrival=1.0, pending=0.0005)
    plan = policy()(snap([], [first, second], free=14, hidden=1))
    assert [d.req_id for d in plan.scheduled] == ["first"]
    assert plan.cache_types == {}
    ok = policy()(snap([], [first, replace(second, pending_s=0.002)], free=14, hidden=1))
    assert ok.cache_types == {"second": CacheType.HIDDEN}


def test_no_hidden_cache_on_grouped_query_geometry_or_when_switched_off():
    first = cand("first", 64, 1, computed=0, blocks=0, arrival=0.0, pending=100.0)
    second = cand("second", 64, 1, computed=0, blocks=0, arrival=1.0, pending=100.0)
    gqa = policy()(snap([], [first, second], free=14, hidden=3))       # hidden: 3 blocks per 16 tokens
    assert gqa.cache_types == {} and [d.req_id for d in gqa.scheduled] == ["first"]
    off = policy(off=frozenset({Mechanism.HIDDEN}))(snap([], [first, second], free=14, hidden=1))
    assert off.cache_types == {}
    kv_only = policy(hybrid=False)(snap([], [first, second], free=14, hidden=1))
    assert kv_only.cache_types == {}


def test_look_ahead_admission_keeps_out_what_the_running_growth_will_need():
    """Two running BE requests at 97 tokens (14 blocks each) with 39 more predicted, 12 blocks
    free: 40 in all. Their peak is 35.75 blocks (Footprint's formula by hand: 2 x 97/16 x 2 +
    38 x 4/16 + 2); a new 32-token request predicted to run 200 tokens (longer than theirs, so
    it may not displace them) raises the peak to 45.5, so it waits though its prompt fits now;
    without lengths it runs."""
    running = [cand(f"r{i}", 96, 40, out=1) for i in range(2)]
    new = cand("new", 32, 200, computed=0, blocks=0, arrival=5.0)
    on = policy()(snap(running, [new], free=12))
    assert "new" not in {d.req_id for d in on.scheduled}
    assert {"r0", "r1"} <= {d.req_id for d in on.scheduled}
    off = policy(off=frozenset({Mechanism.LENGTHS}))(snap(running, [new], free=12))
    assert "new" in {d.req_id for d in off.scheduled}


def test_look_ahead_admission_counts_a_shared_cached_prefix_once():
    """The two running requests above (24 blocks) and a 96-token request whose first 80 tokens
    are cached (10 blocks), predicted to run 200 tokens (so it may not displace them): with it
    the peak is 53.5 (Footprint's formula by hand: 2 x 96/16 + 2 x 97/16 x 2 + 38 x 6/16 + 3).
    24 blocks free: 48 in all; its 12 blocks fit the free ones now, but its growth does not fit
    beside theirs, so it waits. When running requests hold its cached blocks, those are in the
    pool once though counted in its size and the holder's: 58 in all, and it runs."""
    running = [cand(f"r{i}", 96, 40, out=1) for i in range(2)]
    idle = cand("hit", 96, 200, computed=80, blocks=0, arrival=5.0)
    shared = replace(idle, num_blocks=10)
    assert "hit" not in {d.req_id for d in policy()(snap(running, [idle], free=24)).scheduled}
    assert "hit" in {d.req_id for d in policy()(snap(running, [shared], free=24)).scheduled}
    # a second such request: peak 75.75 (2 x 96/16 x 2 + 199 x 4/16 + 2); 36 free, 80 in all
    # with both requests' shared blocks (counting only the second's would leave 70)
    second = replace(shared, req_id="hit2", arrival=6.0)
    both = policy()(snap(running, [shared, second], free=36))
    assert {"hit", "hit2"} <= {d.req_id for d in both.scheduled}


def test_rt_takes_blocks_from_the_be_request_with_the_most_remaining_time_and_gets_its_wait():
    """No free block; an RT prompt needs 4. Of two running BE requests, the one predicted to run
    longest gives its blocks up, and the plan carries an estimated wait for it (for swapping)."""
    short = cand("be-short", 32, 10, out=1)
    long = cand("be-long", 32, 1500, out=1)
    rt = cand("rt", 30, 10, rt=True, computed=0, blocks=0, arrival=9.0, slo=5.0)
    plan = policy()(snap([short, long], [rt], free=0))
    assert plan.preempted == ["be-long"]
    assert "rt" in {d.req_id for d in plan.scheduled}
    assert plan.ewt.get("be-long", -1) >= 0


def test_slo_off_runs_every_request_that_fits():
    rt = cand("rt", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    be = cand("be", 800, 40, computed=0)
    plan = policy(off=frozenset({Mechanism.SLO}))(snap([rt], [be]))
    assert {d.req_id: d.num_new_tokens for d in plan.scheduled} == {"rt": 1, "be": 800}


def test_mean_tbt_residual_counts_banked_slack_up_to_twice_the_target():
    """TBT target 0.1 s, last token 0.02 s ago (per-gap residual 0.08 s). Ten tokens since the
    first one 0.5 s ago: 0.5 s banked, so the next may come within 2 x 0.1 - 0.02 = 0.18 s.
    Ten tokens in 1.2 s: behind, the per-gap residual stands."""
    ahead = cand("a", 20, 100, rt=True, out=10, slo=0.1, pending=0.02)
    ahead = replace(ahead, decoding_s=0.5)
    assert abs(ahead.residual() - 0.08) < 1e-12
    assert abs(ahead.residual_tpot() - 0.18) < 1e-12
    behind = replace(ahead, decoding_s=1.2)
    assert abs(behind.residual_tpot() - 0.08) < 1e-12


def test_mean_tbt_lets_a_longer_be_chunk_in_beside_a_request_ahead_of_schedule():
    """The step of test_be_never_makes_the_rt_step_late, with the RT request 0.5 s ahead of its
    mean-gap schedule: under mean_tbt the BE chunk may fill a 0.08 s step (2 x 0.05 - 0.02) instead
    of 0.03 s."""
    rt = replace(cand("rt", 100, 50, rt=True, out=10, slo=0.05, pending=0.02), decoding_s=0.0)
    be = cand("be", 800, 40, computed=0)
    gap = {d.req_id: d.num_new_tokens for d in policy()(snap([rt], [be])).scheduled}
    mean = {d.req_id: d.num_new_tokens for d in policy(mean_tbt=True)(snap([rt], [be])).scheduled}
    assert mean["be"] > gap.get("be", 0)
    shape = StepShape().add(1, 110, True).add(mean["be"], mean["be"], False)
    assert COST.predict(shape) <= 2 * 0.05 - 0.02 + 1e-9


def test_be_never_takes_the_place_of_an_rt_prompt():
    """A decoding RT request sets a 30 ms budget; a 500-token RT prompt with 10 s of TTFT slack
    gets the rest of it (188 tokens: 11.1 + 18.8 ms); a decoding BE request then does not fit.
    BROS lets the BE request take the prompt's place (its slack allows it), which defers the
    prompt until its slack runs out; tandem keeps the prompt and the BE request waits."""
    d = cand("d", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    w = cand("w", 500, 50, rt=True, computed=0, blocks=0, slo=10.0, arrival=1.0)
    b = cand("b", 100, 10, out=3)
    s = snap([d, b], [w], t_avg=0.02)
    assert chunks(policy()(s)) == [("d", 1), ("w", 188)]
    assert chunks(Bros(cost, max_num_seqs=64)(s)) == [("d", 1), ("b", 1)]


def test_an_rt_prompt_is_not_held_behind_be_work_up_to_its_ttft():
    """No decoding RT request bounds the iteration, only a prompt with 10 s of TTFT slack: BROS
    stretches the iteration with the BE prompt up to that slack (its first token would come
    seconds late), tandem stops at the tightest RT target it knows. No clock is read: that target
    is set to what the test cost model prices a step of the 100 prompt tokens and 300 BE tokens
    at, so tandem's plan must be exactly that step; BROS's is bounded by the token budget alone."""
    w = cand("w", 100, 50, rt=True, computed=0, blocks=0, slo=10.0)
    be = cand("be", 2000, 40, computed=0, blocks=0)
    s = snap([], [w, be])
    target = COST.predict(StepShape().add(100, 100, False).add(300, 300, False))   # cost-model units
    assert chunks(policy(idle_budget_s=target)(s)) == [("w", 100), ("be", 300)]
    assert chunks(Bros(cost, max_num_seqs=64, idle_budget_s=target)(s)) == [("w", 100), ("be", 1948)]


def test_with_swapping_a_new_chat_starts_in_free_blocks_while_a_swapped_one_waits_for_more():
    """A full pool: 10 blocks free, a chat swapped out (630 tokens: 80 blocks to come back) is the
    most urgent and cannot preempt the earlier chat that runs. With swapping, a
    chat before its first token that fits in the free blocks (40 tokens: 6) starts; one that
    does not fit (200 tokens: 26) and one that already has tokens wait, and nobody is
    preempted. Without swapping every waiting chat stays behind the swapped one."""
    old = cand("old", 100, None, out=50, rt=True, arrival=0.0, slo=1.0)
    swapped = cand("swapped", 600, None, out=30, rt=True, computed=0, blocks=0, arrival=1.0, slo=1.0, pending=0.9)
    again = cand("again", 40, None, out=3, rt=True, computed=0, blocks=0, arrival=1.5, slo=1.0, pending=0.5)
    new = cand("new", 40, None, rt=True, computed=0, arrival=2.0, slo=1.0, pending=0.1)
    big = cand("big", 200, None, rt=True, computed=0, arrival=3.0, slo=1.0, pending=0.0)
    s = snap([old], [swapped, again, new, big], free=10)
    off = frozenset({Mechanism.LENGTHS})           # BROS's order: by residual time, swapped first
    on = policy(off=off, swapping=True)(s)
    assert sorted(d.req_id for d in on.scheduled) == ["new", "old"] and on.preempted == []
    assert on.reasons["swapped"].startswith("waiting: no block")
    assert on.reasons["again"] == on.reasons["big"] == "waiting: behind a more urgent RT request that waits for blocks"
    assert on.reasons["new"] == STARTED_AHEAD and on.reasons["old"] == "scheduled (RT)"
    without = policy(off=off)(s)
    assert [d.req_id for d in without.scheduled] == ["old"] and without.preempted == []


def test_the_default_knows_whether_preempted_chats_are_swapped():
    from tandem.sched.scheduler import SchedConfig, make_policy
    assert make_policy(SchedConfig(policy="tandem"), cost).swapping
    assert not make_policy(SchedConfig(policy="tandem", preemption_mode="recompute"), cost).swapping


def test_with_swapping_a_chat_past_half_its_ttft_target_starts_though_its_growth_may_not_fit():
    """The look-ahead case above with RT requests (TTFT and TBT targets of 1 s): a new chat
    predicted to run 200 tokens raises the running chats' peak to 45.5 blocks of 40, so it waits
    while it has waited 0.4 s; at 0.6 s, past half its TTFT target, it starts when caches are
    swapped, and still waits when they are recomputed; with ``late_after`` a quarter it starts
    at 0.4 s, and with the mechanism off it waits however long it has waited."""
    running = [cand(f"r{i}", 96, 40, out=1, rt=True, slo=1.0) for i in range(2)]

    def plan(pending, swapping, **kw):
        new = cand("new", 32, 200, rt=True, computed=0, blocks=0, arrival=5.0, slo=1.0, pending=pending)
        return policy(swapping=swapping, **kw)(snap(running, [new], free=12))

    def started(pending, swapping, **kw):
        return "new" in {d.req_id for d in plan(pending, swapping, **kw).scheduled}
    assert not started(0.4, True) and started(0.6, True)
    assert plan(0.6, True).reasons["new"] == STARTED_LATE       # what /metrics counts it under
    fits = cand("new", 32, 8, rt=True, computed=0, blocks=0, arrival=5.0, slo=1.0, pending=0.6)
    assert policy(swapping=True)(snap(running, [fits], free=12)).reasons["new"] == "scheduled (RT)"
    assert not started(0.6, False)
    assert started(0.4, True, late_after=0.25) and not started(0.2, True, late_after=0.25)
    assert not started(5.0, True, off=frozenset({Mechanism.LATE}))


def test_a_late_chat_starts_only_where_the_pool_has_room_for_its_prompt():
    """The late chat above (32 prompt tokens: 4 blocks) beside a running BE request holding 8
    blocks: with 4 blocks free when the plan begins it starts late (the two decoding chats take
    2 of them each for their next token, so it takes the BE request's); with 3 it waits (the
    decoding chats take the BE request's blocks); when its growth fits, it starts as any chat."""
    running = [cand(f"r{i}", 96, 40, out=1, rt=True, slo=1.0) for i in range(2)] + [cand("be", 64, 40, out=1)]

    def plan(free, predicted=200):
        new = cand("new", 32, predicted, rt=True, computed=0, blocks=0, arrival=5.0, slo=1.0, pending=0.6)
        return policy(swapping=True)(snap(running, [new], free=free))
    late = plan(4)
    assert late.reasons["new"] == STARTED_LATE and late.preempted == ["be"]
    short = plan(3)
    assert "new" not in {d.req_id for d in short.scheduled}
    assert short.reasons["new"] == "waiting: its predicted growth would not fit beside the running requests'"
    fits = plan(3, predicted=8)
    assert "new" in {d.req_id for d in fits.scheduled} and fits.preempted == ["be"]


def test_late_after_reaches_the_policy_and_is_checked():
    from tandem.sched.scheduler import SchedConfig, make_policy
    assert make_policy(SchedConfig(policy="tandem", late_after=0.25).check(), cost).late_after == 0.25
    assert make_policy(SchedConfig(policy="tandem", tandem_off=("late",)).check(), cost).late_after == math.inf
    for bad in (-0.1, math.nan, "0.5", True):
        with pytest.raises(ValueError, match="late_after"):
            SchedConfig(policy="tandem", late_after=bad).check()


def test_a_chat_overdue_for_its_first_token_takes_the_prompt_time_back_from_chats_on_target():
    """Fifteen chats decoding, each token due within 30 ms (the budget), a new 400-token chat
    with 10 s of TTFT slack, and an older one of the same size and prediction that missed its
    1 s TTFT target. The decodes take 26.5 ms (10 + 15 x 1 + 15 x 103 x 0.001, by hand), which
    leaves one prompt a chunk. Late by five targets, the old chat runs on what the chats on
    target leave, here nothing: the new chat's chunk takes it. Overdue (past ten targets) it
    takes that chunk, the longest that keeps the step within 30 ms beside every due decode, and
    the new chat waits; with the mechanism off it waits however long it has waited. A chat that
    missed its TTFT and has waited five TBT targets for its next token is not overdue yet."""
    decoding = [cand(f"d{i}", 100, 40, out=3, rt=True, slo=0.05, pending=0.02, arrival=1.0 + i) for i in range(15)]
    stalled = replace(cand("stalled", 100, 40, out=3, rt=True, slo=0.05, pending=0.25), missed=True)
    new = cand("new", 400, 40, rt=True, computed=0, blocks=0, slo=10.0, arrival=20.0)

    def plan(waited, **kw):
        old = replace(cand("old", 400, 40, rt=True, computed=0, blocks=0, slo=1.0, pending=waited), missed=True)
        return dict(chunks(policy(**kw)(snap(decoding + [stalled], [old, new], t_avg=0.02))))

    def longest_chunk(sizes):
        shape = StepShape()
        for i in range(15):
            shape = shape.add(1, 103, True)
        k = sizes["old" if "old" in sizes else "new"]
        return COST.predict(shape.add(k, k, False)) <= 0.03 + 1e-9 < COST.predict(shape.add(k + 1, k + 1, False))

    late = plan(5.0)
    assert "old" not in late and late["new"] > 0 and longest_chunk(late)
    overdue = plan(11.0)
    assert "new" not in overdue and overdue["old"] > 0 and longest_chunk(overdue)
    assert all(late[d.req_id] == overdue[d.req_id] == 1 for d in decoding)
    assert "stalled" not in late and "stalled" not in overdue
    assert plan(11.0, off=frozenset({Mechanism.OVERDUE})) == late
    from tandem.sched.scheduler import SchedConfig, make_policy
    assert make_policy(SchedConfig(policy="tandem", tandem_off=("overdue",)).check(), cost).overdue_after == math.inf


def test_a_late_chat_decoding_is_overdue_for_its_next_token_after_ten_targets():
    """The fifteen due decodes and the new chat of the test above, and a chat that missed its
    TTFT, decoding, whose next token has waited. Late, it runs on what the chats on target leave:
    nothing here. After five TBT targets (0.25 s of 50 ms) it still waits; after twelve it is
    overdue and runs, back among the chats on target at its level (most urgent there), every due
    decode still running and the new chat's chunk shortened to what is left (hand-computed:
    16 decodes take 27.65 ms, 23 prompt tokens fit in the other 2.35). Swapped out, it is not
    moved: it would take blocks back from chats on target. With the mechanism off it waits."""
    decoding = [cand(f"d{i}", 100, 40, out=3, rt=True, slo=0.05, pending=0.02, arrival=1.0 + i) for i in range(15)]
    new = cand("new", 400, 40, rt=True, computed=0, blocks=0, slo=10.0, arrival=20.0)

    def plan(waited, swapped=False, **kw):
        stalled = replace(cand("stalled", 100, 40, out=3, rt=True, slo=0.05, pending=waited), missed=True)
        if swapped:
            return dict(chunks(policy(**kw)(snap(decoding, [replace(stalled, num_blocks=0, num_cpu=14), new],
                                                 t_avg=0.02))))
        return dict(chunks(policy(**kw)(snap(decoding + [stalled], [new], t_avg=0.02))))

    assert "stalled" not in plan(0.25)
    overdue = plan(0.6)
    assert overdue["stalled"] == 1 and all(overdue[d.req_id] == 1 for d in decoding)
    assert overdue["new"] == 23
    assert "stalled" not in plan(0.6, swapped=True)
    assert "stalled" not in plan(0.6, off=frozenset({Mechanism.OVERDUE}))


def test_a_prompt_past_its_ttft_target_is_fitted_to_the_residual_not_to_the_overrun_margin():
    """One in seven recent steps ran 25% past its prediction, so a step is planned against the
    decoding chat's 40.5 ms residual shrunk to 32.4 ms. A prompt still on target gets the longest chunk
    within 32.4 ms: 17 tokens (10 + 5 ms for the decode, 1 ms a prompt token, by hand). One that
    has missed its TTFT target gets the longest within the 40.5 ms itself, 25 tokens (a 20-token
    one runs whole); BROS fits it to the 32.4 ms too."""
    online = overrunning_cost()
    a = cand("a", 100, 40, out=3, rt=True, slo=0.1, pending=0.0595)
    on_target = cand("w", 100, 2000, rt=True, computed=0, blocks=0, slo=1.0, arrival=1.0)
    late = replace(cand("w", 100, 2000, rt=True, computed=0, blocks=0, slo=1.0, pending=2.0, arrival=1.0), missed=True)
    assert chunks(Tandem(online, max_num_seqs=8)(snap([a], [on_target]))) == [("a", 1), ("w", 17)]
    assert chunks(Tandem(online, max_num_seqs=8)(snap([a], [late]))) == [("a", 1), ("w", 25)]
    assert chunks(Bros(online, max_num_seqs=8)(snap([a], [late]))) == [("a", 1), ("w", 17)]
    short = replace(cand("w", 20, 2000, rt=True, computed=0, blocks=0, slo=1.0, pending=2.0, arrival=1.0), missed=True)
    assert chunks(Tandem(online, max_num_seqs=8)(snap([a], [short]))) == [("a", 1), ("w", 20)]   # 35 ms, whole


def test_a_late_prompt_spends_the_time_per_output_token_the_decoding_chats_banked():
    """The decoding chat of the test above (40.5 ms to its target gap) got its first token 239.5
    ms ago and has three tokens: its mean gap may stay within 100 ms while its next token comes
    within 3 x 100 - 239.5 = 60.5 ms. A prompt past its TTFT target gets the longest chunk within
    those 60.5 ms: 45 tokens (10 + 5 + 45 ms, by hand); one still on target keeps within the
    margin (17 tokens). A chat that banked more is held to one gap of twice its target: 140.5 ms
    (first token 60 ms ago), 125 tokens of a 200-token prompt. Beside a second chat that banked
    nothing, the late prompt is back at the 40.5 ms gap: 20 tokens (10 + 2 x 5 + 20 ms)."""
    online = overrunning_cost()
    a = replace(cand("a", 100, 40, out=3, rt=True, slo=0.1, pending=0.0595), decoding_s=0.2395)
    late = replace(cand("w", 200, 2000, rt=True, computed=0, blocks=0, slo=1.0, pending=2.0, arrival=1.0), missed=True)
    on_target = replace(late, pending_s=0.0, missed=False)

    def planned(running, waiting):
        return dict(chunks(Tandem(online, max_num_seqs=8)(snap(running, [waiting]))))
    assert planned([a], late) == {"a": 1, "w": 45}
    assert planned([a], on_target) == {"a": 1, "w": 17}
    banked_more = replace(a, decoding_s=0.06)          # its first token 60 ms ago: capped at one gap of 2 x 100 ms
    assert planned([banked_more], late) == {"a": 1, "w": 125}
    b = replace(a, req_id="b", decoding_s=0.3, arrival=0.5)
    assert planned([a, b], late) == {"a": 1, "b": 1, "w": 20}


def test_a_prompt_overdue_for_its_first_token_leaves_the_decodes_after_it_their_time():
    """The same overrun, two chats decoding with 60.5 ms residuals (each due: T_avg 40 ms) and
    predicted to reply at length, and a prompt overdue for its first token (waiting 11 s
    against a 1 s target) ranked before them. Like a late prompt its chunk is fitted to the residual itself,
    and it leaves both decodes their time in it: 40 tokens (10 + 40 x 1 + 2 x 5 = 60 ms, by
    hand), and both decodes run, though the step is past the margin (48.4 ms)."""
    online = overrunning_cost()
    decoding = [cand(f"d{i}", 100, 4000, out=3, rt=True, slo=0.1, pending=0.0395, arrival=1.0 + i) for i in range(2)]
    old = replace(cand("old", 100, 5, rt=True, computed=0, blocks=0, slo=1.0, pending=11.0), missed=True)
    plan = Tandem(online, max_num_seqs=8)(snap(decoding, [old], t_avg=0.04))
    assert dict(chunks(plan)) == {"old": 40, "d0": 1, "d1": 1}


def test_a_late_prompt_keeps_within_the_idle_bound_while_a_new_prompt_can_make_its_first_token():
    """No chat decoding; a 10-token prompt with 400 ms to its first token, and a 1,000-token one
    past its target. While the new prompt can make its TTFT the step is bounded by the tightest
    target seen (here COST's price of a 400-token prompt step, 50 ms, and 0.05 ms more to keep
    off a float tie), the late prompt's chunk too: 390 tokens beside the new prompt's 10 (10 ms +
    400 x 0.1 ms, by hand), not the whole prompt that the new one's 400 ms would allow. Every
    time here is a price of the cost model COST or a target handed to the policy: nothing reads
    a clock, and the chunk sizes are exact."""
    new = cand("new", 10, 5, rt=True, computed=0, blocks=0, slo=0.4, arrival=2.0)
    late = replace(cand("late", 1000, 5, rt=True, computed=0, blocks=0, slo=1.0, pending=2.0), missed=True)
    priced_bound = COST.predict(StepShape(prefill_tokens=400)) + 5e-5     # a step's price, not a clock reading
    plan = policy(idle_budget_s=priced_bound)(snap([], [new, late]))
    assert chunks(plan) == [("new", 10), ("late", 390)]


def test_be_work_that_does_not_fit_passes_to_the_be_decodes_behind_it(monkeypatch):
    """A step priced 20 ms more as soon as it holds a prompt chunk (as the engine's were), a
    chat with 30 ms left and two running BE requests: the one ranked first (20 prompt tokens
    left, 2 to generate) fits no chunk beside the chat's decode (10 + 20 + 1.6 + 1 ms for 16
    tokens); the one behind it (797 tokens to generate) decodes in 12 ms. The default policy
    passes over the first to the second; stopping at the first misfit, as BROS does, runs the
    chat alone."""
    def jumpy(shape, swap_slots=0):
        return COST.predict(shape) + (0.02 if shape.prefill_tokens else 0.0)
    rt = cand("rt", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    head, behind = cand("be_prompt", 40, 2, computed=20), cand("be_decode", 100, 800, out=3)
    running = [rt, head, behind]
    assert chunks(Tandem(jumpy, max_num_seqs=64)(snap(running, []))) == [("rt", 1), ("be_decode", 1)]
    monkeypatch.setattr(Tandem, "skip_misfits", False)
    plan = Tandem(jumpy, max_num_seqs=64)(snap(running, []))
    assert chunks(plan) == [("rt", 1)] and "time budget" in plan.reasons["be_prompt"]


def test_be_work_passed_over_takes_no_blocks_and_no_place_in_admission():
    """What a BE request that does not fit took to be considered is given back: with no free
    block, the first-ranked batch prompt of the case above would take the blocks of the last
    ranked running request (preempting it) and then not run; it preempts nobody, and the
    decodes behind it all run. A waiting prompt that does not fit leaves admission's books: a
    smaller one behind it starts as it would alone (its 10 tokens beside the chat's decode fit
    the 10 free blocks; with the first one still counted, its predicted growth did not)."""
    def jumpy(shape, swap_slots=0):
        return COST.predict(shape) + (0.02 if shape.prefill_tokens else 0.0)
    rt = cand("rt", 100, 50, rt=True, out=3, slo=0.05, pending=0.02)
    running = [rt, cand("be_prompt", 40, 2, computed=20), cand("be_decode", 100, 800, out=3),
               cand("last", 100, 900, out=3)]
    plan = Tandem(jumpy, max_num_seqs=64)(snap(running, [], free=0))
    assert chunks(plan) == [("rt", 1), ("be_decode", 1), ("last", 1)] and plan.preempted == []

    def linear(shape, swap_slots=0):
        return 0.01 + 1e-3 * shape.decode_tokens + 1.5e-3 * shape.prefill_tokens
    big, small = cand("big", 40, 50, computed=0), cand("small", 10, 60, computed=0, arrival=1.0)
    alone = chunks(Tandem(linear, max_num_seqs=64)(snap([rt], [small], free=20)))
    assert alone == [("rt", 1), ("small", 10)]
    assert chunks(Tandem(linear, max_num_seqs=64)(snap([rt], [big, small], free=20))) == alone
