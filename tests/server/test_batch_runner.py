"""The Batch API's state machine, with a stand-in for the engine: a cancel during validation,
expiry across a stop, a stop that aborts the lines in flight, and finalization off the loop.
The states and error codes are OpenAI's (validating -> in_progress -> finalizing -> completed;
cancelling -> cancelled; expired, with batch_cancelled / batch_expired per line not run)."""
import asyncio
import contextlib
import json
import logging
import resource
import sqlite3
import threading
import time
from types import SimpleNamespace

import pytest

from tandem.server import batches, errors
from tandem.server import store as store_module
from tandem.server.batches import BatchRunner
from tandem.server.store import Store

ENDPOINT = "/v1/chat/completions"


def input_file(store: Store, n: int) -> str:
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT,
             "body": {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2}} for i in range(n)]
    return store.add_file("".join(json.dumps(r) + "\n" for r in rows).encode(), "in.jsonl", "batch")["id"]


def lines_of(store: Store, fid: str | None) -> list[dict]:
    if fid is None:
        return []
    return [json.loads(x) for x in store.file_path(fid).read_text().splitlines()]


def answer(body):
    return 200, {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}


def test_a_cancel_while_validating_is_kept(tmp_path, monkeypatch):
    """Cancelled while its input is being validated (in a thread): the batch ends cancelled, every
    line as batch_cancelled, and nothing runs."""
    store = Store(tmp_path)
    ran, validating, go_on = [], threading.Event(), threading.Event()
    real = batches.validate_lines

    def slow_validation(raw, endpoint):
        validating.set()
        go_on.wait(30)
        return real(raw, endpoint)
    monkeypatch.setattr(batches, "validate_lines", slow_validation)

    async def run_line(body, chat):
        ran.append(body)
        return answer(body)

    async def main():
        runner = BatchRunner(store, run_line, 4)
        b = store.add_batch(input_file(store, 5), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await asyncio.to_thread(validating.wait, 30)
        assert runner.cancel(b["id"])["status"] == "cancelling"
        go_on.set()
        await runner.tasks[b["id"]]
        return store.get_batch(b["id"])
    b = asyncio.run(main())
    assert b["status"] == "cancelled" and not ran
    errs = lines_of(store, b["error_file_id"])
    assert len(errs) == 5 and {e["error"]["code"] for e in errs} == {"batch_cancelled"}
    assert b["output_file_id"] is None


def test_an_expired_batch_stopped_before_its_files_resumes_and_gets_them(tmp_path, monkeypatch):
    """The window passes while lines still run (a clock of the test's: it passes as the first
    line ends); the server stops before the files are written. The batch must stay active, so
    the next start writes its files: the lines that ran in the output file, the others as
    batch_expired; and it starts none of them again (it started as many as it runs at once)."""
    store = Store(tmp_path)
    now = [time.time()]
    clock = SimpleNamespace(time=lambda: now[0])
    monkeypatch.setattr(batches, "time", clock)

    async def main():
        release = asyncio.Event()

        async def run_line(body, chat):
            if body["messages"][0]["content"] != "q0":
                await release.wait()           # never set: these run past the window
            now[0] += 7200                     # the window passes as the first line ends
            return answer(body)
        runner = BatchRunner(store, run_line, 4)
        b = store.add_batch(input_file(store, 3), ENDPOINT, 3600, "1h", None, "M")
        entered = asyncio.Event()

        async def stuck(bid, final):
            entered.set()
            await asyncio.Event().wait()
        monkeypatch.setattr(runner, "_finalize", stuck)
        runner.start(b["id"])
        await asyncio.wait_for(entered.wait(), 30)
        await runner.stop()
        return b["id"]
    bid = asyncio.run(main())
    monkeypatch.undo()
    assert bid in store.active_batches(), store.get_batch(bid)["status"]
    monkeypatch.setattr(batches, "time", clock)
    b = restarted(store, bid)
    assert b["status"] == "expired" and b["expired_at"]
    assert [x["custom_id"] for x in lines_of(store, b["output_file_id"])] == ["c0"]
    errs = lines_of(store, b["error_file_id"])
    assert sorted(e["custom_id"] for e in errs) == ["c1", "c2"]
    assert {e["error"]["code"] for e in errs} == {"batch_expired"}


def restarted(store: Store, bid: str) -> dict:
    """The batch after the next start's runner took it to its end, running no line."""
    ran = []

    async def restart():
        async def run_line(body, chat):
            ran.append(body)
            return answer(body)
        runner = BatchRunner(store, run_line, 4)
        runner.resume_all()
        await asyncio.gather(*runner.tasks.values())
    asyncio.run(restart())
    assert ran == []                       # a batch past its window starts no line again
    return store.get_batch(bid)


def test_a_batch_whose_lines_all_ran_completes_though_its_window_passed_before_its_files(tmp_path, monkeypatch):
    """Every line answered, then the data dir refuses the write that starts finalizing, and the
    batch goes on (it waits for room) after its window passed: it completes with every answer,
    nothing expired."""
    import errno
    store = Store(tmp_path)
    now = [time.time()]
    monkeypatch.setattr(batches, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(errors, "STORAGE_RETRY_S", 0.01)
    real = store.set_status

    def full_once(bid, status, **kw):
        if status == "finalizing" and now[0] < time.time() + 3600:
            now[0] += 7200                     # the window passes while the batch waits for room
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(bid, status, **kw)
    monkeypatch.setattr(store, "set_status", full_once)

    async def main():
        async def run_line(body, chat):
            return answer(body)
        runner = BatchRunner(store, run_line, 4)
        b = store.add_batch(input_file(store, 3), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await asyncio.wait_for(runner.tasks[b["id"]], 30)
        return store.get_batch(b["id"])
    b = asyncio.run(main())
    assert now[0] > b["expires_at"], "the window was meant to pass"
    assert b["status"] == "completed" and b["request_counts"]["completed"] == 3, b
    assert sorted(x["custom_id"] for x in lines_of(store, b["output_file_id"])) == ["c0", "c1", "c2"]


def test_a_stop_between_the_result_files_and_the_batchs_end_lists_each_file_once(tmp_path, monkeypatch):
    """The server stops after a batch's result files were written
    and before its end was recorded. The next start finalizes again: the batch lists one output
    file, and no other output file of it is left listed (a pipeline listing output files would
    otherwise read its lines twice)."""
    store = Store(tmp_path)

    async def run_line(body, chat):
        return answer(body)

    def stopped(*a, **k):                # the task is cancelled there, as a stop cancels it
        raise asyncio.CancelledError
    monkeypatch.setattr(store, "end_batch", stopped)

    async def main():
        runner = BatchRunner(store, run_line, 2)
        b = store.add_batch(input_file(store, 3), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await asyncio.gather(*runner.tasks.values(), return_exceptions=True)
        return b["id"]
    bid = asyncio.run(main())
    monkeypatch.undo()
    assert bid in store.active_batches()
    assert [f for f in store.list_files("batch_output", 100, True, None)[0]] == []

    async def restart():
        runner = BatchRunner(store, run_line, 2)
        runner.resume_all()
        await asyncio.gather(*runner.tasks.values())
    asyncio.run(restart())
    b = store.get_batch(bid)
    listed = store.list_files("batch_output", 100, True, None)[0]
    assert b["status"] == "completed" and [f["id"] for f in listed] == [b["output_file_id"]]
    assert sorted(x["custom_id"] for x in lines_of(store, b["output_file_id"])) == ["c0", "c1", "c2"]


def test_stopping_aborts_the_lines_in_flight_and_keeps_them_pending(tmp_path):
    store = Store(tmp_path)
    started, aborted = [], []

    async def main():
        async def run_line(body, chat):
            started.append(body)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                aborted.append(body)
                raise
        runner = BatchRunner(store, run_line, 3)
        b = store.add_batch(input_file(store, 6), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        while len(started) < 3:
            await asyncio.sleep(0.01)
        in_flight = runner.running            # what the server's stop line reports
        await runner.stop()
        return b["id"], len(aborted), in_flight, runner.running   # counted before the loop closes (cancels all)
    bid, aborted_by_stop, in_flight, after = asyncio.run(main())
    assert len(started) == 3 and aborted_by_stop == 3 and (in_flight, after) == (3, 0)
    assert len(store.pending_lines(bid)) == 6 and bid in store.active_batches()


def test_result_files_are_built_off_the_event_loop(tmp_path, monkeypatch):
    store = Store(tmp_path)
    threads = []
    real = batches.result_files

    def recording(rows, final):
        threads.append(threading.current_thread())
        return real(rows, final)
    monkeypatch.setattr(batches, "result_files", recording)

    async def run_line(body, chat):
        return answer(body)

    async def main():
        runner = BatchRunner(store, run_line, 2)
        b = store.add_batch(input_file(store, 4), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await runner.tasks[b["id"]]
        return store.get_batch(b["id"]), threading.current_thread()
    b, loop_thread = asyncio.run(main())
    assert b["status"] == "completed" and len(lines_of(store, b["output_file_id"])) == 4
    assert threads and loop_thread not in threads


def test_a_batchs_lines_are_stored_and_read_back_off_the_event_loop(tmp_path, monkeypatch):
    """Inserting a batch's lines, reading their results and dropping them (50,000 lines take
    seconds) run on threads of their own, not on the loop that serves every stream; once the
    batch has ended its lines are gone from the database and its counts stay."""
    store = Store(tmp_path)
    threads = {}
    for name in ("add_lines", "line_results", "end_batch"):
        real = getattr(store, name)

        def recording(*args, _real=real, _name=name):
            threads[_name] = threading.current_thread()
            return _real(*args)
        monkeypatch.setattr(store, name, recording)

    async def main():
        runner = BatchRunner(store, lambda body, endpoint: asyncio.sleep(0, answer(body)), 2)
        b = store.add_batch(input_file(store, 5), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await runner.tasks[b["id"]]
        return store.get_batch(b["id"]), threading.current_thread()
    b, loop_thread = asyncio.run(main())
    assert sorted(threads) == ["add_lines", "end_batch", "line_results"] and loop_thread not in threads.values()
    assert b["status"] == "completed" and b["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert len(lines_of(store, b["output_file_id"])) == 5
    with sqlite3.connect(tmp_path / "tandem.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM batch_lines").fetchone()[0] == 0


class CountingSlots(asyncio.Semaphore):
    """The runner's shared slots, counting the times a worker asked for one."""
    asked = 0

    async def acquire(self):
        self.asked += 1
        return await super().acquire()


def test_batches_running_together_take_turns(tmp_path):
    """A short batch created after a long one runs its lines among the long one's, not after
    its last (one slot: the long batch's first line holds it until the short batch's worker
    waits for it too)."""
    store = Store(tmp_path)
    ran = []

    async def main():
        both_wait = asyncio.Event()

        async def run_line(body, endpoint):
            ran.append(body["messages"][0]["content"])
            await both_wait.wait()
            return answer(body)
        runner = BatchRunner(store, run_line, 1)
        runner._slots = slots = CountingSlots(1)
        long = store.add_batch(input_file(store, 30), ENDPOINT, 3600, "1h", None, "M")
        runner.start(long["id"])
        rows = [{"custom_id": f"s{i}", "method": "POST", "url": ENDPOINT,
                 "body": {"messages": [{"role": "user", "content": f"short{i}"}]}} for i in range(3)]
        short = store.add_batch(store.add_file("".join(json.dumps(r) + "\n" for r in rows).encode(), "s.jsonl",
                                               "batch")["id"], ENDPOINT, 3600, "1h", None, "M")
        runner.start(short["id"])
        while slots.asked < 2:
            await asyncio.sleep(0.001)
        both_wait.set()
        await asyncio.gather(*runner.tasks.values())
    asyncio.run(main())
    assert len(ran) == 33 and ran.index("short2") < 30, ran


def test_ending_a_batch_while_the_loop_writes(tmp_path, monkeypatch):
    """The loop's connection writes (another batch's line) while a batch is being ended on its
    thread: both writes land, the batch ends completed."""
    store = Store(tmp_path)
    a, b = (store.add_batch(input_file(store, 1), ENDPOINT, 3600, "1h", None, "M")["id"] for _ in range(2))
    store.add_lines(a, [(0, "c0", {})])
    store.add_lines(b, [(0, "c0", {})])
    store.finish_line(a, 0, 200, {})
    counted = store_module.Store._line_counts
    writer = threading.Thread(target=lambda: store.finish_line(b, 0, 200, {}))

    def meanwhile(db, bid):
        counts = counted(db, bid)
        if db is not store.db:            # in end_batch's own transaction, counted: the loop writes now
            writer.start()
            writer.join(0.5)              # it waits for the batch's end (else it has written by now)
        return counts
    monkeypatch.setattr(store_module.Store, "_line_counts", staticmethod(meanwhile))
    store.end_batch(a, "completed", None, None)
    writer.join()
    assert store.get_batch(a)["status"] == "completed" and store.get_batch(a)["request_counts"]["completed"] == 1
    assert store.get_batch(b)["request_counts"]["completed"] == 1


def test_a_batch_sums_its_lines_usage_once_each(tmp_path):
    """Chat, completion and Responses usage shapes all count; a failed line and a line recorded
    twice (a resumed batch finishing a line another run finished) count nothing more."""
    store = Store(tmp_path)
    bid = store.add_batch(input_file(store, 4), ENDPOINT, 3600, "1h", None, "M")["id"]
    store.add_lines(bid, [(n, f"c{n}", {}) for n in range(4)])
    chat = {"usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
                      "prompt_tokens_details": {"cached_tokens": 8}}}
    response = {"usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 2}}}
    plain = {"usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13, "prompt_tokens_details": None}}
    failed = {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}}
    for n, (code, body) in enumerate([(200, chat), (200, response), (200, plain), (400, failed)]):
        assert store.finish_line(bid, n, code, body, batches.line_usage(code, body))
    assert not store.finish_line(bid, 0, 200, chat, batches.line_usage(200, chat))
    assert store.get_batch(bid)["usage"] == {
        "input_tokens": 22, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 17,
        "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 39}
    assert store.get_batch(bid)["model"] == "M" and bid.startswith("batch_")


def test_a_file_is_gone_when_its_time_is_up(tmp_path, monkeypatch):
    """An expiring file is served until its expires_at, then neither got nor listed, and its
    bytes are removed; a batch's output files expire as the batch asked."""
    store = Store(tmp_path)
    keep = store.add_file(b"{}\n", "keep.jsonl", "batch")
    brief = store.add_file(b"{}\n", "brief.jsonl", "batch", expires_s=3600)
    assert brief["expires_at"] == brief["created_at"] + 3600 and keep["expires_at"] is None

    async def main():
        runner = BatchRunner(store, lambda body, endpoint: asyncio.sleep(0, answer(body)), 2)
        b = store.add_batch(input_file(store, 2), ENDPOINT, 3600, "1h", None, "M", output_expires_s=7200)
        runner.start(b["id"])
        await asyncio.gather(*runner.tasks.values())
        return store.get_batch(b["id"])
    b = asyncio.run(main())
    out = store.get_file(b["output_file_id"])
    assert b["status"] == "completed" and out["expires_at"] == out["created_at"] + 7200
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 3601)
    assert store.get_file(brief["id"]) is None and store.get_file(out["id"]) is not None
    listed = {f["id"] for f in store.list_files()[0]}
    assert keep["id"] in listed and brief["id"] not in listed
    assert not (store.files_dir / brief["id"]).exists() and (store.files_dir / keep["id"]).exists()
    monkeypatch.setattr(time, "time", lambda: now + 7201)
    assert store.get_file(out["id"]) is None


def test_a_data_dir_from_before_usage_and_expiry_opens(tmp_path):
    """A store written before batches had a model and usage, and files an expiry, gets the new
    columns on opening; its old batch says no usage (it was not counted), as OpenAI's older ones."""
    db = sqlite3.connect(tmp_path / "tandem.sqlite3")
    db.executescript(store_module.SCHEMA)
    db.execute("INSERT INTO batches (id, seq, input_file_id, endpoint, completion_window, status, created_at) "
               "VALUES ('batch-old', 1, 'file-x', ?, '24h', 'completed', 1)", (ENDPOINT,))
    db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose) VALUES ('file-x', 3, 1, 'x', 'batch')")
    db.commit()
    db.close()
    store = Store(tmp_path)
    old = store.get_batch("batch-old")
    assert old["status"] == "completed" and old["model"] is None and old["usage"] is None
    assert store.get_file("file-x")["expires_at"] is None
    assert store.add_batch("file-x", ENDPOINT, 3600, "24h", None, "M")["usage"]["total_tokens"] == 0


def test_a_batchs_start_end_and_failure_are_logged_with_its_counts(tmp_path, caplog):
    """Read once the runner's task is done (no waiting on the log): the start with its lines and
    endpoint, the end with the counts the batch gives, and a failed one's first error."""
    import logging
    store = Store(tmp_path)

    async def run_line(body, endpoint):
        return (400, {"error": {"message": "no"}}) if body["messages"][0]["content"] == "q1" else answer(body)

    async def main():
        runner = BatchRunner(store, run_line, 2)
        good = store.add_batch(input_file(store, 3), ENDPOINT, 3600, "1h", None, "M")
        bad = store.add_batch(store.add_file(b"{not json}\n[1]\n", "bad.jsonl", "batch")["id"], ENDPOINT, 3600,
                              "1h", None, "M")
        for b in (good, bad):
            runner.start(b["id"])
            await runner.tasks[b["id"]]
        return store.get_batch(good["id"]), store.get_batch(bad["id"])
    with caplog.at_level(logging.INFO, logger="tandem.batches"):
        good, bad = asyncio.run(main())
    assert good["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert f"batch {good['id']}: 3 lines to {ENDPOINT}" in lines
    assert any(line.startswith(f"batch {good['id']} completed: 2 of 3 lines completed, 1 failed, in ") for line in lines)
    errors = bad["errors"]["data"]
    assert bad["status"] == "failed" and \
        f"batch {bad['id']} failed: {errors[0]['message']} (and {len(errors) - 1} more errors)" in lines


def test_an_upload_that_cannot_be_listed_leaves_no_bytes_behind(tmp_path, monkeypatch):
    """The file's bytes are written before its row; when the row cannot be written, the bytes go."""
    store = Store(tmp_path)

    def refused(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")
    monkeypatch.setattr(store, "register_file", refused)
    with pytest.raises(sqlite3.OperationalError):
        store.add_file(b'{"a": 1}\n', "a.jsonl", "batch")
    assert [p.name for p in store.files_dir.iterdir()] == []
    store.close()


def _big_answer(body):
    """A line's answer of about 20 KB: a few lines fill a small file size limit."""
    return 200, {"id": "chatcmpl-1", "object": "chat.completion",
                 "choices": [{"message": {"content": body["messages"][0]["content"] + "x" * 20_000}}]}


@contextlib.contextmanager
def file_size_limit():
    """Yields a setter of this process's file size limit, the real one set back after: past the
    limit a write fails as on a full disk (Python ignores SIGXFSZ, so it is an OSError)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _wait_for(check, what: str, caplog=None) -> None:
    for _ in range(600):
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen" + (f": {caplog.text[-2000:]}" if caplog else ""))


def _answered_once(store: Store, b: dict, n: int) -> None:
    """The batch ended completed with each line's own answer, once."""
    assert b["status"] == "completed" and b["request_counts"] == {"total": n, "completed": n, "failed": 0}, b
    out = lines_of(store, b["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))
    for r in out:
        content = r["response"]["body"]["choices"][0]["message"]["content"]
        assert content == f"q{r['custom_id'][1:]}" + "x" * 20_000
    assert b["error_file_id"] is None and not list(store.files_dir.glob(".*.tmp"))


@pytest.mark.parametrize("where", ["line results", "result files"])
def test_a_full_disk_delays_a_batch_and_loses_none_of_it(where, tmp_path, monkeypatch, caplog):
    """The data dir refuses writes part way (a file size limit, as a full disk refuses them):
    while lines' results are recorded, or while the result files are written. The batch
    failed with an internal error, or stayed in progress for ever with its task dead. It now
    waits, and once the disk takes writes again it ends completed with every line's answer,
    once, and no part-written file left."""
    monkeypatch.setattr(errors, "STORAGE_RETRY_S", 0.05)
    store, n = Store(tmp_path), 30
    fid = input_file(store, n)
    with file_size_limit() as limit:
        if where == "result files":            # the limit comes once every result is recorded
            real, built = batches.result_files, []

            def then_full(*a):
                files = real(*a)
                if not built:
                    limit(50_000)
                built.append(1)
                return files
            monkeypatch.setattr(batches, "result_files", then_full)
        else:
            wal = tmp_path / "tandem.sqlite3-wal"
            limit((wal.stat().st_size if wal.exists() else 0) + 150_000)

        async def run_line(body, endpoint):
            return _big_answer(body)

        async def main():
            runner = BatchRunner(store, run_line, 4)
            b = store.add_batch(fid, ENDPOINT, 3600, "1h", None, "M")
            runner.start(b["id"])
            await asyncio.to_thread(_wait_for, lambda: caplog.text.count("the data dir refused a write") >= 2,
                                    "a refused write", caplog)
            assert store.get_batch(b["id"])["status"] in ("in_progress", "finalizing")
            assert not list(store.files_dir.glob(".*.tmp")), "a part-written file holds the space it took"
            limit(resource.RLIM_INFINITY)
            await asyncio.to_thread(_wait_for, lambda: store.get_batch(b["id"])["status"] == "completed",
                                    "the batch's end", caplog)
            return store.get_batch(b["id"])
        with caplog.at_level(logging.WARNING, logger="tandem.batches"):
            b = asyncio.run(main())
    _answered_once(store, b, n)


def test_a_line_the_disk_refuses_to_keep_runs_again_instead_of_failing(tmp_path, monkeypatch, caplog):
    """A line whose own write is refused (a response to keep, on a full disk) was taken for a
    bug: tried three times, then recorded as a 500. The batch now waits for room and runs the
    line again, so every line ends with its answer."""
    import errno
    monkeypatch.setattr(errors, "STORAGE_RETRY_S", 0.05)
    store, refusals = Store(tmp_path), []

    async def run_line(body, endpoint):
        if body["messages"][0]["content"] == "q1" and len(refusals) < 3:
            refusals.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        return _big_answer(body)

    async def main():
        runner = BatchRunner(store, run_line, 2)
        b = store.add_batch(input_file(store, 4), ENDPOINT, 3600, "1h", None, "M")
        runner.start(b["id"])
        await asyncio.gather(*runner.tasks.values())
        return store.get_batch(b["id"])
    with caplog.at_level(logging.WARNING, logger="tandem.batches"):
        b = asyncio.run(main())
    assert len(refusals) == 3 and "the data dir refused a write" in caplog.text
    _answered_once(store, b, 4)


class Killed(BaseException):
    """The server's process ends here (as under SIGKILL: nothing after it runs)."""


def _killed_at_second_write(monkeypatch) -> None:
    """Storing a batch's lines dies after its first transaction of two lines has committed."""
    monkeypatch.setattr(store_module, "LINES_PER_WRITE", 2)
    writes = []

    class Dying(sqlite3.Connection):
        def executemany(self, *args):
            writes.append(1)
            if len(writes) == 2:
                raise Killed
            return super().executemany(*args)

    def connect(self):
        db = sqlite3.connect(self.root / "tandem.sqlite3", isolation_level=None, factory=Dying,
                             check_same_thread=False)
        db.row_factory = sqlite3.Row
        return db
    monkeypatch.setattr(Store, "_connect", connect)


def _validating_then(store: Store, monkeypatch, meanwhile) -> None:
    """``meanwhile(batch id)`` runs while the batch's input is being validated."""
    real = batches.validate_lines

    def validate(raw, endpoint):
        meanwhile()
        return real(raw, endpoint)
    monkeypatch.setattr(batches, "validate_lines", validate)


def _first_life_dies(store: Store, bid: str, run_line) -> None:
    async def main():
        runner = BatchRunner(store, run_line, 4)
        runner.start(bid)
        with pytest.raises(Killed):
            await runner.tasks[bid]
    asyncio.run(main())


def _next_life(tmp_path, run_line) -> tuple[Store, dict]:
    """A new start on the same data dir: every active batch runs to its end."""
    store = Store(tmp_path)

    async def main():
        runner = BatchRunner(store, run_line, 4)
        runner.resume_all()
        await asyncio.gather(*runner.tasks.values())
    asyncio.run(main())
    return store, store.get_batch(store.list_batches(1, None)[0][0]["id"])


def test_a_batch_cancelled_while_validating_and_stopped_before_its_lines_were_in_loses_none(tmp_path, monkeypatch):
    """Cancelled while its 7 lines were being validated; the server died after storing the first
    two. The next start ended it cancelled with those two in its error file (five custom_ids in
    neither file): it now reads its input again, and every line is in the error file as
    batch_cancelled."""
    ran = []

    async def run_line(body, endpoint):
        ran.append(body)
        return answer(body)
    store = Store(tmp_path)
    bid = store.add_batch(input_file(store, 7), ENDPOINT, 3600, "1h", None, "M")["id"]
    _validating_then(store, monkeypatch, lambda: store.set_status(bid, "cancelling"))
    _killed_at_second_write(monkeypatch)
    _first_life_dies(store, bid, run_line)
    monkeypatch.undo()
    store, b = _next_life(tmp_path, run_line)
    assert b["status"] == "cancelled" and not ran
    errs = lines_of(store, b["error_file_id"])
    assert sorted(e["custom_id"] for e in errs) == sorted(f"c{i}" for i in range(7))
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"} and b["request_counts"]["total"] == 7


@pytest.mark.parametrize("how", ["deleted", "expired"])
def test_an_input_deleted_while_its_batch_validates_is_read_again_after_a_stop(how, tmp_path, monkeypatch):
    """The input file is deleted (or its time is up) while its batch validates, and the server
    dies after the first two of 7 lines are stored. The next start failed the batch (input file
    deleted) and kept those two lines in the store for ever: the input's bytes stay until the
    batch has all its lines, so it runs every line, and they go then (the file stays deleted
    for the API)."""
    store = Store(tmp_path)
    fid = input_file(store, 7)
    bid = store.add_batch(fid, ENDPOINT, 3600, "1h", None, "M")["id"]

    async def run_line(body, endpoint):
        return 200, {"id": "x", "choices": [{"message": {"content": body["messages"][0]["content"]}}]}

    def expire():
        store.db.execute("UPDATE files SET expires_at=1 WHERE id=?", (fid,))
        store.sweep_expired()
    _validating_then(store, monkeypatch, (lambda: store.delete_file(fid)) if how == "deleted" else expire)
    _killed_at_second_write(monkeypatch)
    _first_life_dies(store, bid, run_line)
    monkeypatch.undo()
    assert store.get_file(fid) is None
    store, b = _next_life(tmp_path, run_line)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 7, "completed": 7, "failed": 0}, b
    out = lines_of(store, b["output_file_id"])
    assert sorted((r["custom_id"], r["response"]["body"]["choices"][0]["message"]["content"]) for r in out) == \
        sorted((f"c{i}", f"q{i}") for i in range(7))
    assert store.get_file(fid) is None and not (store.files_dir / fid).exists()
    assert not store.db.execute("SELECT 1 FROM batch_lines").fetchall()


def test_a_failed_batch_keeps_no_lines(tmp_path):
    """A batch that fails (here a bug while it runs) drops its lines as an ended one does; its
    counts are those of its lines when it failed."""
    store = Store(tmp_path)
    fid = input_file(store, 5)
    bid = store.add_batch(fid, ENDPOINT, 3600, "1h", None, "M")["id"]
    store.add_lines(bid, batches.validate_lines(store.file_content(fid), ENDPOINT)[0])
    for n in (1, 2):
        store.finish_line(bid, n, 200, {"id": "x"})
    store.close()
    store = Store(tmp_path)

    async def main():
        runner = BatchRunner(store, None, 1)
        runner._run_lines = lambda *a: (_ for _ in ()).throw(RuntimeError("a bug"))
        runner.start(bid)
        await runner.tasks[bid]
    asyncio.run(main())
    b = store.get_batch(bid)
    assert b["status"] == "failed" and b["request_counts"] == {"total": 5, "completed": 2, "failed": 0}
    assert not store.db.execute("SELECT 1 FROM batch_lines").fetchall()


def test_a_start_removes_what_a_stop_left_on_disk(tmp_path, caplog):
    """A deleted file's body (a stop between the delete and the unlink) and a part-written body an
    hour old are removed at the next start; a listed file's body, a part-written one being
    written now (another server on the data dir) and a body no file lists (it may be a user's:
    a database restored from a backup lists none of the files uploaded since) stay, the last
    counted in the log."""
    import os
    store = Store(tmp_path)
    kept = store.add_file(b"kept\n", "k.jsonl", "batch")["id"]
    gone = store.add_file(b"gone\n", "g.jsonl", "batch")["id"]
    store.db.execute("UPDATE files SET deleted=1 WHERE id=?", (gone,))
    for name in (".file-old.tmp", ".file-new.tmp", "file-unlisted"):
        (store.files_dir / name).write_bytes(b"part")
    hour_ago = time.time() - store_module.STALE_PART_S - 1
    os.utime(store.files_dir / ".file-old.tmp", (hour_ago, hour_ago))
    store.close()
    with caplog.at_level(logging.WARNING, logger="tandem.store"):
        Store(tmp_path).close()
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted([kept, ".file-new.tmp", "file-unlisted"])
    assert "holds 1 file bodies no file lists" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_database_is_named_with_what_to_do(tmp_path, damage):
    store = Store(tmp_path)
    for i in range(40):
        store.add_file(b"x" * 3000 + b"\n", f"{i}.jsonl", "batch")
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    path = tmp_path / "tandem.sqlite3"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x00" * 100 + data[100:])
    with pytest.raises(store_module.StoreError) as e:
        Store(tmp_path)
    assert str(path) in str(e.value) and "move it aside" in str(e.value)


def test_a_locked_database_is_not_called_damaged(tmp_path, monkeypatch):
    """Another process holds the database's write lock past the wait: the start says it cannot
    open it, not that it is damaged (whose advice, to move it aside, would lose its contents)."""
    Store(tmp_path).close()
    monkeypatch.setattr(store_module, "SIDE_WAIT_S", 0.05)
    other = sqlite3.connect(tmp_path / "tandem.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(store_module.StoreError) as e:
            Store(tmp_path)
    finally:
        other.close()
    assert "cannot be opened: database is locked" in str(e.value) and "damaged" not in str(e.value)
