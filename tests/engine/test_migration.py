"""A request migrated between two workers mid-generation continues exactly: the same greedy
tokens as HF transformers, the same seeded samples as a run that never moved, each token once."""
import itertools
import os
import threading
import time

import pytest
from prometheus_client import generate_latest

from tandem import LLM, SamplingParams
from tandem.sched.request import FinishReason, Request, Status, Transfer
from tests.conftest import assert_pool_free, hf_greedy, mixed_prompts

# two devices: two CPU workers, or on a GPU machine e.g. "cuda:0,0" (two workers sharing a GPU:
# KV moves through CUDA IPC handles); bench/gpu_run.sh sets it
TWO = os.environ.get("TANDEM_TEST_TWO_DEVICES", "cpu:2")
MAX_NEW = 20
MOVE_AFTER = 7         # tokens streamed before the migration is asked for
POOL = 16 << 20        # bytes per device (thousands of blocks): the suite checks every block after every step


def run(llm, prompt, sp, move: Transfer | None, rid: str, adapter=None) -> tuple[list[int], object]:
    """Generate on device 0 (``adapter``: with this LoRA adapter); after MOVE_AFTER tokens ask
    for a migration to device 1. Returns every token the stream saw, in order, and the request's
    final state."""
    rt = llm.start_runtime()
    st = llm.scheduler.new_state(Request(rid, prompt, sp, arrival_time=time.monotonic(), adapter=adapter))
    seen, done = [], threading.Event()

    def sink(ups):
        for u in ups:
            seen.extend(u.new_token_ids)
            if move is not None and len(seen) == MOVE_AFTER and u.finish_reason is None:
                rt.migrate(rid, 0, 1, move, "test")
            if u.finish_reason is not None:
                done.set()
    llm.subscribe([rid], sink)
    rt.add(st, device=0)
    assert done.wait(120), "generation did not finish"
    llm.unsubscribe([rid])
    return seen, st


def wait_pool_free(llm, timeout=10.0):
    """The source frees a migrated cache when the destination confirms: asynchronously."""
    t0 = time.monotonic()
    while any(a.pool.num_free != a.pool.geometry.num_blocks for a in llm.scheduler.actors):
        assert time.monotonic() - t0 < timeout, "a migrated request's blocks were never freed"
        time.sleep(0.05)
    assert_pool_free(llm)


def migrated_like_hf(llm, model_dir, kinds, n=2):
    """Each kind in turn: n prompts migrated mid-generation give HF's greedy tokens."""
    prompts = mixed_prompts(n, 512, seed=11, lo=20, hi=40)
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for kind in kinds:
        for i, p in enumerate(prompts):
            rid = f"mig-{kind.value}-{i}"
            before = llm.scheduler.actors[1].moves_total
            seen, st = run(llm, p, greedy, kind, rid)
            assert st.device == 1, "the request never reached the other device"
            assert llm.scheduler.actors[1].moves_total == before + 1, "this request's move was not recorded"
            moves = [m for m in llm.scheduler.actors[1].moves if m.src == 0]
            assert moves and moves[-1].kind is kind, f"expected a {kind.value} migration, got {moves}"
            assert moves[-1].tokens >= len(p) + MOVE_AFTER
            assert (moves[-1].cache_bytes > 0) == (kind is Transfer.KV)
            assert seen == ref[i], f"prompt {i}: migrated as {kind.value}, tokens differ from HF"
        wait_pool_free(llm)


