"""BROS packing and the round-robin baseline on hand-made snapshots where the right plan is known.

Cost model used throughout (seconds): 0.01 per step + 0.001 per prefill token + 0.005 per decode.
"""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.messages import Phase
from tandem.sched.bros import FULL_WAIT, Bros, RoundRobin
from tandem.sched.cost_model import CostModel, OnlineCostModel, StepShape, SwapModel
from tandem.sched.policy import Candidate, Limits, Snapshot

B = 4   # block size; a KV token-block costs 2 blocks


def cost(shape: StepShape, swap_slots: int = 0) -> float:
    return 0.01 + 0.001 * shape.prefill_tokens + 0.005 * shape.decode_tokens


def snap(running=(), waiting=(), free=1000, seqs=8, tokens=512, chunked=True, t_avg=0.02):
    return Snapshot(list(running), list(waiting), free, B, 2, Limits(seqs, tokens, chunked), t_avg)


def dec(rid, slo, pending, rt=True, ctx=8, arrival=0.0, cpu=0):
    """A running request about to decode its next token."""
    return Candidate(rid, ctx + 1, ctx, -(-ctx // B) * 2, arrival, rt, slo, pending, cpu)


def new(rid, prompt, slo=None, pending=0.0, rt=True, arrival=0.0, cpu=0):
    """A waiting request (no blocks yet)."""
    return Candidate(rid, prompt, 0, 0, arrival, rt, slo, pending, cpu)


def planned(plan):
    return [(d.req_id, d.num_new_tokens) for d in plan.scheduled]


def test_most_urgent_first_and_early_return():
    # residuals: a 0.022, b 0.2, c 0.03 -> order a, c, b; T_res_min = 0.022
    # C(a) = .015, C(a, c) = .02 fit; C(a, c, b) = .025 > .022: early return, B_curr reset
    p = Bros(cost, max_num_seqs=8, b_base=2)
    p.b_curr = 8
    plan = p(snap(running=[dec("a", 0.1, 0.078), dec("b", 0.2, 0.0), dec("c", 0.1, 0.07)]))
    assert planned(plan) == [("a", 1), ("c", 1)]
    assert p.last_early and p.b_curr == 2


def test_late_requests_do_not_set_the_budget():
    # late: residual below the cheapest iteration (.015). They go first, but the budget is the
    # feasible request's 0.03: C(late1, late2, ok) = .025 fits, one more decode (.03) still fits
    late = [dec(f"late{i}", 0.1, 0.2 + 0.01 * i) for i in range(2)]
    ok = dec("ok", 0.1, 0.07)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[ok, *late, dec("be", None, 0, rt=False)]))
    assert planned(plan) == [("late1", 1), ("late0", 1), ("ok", 1), ("be", 1)]


def test_rt_packed_while_the_time_budget_holds():
    # T_res_min = 0.1 - 0.07 = 0.03: C(1 decode) = .015, C(2) = .02, C(3) = .025, C(4) = .03, C(5) = .035
    rts = [dec(f"r{i}", 0.1, 0.07 - 0.001 * i) for i in range(6)]
    p = Bros(cost, max_num_seqs=8, b_base=8)
    plan = p(snap(running=rts))
    assert planned(plan) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    assert p.last_early


def test_rt_requests_the_packing_did_not_reach_are_told_what_filled_the_iteration():
    # time: as above, r4 is refused (early return) and r5 is never reached
    rts = [dec(f"r{i}", 0.1, 0.07 - 0.001 * i) for i in range(6)]
    plan = Bros(cost, max_num_seqs=8, b_base=8)(snap(running=rts))
    assert plan.reasons["r4"] == "waiting: the batch would miss the most urgent RT deadline"
    assert plan.reasons["r5"] == FULL_WAIT["time"]
    # batch size: B_curr = B_base = 2 with time to spare
    plan = Bros(cost, max_num_seqs=8, b_base=2)(snap(running=[dec(f"r{i}", 1.0, 0.0) for i in range(4)]))
    assert planned(plan) == [("r0", 1), ("r1", 1)]
    assert plan.reasons["r2"] == plan.reasons["r3"] == FULL_WAIT["batch"]
    # tokens: the 60-token prompt (more urgent: it needs more iterations) takes all 50 of them
    plan = Bros(cost, max_num_seqs=8)(snap(waiting=[new("q", 10, slo=10.0), new("p", 60, slo=10.0)], tokens=50))
    assert planned(plan) == [("p", 50)]
    assert plan.reasons["q"] == FULL_WAIT["tokens"]


