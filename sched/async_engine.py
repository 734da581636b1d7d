"""AsyncEngine: the scheduler loop on its own thread, driven from asyncio.

HTTP handlers call ``submit`` and read a per-request asyncio queue of events.
The engine thread owns the Scheduler: it drains the inbox (new requests,
aborts), runs one ``step()`` and pushes each request's new tokens back to the
event loop with ``call_soon_threadsafe``. Nothing else touches the Scheduler.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from engine.llm import LLM
from engine.messages import DeviceError
from sched.request import FinishReason, Request


@dataclass(slots=True)
class Event:
    """One request's progress: new token ids, and at the end its finish reason."""
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None          # set when the request was rejected or failed
    rejected: bool = False            # the scheduler refused it (bad input): nothing ran
    text_end: int | None = None       # at the end: where a stop string cut the text
    queue_s: float | None = None      # at the end: seconds waiting before first scheduled


class AsyncEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.scheduler = llm.scheduler
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.dead: str | None = None
        self.step_listeners: list = []    # callables(updates) run on the engine thread after each round
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop -----------------------------------------
    def submit(self, req: Request) -> "Submission":
        """Queue ``req`` now (it counts as waiting at once); read it with ``Submission.events()``."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.req_id] = (asyncio.get_running_loop(), q)
        self._post("add", req)
        return Submission(self, req.req_id, q)

    def num_waiting(self) -> int:
        return sum(len(q.waiting) for q in self.scheduler.queues) + len(self._inbox)

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self.llm.shutdown()

    def _forget(self, req_id: str, abort: bool) -> None:
        self._queues.pop(req_id, None)
        if abort:
            self._post("abort", req_id)

    def _post(self, kind: str, payload) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    # ---- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.scheduler.has_unfinished():
                    self._wake.wait()
                if self._stop:
                    return
                inbox, self._inbox = list(self._inbox), deque()
            for kind, payload in inbox:
                self._handle(kind, payload)
            updates = self.scheduler.step() if self.scheduler.has_unfinished() else []
            for fn in self.step_listeners:          # also after aborts alone: gauges stay current
                fn(updates)
            for u in updates:
                self._emit(u.req_id, Event(u.new_token_ids, u.finish_reason, u.error,
                                           text_end=u.text_end, queue_s=u.queue_s))

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            req: Request = payload
            try:
                self.scheduler.add(req)
            except (ValueError, DeviceError) as e:
                self._emit(req.req_id, Event([], None, str(e), rejected=True))
        elif kind == "abort":
            self.scheduler.abort(payload)

    def _emit(self, req_id: str, ev: Event) -> None:
        target = self._queues.get(req_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, ev)


class Submission:
    """One submitted request as seen by its caller."""

    def __init__(self, engine: AsyncEngine, req_id: str, q: asyncio.Queue):
        self.engine, self.req_id, self._q = engine, req_id, q
        self.done = False

    async def events(self) -> AsyncIterator[Event]:
        """Yield events until the request ends (finish or rejection)."""
        while not self.done:
            ev: Event = await self._q.get()
            self.done = ev.finish_reason is not None or ev.rejected
            yield ev
        self.engine._forget(self.req_id, abort=False)

    def close(self) -> None:
        """Abort the request if it has not ended (idempotent; frees its blocks at once)."""
        if not self.done:
            self.done = True
            self.engine._forget(self.req_id, abort=True)
