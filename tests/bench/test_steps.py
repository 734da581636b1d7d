"""``python -m bench steps``: a step log's steps by the work they held, measured / predicted,
and the steps holding RT decodes past a target, against a log whose answers are worked out by
hand (every record's seconds are given here, none is measured: the summary's sums and
counts are checked, never a machine's speed). A line a killed server cut short is ended by the next server that logs to the file and
left out when read; a line that is not a record is refused; a failed write closes the log."""
import json
import logging

import pytest

from tandem.bench.__main__ import main
from tandem.bench.steps import summarize
from tandem.sched.cost_model import StepShape
from tandem.sched.steplog import StepLog, StepRecord, read_steps


def record(seconds, predicted, rt_dec=0, be_dec=0, be_prompt=0, context=0, device="cpu#0"):
    """A step log line with the given (not measured) seconds and predicted seconds."""
    shape = StepShape(prefill_tokens=be_prompt, decode_tokens=rt_dec + be_dec)
    return StepRecord(1.0, device, seconds, predicted, rt_dec, be_dec, 0, be_prompt, int(be_prompt > 0), context,
                      shape)


STEPS = [record(0.2, 0.1, rt_dec=2, be_prompt=80, context=100),     # a batch chunk beside two chat decodes
         record(0.05, 0.1, rt_dec=1, be_dec=3),                      # decodes only
         record(0.3, 0.15, rt_dec=2),                                # chats alone
         record(0.4, 0.2, be_prompt=40, context=500)]                # a batch chunk alone, a long context


def test_the_summary_of_a_log_worked_out_by_hand():
    s = summarize(STEPS, target_s=0.1)
    assert s["steps"] == 4 and s["busy_s"] == pytest.approx(0.95)
    kinds = s["kinds"]
    assert kinds["BE prompt tokens"]["steps"] == 2 and kinds["BE prompt tokens"]["seconds"] == pytest.approx(0.6)
    assert kinds["BE prompt tokens"]["be_prompt_tokens"] == 60 and kinds["BE prompt tokens"]["rt_decodes"] == 1
    assert kinds["BE decodes, no BE prompt"]["steps"] == 1 and kinds["no BE work"]["steps"] == 1
    assert s["measured_over_predicted"]["decodes only"]["p50"] == pytest.approx(1.25)       # 0.5 and 2.0
    assert s["measured_over_predicted"]["with a prompt chunk"]["p50"] == pytest.approx(2.0)
    assert [(b["context"], b["steps"]) for b in s["by_chunk_context"]] == [([0, 150], 1), ([450, 600], 1)]
    assert s["target"] == {"target_s": 0.1, "steps_with_rt_decodes": 3, "over": 2, "share_over": 2 / 3}