def test_prefill_chunk_shortened_to_fit_the_deadline():
    # decode a: T_res_min = 0.04. With the 100-token prompt: .01+.005+.1 > .04; the longest chunk
    # that fits is 25 tokens (.015 + .025 = .04)
    p = Bros(cost, max_num_seqs=8)
    plan = p(snap(running=[dec("a", 0.1, 0.06)], waiting=[new("w", 100, slo=1.0)]))
    assert planned(plan) == [("a", 1), ("w", 25)]
    assert plan.scheduled[1].phase is Phase.PREFILL and not plan.scheduled[1].sample


def overrunning_cost() -> OnlineCostModel:
    """A cost model one in seven of whose recent steps ran 25% past its prediction (the others on
    time, so their median is too, and the model's per-kind correction stays 1): 10 ms a step, 1
    ms a prompt token, 5 ms a decode, no attention terms."""
    online = OnlineCostModel(CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0), refit_every=10**9)
    for i in range(50):
        online.observe(StepShape().add(1, 8, decode=True), 0.015 * (1.25 if i % 7 == 0 else 1.0))
    return online


def test_a_chunk_is_fitted_to_what_steps_with_a_prompt_chunk_recently_took():
    """Steps with a prompt chunk have run at 1.2 times the fitted price (decode-only steps were
    never measured), so the cost model prices such a step at 1.2 times the fit, and the margin
    stays 1 (only the first four ran past the corrected price: 8% of 50). The chunk beside the
    decode is fitted against 0.04 at that level: (.010 + .005 + .001 n) * 1.2 <= .04, so 18
    tokens (by hand), not 25."""
    online = OnlineCostModel(CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0), refit_every=10**9)
    for _ in range(50):
        online.observe(StepShape().add(20, 20, decode=False), 0.030 * 1.2)
    assert online.overrun() == 1.0
    plan = Bros(online, max_num_seqs=8)(snap(running=[dec("a", 0.1, 0.06)], waiting=[new("w", 100, slo=1.0)]))
    assert planned(plan) == [("a", 1), ("w", 18)]


def test_the_deadline_keeps_a_margin_for_the_cost_models_overruns():
    # as above, but one in seven recent steps ran 25% past its prediction: the chunk is fitted
    # against 0.04 / 1.25 = 0.032, so 17 tokens (.015 + .017), not 25
    plan = Bros(overrunning_cost(), max_num_seqs=8)(snap(running=[dec("a", 0.1, 0.06)],
                                                         waiting=[new("w", 100, slo=1.0)]))
    assert planned(plan) == [("a", 1), ("w", 17)]


def test_be_fills_the_batch_without_rt_and_fewest_checkpointed_first():
    bes = [dec("be_many", None, 0, rt=False, cpu=5), dec("be_none", None, 0, rt=False, cpu=0),
           new("be_new", 6, rt=False, cpu=0, arrival=1.0)]
    p = Bros(cost, max_num_seqs=2, b_base=2)
    plan = p(snap(running=bes[:2], waiting=bes[2:], seqs=2))
    assert planned(plan) == [("be_none", 1), ("be_new", 6)]     # B_curr = 2: be_many waits


def test_be_replaces_the_least_urgent_rt_when_its_slack_allows():
    # a: res 0.04 (T_res_min); b: res 1.0. BE prompt of 22 tokens, unchunked:
    # C(a, b, be) = .01 + .01 + .022 = .042 > .04; C(a, be) = .037 fits; b keeps 1.0 - .037 >= t_avg
    a, b = dec("a", 0.1, 0.06), dec("b", 1.0, 0.0)
    be = new("be", 22, rt=False)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[a, b], waiting=[be], chunked=False))
    assert planned(plan) == [("a", 1), ("be", 22)]
    assert "replaced" in plan.reasons["b"]


