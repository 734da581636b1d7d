"""Every request makes progress: workloads that once stalled a policy for ever, or made two
requests take each other's blocks every iteration, run to the end. The real Scheduler and
policies run on simulated devices (a virtual clock and the OPT-13B cost model); the check is
independent of how they decide: every request finishes, within a bounded virtual time."""
import threading
import time

import pytest

from tandem.bench.simulator import SimClock, SimDevice
from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType
from tandem.engine.params import SamplingParams
from tandem.sched.cost_model import OPT_13B_A100, OnlineCostModel, StepShape
from tandem.sched.policy import Plan
from tandem.sched.request import Request, ServiceClass
from tandem.sched.runtime import EMPTY_PLAN_RETRY_S, Runtime
from tandem.sched.scheduler import PRICED, SchedConfig, Scheduler


class Run:
    def __init__(self, cfg: SchedConfig, num_blocks: int, max_model_len: int = 2048, hidden_blocks: int = 0):
        self.clock = SimClock()
        dev = SimDevice("sim0", PoolGeometry(num_blocks, 16, hidden_blocks=hidden_blocks), OPT_13B_A100, self.clock,
                        rho=cfg.rho or 0.0)
        cost = OnlineCostModel(OPT_13B_A100, refit_every=1 << 60) if cfg.policy in PRICED else None
        self.s = Scheduler(cfg, [dev], eos_ids=(), max_model_len=max_model_len, clock=self.clock, cost=cost)
        self.tokens: dict[str, int] = {}
        self.done: set[str] = set()

    def add(self, rid, prompt, out, cls="rt", pred=None, ttft=None, tbt=None):
        rt = cls == "rt"
        self.s.add(Request(rid, list(range(prompt)), SamplingParams(max_tokens=out, temperature=0, ignore_eos=True),
                           ServiceClass(cls), arrival_time=self.clock.t, predicted_len=pred,
                           slo_ttft_s=ttft if rt else None, slo_tbt_s=tbt if rt else None))

    def step(self) -> bool:
        """One iteration; False when it computed nothing (the virtual clock stood still)."""
        before = self.clock.t
        for u in self.s.step():
            self.tokens[u.req_id] = self.tokens.get(u.req_id, 0) + len(u.new_token_ids)
            if u.finish_reason is not None:
                self.done.add(u.req_id)
        self.s.check_invariants()
        return self.clock.t > before

    def until(self, t: float) -> None:
        """Step until the virtual clock reaches ``t``; every iteration on the way computes."""
        while self.clock.t < t:
            assert self.step()

    def to_the_end(self, limit_s: float) -> None:
        """Step until every request ends; ``limit_s`` bounds the simulator's virtual clock (its
        seconds come from the cost model, not from this machine's speed)."""
        idle = 0            # an iteration that only preempts or switches cache types computes nothing
        while self.s.has_unfinished():
            idle = 0 if self.step() else idle + 1
            assert idle < 5, f"stalled at {self.clock.t:.2f} s: {self.reasons()}"
            assert self.clock.t < limit_s, f"not done by {limit_s} s: {self.reasons()}"

    def reasons(self) -> dict:
        a = self.s.actors[0]
        return {r: a.last_plan.reasons.get(r) for r in [*a.running, *a.waiting]}


@pytest.mark.parametrize("policy, extra", [("bros", {}), ("bros", {"bidirectional": True}), ("tandem", {}),
                                           ("tandem", {"tandem_off": ("lengths",)}), ("fcfs", {})],
                         ids=["bros", "bros-bidir", "tandem", "tandem-lengths-off", "fcfs"])
def test_batch_requests_that_outgrow_the_pool_together_all_finish(policy, extra):
    """Four BE requests, each fitting alone, fill the pool as they grow: one must give its
    blocks to the others (with free blocks only, none ever got one again)."""
    run = Run(SchedConfig(policy=policy, max_num_seqs=16, max_num_batched_tokens=2048, rt_budget_s=0.2, **extra),
              num_blocks=64)
    for i in range(4):
        run.add(f"be{i}", 100, 200, "be")
    run.to_the_end(limit_s=120)
    assert run.tokens == {f"be{i}": 200 for i in range(4)}


