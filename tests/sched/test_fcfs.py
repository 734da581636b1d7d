"""FCFS policy on hand-made snapshots where the right plan is known."""
from tandem.engine.messages import Phase
from tandem.sched.policy import Candidate, Limits, Snapshot, fcfs, fcfs_prefill_first

B = 4   # block size; a KV token-block costs 2 blocks


def snap(running=(), waiting=(), free=100, seqs=8, tokens=64, chunked=True):
    return Snapshot(list(running), list(waiting), free, B, 2, Limits(seqs, tokens, chunked))


def c(rid, tokens, computed=0, blocks=None, arrival=0.0):
    if blocks is None:
        blocks = -(-computed // B) * 2
    return Candidate(rid, tokens, computed, blocks, arrival)


def test_decodes_then_admits_in_order():
    plan = fcfs(snap(running=[c("r", 9, 8)], waiting=[c("w1", 5, arrival=1), c("w2", 3, arrival=2)]))
    assert [(d.req_id, d.num_new_tokens, d.phase) for d in plan.scheduled] == [
        ("r", 1, Phase.DECODE), ("w1", 5, Phase.PREFILL), ("w2", 3, Phase.PREFILL)]
    assert all(d.sample for d in plan.scheduled)


def test_head_of_line_blocks_admission():
    # w1 needs 4 blocks but only 3 free: w2 (1 token-block) must not overtake it
    plan = fcfs(snap(waiting=[c("w1", 8, arrival=1), c("w2", 2, arrival=2)], free=3))
    assert plan.scheduled == [] and "not enough free blocks" in plan.reasons["w1"]


def test_max_num_seqs_and_token_budget():
    w = [c(f"w{i}", 10, arrival=i) for i in range(5)]
    plan = fcfs(snap(waiting=w, seqs=3, tokens=1000))
    assert [d.req_id for d in plan.scheduled] == ["w0", "w1", "w2"]
    plan = fcfs(snap(waiting=w, tokens=25))      # chunked: third prompt gets a 5-token chunk
    assert [(d.req_id, d.num_new_tokens, d.sample) for d in plan.scheduled] == [
        ("w0", 10, True), ("w1", 10, True), ("w2", 5, False)]
    plan = fcfs(snap(waiting=w, tokens=25, chunked=False))
    assert [d.req_id for d in plan.scheduled] == ["w0", "w1"]


def test_preempts_latest_arrival_and_admits_nothing():
    # both running requests sit at a block boundary: each next token needs 2 new blocks
    r1, r2 = c("r1", 9, 8, arrival=1), c("r2", 9, 8, arrival=2)
    plan = fcfs(snap(running=[r1, r2], waiting=[c("w", 2, arrival=3)], free=2))
    assert [d.req_id for d in plan.scheduled] == ["r1"]
    assert plan.preempted == ["r2"]
    plan = fcfs(snap(running=[r1, r2], free=0))   # r2's 4 blocks make room for r1
    assert plan.preempted == ["r2"] and [d.req_id for d in plan.scheduled] == ["r1"]


def test_lone_request_preempts_itself_when_nothing_else_frees():
    plan = fcfs(snap(running=[c("r1", 9, 8)], free=1))
    assert plan.preempted == ["r1"] and plan.scheduled == []


def test_partial_prefill_continues_before_admissions():
    plan = fcfs(snap(running=[c("r", 20, 8, arrival=0)], waiting=[c("w", 4, arrival=1)], tokens=14))
    assert [(d.req_id, d.num_new_tokens, d.phase, d.sample) for d in plan.scheduled] == [
        ("r", 12, Phase.PREFILL, True), ("w", 2, Phase.PREFILL, False)]


def test_prefill_first_runs_whole_prompts_alone_then_decodes():
    # vLLM 0.5: w1 and w2 fit (4 + 2 blocks of 7 free): a prefill-only iteration, r waits; w3
    # (4 blocks) does not fit and stops admission
    w = [c("w1", 8, arrival=1), c("w2", 3, arrival=2), c("w3", 8, arrival=3)]
    plan = fcfs_prefill_first(snap(running=[c("r", 9, 8)], waiting=w, free=7))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("w1", 8), ("w2", 3)]
    # the head does not fit: a decode iteration (r takes one of the 3 free blocks it needs)
    plan = fcfs_prefill_first(snap(running=[c("r", 9, 8)], waiting=w, free=3))
    assert [(d.req_id, d.phase) for d in plan.scheduled] == [("r", Phase.DECODE)]
    # a prompt longer than the token budget runs whole, alone; never chunked
    plan = fcfs_prefill_first(snap(waiting=[c("w1", 80, arrival=1), c("w2", 3, arrival=2)], tokens=64))
    assert [(d.req_id, d.num_new_tokens) for d in plan.scheduled] == [("w1", 80)]