def test_no_replacement_when_the_rt_request_would_lose_its_slack():
    # b: res 0.05; after this iteration 0.05 - 0.037 = 0.013 < t_avg 0.02 -> keep b, BE waits
    a, b = dec("a", 0.1, 0.06), dec("b", 0.1, 0.05)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[a, b], waiting=[new("be", 22, rt=False)], chunked=False))
    assert planned(plan) == [("a", 1), ("b", 1)]


def test_a_prompts_first_token_counts_the_iterations_its_prefill_still_needs():
    # w: a 100-token prompt; alone it costs .01 + .1 = .11, i.e. k = ceil(.11 / t_avg .02) = 6
    # iterations, so its residual is 1.0 - .85 - 5 x .02 = .05 (not .15). a: res .04 sets the
    # budget; w's chunk is fitted to it (25 tokens). The 22-token BE prompt does not fit beside
    # them; replacing w would leave it .05 - C(a, be) = .05 - .037 = .013 < t_avg: w stays.
    # (Counting one iteration, w's .15 - .037 = .113 looked ample and BE took its place.)
    a, w = dec("a", 0.1, 0.06), new("w", 100, slo=1.0, pending=0.85)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[a], waiting=[w, new("be", 22, rt=False)]))
    assert planned(plan) == [("a", 1), ("w", 25)]


def test_a_long_prompt_is_more_urgent_than_a_short_one_that_waited_as_long():
    # same target and wait (residual .5 each with one iteration), one request a batch: the
    # 100-token prompt needs 6 iterations (res .4), the 4-token one fits one (res .5)
    short, long_ = new("short", 4, slo=1.0, pending=0.5), new("long", 100, slo=1.0, pending=0.5, arrival=1.0)
    plan = Bros(cost, max_num_seqs=1)(snap(waiting=[short, long_], seqs=1))
    assert planned(plan) == [("long", 100)]


def test_when_no_rt_request_can_be_saved_the_iteration_is_not_bounded():
    # nobody can make it: serving for throughput beats bounding the iteration by the tightest
    # target (0.025, which would fit the three late decodes only): BE joins too
    late = [dec(f"late{i}", 0.1, 0.3 + 0.01 * i) for i in range(3)]
    p = Bros(cost, max_num_seqs=8, idle_budget_s=0.025)
    plan = p(snap(running=[*late, dec("be", None, 0, rt=False)]))
    assert planned(plan) == [("late2", 1), ("late1", 1), ("late0", 1), ("be", 1)]


def test_requests_past_their_ttft_come_after_savable_ones():
    # "gone" waited 1 s for a 0.5 s TTFT: its SLO is lost, so although its residual is the most
    # negative it runs after the savable one, within its budget: "ok" has residual .2, C(ok) =
    # .11, and the lost prompt is cut to the 90 tokens that keep C at .2
    gone = Candidate("gone", 100, 0, 0, 0.0, True, 0.5, 1.0, 0, missed=True)
    ok = new("ok", 100, slo=0.5, pending=0.3, arrival=0.7)
    plan = Bros(cost, max_num_seqs=8)(snap(waiting=[gone, ok]))
    assert planned(plan) == [("ok", 100), ("gone", 90)]
    # alone, the lost request is served for throughput, bounded by half the loosest target seen
    # (.25 s: after "gone" (.11) a second lost 1000-token prompt is cut to 140 tokens)
    p = Bros(cost, max_num_seqs=8)
    big = Candidate("big", 1000, 0, 0, 0.5, True, 0.5, 0.9, 0, missed=True)
    assert planned(p(snap(waiting=[gone, big]))) == [("gone", 100), ("big", 140)]


def test_without_rt_an_iteration_is_bounded_by_the_tightest_target():
    # idle budget 0.1: a 500-token BE prompt is cut to 90 tokens (.01 + .09)
    p = Bros(cost, max_num_seqs=8, idle_budget_s=0.1)
    assert planned(p(snap(waiting=[new("be", 500, rt=False)]))) == [("be", 90)]
    assert planned(Bros(cost, max_num_seqs=8)(snap(waiting=[new("be", 500, rt=False)]))) == [("be", 500)]


