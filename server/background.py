"""Responses created with ``background: true``: each runs in a task of its own, not tied to
the connection that asked for it. A client polls ``GET /v1/responses/{id}`` (queued,
in_progress, then completed, incomplete, failed or cancelled), cancels it with ``POST
/v1/responses/{id}/cancel``, or reads its stream events, from the start or after the
``sequence_number`` it last saw, as often as it reconnects.

What is accepted is not lost: the request is kept in the store until it ends, and one the
server stopped before its end runs again from its start when the model is next loaded, with
the seed its first run drew: its events are the first run's again (the same tokens, as far as a
different batch's rounding leaves sampling alone; a tool call's id is new), so a reader goes on
after the last one it saw.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import AsyncIterator, Awaitable, Callable

import orjson

from tandem.sched.request import error_id
from tandem.server.errors import out_of_storage, when_stored
from tandem.server.store import Store

KEPT_LOGS = 100                 # finished responses whose events stay readable, the newest,
KEPT_LOG_BYTES = 64 << 20       # as long as their events take at most this much memory together

log = logging.getLogger("tandem.responses")


def sse(kind: str, payload: dict) -> bytes:
    """One server-sent event of the Responses API: its type, and the type with ``payload`` as data."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


class EventLog:
    """A response's stream events as they are sent, for readers that come and go."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.nbytes = 0
        self.done = False
        self._changed = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.events.append(data)
        self.nbytes += len(data)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, after: int) -> AsyncIterator[bytes]:
        """The events numbered after ``after`` (-1: all), as they come, until the response ends."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._changed.wait()


class Background:
    """The running background responses, and the events of those running or recently ended."""

    def __init__(self, store: Store):
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}
        self.logs: OrderedDict[str, EventLog] = OrderedDict()
        self._cancelled: set[str] = set()

    def start(self, rid: str, run: Callable[[EventLog], Awaitable[None]]) -> EventLog:
        """Run ``run(events)`` for the kept response ``rid``; its request is kept until it ends."""
        events = self.logs[rid] = EventLog()
        self.tasks[rid] = asyncio.get_running_loop().create_task(self._run(rid, run, events))
        return events

    async def _run(self, rid: str, run: Callable[[EventLog], Awaitable[None]], events: EventLog) -> None:
        """``run`` keeps the response it ends with (also a failure it can name); a cancel keeps it
        cancelled, a bug failed. A stop of the server leaves it to run again."""
        try:
            await run(events)
            await when_stored(lambda: self.store.end_response_job(rid), f"background response {rid}", log)
        except asyncio.CancelledError:
            if rid in self._cancelled:
                self._settle(rid, "cancelled")
            raise
        except Exception:                # noqa: BLE001 -- the response must reach a final state
            eid = error_id()
            log.exception("background response %s failed (%s)", rid, eid)
            await self.failed(rid, events, {"code": "server_error", "message": f"internal error (error id {eid})"})
        finally:
            events.close()
            self.tasks.pop(rid, None)
            self._cancelled.discard(rid)
            self._forget_old()

    def _settle(self, rid: str, status: str, error: dict | None = None) -> dict | None:
        """The kept response ended as ``status``: the response as kept now (None if forgotten)."""
        kept = self.store.get_response(rid)
        response = None if kept is None else kept[0] | {"status": status, "error": error}
        if response is not None:
            self.store.set_response(response, ends_job=True)
        else:
            self.store.end_response_job(rid)
        return response

    def in_progress(self, response: dict) -> None:
        """``response`` kept as it is now (in progress). Where the data dir refuses the write, the
        kept one stays queued and generation goes on: its end is what must be kept (it waits for
        room, ``errors.when_stored``)."""
        try:
            self.store.set_response(response)
        except Exception as e:           # noqa: BLE001 -- re-raised unless the disk is full
            if not out_of_storage(e):
                raise
            log.warning("background response %s: the data dir refused a write (%s)", response["id"], e)

    async def failed(self, rid: str, events: EventLog, error: dict) -> None:
        """``rid`` kept failed with ``error`` (OpenAI's code and message), and its readers told
        (``response.failed``)."""
        response = self._settle(rid, "failed", error)
        if response is not None:
            await events.write(sse("response.failed", {"sequence_number": len(events.events),
                                                       "response": response}))

    def _forget_old(self) -> None:
        """The oldest ended responses' events go, past ``KEPT_LOGS`` of them or ``KEPT_LOG_BYTES``."""
        ended = [rid for rid in self.logs if rid not in self.tasks]
        held = sum(self.logs[rid].nbytes for rid in ended)
        while ended and (len(ended) > KEPT_LOGS or held > KEPT_LOG_BYTES):
            held -= self.logs.pop(ended.pop(0)).nbytes

    async def cancel(self, rid: str) -> None:
        """Stop ``rid`` where it still runs (or waits to run again) and keep it cancelled; one
        that has ended stays as it is."""
        task = self.tasks.get(rid)
        if task is not None:
            self._cancelled.add(rid)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif self.store.response_job(rid) is not None:
            self._settle(rid, "cancelled")

    async def stop(self) -> None:
        """The server stops: every running response is stopped and stays kept, to run again."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
