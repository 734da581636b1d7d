"""What refusing new chats past capacity reads (server ``--shed-chats-after``): the longest wait
of a chat still without its first token, in its own TTFT targets, checked against hand-computed
values, also while a long step runs; and the rule over devices: refused only while every live
device holds such a chat."""
import threading
from types import SimpleNamespace

from tandem.bench.simulator import SimClock, SimDevice
from tandem.cache import PoolGeometry
from tandem.engine.params import SamplingParams
from tandem.sched.actor import first_token_waits, wait_targets
from tandem.sched.cost_model import OPT_13B_A100
from tandem.sched.policy import Candidate, Limits, Snapshot
from tandem.sched.request import Request, ServiceClass
from tandem.sched.runtime import Runtime
from tandem.sched.scheduler import SchedConfig, Scheduler


def cand(rid, *, rt=True, slo=None, arrival=0.0, out=0, computed=0):
    return Candidate(rid, 40 + out, computed, 0, arrival, rt, slo, 0.0, num_output=out)


def longest(snap, now: float) -> float:
    return wait_targets(tuple((arrival, target) for _, arrival, target in first_token_waits(snap)), now)


def test_the_longest_first_token_wait_in_targets():
    snap = Snapshot(
        running=[cand("chunked", slo=0.05, arrival=9.7, computed=16),       # 6 targets at 10 s, prompt half done
                 cand("decoding", slo=0.1, arrival=1.0, out=3)],             # a TBT wait: not counted
        waiting=[cand("new", slo=0.1, arrival=9.5),                          # 5 targets at 10 s
                 cand("batch", rt=False, arrival=0.0),                       # BE: no target
                 cand("no-target", slo=None, arrival=0.0)],
        num_free_blocks=10, block_size=16, blocks_per_token_block=2, limits=Limits(8, 512, True))
    assert longest(snap, 10.0) == (10.0 - 9.7) / 0.05
    assert longest(snap, 12.0) == (12.0 - 9.7) / 0.05      # it waits on
    snap.running = snap.running[1:]
    assert longest(snap, 10.0) == (10.0 - 9.5) / 0.1
    snap.waiting = snap.waiting[1:]
    assert longest(snap, 10.0) == 0.0
    assert first_token_waits(None) == ()


def test_a_chats_wait_grows_while_the_step_with_its_prompt_runs():
    """A device's check is read while its step runs. It was the wait as of the step's plan: a
    chat whose 2,048-token prompt took a 12 s step on a CPU counted as just arrived for all of
    it, and new chats were taken meanwhile."""
    clock = SimClock()
    dev = SimDevice("sim0", PoolGeometry(1024, 16), OPT_13B_A100, clock)
    s = Scheduler(SchedConfig(), [dev], eos_ids=(), max_model_len=4096, clock=clock)
    s.add(Request("long", list(range(2048)), SamplingParams(max_tokens=4, temperature=0), ServiceClass.RT,
                  arrival_time=0.0, slo_ttft_s=0.05, slo_tbt_s=0.05))
    actor = s.actors[0]
    clock.t = 0.25
    assert actor.plan() is not None                     # its prompt's step, sent to the device
    assert actor.chat_wait_targets() == 0.25 / 0.05
    clock.t = 12.0                                      # and still running
    assert actor.chat_wait_targets() == 12.0 / 0.05
    actor.abort("long")                                 # gone: an idle device plans nothing more
    clock.t = 20.0
    assert actor.chat_wait_targets() == 0.0


def test_chats_are_refused_only_while_every_live_device_is_past_the_limit():
    def runtime(*devices):      # (dead, chat_wait_targets) per device
        return SimpleNamespace(threads=[SimpleNamespace(actor=SimpleNamespace(dead=d, chat_wait_targets=lambda w=w: w))
                                        for d, w in devices])
    assert Runtime.chats_overdue(runtime((None, 12.0), (None, 10.5)), 10)
    assert not Runtime.chats_overdue(runtime((None, 12.0), (None, 9.0)), 10)       # one device can still take it
    assert Runtime.chats_overdue(runtime((None, 12.0), ("worker died", 0.0)), 10)  # a dead device takes nothing
    assert not Runtime.chats_overdue(runtime((None, 10.0)), 10)                    # more than the limit, not at it
    assert not Runtime.chats_overdue(runtime(("worker died", 50.0)), 10)           # none live: not this rule's call


class HeldDevice(SimDevice):
    """A simulated device whose steps end only once ``release`` is set: a long step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.running, self.release = threading.Event(), threading.Event()

    def collect(self):
        self.running.set()
        assert self.release.wait(30)
        return super().collect()


def test_the_status_view_lists_the_requests_of_a_step_while_it_runs():
    """The dashboard's view of a device was built after each step: through a step of many
    seconds it listed none of the requests in it (an idle device, while a long prompt ran). It
    is built once the step is planned too. The real runtime thread and the server's metrics,
    on a simulated device held in its first step."""
    from tandem.server.metrics import Metrics
    clock = SimClock()
    dev = HeldDevice("sim0", PoolGeometry(1024, 16), OPT_13B_A100, clock)
    s = Scheduler(SchedConfig(), [dev], eos_ids=(), max_model_len=4096, clock=clock)
    metrics = Metrics("m")
    runtime = Runtime(s, lambda ups: None)
    runtime.listeners.append(metrics.engine_step)
    runtime.plan_listeners.append(metrics.device_planned)
    try:
        assert runtime.report(timeout_s=None)            # the idle device's view, as the server starts
        assert metrics.status()["devices"][0]["requests"] == []
        runtime.add(s.new_state(Request("long", list(range(2048)), SamplingParams(max_tokens=4, temperature=0),
                                        ServiceClass.RT, arrival_time=0.0, slo_ttft_s=0.05, slo_tbt_s=0.05)))
        assert dev.running.wait(30)                      # its step runs, and is held
        listed = metrics.status()["devices"][0]["requests"]
        assert [(r["id"], r["state"]) for r in listed] == [("long", "running")]
    finally:
        dev.release.set()
        runtime.stop()
