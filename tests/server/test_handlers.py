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