def test_a_move_is_counted_once_though_its_request_ends_before_a_token_where_it_went(llama2):
    """Cancelled right after its move was ordered: it leaves device 0, reaches device 1 and ends
    there without a token. /metrics counted a migration only at its next token, so this one went
    uncounted while the log said "migrating"; it counts each move as it leaves. (The pause
    histogram keeps only moves that resumed.)"""
    from tandem.server.metrics import Metrics
    from tests.server.test_load import metric
    m = Metrics("m")
    rt = llama2.start_runtime()
    for a in llama2.scheduler.actors:        # what earlier moves left in the actors' totals
        m.engine_step(a)
    before = generate_latest(m.registry).decode()
    rid, done, ended = "moved-then-cancelled", threading.Event(), []

    def sink(ups):
        for u in ups:
            if u.new_token_ids and not ended and u.finish_reason is None:
                ended.append("asked")
                rt.migrate(rid, 0, 1, Transfer.KV, "test")      # both wait in device 0's inbox, in order
                rt.abort(rid)
            if u.finish_reason is not None:
                ended.append(u.finish_reason)
                done.set()
    llama2.subscribe([rid], sink)
    st = llama2.scheduler.new_state(Request(rid, list(range(5, 30)), SamplingParams(max_tokens=MAX_NEW,
                                            temperature=0, ignore_eos=True), arrival_time=time.monotonic()))
    arrived = llama2.scheduler.actors[1].moves_total
    rt.add(st, device=0)
    assert done.wait(120), "the request never ended"
    llama2.unsubscribe([rid])
    wait_pool_free(llama2)
    assert st.device == 1 and ended[-1] is FinishReason.ABORT, (st.device, ended)
    assert llama2.scheduler.actors[1].moves_total == arrived, "it was meant to end before a token there"
    for a in llama2.scheduler.actors:
        m.engine_step(a)
    after = generate_latest(m.registry).decode()
    assert metric(after, "tandem:migrations_total") - metric(before, "tandem:migrations_total") == 1
    pauses = "tandem:migration_pause_seconds_count"
    assert metric(after, pauses) == metric(before, pauses)


@pytest.fixture(scope="module")
def llama2(tiny_llama):
    with LLM(str(tiny_llama), TWO, dtype="float32", block_size=8, threads_per_worker=1, kv_cache_bytes=POOL) as llm:
        yield llm


def test_migrated_request_matches_hf(llama2, tiny_llama):
    migrated_like_hf(llama2, tiny_llama, [Transfer.KV, Transfer.TOKEN])


