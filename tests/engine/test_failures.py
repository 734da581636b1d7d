"""Failures are never silent and never lose work: worker deaths, step errors, scheduling-loop
bugs, and devices that step independently of each other."""
import json
import os
import signal
import threading

import pytest

from tandem.engine.messages import DeviceError
from tandem.sched import runtime
from tandem import LLM, SamplingParams
from tests.conftest import assert_pool_free, hf_greedy, mixed_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(runtime, "RESTART_BACKOFF_S", 0.01)


def kill_on_calls(handle, calls: set[int]) -> list[int]:
    """SIGKILL the worker behind ``handle`` just before its n-th collect() for n in ``calls``
    (counted over every worker the handle starts); the returned list records the kills."""
    real, n, killed = handle.collect, [0], []

    def collect():
        n[0] += 1
        if n[0] in calls:
            os.kill(handle.proc.pid, signal.SIGKILL)
            handle.proc.join()
            killed.append(n[0])
        return real()
    handle.collect = collect
    return killed


def generate_bounded(llm, prompts, max_tokens: int) -> list[str]:
    """Greedy generate on a thread of its own; fails (instead of hanging) unless every request
    ended within 60 s. The DeviceError messages it raised."""
    raised = []

    def run():
        try:
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
        except DeviceError as e:
            raised.append(str(e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a request never ended"
    return raised


@pytest.mark.parametrize("pool", ["blocks", "bidirectional, odd"])
def test_killed_worker_is_restarted_and_its_requests_finish_token_exact(pool, tiny_llama, caplog):
    """Also with bidirectional blocks on an odd block count, whose last block the pool leaves out
    of its geometry: the new worker's pool is the same pool. The log names the signal and what
    usually sends it."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    prompts = mixed_prompts(8, 512, seed=11)
    opts = dict(kv_cache_bytes=1 << 22) if pool == "blocks" else \
        dict(kv_cache_bytes=81 * spec.num_layers * 8 * spec.unit * 4, block_size=8, bidirectional_blocks=True)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", threads_per_worker=1, **opts) as llm:
        handle = llm._workers[0]
        first_pid = handle.proc.pid
        killed = kill_on_calls(handle, {3})
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, **GREEDY))
        assert killed == [3], "the worker was meant to die mid-generation"
        assert handle.proc.pid != first_pid and llm.runtime.threads[0].restarts == 1
        assert "worker process killed by SIGKILL (most often the kernel's out-of-memory killer" in caplog.text
        assert llm.runtime.serving()
        assert_pool_free(llm)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 30)


def test_a_restarted_worker_keeps_its_pool_size_when_its_budget_changed(tiny_llama):
    """A pool sized by a share of the GPU's free memory comes out another size after a crash
    (the free memory changed meanwhile). The new worker must take as many blocks as before: the
    device's books and the placement assume them. Here the budget is changed by hand before the
    worker is killed."""
    from dataclasses import replace
    prompts = mixed_prompts(6, 512, seed=12)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        handle = llm._workers[0]
        blocks = handle.pool_info.num_blocks
        handle.cfg = replace(handle.cfg, kv_cache_bytes=1 << 21)       # half the memory is free now
        killed = kill_on_calls(handle, {3})
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
        assert killed == [3] and llm.runtime.threads[0].restarts == 1
        assert handle.pool_info.num_blocks == blocks and llm.runtime.serving()
        assert_pool_free(llm)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 20)


def test_arrivals_wait_out_a_restart_instead_of_being_refused(tiny_llama):
    """While its only device is marked restarting (not serving, not dead), a new request is
    dispatched to it and served, rather than refused with "no device can serve"."""
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        thread = llm.start_runtime().threads[0]
        thread.restarting = True
        try:
            assert not llm.runtime.serving() and llm.runtime.accepting()
            out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        finally:
            thread.restarting = False
        assert_pool_free(llm)
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 6)[0]


def test_arrivals_go_to_a_serving_device_while_another_restarts(tiny_llama):
    """Two devices, one restarting its worker: whatever the placement would pick, every arrival
    runs on the serving one, rather than waiting out the restart; outputs match HF."""
    prompts = mixed_prompts(6, 512, seed=21)
    with LLM(str(tiny_llama), "cpu:2", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1,
             placement="lb") as llm:
        restarting = llm.start_runtime().threads[1]
        restarting.restarting = True
        try:
            out = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
        finally:
            restarting.restarting = False
        ran = [sum(t.actor.tokens_by_phase.values()) for t in llm.runtime.threads]
        assert_pool_free(llm)
    assert ran[0] > 0 and ran[1] == 0, ran
    assert [o.token_ids for o in out] == hf_greedy(tiny_llama, prompts, 6)


def test_a_device_down_for_good_leaves_the_placement_and_the_others_serve(tiny_llama):
    """Three devices under lb, the middle one down for good: the placement takes it out of its
    books at the first arrival it would have got, and every request runs on the other two (the
    placement's picks, not the dispatcher's: none is sent elsewhere), outputs matching HF."""
    prompts = mixed_prompts(6, 512, seed=23)
    with LLM(str(tiny_llama), "cpu:3", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1,
             placement="lb") as llm:
        rt = llm.start_runtime()
        rt.threads[1].actor.dead = "down for the test"
        placed = []
        real_arrive = rt.rebalancer.arrive
        rt.rebalancer.arrive = lambda *a: placed.append(real_arrive(*a)) or placed[-1]
        out = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
        ran = [sum(t.actor.tokens_by_phase.values()) for t in rt.threads]
        assert rt.rebalancer.cluster.down == {1} and placed.count(1) == 1, placed
        assert_pool_free(llm)
    assert ran[0] > 0 and ran[1] == 0 and ran[2] > 0, ran
    assert [o.token_ids for o in out] == hf_greedy(tiny_llama, prompts, 6)


def test_a_request_that_keeps_killing_its_worker_fails_alone(tiny_llama):
    """After MAX_REQUEST_CRASHES restarts the requests on board fail (they may be the cause);
    the device comes back and serves the next request exactly."""
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        killed = kill_on_calls(llm._workers[0], {3, 4, 5})
        with pytest.raises(DeviceError, match="failed 3 times"):
            llm.generate(mixed_prompts(2, 512, seed=12), SamplingParams(max_tokens=30, **GREEDY))
        assert killed == [3, 4, 5]
        assert llm.runtime.serving()
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, **GREEDY))
        assert_pool_free(llm)
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 8)[0]


def test_a_policy_that_raises_fails_requests_then_marks_the_device_down(tiny_llama):
    def broken(snapshot):
        raise RuntimeError("policy bug")
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        llm.scheduler.policy = broken
        for _ in range(runtime.MAX_LOOP_FAILURES):
            with pytest.raises(DeviceError, match="internal error in the scheduler"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
            assert_pool_free(llm)
        assert not llm.runtime.serving()
        with pytest.raises(DeviceError, match="no device can serve"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))


def test_a_step_error_fails_that_step_and_the_device_serves_on(tiny_llama):
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        handle = llm._workers[0]
        real, n = handle.collect, [0]

        def collect():
            out = real()
            n[0] += 1
            if n[0] == 2:
                out.error = "Traceback ...\nRuntimeError: injected"
            return out
        handle.collect = collect
        with pytest.raises(DeviceError, match="internal error while generating"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        assert_pool_free(llm)
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 6)[0]


def test_devices_step_without_waiting_for_each_other(tiny_llama):
    """Device 0 cannot finish its first step until device 1 has finished all its requests: in
    lock-step that would never happen (the wait times out and the test fails)."""
    with LLM(str(tiny_llama), "cpu:2", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        slow = llm._workers[0]
        other_done = threading.Event()
        real = slow.collect
        waited = []

        def collect():
            if not waited:
                waited.append(other_done.wait(timeout=60))
            return real()
        slow.collect = collect
        fast = llm.scheduler.actors[1]
        account = fast.account

        def watched(pending, out):            # device 1's thread, after each of its steps
            updates = account(pending, out)
            if any(u.finish_reason is not None for u in updates) and not fast.has_work():
                other_done.set()
            return updates
        fast.account = watched
        outs = llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=20, **GREEDY))
        assert waited == [True], "device 0 was held until device 1 had finished"
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, [[5, 6, 7], [8, 9, 10]], 20)


def test_messages_behind_one_that_fails_are_still_handled(tiny_llama, monkeypatch):
    """A message whose handling raises (the loop's recovery then runs) must not take the
    arrivals queued behind it in the same turn down with it: they are served, token-exact."""
    import time
    from tandem.sched.request import Request
    prompts = mixed_prompts(3, 512, seed=13)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        rt = llm.start_runtime()
        thread = rt.threads[0]
        real = thread._handle

        def handle(msg):
            if isinstance(msg, runtime.Abort) and msg.req_id == "boom":
                raise RuntimeError("a message the loop cannot handle")
            return real(msg)
        monkeypatch.setattr(thread, "_handle", handle)
        sp = SamplingParams(max_tokens=8, **GREEDY)
        states = [llm.scheduler.new_state(Request(f"q{i}", p, sp, arrival_time=time.monotonic()))
                  for i, p in enumerate(prompts)]
        ended = {}
        done = threading.Event()

        def sink(ups):
            for u in ups:
                if u.finish_reason is not None:
                    ended[u.req_id] = u.finish_reason.value
                    if len(ended) == len(states):
                        done.set()
        llm.subscribe([st.req_id for st in states], sink)
        with thread._wake:                      # one turn of the loop reads all of these
            thread.post(runtime.Abort("boom"))
            for st in states:
                rt.add(st, device=0)
        assert done.wait(60), f"requests queued behind the failing message were lost: {ended}"
        assert ended == {st.req_id: "length" for st in states}
        assert [st.output_token_ids for st in states] == hf_greedy(tiny_llama, prompts, 8)
        assert_pool_free(llm)


def test_a_recovery_that_fails_marks_the_device_down_and_ends_its_requests(tiny_llama, monkeypatch):
    """The policy raises, and so does failing its requests: the requests still end (with an
    error), the device is reported down, and later arrivals are refused, never left waiting."""
    def broken(snapshot):
        raise RuntimeError("policy bug")

    def also_broken(why):
        raise RuntimeError("books broken too")
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        llm.scheduler.policy = broken
        monkeypatch.setattr(llm.scheduler.actors[0], "fail_all", also_broken)
        raised = generate_bounded(llm, [[5, 6, 7], [8, 9]], 4)
        assert raised and "recovery failed" in raised[0]
        assert not llm.runtime.serving() and llm.runtime.threads[0]._thread.is_alive()
        with pytest.raises(DeviceError, match="no device can serve"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))


def test_books_broken_for_one_request_still_end_every_request(tiny_llama):
    """A policy bug leaves one request's books inconsistent (preempted twice in one plan), so
    failing that request raises too: every request still ends, none hangs, and the device's
    fresh books serve the next request token-exact."""
    from tandem.sched.policy import Plan, fcfs
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", policy="fcfs", kv_cache_bytes=1 << 22,
             threads_per_worker=1) as llm:
        plans = [0]

        def buggy(snap):
            plans[0] += 1
            if plans[0] == 4 and snap.running:
                r = snap.running[-1].req_id
                return Plan(preempted=[r, r])
            return fcfs(snap)
        llm.scheduler.policy = buggy
        raised = generate_bounded(llm, [[5, 6, 7], [8, 9, 10], [11, 12, 13]], 20)
        assert raised and "3 request(s) failed" in raised[0] and "internal error in the scheduler" in raised[0]
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        assert_pool_free(llm)
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 6)[0]


def test_a_request_whose_token_handling_raises_fails_alone(tiny_llama, monkeypatch):
    """A bug in one request's stop or text handling fails that request only: the others on
    the device finish with HF's greedy tokens."""
    from tandem.sched.actor import DeviceActor
    prompts = mixed_prompts(4, 512, seed=21)
    real = DeviceActor._token_update

    def token_update(self, st, tok):
        if st.req_id.endswith("-1") and len(st.output_token_ids) == 3:
            raise RuntimeError("a stop-string bug")
        return real(self, st, tok)
    monkeypatch.setattr(DeviceActor, "_token_update", token_update)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        import time
        from tandem.sched.request import FinishReason, Request
        now = time.monotonic()
        states = [llm.scheduler.new_state(Request(f"q-{i}", p, SamplingParams(max_tokens=10, **GREEDY),
                                                  arrival_time=now)) for i, p in enumerate(prompts)]
        llm._run(states, None)
        assert_pool_free(llm)
    ref = hf_greedy(tiny_llama, prompts, 10)
    assert states[1].finish_reason is FinishReason.ERROR and "internal error" in states[1].error
    for i in (0, 2, 3):
        assert states[i].finish_reason is FinishReason.LENGTH and states[i].output_token_ids == ref[i]


def test_a_step_that_fails_midway_loses_no_swapped_request(tiny_llama):
    """The worker raises in the middle of a step that swaps caches out, before it has copied
    them: the step's scheduled requests fail, and the preempted requests (whose caches the
    books said were in the host pool) recompute and still give HF's greedy tokens."""
    import time
    from tandem.engine.messages import Offload
    from tandem.engine.models.loader import load_spec
    from tandem.sched.request import FinishReason, Request
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    prompts = mixed_prompts(18, 512, seed=11)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", block_size=8, kv_cache_bytes=24 * block_bytes,
             max_num_batched_tokens=64, threads_per_worker=1, preemption_mode="swap",
             swap_dtype="auto", tandem_off=("lengths",)) as llm:
        handle = llm._workers[0]
        real, failed_step = handle.submit, {}

        def submit(inp):
            if inp.offloads and not failed_step:         # the worker raises before any copy
                failed_step.update(ran={s.req_id for s in inp.scheduled},
                                   swapped={o.req_id for o in inp.offloads})
                inp.offloads.insert(0, Offload("no-such-request", 1, False))
            real(inp)
        handle.submit = submit
        now = time.monotonic()
        states = [llm.scheduler.new_state(Request(f"r{i}", p, SamplingParams(max_tokens=24, **GREEDY),
                                                  arrival_time=now))
                  for i, p in enumerate(prompts)]
        llm._run(states, None)
        assert_pool_free(llm)
    assert failed_step["swapped"] - failed_step["ran"], "no request was being swapped out"
    ref = hf_greedy(tiny_llama, prompts, 24)
    for st, r in zip(states, ref, strict=True):
        if st.req_id in failed_step["ran"]:
            assert st.finish_reason is FinishReason.ERROR and "internal error" in st.error
        else:
            assert st.finish_reason is FinishReason.LENGTH, (st.req_id, st.error)
            assert st.output_token_ids == r, f"{st.req_id} differs"


def test_ctrl_c_in_the_terminal_leaves_the_worker_to_its_parent(tiny_llama):
    """SIGINT goes to the whole process group: a worker that died of it (KeyboardInterrupt, with
    its own traceback) mid-step left the server to restart it while shutting down. It ignores
    SIGINT and keeps serving until its parent stops it."""
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        handle = llm._workers[0]
        os.kill(handle.proc.pid, signal.SIGINT)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        assert handle.proc.is_alive() and llm.runtime.threads[0].restarts == 0
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 6)[0]
    assert not handle.proc.is_alive()


def test_a_worker_not_ready_in_time_is_stopped_and_its_start_fails(tiny_llama):
    """A start that hangs (a restart behind a stuck lock, a model load that never returns) must
    not hold the device for ever: past the deadline the worker is killed and the start fails."""
    from tandem.engine.kernels import _build_dir
    from tandem.engine.models.loader import load_spec
    from tandem.engine.worker import WorkerConfig, WorkerHandle
    from tandem.paths import exclusive
    spec = load_spec(tiny_llama)
    with exclusive(_build_dir() / "load.flock"):         # the kernels' load waits for this lock
        h = WorkerHandle("cpu#0", WorkerConfig(str(tiny_llama), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1,
                                               False, True))
        try:
            with pytest.raises(DeviceError, match="not ready in time"):
                h.wait_ready(timeout_s=2.0)
            assert not h.proc.is_alive()
        finally:
            h.shutdown()


def test_a_worker_that_dies_while_idle_is_started_again_at_once(tiny_llama, caplog):
    """Killed between requests, the worker is replaced with no request to find it gone (the
    next one used to wait out the restart, and /health said ok meanwhile); the next request is
    served as before, and the log names the signal. The wait for the restart is a guard
    against a hang, not a speed goal."""
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
        handle, thread = llm._workers[0], llm.runtime.threads[0]
        first, real, restarted = handle.proc.pid, handle.restart, threading.Event()

        def restart():
            info = real()
            restarted.set()
            return info
        handle.restart = restart
        os.kill(first, signal.SIGKILL)
        assert restarted.wait(300), "no restart without a request"
        assert handle.proc.pid != first
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))
        # read after a request was served: the thread marks the restart done once it returns
        assert thread.restarts == 1 and llm.runtime.serving()
    assert "worker process killed by SIGKILL (most often" in caplog.text     # idle, or found at the next send
    assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 6)[0]