def test_a_waiting_batch_request_ranked_first_does_not_freeze_the_running_one():
    """A short BE request (predicted short, so ranked first) needs more blocks than are free; the
    long BE request holding them must keep running and finish, and then the short one runs."""
    run = Run(SchedConfig(policy="tandem", max_num_seqs=16, max_num_batched_tokens=2048, rt_budget_s=0.2),
              num_blocks=64)
    run.add("long", 100, 300, "be", pred=300)
    while run.tokens.get("long", 0) < 250:
        assert run.step()
    assert run.s.actors[0].pool.num_free < 26          # what "short" needs: 205 tokens, K and V
    run.add("short", 200, 5, "be", pred=5)
    run.to_the_end(limit_s=60)                           # well before aging (minutes) could reorder them
    assert run.tokens == {"long": 300, "short": 5}


def test_two_prompts_that_cannot_both_fit_do_not_take_each_others_blocks_in_turn():
    """Two RT prompts that each fit the pool alone, not together. The one that lost its cache
    needs one more iteration, so it looked more urgent than the one holding the blocks and took
    them back, every iteration (hundreds of preemptions, no token for as long as the TTFT)."""
    run = Run(SchedConfig(policy="bros", max_num_seqs=4, max_num_batched_tokens=256, rt_budget_s=0.05),
              num_blocks=48, max_model_len=384)
    run.add("A", 300, 60, ttft=30.0, tbt=0.05, pred=60)
    run.add("B", 300, 60, ttft=30.0, tbt=0.05, pred=60)
    run.to_the_end(limit_s=30)
    assert run.tokens == {"A": 60, "B": 60}
    assert sum(run.s.actors[0].preemptions_by_class.values()) <= 2


@pytest.mark.parametrize("policy", ["tandem", "alise"])
def test_a_request_far_past_its_prediction_is_admitted_again_after_a_preemption(policy):
    """A BE request predicted at 100 tokens runs to 1,650 of its 1,800, is preempted by a burst
    of chats, then waits beside a light chat stream. Its prediction doubled past what it may
    still generate made its predicted peak larger than the pool, so it was never admitted again."""
    run = Run(SchedConfig(policy=policy, max_num_seqs=64, max_num_batched_tokens=2048,
                          rt_budget_s=0.2 if policy == "tandem" else None), num_blocks=320)
    run.add("be", 100, 1800, "be", pred=100)
    while run.tokens.get("be", 0) < 1650:
        assert run.step()
    for j in range(12):
        run.add(f"burst{j}", 100, 30, ttft=1.0, tbt=0.2, pred=30)
    next_chat, k = run.clock.t, 0
    while "be" not in run.done:
        if run.clock.t >= next_chat:
            run.add(f"chat{k}", 16, 60, ttft=1.0, tbt=0.2, pred=60)
            k, next_chat = k + 1, next_chat + 0.5
        if not run.step():
            run.clock.t = next_chat
        assert run.clock.t < 200, f"still waiting: {run.reasons().get('be')}"
    assert run.tokens["be"] == 1800
    assert run.s.actors[0].preemptions_by_class[ServiceClass.BE] >= 1, "the burst was meant to preempt it"


@pytest.mark.parametrize("policy", ["bros", "tandem"])
def test_chats_without_targets_that_outgrow_the_pool_together_all_finish(policy):
    """RT requests with no latency target have equal (infinite) deadlines: one of them must
    still give its blocks to another (by arrival), or all wait for a block for ever."""
    run = Run(SchedConfig(policy=policy, max_num_seqs=16, max_num_batched_tokens=2048, rt_budget_s=0.2),
              num_blocks=64)
    for i in range(4):
        run.add(f"rt{i}", 100, 200)
    run.to_the_end(limit_s=120)
    assert run.tokens == {f"rt{i}": 200 for i in range(4)}


