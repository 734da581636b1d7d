"""Start-up profiling of the iteration cost model (SPEC §2.2): a few seconds of dummy steps.

Dummy requests (random prompt ids, EOS ignored) go through the scheduler with FCFS so
the measured steps cover the cost model's features independently: pure prefills of
lengths at powers of two (prefill tokens and prefill attention), then decode batches
of several sizes at short and long contexts (decode count and decode context).
"""
from __future__ import annotations

import random
import time

from tandem.engine.params import SamplingParams
from tandem.sched.cost_model import CostModel, OnlineCostModel, StepShape
from tandem.sched.profile_store import Profile
from tandem.sched.request import Request

# (requests, prompt tokens, output tokens): prefills alone, then decode batches.
# [open choice] On a 2-core AVX2 CPU (SmolLM2 in float32) this takes 25-31 s, close to the 30 s
# a start-up may take. A plan of 15-17 s (the prompts it prefills anyway decoding on, instead of
# the batches of 4 x 512 and 32 x 128 prompt tokens) fitted serving steps as well (mean |error|
# 14.0% vs 13.0%, `python -m bench startup-profile`), but under the default policy its models
# left a quarter fewer batch prompt tokens in each step (13.6-14.2 against 17.9-18.6 per step,
# two runs each of `bench mixed` at 0.25 chats/s; the start-up samples stay in every refit, and
# which of them moved the chunks was not found), so this plan stays.
PLAN = [(1, 32, 1), (1, 128, 1), (1, 512, 1), (1, 1024, 1), (2, 256, 1),
        (1, 64, 8), (8, 64, 8), (4, 512, 8), (32, 128, 8)]
# a quicker plan (about a sixth of PLAN's prompt tokens, 5-6 s there): alise's ranking and the
# rebalancer's re-prefill budget. Its 512-token prompt decodes on, for the context terms: with
# prompts of at most 256 tokens and decodes at short contexts only, its model predicted serving
# steps a third too long or more (mean |error| 36-92%; now 8-16%, `bench startup-profile`)
SHORT_PLAN = [(1, 32, 1), (1, 128, 1), (1, 512, 8), (4, 64, 8), (8, 64, 8)]


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` random prompt ids (past the first few, where special tokens usually sit)."""
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def dummy_request(req_id: str, ids: list[int], max_tokens: int) -> Request:
    """A request that generates exactly ``max_tokens`` tokens greedily (EOS ignored)."""
    return Request(req_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def profile_steps(scheduler, vocab_size: int, seed: int = 0, plan=PLAN) -> list[tuple[StepShape, float]]:
    """Run ``plan`` (shapes that do not fit the pool or context are scaled down): its measured steps."""
    rng = random.Random(seed)
    log = scheduler.step_log = []
    n = 0
    try:
        # the plan's shapes are cut to what one request can hold, so a small pool is profiled too
        room = min(scheduler.max_model_len - 1, scheduler.pool_tokens())
        for reqs, prompt, out in [(1, 8, 2)] + plan:          # the first is a warm-up, not fitted
            out = max(1, min(out, room - 1))
            prompt = max(1, min(prompt, room - out))
            while reqs > 1 and not _fits(scheduler, reqs, prompt + out):
                reqs //= 2
            if not _fits(scheduler, reqs, prompt + out):
                continue
            for _ in range(reqs):
                n += 1
                scheduler.add(dummy_request(f"profile-{n}", random_ids(rng, prompt, vocab_size), out))
            while scheduler.has_unfinished():
                scheduler.step()
            if n == 1:
                log.clear()
    finally:
        scheduler.step_log = None
    return log


def profile_cost(scheduler, vocab_size: int, seed: int = 0, plan=PLAN) -> OnlineCostModel:
    """Run ``plan`` and fit the model on its steps."""
    return fitted(profile_steps(scheduler, vocab_size, seed, plan), scheduler)


def measure(scheduler, vocab_size: int, plan=PLAN, with_rho: bool = False, seed: int = 0) -> Profile:
    """The start-up profile: ``plan``'s steps, and with ``with_rho`` Apt-Serve's ρ from
    profile_rho's paired runs, whose steps (KV and hidden caches) join the samples, so the
    hidden-block coefficient -- ρ, fitted jointly -- is refined online from every measured step."""
    t0 = time.monotonic()
    paired: list = []
    rho = profile_rho(scheduler, vocab_size, seed, samples=paired) if with_rho else None
    samples = profile_steps(scheduler, vocab_size, seed, plan) + paired
    return Profile(samples, time.monotonic() - t0, rho)


def fitted(samples: list[tuple[StepShape, float]], scheduler) -> OnlineCostModel:
    """The online cost model fitted on start-up ``samples``, which it keeps for every refit."""
    return OnlineCostModel(CostModel.fit(samples, scheduler.products()), startup=samples)


def thin_rows(scheduler) -> int:
    """The devices' thin-product threshold (engine.linear.thin_rows_of where a device has one)."""
    return max(d.pool_info.thin_rows for d in scheduler.devices)


def _fits(scheduler, reqs: int, tokens: int) -> bool:
    g = scheduler.queues[0].pool.geometry
    return reqs * g.blocks_for(tokens) <= g.num_blocks


def profile_rho(scheduler, vocab_size: int, seed: int = 0, contexts: tuple[int, ...] = (64, 256, 512),
                batch: int = 4, out: int = 5, samples: list | None = None) -> float:
    """Apt-Serve's ρ (SPEC §1.3): extra seconds per KV block of context when a request keeps a
    hidden cache, measured on the engine itself rather than on a bare matmul.

    The same decode batches run twice, with KV caches and with hidden caches; ρ is the
    least-squares slope, through the origin, of the mean extra decode-step time against the
    batch's size in KV blocks. A few seconds on this CPU for SmolLM2-sized models. Every measured
    step (shape, seconds) is also appended to ``samples`` when given.
    """
    from tandem.engine.messages import CacheType
    rng = random.Random(seed)
    g = scheduler.queues[0].pool.geometry
    if not g.hidden_blocks:
        raise ValueError("rho: this model cannot keep a hidden cache")
    xs, ys = [], []
    log = scheduler.step_log = []
    try:
        for ctx in contexts:
            ctx = max(1, min(ctx, scheduler.max_model_len - out - 1))
            b, need = batch, max(g.blocks_for(ctx + out), g.blocks_for(ctx + out, CacheType.HIDDEN))
            while b > 1 and b * need > g.num_blocks:
                b //= 2
            if b * need > g.num_blocks:
                continue
            prompts = [random_ids(rng, ctx, vocab_size) for _ in range(b)]
            means = {}
            for ct in (CacheType.KV, CacheType.HIDDEN):
                log.clear()
                for i, ids in enumerate(prompts):
                    st = scheduler.add(dummy_request(f"profile-rho-{ct.value}-{ctx}-{i}", ids, out))
                    st.cache_type = ct
                while scheduler.has_unfinished():
                    scheduler.step()
                if samples is not None:
                    samples.extend(log)
                dec = [s for shape, s in log if shape.prefill_tokens == 0 and shape.decode_tokens == b]
                means[ct] = sum(dec) / len(dec) if dec else None
            if means[CacheType.KV] is not None and means[CacheType.HIDDEN] is not None:
                xs.append(b * g.blocks_for(ctx + out // 2))
                ys.append(means[CacheType.HIDDEN] - means[CacheType.KV])
    finally:
        scheduler.step_log = None
    den = sum(x * x for x in xs)
    return max(0.0, sum(x * y for x, y in zip(xs, ys)) / den) if den else 0.0