def next_turns_find_their_first(llm, model_dir) -> None:
    """Two chats' first turns (40-token prompts, 8 tokens each) go to different devices; their
    second turns (the first turn, its reply, 10 more tokens), sent in the other order, each go
    back to the device whose prefix cache holds their first turn, where placement by load alone
    would send each to the other one. Each reuses the 5 whole blocks of 8 its first turn
    computed (prompt and reply but the reply's last token: 47 tokens) and still matches HF."""
    firsts = mixed_prompts(2, 512, seed=31, lo=40, hi=41)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    routed = sum(a.prefix_routed for a in llm.scheduler.actors)
    outs = llm.generate(firsts, greedy)
    extra = mixed_prompts(2, 512, seed=32, lo=10, hi=11)
    seconds = [f + o.token_ids + e for f, o, e in zip(firsts, outs, extra)]
    again = llm.generate(seconds[::-1], greedy)[::-1]
    wait_pool_free(llm)
    assert [o.num_cached_tokens for o in again] == [(40 + 8 - 1) // 8 * 8] * 2
    assert sum(a.prefix_routed for a in llm.scheduler.actors) == routed + 2
    assert [o.token_ids for o in outs + again] == hf_greedy(model_dir, firsts + seconds, 8)


def test_a_chats_next_turn_goes_to_the_device_holding_its_first(llama2, tiny_llama):
    next_turns_find_their_first(llama2, tiny_llama)       # lb: the placement's books


def test_static_placement_routes_next_turns_by_cache_too(tiny_llama):
    with LLM(str(tiny_llama), TWO, dtype="float32", policy="fcfs", block_size=8, threads_per_worker=1,
             placement="static", kv_cache_bytes=POOL) as llm:
        next_turns_find_their_first(llm, tiny_llama)      # the dispatcher: queue lengths


def test_hidden_cache_migrates_as_kv(tiny_opt):
    """A hidden cache (m rows per token, multi-head model) moves by the same export and import."""
    with LLM(str(tiny_opt), TWO, dtype="float32", policy="fcfs", block_size=8, threads_per_worker=1, cache_type="hidden",
             kv_cache_bytes=POOL) as llm:
        migrated_like_hf(llm, tiny_opt, [Transfer.KV, Transfer.TOKEN], n=1)


@pytest.mark.parametrize("kind", [Transfer.KV, Transfer.TOKEN])
def test_seeded_sampling_survives_migration(kind, llama2):
    prompt = mixed_prompts(1, 512, seed=5, lo=30, hi=31)[0]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    still, _ = run(llama2, prompt, sp, None, f"stay-{kind.value}")
    moved, st = run(llama2, prompt, sp, kind, f"move-{kind.value}")
    assert st.device == 1
    wait_pool_free(llama2)
    assert len(set(still)) > 3, "sampling at temperature 1 should not be near-greedy"
    assert moved == still


def test_cancelled_while_moving_ends(llama2):
    """A request cancelled as it migrates ends on the device it reaches; nothing leaks."""
    prompt = mixed_prompts(1, 512, seed=9, lo=30, hi=31)[0]
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    llm = llama2
    rt = llm.start_runtime()
    st = llm.scheduler.new_state(Request("c", prompt, sp, arrival_time=time.monotonic()))
    ended, done = [], threading.Event()

    def sink(ups):
        for u in ups:
            if u.new_token_ids and len(st.output_token_ids) == 3:
                rt.migrate("c", 0, 1, Transfer.KV)
                rt.abort("c")
            if u.finish_reason is not None:
                ended.append(u.finish_reason)
                done.set()
    llm.subscribe(["c"], sink)
    rt.add(st, device=0)
    assert done.wait(60)
    wait_pool_free(llm)
    assert [r.value for r in ended] == ["abort"]
    assert st.device == 1, "the abort was meant to meet the request on its way or at its destination"
    assert len(st.output_token_ids) < 400


@pytest.mark.parametrize("placement", ["mell", "lb"])
def test_rebalancer_migrations_keep_outputs_exact(placement, tiny_llama):
    """Requests that outgrow a small pool are migrated by the rebalancer (its epochs every 50 ms);
    every output still equals HF's greedy tokens, and nothing leaks. How many moves a run makes
    depends on how the requests' growth meets the epochs (Mell often makes just one here), so
    the same batch runs again, up to three times, until one run has migrated; every run's
    outputs are checked."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    prompts = mixed_prompts(8, 512, seed=21, lo=24, hi=40)
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = hf_greedy(tiny_llama, prompts, 48)
    with LLM(str(tiny_llama), TWO, dtype="float32", policy="fcfs", block_size=8, kv_cache_bytes=48 * block_bytes,
             threads_per_worker=1, max_num_batched_tokens=64, placement=placement, rebalance_interval_s=0.05) as llm:
        for _run in range(3):
            outs = llm.generate(prompts, sp)
            wait_pool_free(llm)
            for i, (o, r) in enumerate(zip(outs, want, strict=True)):
                assert o.token_ids == r, f"prompt {i} differs after {placement} migrations"
            moved = [m for a in llm.scheduler.actors for m in a.moves]
            if moved:
                break
    assert moved, f"{placement}: no request was migrated in three runs; the pool was meant to force it"
    assert all(m.pause_s is not None and m.pause_s >= 0 for m in moved)


def exported_after_four_tokens(model_dir, seed: int):
    """A lock-step scheduler on an in-process CPU device, request "x" (a 20-token prompt, 12 to
    generate) four tokens in, and its cache exported: (scheduler, its state, prompt, rows)."""
    import torch
    from tandem.engine.models.loader import load_spec
    from tandem.engine.worker import InProcessDevice, WorkerConfig
    from tandem.sched.scheduler import SchedConfig, Scheduler
    torch.set_num_threads(1)
    spec = load_spec(model_dir)
    dev = InProcessDevice("cpu", WorkerConfig(str(model_dir), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1,
                                              False, False))
    sched = Scheduler(SchedConfig(), [dev], spec.eos_token_ids, spec.max_model_len)
    prompt = mixed_prompts(1, 512, seed=seed, lo=20, hi=21)[0]
    st = sched.add(Request("x", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    while len(st.output_token_ids) < 4:
        sched.step()
    dev.submit(sched.actors[0].export_input("x"))
    return sched, st, prompt, dev.collect().exported["x"]


@pytest.mark.parametrize("lose", ["preempted", "aborted"])
def test_cache_lost_before_its_import_is_sent(lose, tiny_llama):
    """A request that arrives with its cache and is preempted (or cancelled) before the import
    reaches the worker: the worker never hears of it, and a preempted one recomputes exactly."""
    from tandem.sched.policy import Plan, fcfs
    sched, st, prompt, rows = exported_after_four_tokens(tiny_llama, seed=3)
    a = sched.actors[0]
    a.detach("x", keep_cache=True)
    a.release("x")
    assert a.attach(st, rows), "the cache should fit back"
    if lose == "aborted":
        a.abort("x")
    else:
        a.policy = lambda snap: Plan(preempted=["x"])
        sched.step()                                     # the worker raised KeyError here before
        a.policy = fcfs
    while sched.has_unfinished():
        sched.step()
    assert a.pool.num_free == a.pool.geometry.num_blocks
    if lose == "preempted":
        assert st.output_token_ids == hf_greedy(tiny_llama, [prompt], 12)[0]
    else:
        assert st.finish_reason.value == "abort"


@pytest.mark.parametrize("back_as", ["tokens", "cache"])
def test_back_before_the_release_of_its_old_blocks(back_as, tiny_llama):
    """A request leaves with its cache and comes back (moved on again at once, as tokens or with
    a copy) before the release of its old blocks reached this device: those blocks are freed
    first, and it continues as HF does."""
    sched, st, prompt, rows = exported_after_four_tokens(tiny_llama, seed=5)
    a = sched.actors[0]
    a.detach("x", keep_cache=True)                       # left with its cache; no release yet
    if back_as == "tokens":
        st.num_computed, st.status, st.sent_to_device = 0, Status.WAITING, False
        a.attach(st)
    else:
        assert a.attach(st, rows), "the copy should fit beside nothing"
    a.release("x")                                       # the late release changes nothing now
    if back_as == "cache":
        assert a.pool.num_blocks_of("x") == a.pool.geometry.blocks_for(st.num_computed), "its blocks were freed"
    while sched.has_unfinished():
        sched.step()
    a.check_invariants()
    assert a.pool.num_free == a.pool.geometry.num_blocks and not a.leaving
    assert st.output_token_ids == hf_greedy(tiny_llama, [prompt], 12)[0]


def test_no_move_to_a_device_that_is_restarting(llama2, tiny_llama):
    """A migration asked for while its destination restarts is not carried out: the request
    finishes where it is, as HF does, instead of waiting out the restart (or failing with it)."""
    prompt = mixed_prompts(1, 512, seed=17, lo=20, hi=30)[0]
    rt = llama2.start_runtime()
    dst = rt.threads[1]
    before = llama2.scheduler.actors[1].moves_total
    dst.restarting = True
    try:
        seen, st = run(llama2, prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                       Transfer.KV, "to-restarting")
    finally:
        dst.restarting = False
    assert st.device == 0 and llama2.scheduler.actors[1].moves_total == before
    assert seen == hf_greedy(tiny_llama, [prompt], MAX_NEW)[0]
    wait_pool_free(llama2)


def test_placement_packs_to_the_smallest_pool(tiny_llama, monkeypatch):
    """Pools sized by a memory fraction differ (two workers sharing a GPU): the placement packs
    every device to the smallest pool, as the workers report them, never to the first's."""
    from tandem.engine.models.loader import load_spec
    from tandem.sched import llm as llm_module
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    real, made = llm_module.WorkerConfig, []

    def second_gets_half(*args, **kwargs):
        args = list(args)
        if made:
            args[5] //= 2                                   # kv_cache_bytes
        made.append(args[3])
        return real(*args, **kwargs)
    monkeypatch.setattr(llm_module, "WorkerConfig", second_gets_half)
    with LLM(str(tiny_llama), TWO, dtype="float32", policy="fcfs", block_size=8, kv_cache_bytes=256 * block_bytes,
             threads_per_worker=1, placement="mell") as llm:
        big, small = (w.pool_info.num_blocks for w in llm._workers)
        assert len(made) == 2 and small < big
        assert llm.rebalancer.capacity == small


def test_random_moves_cancels_and_a_worker_death_keep_every_output_exact(tiny_llama):
    """Requests arriving over a second on a small pool, moved between the two devices at random
    (as cache or as tokens, every few milliseconds, beside the rebalancer's own moves), two of
    them cancelled, and one worker killed midway: each stream sees its request's tokens once
    each, every request that was not cancelled gives HF's greedy tokens (a cancelled one a
    prefix of them), and no block is left held."""
    import random
    import signal
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    rng = random.Random(4)
    prompts = mixed_prompts(16, 512, seed=31, lo=8, hi=40)
    lengths = [rng.randrange(8, 48) for _ in prompts]
    refs = hf_greedy(tiny_llama, prompts, 48)
    with LLM(str(tiny_llama), TWO, dtype="float32", policy="fcfs", block_size=8, kv_cache_bytes=40 * block_bytes,
             threads_per_worker=1, max_num_batched_tokens=64, placement="lb", rebalance_interval_s=0.05) as llm:
        rt = llm.start_runtime()
        states, seen, ended, twice = {}, {}, {}, []
        lock, done = threading.Lock(), threading.Event()

        def sink(ups):              # on the actors' threads: what it finds is asserted below
            with lock:
                for u in ups:
                    seen[u.req_id].extend(u.new_token_ids)
                    if u.finish_reason is not None:
                        if u.req_id in ended:
                            twice.append(u.req_id)
                        ended[u.req_id] = u.finish_reason.value
                if len(ended) == len(prompts):
                    done.set()

        cancelled, killed, stop = set(), [], threading.Event()
        events = [(25, "cancel"), (40, "kill"), (60, "cancel")]    # at the first tick from then on

        def chaos(rng=random.Random(5)):
            for tick in itertools.count():
                if stop.wait(rng.uniform(0.005, 0.03)):
                    return
                with lock:
                    live = [st for rid, st in states.items() if rid not in ended]
                if not live:
                    continue
                st = rng.choice(live)
                event = events.pop(0)[1] if events and tick >= events[0][0] else None
                if event == "kill":
                    os.kill(llm._workers[1].proc.pid, signal.SIGKILL)
                    killed.append(tick)
                elif event == "cancel":
                    cancelled.add(st.req_id)
                    rt.abort(st.req_id)
                else:
                    rt.migrate(st.req_id, st.device, 1 - st.device, rng.choice([Transfer.KV, Transfer.TOKEN]), "test")
        mover = threading.Thread(target=chaos, daemon=True)
        mover.start()
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            rid = f"chaos-{i}"
            st = llm.scheduler.new_state(Request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                                 arrival_time=time.monotonic()))
            with lock:
                states[rid], seen[rid] = st, []
            llm.subscribe([rid], sink)
            rt.add(st)
            time.sleep(rng.uniform(0, 0.12))
        assert done.wait(120), f"requests never ended: {sorted(set(states) - set(ended))}"
        stop.set()
        mover.join()
        wait_pool_free(llm)
        moves = sum(a.moves_total for a in llm.scheduler.actors)
        # the requests may all end on the other device while the killed one still restarts
        deadline = time.monotonic() + 60
        while rt.threads[1].restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.threads[1].restarts == 1, "the killed worker was meant to be started again"
    assert not twice, f"requests ended twice: {twice}"
    assert killed and moves >= 10, f"the chaos was meant to kill a worker and move requests ({moves} moves)"
    for i, (ref, n) in enumerate(zip(refs, lengths)):
        rid, st = f"chaos-{i}", states[f"chaos-{i}"]
        assert seen[rid] == st.output_token_ids, f"{rid}: the stream saw other tokens than the output"
        if ended[rid] == "abort":
            assert rid in cancelled and st.output_token_ids == ref[:len(st.output_token_ids)]
        else:
            assert ended[rid] == "length" and st.output_token_ids == ref[:n], f"{rid} differs from HF"