@pytest.mark.parametrize("policy", ["bros", "tandem"])
def test_batch_requests_whose_tokens_a_chat_overwrote_grow_again_on_bidirectional_blocks(policy):
    """Two BE requests fill a bidirectional pool; two chats arrive, take BE slots (the
    overwritten BE tokens go to the CPU) and finish. Their slots are then empty inside the BE
    requests' earlier blocks while the pool has no free block: the BE requests must swap their
    tokens back in there (a request looking at its last block only never grew again)."""
    run = Run(SchedConfig(policy=policy, max_num_seqs=16, max_num_batched_tokens=256, rt_budget_s=0.2,
                          bidirectional=True), num_blocks=16, max_model_len=128)
    run.add("be0", 32, 4, "be", pred=4)
    run.add("be1", 58, 63, "be", pred=63)
    for rid, at, prompt, out in (("rt0", 0.7, 55, 7), ("rt1", 1.1, 4, 8)):
        run.until(at)
        run.add(rid, prompt, out, ttft=1.0, tbt=0.1, pred=out)
    run.to_the_end(limit_s=60)
    assert run.tokens == {"be0": 4, "be1": 63, "rt0": 7, "rt1": 8}
    assert run.s.actors[0].pool.preemption_table, "no chat overwrote a BE token: the case was not built"


@pytest.mark.parametrize("policy", ["bros", "tandem"])
def test_a_batch_request_that_shares_a_full_block_with_a_chat_is_not_planned_to_grow_in_it(policy):
    """One request per iteration; a BE request and a chat fill a bidirectional pool, sharing a
    block. The BE request counted that block as its own whole, so the policy planned its next
    token (the chat's slack allowed it), which had no slot: nothing ran, for ever. It must see
    that it needs another block, so that the chat runs, takes its blocks and both end."""
    run = Run(SchedConfig(policy=policy, max_num_seqs=1, max_num_batched_tokens=64, rt_budget_s=0.2,
                          bidirectional=True), num_blocks=24, max_model_len=192)
    run.add("be", 64, 105, "be", pred=105)
    run.until(1.0)
    run.add("rt", 70, 70, ttft=1.0, tbt=0.1, pred=70)
    run.to_the_end(limit_s=600)
    assert run.tokens == {"be": 105, "rt": 70}
    assert run.s.actors[0].pool.preemption_table, "the chat never took a BE slot: the case was not built"


def test_a_chat_whose_room_is_batch_slots_in_its_earlier_block_is_not_held_back():
    """A chat moved on to a new block before meeting the BE tokens in its earlier one; with no
    block free it takes BE slots (the pool, or the scheduler sending the BE request to the
    CPU). Counting those BE tokens against its blocks made the policy see no room for it, and
    the chat and the batch request waited for each other for ever."""
    run = Run(SchedConfig(policy="tandem", max_num_seqs=16, max_num_batched_tokens=256, rt_budget_s=0.2,
                          bidirectional=True, swap_space_bytes=1 << 20), num_blocks=24, max_model_len=192)
    work = [(0.0, "be11", 70, 121), (1.1, "rt6", 92, 96), (1.8, "rt27", 51, 119), (5.1, "rt12", 51, 40),
            (6.2, "rt19", 80, 105)]
    for at, rid, prompt, out in work:
        run.until(at)
        run.add(rid, prompt, out, rid[:2], pred=out, ttft=1.0, tbt=0.1)
    run.to_the_end(limit_s=600)
    assert run.tokens == {rid: out for _, rid, _, out in work}


