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
