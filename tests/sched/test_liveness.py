"""No policy plans an empty iteration while some request could run: on one device nothing else
frees blocks or moves requests, so an empty plan is planned again, and again, for ever (a long
batch prompt with no chunk under a tight RT target did that). Random snapshots; the reference
is the reachable state itself: every request fits the pool alone, so some request can run."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.messages import CacheType
from tandem.sched.alise import Alise
from tandem.sched.aptserve import AptServe
from tandem.sched.bros import Bros, RoundRobin
from tandem.sched.cost_model import OPT_13B_A100, OnlineCostModel
from tandem.sched.policy import Candidate, Limits, Snapshot, fcfs, fcfs_prefill_first
from tandem.sched.tandem import Tandem

BLOCK, PER = 16, 2          # a KV token-block takes two pool blocks


def blocks(tokens: int, hidden: bool = False) -> int:
    """Pool blocks of a cache of ``tokens`` (a hidden cache: one per token-block, as a multi-head
    model's layer inputs take half the memory of its K and V)."""
    return -(-tokens // BLOCK) * (1 if hidden else PER)


@st.composite
def candidate(draw, i: int, hidden_pool: bool) -> Candidate:
    """Waiting (nothing computed), decoding (all but its last token computed) or part-way
    through its prompt; on a pool that holds hidden caches, a running one may keep one."""
    rt, state = draw(st.booleans()), draw(st.sampled_from(["waiting", "decoding", "prefilling"]))
    prompt = draw(st.integers(2 if state == "prefilling" else 1, 3000))
    out = draw(st.integers(1, 300)) if state == "decoding" else 0
    tokens = prompt + out
    computed = {"waiting": 0, "decoding": tokens - 1, "prefilling": draw(st.integers(1, prompt - 1))
                if state == "prefilling" else 0}[state]
    slo = draw(st.sampled_from([0.05, 0.2, 1.0])) if rt else None
    pending = draw(st.floats(0, 20))
    hidden = hidden_pool and computed > 0 and draw(st.booleans())
    return Candidate(f"{'r' if rt else 'b'}{i}", tokens, computed, blocks(computed, hidden), float(i), rt,
                     slo, pending, missed=bool(rt and out == 0 and pending > slo),
                     cache_type=CacheType.HIDDEN if hidden else CacheType.KV,
                     num_output=out, predicted=draw(st.none() | st.integers(1, 2000)),
                     decoding_s=pending if out else None, max_output=out + 500)


@st.composite
def snapshots(draw) -> Snapshot:
    """A state the scheduler can reach: the running requests hold their blocks, every other
    block of the pool is free, and the pool holds each request alone (admission refuses those
    it could never hold)."""
    hidden_pool = draw(st.booleans())
    cands = [draw(candidate(i, hidden_pool)) for i in range(draw(st.integers(1, 6)))]
    running = [c for c in cands if c.num_computed]
    waiting = [c for c in cands if not c.num_computed]
    held = sum(c.num_blocks for c in running)
    total = max([held] + [blocks(c.num_tokens) for c in cands]) + draw(st.integers(0, 400))
    limits = Limits(draw(st.integers(1, 8)), draw(st.sampled_from([64, 512, 2048])), True)
    return Snapshot(running, waiting, total - held, BLOCK, PER, limits, draw(st.just(0.0) | st.floats(0.001, 0.3)),
                    hidden_blocks_per_token_block=1 if hidden_pool else 0)


def policies(scale: float, idle: float | None):
    cost = OnlineCostModel(OPT_13B_A100, refit_every=1 << 60)
    cost.model = replace(OPT_13B_A100, **{f: getattr(OPT_13B_A100, f) * scale for f in
                                          ("base", "per_prefill_token", "per_prefill_attn", "per_decode_token",
                                           "per_decode_ctx")})
    return {"fcfs": fcfs, "fcfs-prefill-first": fcfs_prefill_first, "rr": RoundRobin(),
            "bros": Bros(cost, 8, idle_budget_s=idle), "alise": Alise(cost), "aptserve": AptServe(1e-4),
            "aptserve-mixed": AptServe(1e-4, mixed=True), "tandem": Tandem(cost, 8, rho=1e-4, idle_budget_s=idle)}


@settings(max_examples=400, deadline=None)
@given(snapshots(), st.sampled_from([1.0, 30.0]), st.sampled_from([None, 0.001, 0.2]))
def test_a_plan_is_never_empty_while_there_is_work(snap, scale, idle):
    for name, policy in policies(scale, idle).items():
        plan = policy(snap)
        assert plan.scheduled or plan.preempted or plan.cache_types, (name, plan.reasons)