@pytest.mark.parametrize("mixed", [True, False])
def test_chunked_prompts_with_hidden_caches_do_not_discard_each_other_for_ever(mixed):
    """Apt-Serve on a pool that holds hidden caches, prompts longer than one iteration's tokens:
    a prompt admitted with a hidden cache (the greedy had kept room for requests the token
    limit then left waiting) was switched to a KV cache halfway, by the next iteration, which
    discarded its chunk; the other prompt, admitted in its place, met the same fate, in turn,
    for ever."""
    run = Run(SchedConfig(policy="aptserve", mixed_batches=mixed, rho=0.002, max_num_seqs=16,
                          max_num_batched_tokens=256), num_blocks=64, max_model_len=512, hidden_blocks=1)
    work = [("be", 195, 2), ("be", 219, 44), ("be", 341, 25), ("be", 361, 24), ("be", 382, 55),
            ("rt", 51, 39), ("rt", 337, 19), ("rt", 372, 23)] if mixed else \
        [("be", 42, 10), ("be", 122, 36), ("be", 152, 33), ("be", 321, 43), ("be", 329, 47), ("be", 339, 12),
         ("be", 360, 27), ("be", 384, 8), ("rt", 13, 22), ("rt", 18, 5), ("rt", 19, 21), ("rt", 150, 10),
         ("rt", 191, 8), ("rt", 203, 57), ("rt", 315, 55), ("rt", 340, 17)]
    for i, (cls, prompt, out) in enumerate(work):
        run.add(f"{cls}{i}", prompt, out, cls, ttft=1.0, tbt=0.1)
    run.to_the_end(limit_s=600)
    assert run.tokens == {f"{cls}{i}": out for i, (cls, _, out) in enumerate(work)}
    assert run.s.tokens_by_cache_type[CacheType.HIDDEN], "no prompt ran with a hidden cache: the case was not built"


def test_round_robin_classes_do_not_take_each_others_blocks_in_turn():
    """Round robin between the classes, a chat and a batch request that each fit the pool
    alone, not together: the turn of one class preempted the other's request, the next turn
    preempted it back, and both recomputed for ever."""
    run = Run(SchedConfig(policy="rr", max_num_seqs=16, max_num_batched_tokens=256), num_blocks=128, max_model_len=1024)
    run.add("chat", 500, 300)
    run.add("batch", 500, 300, "be")
    run.to_the_end(limit_s=600)
    assert run.tokens == {"chat": 300, "batch": 300}


@pytest.mark.parametrize("policy", ["bros", "tandem"])
def test_a_long_batch_prompt_runs_when_no_chunk_fits_the_rt_target(policy):
    """With no chat present an iteration is bounded by the tightest RT target; when not even the
    smallest prompt chunk fits that bound (a tight target, a cost model that prices long context
    high), the batch prompt took nothing and the server planned empty iterations for ever. Alone,
    it must run: a chat first, then an 8,000-token batch prompt and a batch decode."""
    floor = OPT_13B_A100.predict(StepShape().add(1, 1, True))        # the cheapest step
    run = Run(SchedConfig(policy=policy, max_num_seqs=16, max_num_batched_tokens=2048, rt_budget_s=floor / 2),
              num_blocks=1100, max_model_len=8192)
    run.add("chat", 40, 8, ttft=1.0, tbt=floor / 2, pred=8)
    run.to_the_end(limit_s=60)
    run.add("prompt", 8000, 4, "be", pred=4)
    run.add("short", 16, 20, "be", pred=20)
    run.to_the_end(limit_s=600)
    assert run.tokens == {"chat": 8, "prompt": 4, "short": 20}


def test_an_actor_whose_policy_plans_nothing_waits_and_plans_again():
    """A device actor with work whose plan is empty must not plan again at once, for ever (a core
    spun at 100% while nothing ran); it plans again as time passes, without a message, and the
    request then runs. The real runtime thread, on a simulated device."""
    run = Run(SchedConfig(policy="fcfs", max_num_seqs=4, max_num_batched_tokens=256), num_blocks=64)
    actor = run.s.actors[0]
    real, actor.policy = actor.policy, lambda snap: Plan()
    done = threading.Event()
    runtime = Runtime(run.s, lambda ups: done.set() if any(u.finish_reason for u in ups) else None)
    try:
        runtime.add(run.s.new_state(Request("r", list(range(20)), SamplingParams(max_tokens=3, ignore_eos=True))))
        time.sleep(0.5)
        planned = actor.step_id
        assert 1 <= planned <= 0.5 / EMPTY_PLAN_RETRY_S + 10, planned
        actor.policy = real
        assert done.wait(30), actor.last_plan.reasons
    finally:
        runtime.stop()
