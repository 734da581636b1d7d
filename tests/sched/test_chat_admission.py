"""What refusing new chats past capacity reads (server ``--shed-chats-after``): the longest wait
of a chat still without its first token, in its own TTFT targets, checked against hand-computed
values; and the rule over devices: refused only while every live device holds such a chat."""
from types import SimpleNamespace

from tandem.sched.actor import first_token_wait
from tandem.sched.policy import Candidate, Limits, Snapshot
from tandem.sched.runtime import Runtime


def cand(rid, *, rt=True, slo=None, pending=0.0, out=0, computed=0):
    return Candidate(rid, 40 + out, computed, 0, 0.0, rt, slo, pending, num_output=out)


def test_the_longest_first_token_wait_in_targets():
    snap = Snapshot(
        running=[cand("chunked", slo=0.05, pending=0.3, computed=16),       # 6 targets, prompt half done
                 cand("decoding", slo=0.1, pending=2.0, out=3)],             # a TBT wait: not counted
        waiting=[cand("new", slo=0.1, pending=0.5),                          # 5 targets
                 cand("batch", rt=False, pending=100.0),                     # BE: no target
                 cand("no-target", slo=None, pending=50.0)],
        num_free_blocks=10, block_size=16, blocks_per_token_block=2, limits=Limits(8, 512, True))
    assert first_token_wait(snap) == 0.3 / 0.05
    snap.running = snap.running[1:]
    assert first_token_wait(snap) == 0.5 / 0.1
    snap.waiting = snap.waiting[1:]
    assert first_token_wait(snap) == 0.0
    assert first_token_wait(None) == 0.0


def test_chats_are_refused_only_while_every_live_device_is_past_the_limit():
    def runtime(*devices):      # (dead, chat_wait_targets) per device
        return SimpleNamespace(threads=[SimpleNamespace(actor=SimpleNamespace(dead=d, chat_wait_targets=w))
                                        for d, w in devices])
    assert Runtime.chats_overdue(runtime((None, 12.0), (None, 10.5)), 10)
    assert not Runtime.chats_overdue(runtime((None, 12.0), (None, 9.0)), 10)       # one device can still take it
    assert Runtime.chats_overdue(runtime((None, 12.0), ("worker died", 0.0)), 10)  # a dead device takes nothing
    assert not Runtime.chats_overdue(runtime((None, 10.0)), 10)                    # more than the limit, not at it
    assert not Runtime.chats_overdue(runtime(("worker died", 50.0)), 10)           # none live: not this rule's call
