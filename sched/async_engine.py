"""AsyncEngine: the device actors (sched/runtime.py) as seen from an asyncio event loop.

HTTP handlers call ``submit`` and read a per-request asyncio queue of events. Each device
actor's step ends in one ``call_soon_threadsafe`` carrying all of that step's updates for this
engine, so the event loop wakes once per step, however many requests the step served.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from tandem.engine.messages import TokenLogprobs
from tandem.sched.actor import Update
from tandem.sched.beam import BeamSearch, BeamSearchParams
from tandem.sched.llm import LLM
from tandem.sched.request import FinishReason, Request


class GenerationFailed(RuntimeError):
    """A request failed on its device after it was accepted (the event's error)."""


@dataclass(slots=True)
class Event:
    """One request's progress: new token ids and text, and at the end its finish reason."""
    new_token_ids: list[int]
    text: str = ""                    # new text (a possible stop-string start is held back)
    finish_reason: FinishReason | None = None
    error: str | None = None          # set when the request failed (finish_reason ERROR)
    queue_s: float | None = None      # with the first token and at the end: seconds waiting before first scheduled
    logprobs: list | None = None      # TokenLogprobs of new_token_ids, when the request asked for them
    prompt_logprobs: list | None = None   # with the first token, when asked: per prompt token (None first)
    cached_tokens: int = 0            # at the end: prompt tokens found in the prefix cache
    stop_reason: str | int | None = None  # at the end: the stop string or stop token id that ended it


class AsyncEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.scheduler = llm.scheduler
        self.runtime = llm.start_runtime()
        self.step_listeners = self.runtime.listeners   # callables(actor), run on its thread per step
        self.plan_listeners = self.runtime.plan_listeners   # and once each step is planned
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.admitting = 0            # requests accepted, not queued yet (their lengths being predicted)
        self.admitting_be = 0         # of them, BE ones (a batch's lines among them)

    # ---- called from the event loop -----------------------------------------
    def submit(self, req: Request) -> "Submission":
        """Queue ``req`` now; read it with ``Submission.events()``. ValueError if it can never run,
        DeviceError if no device can serve."""
        st = self.scheduler.new_state(req)
        self._loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.req_id] = q
        self.llm.subscribe([req.req_id], self._sink)
        try:
            self.runtime.add(st)
        except BaseException:
            self._forget(req.req_id, abort=False)
            raise
        return Submission(self, req.req_id, q)

    async def beam_search(self, req: Request, params: BeamSearchParams,
                          top: int = 0) -> tuple[BeamSearch, list[float], int]:
        """``req``'s prompt searched as sched/beam.py says: each step submits one one-token request
        per live beam, with ``req``'s class, targets and cache salt (and seed, each step's beams
        their own); ``req``'s max_tokens bounds the steps; ``top``: alternatives to list per token
        (each step lists at least 2·width). Returns the search, the clock at each step's end and
        the prompt tokens the first step found in the prefix cache. ValueError / DeviceError as
        ``submit``, GenerationFailed if a step fails."""
        search = BeamSearch(req.prompt_token_ids, params, self.llm.spec.eos_token_ids, req.sampling.max_tokens)
        ends, cached = [], 0
        while not search.done:
            steps = search.step_requests(req.req_id, req.sampling.seed, top, service_class=req.service_class,
                                         slo_ttft_s=req.slo_ttft_s, slo_tbt_s=req.slo_tbt_s, cache_salt=req.cache_salt,
                                         adapter=req.adapter)
            subs: list[Submission] = []
            try:
                for r in steps:
                    subs.append(self.submit(r))
                got = await asyncio.gather(*(s.token() for s in subs))
            finally:
                for s in subs:
                    s.close()
            if not ends:                  # the first step's prompt is the request's
                cached = got[0][2]
            search.advance([lp for _, lp, _ in got], [t for t, _, _ in got])
            ends.append(time.monotonic())
        return search, ends, cached

    @property
    def dead(self) -> str | None:
        """Why no request can be taken (every device dead); None while one can."""
        return None if self.runtime.accepting() else self.runtime.why_down()

    def serving(self) -> bool:
        """Some device can run a step now (``/health``): False also while every one restarts."""
        return self.runtime.serving()

    def num_waiting(self, rt_only: bool = False) -> int:
        """Requests waiting for a device, and those accepted on their way to one; ``rt_only``:
        but the BE requests waiting (``Runtime.num_waiting``)."""
        return self.runtime.num_waiting(rt_only) + self.admitting - (self.admitting_be if rt_only else 0)

    def num_requests(self) -> int:
        """Requests accepted and not ended (each of a prompt's n choices one)."""
        return len(self._queues) + self.admitting

    def chats_overdue(self, targets: float) -> bool:
        """Every device holds a chat waiting more than ``targets`` TTFT targets for its first token."""
        return self.runtime.chats_overdue(targets)

    def shutdown(self) -> None:
        self.llm.shutdown()

    def _forget(self, req_id: str, abort: bool) -> None:
        self._queues.pop(req_id, None)
        self.llm.unsubscribe([req_id])
        if abort:
            self.runtime.abort(req_id)

    # ---- called on an actor's thread ---------------------------------------------
    def _sink(self, updates: list[Update]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates: list[Update]) -> None:
        for u in updates:
            q = self._queues.get(u.req_id)
            if q is not None:
                q.put_nowait(Event(u.new_token_ids, u.text, u.finish_reason, u.error, u.queue_s, u.logprobs,
                                 u.prompt_logprobs, u.cached_tokens, u.stop_reason))


class Submission:
    """One submitted request as seen by its caller."""

    def __init__(self, engine: AsyncEngine, req_id: str, q: asyncio.Queue):
        self.engine, self.req_id, self._q = engine, req_id, q
        self.done = False

    async def events(self) -> AsyncIterator[Event]:
        """Yield events until the request ends."""
        while not self.done:
            ev: Event = await self._q.get()
            self.done = ev.finish_reason is not None
            yield ev
        self.engine._forget(self.req_id, abort=False)

    async def token(self) -> tuple[int, TokenLogprobs, int]:
        """A one-token request's token, its log probabilities (it asked for them) and the prompt
        tokens it found in the prefix cache, once it ends; GenerationFailed if it failed or ended
        without a token."""
        ids, lps, cached = [], [], 0
        async for ev in self.events():
            ids += ev.new_token_ids
            lps += ev.logprobs or []
            cached = ev.cached_tokens
            if ev.error:
                raise GenerationFailed(f"generation failed: {ev.error}")
        if not ids or not lps:
            raise GenerationFailed(f"generation failed: {self.req_id} ended without a token")
        return ids[0], lps[0], cached

    def close(self) -> None:
        """Stop listening; abort the request if it has not ended (frees its blocks at once).
        Idempotent, and needed also after the last event when the caller stopped reading there
        (an error event, a client gone while the last chunk was written)."""
        abort, self.done = not self.done, True
        self.engine._forget(self.req_id, abort=abort)
