"""The pieces of a request handler that must clean up when a request ends badly: a submission
read up to an error event, and the choices of an n > 1 request when one of them fails."""
import asyncio

import pytest

from tandem.sched.async_engine import Event, Submission
from tandem.sched.request import FinishReason
from tandem.server.app import all_or_none


class Books:
    """Stands in for the engine: records what a submission asks it to forget."""

    def __init__(self):
        self.forgot: list[tuple[str, bool]] = []

    def _forget(self, req_id: str, abort: bool) -> None:
        self.forgot.append((req_id, abort))


def test_a_submission_read_up_to_its_error_event_is_forgotten_when_closed():
    async def go():
        books, q = Books(), asyncio.Queue()
        sub = Submission(books, "r1", q)
        q.put_nowait(Event([5], "x"))
        q.put_nowait(Event([], "", FinishReason.ERROR, "device 0 failed"))
        with pytest.raises(RuntimeError):
            async for ev in sub.events():
                if ev.error:
                    raise RuntimeError(ev.error)      # as the handler does: the loop never resumes
        sub.close()
        sub.close()
        return books.forgot
    forgot = asyncio.run(go())
    assert forgot and forgot[0] == ("r1", False), "an ended request is forgotten, not aborted"
    assert all(f == ("r1", False) for f in forgot)


def test_closing_a_running_submission_aborts_it():
    async def go():
        books = Books()
        sub = Submission(books, "r2", asyncio.Queue())
        sub.close()
        return books.forgot
    assert asyncio.run(go())[0] == ("r2", True)


def test_when_one_choice_fails_the_others_are_cancelled():
    async def go():
        waiting = asyncio.Event()
        state = {}

        async def sibling():
            try:
                waiting.set()
                await asyncio.Event().wait()          # a choice whose request was closed under it
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise

        async def failing():
            await waiting.wait()
            raise ValueError("generation failed")

        with pytest.raises(ValueError):
            await all_or_none([sibling(), failing()])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return state, pending
    state, pending = asyncio.run(go())
    assert state == {"cancelled": True} and pending == []


def test_a_client_that_leaves_during_its_prediction_leaves_nothing_pending():
    """The prediction thread cannot be stopped part-way: when the handler is cancelled (its
    client went away), the requests are forgotten once the prediction ends, instead of waiting
    for ever among those whose real length the predictor would learn."""
    import threading
    from tandem.sched.request import Request
    from tandem.engine.params import SamplingParams
    from tandem.server.app import predict_lengths

    class Lengths:
        def __init__(self):
            self.entered, self.go_on, self.forgotten = threading.Event(), threading.Event(), threading.Event()
            self.pending: set[str] = set()

        def assign(self, reqs, texts):
            self.entered.set()
            self.go_on.wait(10)
            self.pending |= {r.req_id for r in reqs}

        def forget(self, ids):
            self.pending -= set(ids)
            self.forgotten.set()

    lengths = Lengths()
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(2)]

    async def main():
        task = asyncio.create_task(predict_lengths(lengths, reqs, ["a", "b"]))
        await asyncio.to_thread(lengths.entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    lengths.go_on.set()
    assert lengths.forgotten.wait(10) and not lengths.pending


def test_the_periodic_log_line_reads_rates_from_the_totals(monkeypatch, caplog):
    """vLLM's throughput line: tokens computed since the last line over the period, the requests
    and the pool as they are, the prefix cache's hits over its lookups in the period; nothing
    while there is no work."""
    from tandem.server import app as app_module
    monkeypatch.setattr(app_module, "STATS_EVERY_S", 0.05)
    quiet = dict(prefill=0, decode=0, running=0, waiting=0, kv=0.0, queried=0, hits=0)
    totals = iter([quiet, quiet, dict(prefill=20, decode=4, running=3, waiting=1, kv=0.25, queried=40, hits=10)])

    class Done(Exception):
        pass

    class Totals:
        def activity(self):
            if (t := next(totals, None)) is None:
                raise Done
            return t

    async def run():
        with pytest.raises(Done):
            await app_module.log_stats(Totals())    # two periods, then the scripted totals run out
    with caplog.at_level("INFO", logger="tandem.server"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert lines == ["Avg prompt throughput: 400.0 tokens/s, Avg generation throughput: 80.0 tokens/s, "
                     "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"]


def test_the_log_line_reads_the_metrics_the_server_exports():
    """What the line reads is what /metrics says: the samples' names and labels as exported,
    summed over the two classes (the pool's use is one series, the whole pool's)."""
    from tandem.server.metrics import Metrics
    m = Metrics("m")
    m.step_tokens.labels("m", "rt", "prefill").inc(7)
    m.step_tokens.labels("m", "be", "prefill").inc(5)
    m.step_tokens.labels("m", "be", "decode").inc(3)
    m.running.labels("m", "rt").set(2)
    m.waiting.labels("m", "be").set(4)
    m.kv_usage.labels("m").set(0.75)
    m.kv_usage_by_class.labels("m", "rt").set(0.25)
    m.prefix_queries.labels("m").inc(10)
    m.prefix_hits.labels("m").inc(6)
    assert m.activity() == dict(prefill=12, decode=3, running=2, waiting=4, kv=0.75, queried=10, hits=6)