def test_rt_preempts_best_effort_blocks_least_computed_first():
    # the RT prompt needs 4 blocks (8 tokens); nothing free; BE x holds 4 blocks with 8 computed,
    # BE y holds 6 blocks with 12 computed: x (least work lost) is preempted, y keeps running
    x = Candidate("x", 9, 8, 4, 0.0, False, None, 0.0)
    y = Candidate("y", 13, 12, 6, 0.0, False, None, 0.0)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[x, y], waiting=[new("rt", 8, slo=1.0)], free=0))
    assert plan.preempted == ["x"]
    assert ("rt", 8) in planned(plan) and "x" not in dict(planned(plan))


def test_adaptive_batch_doubles_until_max_then_resets_on_early_return():
    p = Bros(cost, max_num_seqs=16, b_base=2)
    easy = snap(running=[dec("r", 10.0, 0.0)])
    sizes = []
    for _ in range(5):
        p(easy)
        sizes.append(p.b_curr)
    assert sizes == [4, 8, 16, 16, 16]
    p(snap(running=[dec(x, 0.1, 0.08) for x in "abc"]))          # C(3 decodes) .025 > res .02: early
    assert p.b_curr == 2


def test_round_robin_alternates_classes():
    rr = RoundRobin()
    s = snap(running=[dec("rt", 1.0, 0.0), dec("be", None, 0.0, rt=False)])
    assert planned(rr(s)) == [("rt", 1)]
    assert planned(rr(s)) == [("be", 1)]
    assert planned(rr(s)) == [("rt", 1)]
    only_be = snap(running=[dec("be", None, 0.0, rt=False)])
    assert planned(rr(only_be)) == [("be", 1)] and planned(rr(only_be)) == [("be", 1)]


def test_round_robin_takes_blocks_from_the_other_class_first():
    # RT's turn; the waiting RT prompt needs 4 blocks; none free; BE holds 4: BE is preempted
    be = Candidate("be", 9, 8, 4, 0.0, False, None, 0.0)
    plan = RoundRobin()(snap(running=[be], waiting=[new("rt", 8, slo=1.0, arrival=1.0)], free=0))
    assert plan.preempted == ["be"] and planned(plan) == [("rt", 8)]


def test_an_rt_request_preempted_for_a_more_urgent_one_is_not_also_scheduled():
    # urgent waiting RT (an earlier arrival, preempted before) needs 4 blocks, none free; the
    # only victim is the running, less urgent RT that arrived after it
    lax = Candidate("lax", 9, 8, 4, 1.0, True, 10.0, 0.0)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[lax], waiting=[new("urgent", 8, slo=0.5, pending=0.2)], free=0))
    assert plan.preempted == ["lax"] and planned(plan) == [("urgent", 8)]


def test_two_rt_requests_never_take_each_others_blocks_in_turn():
    """A pool that holds one of two RT requests: whichever waits is the more urgent (its
    residual falls while it waits, the runner's is renewed at each token). If the waiting one
    could always preempt the runner, they would swap every few iterations, each time throwing
    a cache away. Of the two role assignments, at most one may preempt."""
    def waits_for(runner: str, waiter: str) -> list[str]:
        arrival = {"first": 0.0, "second": 1.0}
        running = Candidate(runner, 9, 8, 4, arrival[runner], True, 1.0, 0.0)
        waiting = Candidate(waiter, 8, 0, 0, arrival[waiter], True, 1.0, 0.9)
        return Bros(cost, max_num_seqs=8)(snap(running=[running], waiting=[waiting], free=0)).preempted
    taken = [waits_for("first", "second"), waits_for("second", "first")]
    assert taken == [[], ["second"]]


def test_bidirectional_pool_full_of_rt_at_a_block_boundary_preempts_rt():
    """Every block held by RT requests (no free block, none BE-only) and each at the end of its
    last block: the pool has no BE slot to take, so the most urgent request runs and the least
    urgent one not in the batch is preempted to make its room (else none could ever run)."""
    p = Bros(cost, max_num_seqs=8, b_base=8)
    running = [dec("a", 0.1, 0.09, ctx=8), dec("b", 0.1, 0.01, ctx=8)]     # 8 tokens: 2 full token-blocks
    s = Snapshot(running, [], 0, B, 2, Limits(8, 512, True), 0.02, be_only_blocks=0, block_preemption=True)
    plan = p(s)
    assert planned(plan) == [("a", 1)]
    assert plan.preempted == ["b"]