def test_a_worker_is_started_through_a_pipe_that_cannot_fill(tiny_chat_model, monkeypatch):
    """What a spawn writes to its child (the pickled config) must fit the pipe's buffer (64 KiB
    on Linux): the parent writes it while the pipe's read end is still open on its own side, so
    a child that died before reading it (a worker killed again just after a restart began) left
    the write, and the device, blocked for ever. The tokenizer's JSON (1.5 MB for SmolLM2's)
    goes in a file the worker reads."""
    import pickle
    import tandem.sched.llm as llm_module
    seen = []

    def record(name, cfg):
        seen.append(cfg)
        raise RuntimeError("recorded")
    monkeypatch.setattr(llm_module, "WorkerHandle", record)
    with pytest.raises(RuntimeError, match="recorded"):
        LLM(str(tiny_chat_model), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1)
    (cfg,) = seen
    assert len(pickle.dumps(cfg)) < 64 << 10
    with open(cfg.tokenizer_file, encoding="utf-8") as f:
        tokenizer = f.read()
    from transformers import AutoTokenizer
    assert json.loads(tokenizer)["model"] == json.loads(
        AutoTokenizer.from_pretrained(tiny_chat_model).backend_tokenizer.to_str())["model"]


def test_a_hung_worker_is_stopped_and_its_requests_finish_token_exact(tiny_llama):
    """A worker that stops answering mid-generation (SIGSTOP: a hang, a deadlock) used to hold its
    requests for ever while /health said ok. Past the step deadline it is killed and restarted,
    and the requests end as HF's greedy ones. While it is stopped, its steps' deadline is set to
    have passed already (no wait of any length): a step it answered just before the stop is
    still read, the next one is late. A slow machine's healthy steps keep the usual deadline."""
    from tandem.engine import worker as worker_module
    prompts = mixed_prompts(4, 512, seed=13)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as llm:
        handle = llm._workers[0]
        hung, real, n = handle.proc, handle.collect, [0]

        def collect():
            n[0] += 1
            if n[0] < 3 or handle.proc is not hung:         # before the hang, and once restarted
                return real()
            if n[0] == 3:
                os.kill(hung.pid, signal.SIGSTOP)
            usual, worker_module.STEP_TIMEOUT_S = worker_module.STEP_TIMEOUT_S, 0.0
            try:
                return real()
            finally:
                worker_module.STEP_TIMEOUT_S = usual
        handle.collect = collect
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        assert llm.runtime.threads[0].restarts == 1 and handle.proc is not hung and not hung.is_alive()
        assert_pool_free(llm)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 12)


