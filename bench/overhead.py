"""Scheduling overhead of the policies: time per plan on random snapshots of n candidates
(Apt-Serve Table 6: 0.3 ms at 50, 10.8 ms at 1,600), and the whole per-step planning of a
device (snapshot, policy, applying the plan) with a queue kept at W waiting requests, as batch
jobs keep one. Pure CPU, no model."""
from __future__ import annotations

import random
import statistics
import time

from tandem.bench.output import save_json
from tandem.bench.simulator import SimClock, SimDevice, SimSetup, policy_cost
from tandem.cache import PoolGeometry
from tandem.engine.messages import CacheType
from tandem.sched.alise import Alise
from tandem.sched.aptserve import AptServe
from tandem.sched.bros import Bros
from tandem.sched.cost_model import OPT_13B_A100, OPT_13B_A100_RHO, OnlineCostModel
from tandem.engine.params import SamplingParams
from tandem.sched.policy import Candidate, Limits, Snapshot, fcfs
from tandem.sched.request import Request, ServiceClass
from tandem.sched.scheduler import SchedConfig, Scheduler
from tandem.sched.tandem import Tandem

BLOCK = 16


def snapshot(n: int, seed: int, kind: str = "prefill") -> Snapshot:
    """n candidates, half running and half waiting, ShareGPT-like lengths, a pool about 60% full,
    any of them may run (max_num_seqs = n). ``kind`` picks which queue has waited longer in
    total, so Apt-Serve plans a prefill or a decode iteration."""
    rng = random.Random(seed)
    wait_hi = 3.0 if kind == "prefill" else 0.1
    running, waiting = [], []
    for i in range(n):
        ctx = rng.randint(16, 1500)
        if i % 2:
            running.append(Candidate(f"r{i}", ctx + 1, ctx, -(-ctx // BLOCK) * 2, i * 0.01, True, 0.1,
                                     rng.uniform(0, 0.2), cache_type=rng.choice([CacheType.KV, CacheType.HIDDEN])))
        else:
            waiting.append(Candidate(f"w{i}", ctx, 0, 0, i * 0.01, True, 1.0, rng.uniform(0, wait_hi)))
    held = sum(c.num_blocks for c in running)
    return Snapshot(running, waiting, int(held * 0.7), BLOCK, 2, Limits(n, 8192, True), 0.05,
                    hidden_blocks_per_token_block=1)


def crowded(n: int, seed: int) -> Snapshot:
    """n RT candidates: half decoding long replies, each next token due within its 0.1 s TBT
    target, half new chats predicted to reply briefly, with 10 s of TTFT slack, so an order by
    predicted remaining time puts the new chats first and the decodes fill the iteration (the
    case where a prompt's chunk must leave the decodes their time)."""
    rng = random.Random(seed)
    running = [Candidate(f"d{i}", ctx + 1, ctx, -(-ctx // BLOCK) * 2, i * 0.01, True, 0.1, rng.uniform(0.03, 0.07),
                         num_output=rng.randint(1, 50), predicted=1000)
               for i, ctx in enumerate(rng.randint(16, 1500) for _ in range(n // 2))]
    waiting = [Candidate(f"w{i}", rng.randint(16, 1500), 0, 0, 100 + i * 0.01, True, 10.0, rng.uniform(0, 0.5),
                         predicted=5) for i in range(n - n // 2)]
    held = sum(c.num_blocks for c in running)
    return Snapshot(running, waiting, 4 * held, BLOCK, 2, Limits(n, 8192, True), 0.05)


def _cost() -> OnlineCostModel:
    """The simulator's cost model (OPT-13B on an A100) for the policies that price iterations, in
    the wrapper the scheduler hands them (never refitted here)."""
    return OnlineCostModel(OPT_13B_A100, refit_every=1 << 60)


def queue_plan_ms(policy: str, waiting: int, steps: int, seed: int = 0) -> dict:
    """Median and p90 ms of a device's per-step planning (``DeviceActor.plan``: the snapshot of
    every request, the policy, the plan applied) on the simulator's OPT-13B device (12,000 KV
    tokens), its queue topped up to ``waiting`` BE requests (a shared 256-token start, 32-600
    tokens of their own, lengths predicted) before each step, with a chat arriving now and then;
    server defaults (64 sequences, 2,048 tokens a step, prefix caching)."""
    rng = random.Random(seed)
    geometry = PoolGeometry(2 * 12_000 // BLOCK, BLOCK, hidden_blocks=1)
    cfg = SchedConfig(max_num_seqs=64, max_num_batched_tokens=2048, policy=policy, rho=OPT_13B_A100_RHO,
                      rt_budget_s=0.2, prefix_caching=True)
    setup = SimSetup(OPT_13B_A100, geometry, cfg, 2048, slo_ttft_s=1.0, slo_tbt_s=0.2, rho=OPT_13B_A100_RHO,
                     block_bytes=(40 * 16 * 5120 * 2, 40 * 16 * 5120), side_link=True)
    clock = SimClock()
    device = SimDevice("sim0", geometry, setup.cost, clock, rho=setup.rho, block_bytes=setup.block_bytes,
                       side_link=True)
    sched = Scheduler(cfg, [device], eos_ids=(), max_model_len=2048, clock=clock, cost=policy_cost(setup))
    actor = sched.actors[0]
    shared = [rng.randrange(1000, 30000) for _ in range(256)]
    times: list[float] = []
    plan = actor.plan

    def timed():
        t0 = time.perf_counter()
        got = plan()
        times.append(time.perf_counter() - t0)
        return got
    actor.plan = timed
    for i in range(40 + steps):                    # the first 40 steps fill the device
        while len(actor.waiting) < waiting:
            _arrive(sched, rng, shared, f"be{i}-{len(actor.waiting)}", clock.t, rt=False)
        if rng.random() < 0.3:
            _arrive(sched, rng, shared, f"rt{i}", clock.t, rt=True)
        if i == 40:
            times.clear()
        sched.step()
    return {"policy": policy, "waiting": waiting, "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))]}


def _arrive(sched: Scheduler, rng: random.Random, shared: list[int], rid: str, now: float, rt: bool) -> None:
    prompt = ([] if rt else shared) + [rng.randrange(1000, 30000) for _ in range(rng.randint(32, 600))]
    max_tokens = rng.randint(16, 400)
    sched.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                      ServiceClass.RT if rt else ServiceClass.BE, arrival_time=now,
                      predicted_len=rng.randint(16, 300) if rt else max_tokens,
                      slo_ttft_s=1.0 if rt else None, slo_tbt_s=0.2 if rt else None))


def run(args) -> None:
    queued = [queue_plan_ms(p, w, args.steps) for w in args.waiting for p in ("fcfs", "bros", "alise", "tandem")]
    print("| policy | waiting | plan ms, median | p90 |\n|---|---|---|---|")
    for r in queued:
        print(f"| {r['policy']} | {r['waiting']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")
    rows = []
    policies = {"aptserve": lambda n: AptServe(rho=1e-4), "aptserve-kv-only": lambda n: AptServe(1e-4, hybrid=False),
                "fcfs": lambda n: fcfs, "bros": lambda n: Bros(_cost(), n), "alise": lambda n: Alise(_cost()),
                "tandem": lambda n: Tandem(_cost(), n, rho=OPT_13B_A100_RHO)}
    for n, kind in ((n, k) for n in args.candidates for k in ("prefill", "decode", "crowded")):
        snaps = [crowded(n, s) if kind == "crowded" else snapshot(n, s, kind) for s in range(args.repeats)]
        for name, make in policies.items():
            policy, times = make(n), []
            for s in snaps:
                t0 = time.perf_counter()
                policy(s)
                times.append(time.perf_counter() - t0)
            rows.append({"policy": name, "candidates": n, "iteration": kind, "median_ms": 1e3 * statistics.median(times),
                         "p90_ms": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))]})
    print("| policy | candidates | snapshot | median ms | p90 ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['candidates']} | {r['iteration']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} |")
    save_json(args.out, {"snapshots": rows, "queued": queued})