def test_victims_that_would_not_make_room_are_not_preempted():
    # the waiting RT prompt needs 20 blocks, none free; the running BE request holds 4: preempting
    # it would not let the prompt in, so it keeps its cache and keeps decoding
    be = dec("be", None, 0.0, rt=False, ctx=7)
    plan = Bros(cost, max_num_seqs=8)(snap(running=[be], waiting=[new("rt", 40, slo=1.0)], free=0))
    assert plan.preempted == [] and planned(plan) == [("be", 1)]


def test_a_victim_frees_only_the_blocks_it_does_not_share():
    """A 12-token prompt needs 6 blocks; 2 are free. A running request of 10 blocks, 8 of them a
    cached prefix another running request holds too, gives back 2 if preempted: not enough, so
    none is preempted (it would lose its cache for nothing). One that shares nothing gives 10."""
    from tandem.sched.bros import BlockBudget
    from tandem.sched.policy import Plan
    c = new("c", 12)
    shared = Candidate("v", 40, 40, 10, 0.0, False, num_shared=8)
    alone = Candidate("w", 40, 40, 10, 0.0, False)
    plan = Plan()
    assert not BlockBudget(snap(free=2)).take_from(c, 12, [shared], plan, "test") and plan.preempted == []
    assert BlockBudget(snap(free=2)).take_from(c, 12, [alone], plan, "test") and plan.preempted == ["w"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 600), st.none() | st.floats(0.05, 2.0),
                          st.floats(0, 2.0), st.integers(0, 40), st.booleans(), st.sampled_from([0, 10**6, 10**8]),
                          st.sampled_from([None, "x"])), min_size=1, max_size=20),
       st.sampled_from([0.0, 0.02, 0.13]))
def test_urgency_of_every_rt_request_against_bros_residual(rows, t_avg):
    """Each RT request's urgency, priced for all of them at once in a plan (with the cost model
    the server uses, swap time, the copy back of a swapped-out cache and its LoRA adapter and
    the rows run with it included) and for one alone, is res_i - (k_i - 1) T_avg with k_i = max(1, ceil(C(its
    remaining prefill, its swap-in) / T_avg)) worked out one at a time; a request past its TTFT
    keeps its residual."""
    online = OnlineCostModel(CostModel(0.02, 1.3e-4, 2e-9, 6e-5, 6.3e-7, per_swap_in_byte=1e-9, per_adapter=0.03,
                                       per_adapter_row=2e-4), swap=SwapModel(0.05, 5e-3))
    cs = [Candidate(f"r{i}", tokens, min(done, tokens), 0, float(i), True, slo, pending, cpu, missed=missed,
                    host_bytes=nbytes, adapter=adapter)
          for i, (tokens, done, slo, pending, cpu, missed, nbytes, adapter) in enumerate(rows)]

    def by_hand(c):
        res = math.inf if c.slo_s is None else c.slo_s - c.pending_s
        todo, k = c.num_tokens - c.num_computed, 1
        if todo > 1 and t_avg > 0 and c.slo_s is not None:
            pairs = todo * c.num_tokens - todo * (todo - 1) // 2       # each new token sees those before it
            lora = int(c.adapter is not None)
            shape = StepShape(todo, pairs, swap_in_bytes=c.host_bytes, adapters=lora, adapter_rows=lora * todo)
            seconds = online(shape, c.num_cpu)
            k = max(1, math.ceil(seconds / t_avg))
        return res if c.missed else res - (k - 1) * t_avg
    bros = Bros(online, max_num_seqs=8)
    bros(Snapshot([], cs, 10_000, B, 2, Limits(8, 512, True), t_avg))
    assert [bros._urgency(c, t_avg) for c in cs] == [by_hand(c) for c in cs]
    assert [Bros(online, 8)._urgency(c, t_avg) for c in cs] == [by_hand(c) for c in cs]