def test_the_command_reads_a_log_and_splits_it_by_device(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    for r in STEPS:
        log.write(r)
    log.close()
    with open(path, "a") as f:
        f.write(STEPS[0].to_json()[:30])                  # a server killed mid-line
    log = StepLog(path)                                   # the next one logs to the same file
    log.write(record(0.1, None, rt_dec=1, device="cpu#1"))
    log.close()
    main(["steps", str(path), "--target-ms", "100", "--out", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    first, second = out[f"{path} (cpu#0)"], out[f"{path} (cpu#1)"]
    assert first["steps"] == 4 and first["target"]["over"] == 2
    assert second["steps"] == 1 and "measured_over_predicted" not in second


def test_a_line_that_is_not_a_record_and_a_file_that_is_no_log_are_refused(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(STEPS[0].to_json() + "\n" + json.dumps({"t": 1.0}) + "\n")
    with pytest.raises(ValueError, match="not a step log line"):
        read_steps(path)
    path.write_text("a log of something else\n")
    with pytest.raises(ValueError, match="not a step log"):
        read_steps(path)


def test_a_write_that_fails_closes_the_log_and_says_so(caplog):
    log = StepLog("/dev/full")                            # every write: no space left on the device
    with caplog.at_level(logging.WARNING, logger="tandem.sched.steplog"):
        log.write(STEPS[0])
        log.write(STEPS[1])
    assert log.closed and len(caplog.records) == 1 and "no more steps" in caplog.records[0].getMessage()


def test_a_log_priced_again_from_its_start_up_profile_with_and_without_the_per_kind_correction(tmp_path):
    """A profile measured from a known linear model, as a server keeps it; a log of 20 decode-only
    steps that ran at 0.6 of that model's price and 20 with a prompt chunk at 1.25, alternating (no
    refit: fewer than 128 steps). Fitted alone, every step is off by its kind's factor; with the
    correction, only each kind's first four (by hand)."""
    import math

    from tandem.sched.cost_model import CostModel
    from tandem.sched.profile_store import Profile, ProfileStore
    truth = CostModel(0.02, 2e-4, 1e-8, 1e-3, 3e-6)
    samples = []
    for reqs, n, decode in ((1, 64, False), (1, 512, False), (4, 256, False), (1, 64, True), (8, 300, True),
                            (32, 128, True), (4, 900, True)):
        s = StepShape()
        for _ in range(reqs):
            s = s.add(1 if decode else n, n, decode=decode)
        samples.append((s, truth.predict(s)))
    profile = ProfileStore(tmp_path / "profiles", {"machine": "test"}).save("plan", Profile(samples, 1.0))
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    for i in range(20):
        d, p = StepShape().add(1, 200 + i, decode=True), StepShape().add(48, 300 + i, decode=False)
        log.write(StepRecord(1.0, "cpu#0", 0.6 * truth.predict(d), None, 1, 0, 0, 0, 0, 0, d))
        log.write(StepRecord(1.0, "cpu#0", 1.25 * truth.predict(p), None, 0, 0, 0, 48, 1, 300 + i, p))
    log.close()
    main(["steps", str(path), "--profile", str(profile), "--out", str(tmp_path / "out.json")])
    replay = json.loads((tmp_path / "out.json").read_text())[str(path)]["replay"]
    empty = tmp_path / "empty.jsonl"            # priced again from the profile: no steps (it crashed in numpy)
    empty.touch()
    main(["steps", str(empty), "--profile", str(profile), "--out", str(tmp_path / "empty.json")])
    assert json.loads((tmp_path / "empty.json").read_text()) == {str(empty): {"steps": 0}}
    alone, corrected = replay["fitted alone"], replay["with the per-kind correction"]
    assert alone["p50_decodes_only"] == pytest.approx(0.6) and alone["p50_with_a_prompt_chunk"] == pytest.approx(1.25)
    assert alone["under_0.85"] == 0.5 and alone["over_1.1"] == 0.5
    assert alone["mean_abs_log"] == pytest.approx((abs(math.log(0.6)) + math.log(1.25)) / 2)
    assert corrected["p50_decodes_only"] == pytest.approx(1.0)
    assert corrected["p50_with_a_prompt_chunk"] == pytest.approx(1.0)
    assert corrected["under_0.85"] == 0.1 and corrected["over_1.1"] == 0.1
    assert corrected["mean_abs_log"] == pytest.approx(4 * (abs(math.log(0.6)) + math.log(1.25)) / 40)


def test_the_bench_keeps_the_start_up_profile_of_the_whole_plan_and_skips_what_it_cannot_read(tmp_path, capsys):
    """A server's data dir holds the profile of the whole start-up plan and the shorter plan's
    (and here a file cut short): the whole plan's is the one copied beside the step log."""
    from tandem.bench.online import _keep_profile
    from tandem.sched.cost_model import CostModel
    from tandem.sched.profile_store import Profile, ProfileStore
    from tandem.sched.profiling import PLAN, SHORT_PLAN
    store = ProfileStore(tmp_path / "profiles", {"machine": "test"})
    truth = CostModel(0.02, 2e-4, 1e-8, 1e-3, 3e-6)
    shapes = [StepShape().add(n, n, decode=False) for n in (32, 64, 128, 256, 512)]
    store.save(SHORT_PLAN, Profile([(s, 2 * truth.predict(s)) for s in shapes], 1.0))
    (tmp_path / "profiles" / "cut.json").write_text('{"key": ')
    kept = tmp_path / "kept.json"
    _keep_profile(tmp_path / "profiles", kept)
    assert not kept.exists() and "cut.json not kept" in capsys.readouterr().out
    store.save(PLAN, Profile([(s, truth.predict(s)) for s in shapes], 1.0))
    _keep_profile(tmp_path / "profiles", kept)
    assert kept.read_text() == store.path(PLAN).read_text()
    _keep_profile(tmp_path / "nothing", tmp_path / "none.json")          # a server that measured none
    assert not (tmp_path / "none.json").exists()


def test_the_online_bench_reads_the_steps_of_its_own_run_from_the_servers_log(tiny_chat_model, tmp_path,
                                                                                monkeypatch):
    """``bench online --step-log``: the server it starts logs every step, and the row's summary
    covers the steps of the run at that rate, checked against the server's own /metrics step
    counters and against the tokens the bench's client received (each reply's first token comes
    from its prompt's step, every further one from a decode step)."""
    import tandem.bench.online as online
    from tandem.engine.models.loader import load_tokenizer
    monkeypatch.setattr(online, "RESULTS", tmp_path)
    monkeypatch.setattr(online, "_setup", lambda args: (tiny_chat_model, load_tokenizer(tiny_chat_model)))
    # any --model but smollm2 serves the checkpoint _setup gives (here the tiny one)
    main(["online", "--systems", "tandem-fcfs", "--rates", "2", "--duration", "3", "--drain", "60",
          "--max-output", "16", "--slo-ttft-ms", "1000", "--slo-tbt-ms", "200", "--step-log",
          "--model", "opt125m-random", "--out", "run.json"])
    row, = json.loads((tmp_path / "run.json").read_text())["rows"]
    steps, server = row["steps"], row["server"]
    assert steps["log"] == "run_tandem-fcfs_steps.jsonl" and (tmp_path / steps["log"]).is_file()
    assert steps["steps"] == server["steps"] > 0
    assert steps["busy_s"] == pytest.approx(server["step_seconds"], rel=1e-6)
    received = [r["output_tokens"] for r in row["records"] if r["error"] is None]
    assert len(received) == len(row["records"]) > 1
    decodes = sum(k["rt_decodes"] * k["steps"] for k in steps["kinds"].values())
    assert decodes == pytest.approx(sum(n - 1 for n in received)) and decodes == server["tokens_rt_decode"]
    assert steps["target"]["target_s"] == 0.2


def test_two_logs_of_one_name_are_two_entries(tmp_path):
    """Two servers' logs of the same file name (each run's folder): the JSON kept only the last
    one's, where the table showed both."""
    a, b = tmp_path / "a" / "steps.jsonl", tmp_path / "b" / "steps.jsonl"
    for path, records in ((a, STEPS[:3]), (b, STEPS)):
        path.parent.mkdir()
        log = StepLog(path)
        for r in records:
            log.write(r)
        log.close()
    main(["steps", str(a), str(b), "--out", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert {k: v["steps"] for k, v in out.items()} == {str(a): 3, str(b): 4}