def test_workers_that_would_not_fit_in_memory_are_warned_of(tiny_llama, monkeypatch, caplog):
    """Two CPU workers, each about its weights, its pool and the process: the start warns when
    that is more than the machine has available, and says nothing when it fits."""
    import tandem.sched.llm as llm_module
    from tandem.engine.worker import WORKER_OVERHEAD_BYTES
    pool = 1 << 22
    need = 2 * (WORKER_OVERHEAD_BYTES + pool)          # the tiny model's weights are a few hundred KB
    for available, warned in ((need, True), (need + (64 << 20), False)):
        monkeypatch.setattr(llm_module, "available_memory", lambda: available)
        caplog.clear()
        with LLM(str(tiny_llama), "cpu:2", dtype="float32", threads_per_worker=1, kv_cache_bytes=pool) as llm:
            assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
        assert ("2 CPU worker(s) need about" in caplog.text) is warned, caplog.text


def test_workers_that_could_not_fit_in_all_of_the_memory_are_refused_before_they_start(tiny_llama, monkeypatch):
    """Past the machine's memory and swap a worker's pool cannot be allocated: the LLM says so,
    naming kv_cache_bytes, before any worker loads (before, the worker failed with a traceback)."""
    import tandem.sched.llm as llm_module
    from tandem.engine.worker import WORKER_OVERHEAD_BYTES
    pool = 1 << 22
    monkeypatch.setattr(llm_module, "total_memory", lambda: 2 * WORKER_OVERHEAD_BYTES)
    monkeypatch.setattr(llm_module, "WorkerHandle", None)       # a worker started: a TypeError, not this
    with pytest.raises(ValueError, match="kv_cache_bytes: 2 CPU worker.s. would need about"):
        LLM(str(tiny_llama), "cpu:2", dtype="float32", threads_per_worker=1, kv_cache_bytes=pool)


def test_the_start_warns_of_what_the_setup_will_refuse(tiny_llama, tiny_chat_model, caplog):
    """A checkpoint without a tokenizer serves token ids only, and a pool that holds less of one
    request's context than max_model_len refuses the longer ones: both said at start, neither
    where they do not hold. The tiny pool: 16 blocks of 16 rows, K and V, hold 128 tokens."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    block = spec.num_layers * 16 * spec.unit * 4
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", threads_per_worker=1, kv_cache_bytes=16 * block):
        pass
    assert "has no tokenizer" in caplog.text
    assert "the KV pool holds 128 tokens of one request's context, fewer than max_model_len 512" in caplog.text
    caplog.clear()
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", threads_per_worker=1, kv_cache_bytes=1 << 22):
        pass
    assert "has no tokenizer" not in caplog.text and "the KV pool holds" not in caplog.text
