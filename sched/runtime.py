"""The serving runtime: every device actor steps on its own thread, never waiting for another.

    arrivals ──► Runtime.add ──► placement (rebalancer) or dispatcher ──► that actor's inbox
                   (cache-aware: where a device's prefix cache holds the start of the prompt, it
                   goes there while loads allow; ``cached_on``, ``placement.prefix_affinity``)
    actor thread:  drain inbox → plan → submit → collect (the worker runs the step; the GIL is
                   free meanwhile) → account → one ``on_updates(list)`` call per step
    migration:     ``Runtime.migrate(req_id, src, dst, kind)`` moves a request between devices,
                   between two of the source's steps: as its cache (KV: the source worker exports
                   it into shared memory, the destination imports it into blocks it reserved,
                   then the source frees its blocks) or as its tokens (the destination prefills
                   prompt + generated tokens again). Either way it continues token-exact, with its
                   sampling state; its stream sees a pause, never a gap or a repeat.

Failures are never silent:
- a worker that dies is restarted (bounded tries with back-off) and its requests are queued
  again to recompute their tokens, so their callers see a pause, not an error; a request that
  was on a worker through ``MAX_REQUEST_CRASHES`` deaths is failed instead (it may be the cause);
- a worker-side exception in a step fails that step's requests (the worker keeps serving);
- any other exception in an actor's loop is logged with an error id, fails that device's
  requests and resets its books; ``MAX_LOOP_FAILURES`` in a row without a good step in between
  mark the device dead. ``serving()`` is False while no device can serve (``/health`` 503).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.cache import PoolGeometry
from tandem.cache.prefix import block_keys
from tandem.engine.messages import Command, DeviceError, StepInput
from tandem.sched.actor import DeviceActor, Update
from tandem.sched.placement import prefix_affinity
from tandem.sched.rebalancer import Rebalancer, view_of
from tandem.sched.request import FinishReason, Migration, RequestState, Transfer, error_id

log = logging.getLogger("tandem.runtime")

MAX_RESTART_TRIES = 3        # tries to start a fresh worker after one died
RESTART_BACKOFF_S = 0.5      # doubled after each failed try
MAX_REQUEST_CRASHES = 2      # worker deaths a request may live through before it is failed
MAX_ABORTED_KEPT = 10_000    # cancelled ids remembered, for requests migrating while cancelled
MAX_LOOP_FAILURES = 3        # loop exceptions in a row (no good step between) before a device is dead
# work queued but nothing planned: plan again after this long (a message wakes the actor sooner);
# only time changes such a plan then (waits grow), and re-planning at once kept a core busy for ever
EMPTY_PLAN_RETRY_S = 0.01
IDLE_CHECK_S = 1.0           # an idle device's worker is checked for life this often
_LIVE: "weakref.WeakSet[Runtime]" = weakref.WeakSet()     # runtimes not stopped yet


@atexit.register
def _stop_all() -> None:
    """At interpreter exit the actors stop before multiprocessing stops the worker processes (its
    exit handler was registered first, so it runs after this one): no actor takes a worker
    stopped then for one that died, and starts another."""
    for rt in list(_LIVE):
        rt.stop()


@dataclass(slots=True)
class Add:
    st: RequestState
    for_prefix: bool = False     # this device's prefix cache held the start of its prompt when it was placed


@dataclass(slots=True)
class Abort:
    req_id: str


@dataclass(slots=True)
class MoveOut:
    req_id: str
    dst: "ActorThread"
    kind: Transfer = Transfer.TOKEN
    reason: str = ""


@dataclass(slots=True)
class MoveIn:
    st: RequestState
    rows: object | None = None            # its exported cache (KV moves)
    src: "ActorThread | None" = None      # told to free the request's blocks once imported


@dataclass(slots=True)
class Release:
    req_id: str


@dataclass(slots=True)
class Report:
    """Nothing to do: the turn it wakes runs the step listeners, so they see the device before
    its first step (the dashboard lists an idle device, its pool all free); ``done`` is set once
    they ran."""
    done: threading.Event = field(default_factory=threading.Event)


Message = Add | Abort | MoveOut | MoveIn | Release | Report


class ActorThread:
    """Runs one DeviceActor against its worker on a thread of its own."""

    def __init__(self, actor: DeviceActor, on_updates: Callable[[list[Update]], None],
                 listeners: list[Callable[[DeviceActor], None]], aborted: dict[str, None] | None = None,
                 plan_listeners: list[Callable[[DeviceActor], None]] = ()):
        self.actor = actor
        self.aborted = aborted if aborted is not None else {}   # ids cancelled while they may be moving
        self._sources: dict[str, ActorThread] = {}   # imports not yet confirmed -> their source
        self.on_updates = on_updates
        self.listeners = listeners        # run on this thread after every step (metrics)
        self.plan_listeners = plan_listeners   # and once a step is planned, before it runs (status view)
        self._inbox: deque[Message] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._planned_nothing = False     # the last step's plan told the device nothing
        self.restarting = False
        self.loop_failures = 0            # loop exceptions since the last good step
        self.restarts = 0                 # workers started to replace dead ones
        self._thread = threading.Thread(target=self._run, name=f"tandem-actor-{actor.device.name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, msg: Message) -> None:
        with self._wake:
            self._inbox.append(msg)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def serving(self) -> bool:
        return self.actor.dead is None and not self.restarting

    def num_queued(self) -> int:
        return len(self._inbox) + len(self.actor.waiting)

    # ---- the loop ------------------------------------------------------------------
    def _run(self) -> None:
        a = self.actor
        while True:
            died = None
            with self._wake:           # idle means idle: sleep until a message or work arrives
                while not self._stop and not self._inbox and not (a.dead is None and
                                                                  (a.has_work() or a.has_messages())):
                    self._wake.wait(IDLE_CHECK_S)
                    if (died := self._died_idle()) is not None:
                        break
                if self._planned_nothing and not self._stop and not self._inbox:
                    self._wake.wait(EMPTY_PLAN_RETRY_S)
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, deque()
                self._planned_nothing = False
            reports = [m for m in inbox if isinstance(m, Report)]
            updates: list[Update] = []
            if died is not None:        # restarted now, not at the next request's step
                updates.extend(self._recover(self._worker_died, died))
            try:
                while inbox:
                    updates.extend(self._handle(inbox.popleft()))
                self._release_settled()
                if a.dead is None and (a.has_work() or a.has_messages()):
                    updates.extend(self._step())
                    self.loop_failures = 0
            except DeviceError as e:
                self._put_back(inbox)
                updates.extend(self._recover(self._worker_died, str(e)))
            except Exception:            # a bug in the loop (a policy, the books): never silent
                self._put_back(inbox)
                updates.extend(self._recover(self._loop_failed, traceback.format_exc()))
            if updates:
                self.on_updates(updates)
            self._tell(self.listeners)
            for r in reports:
                r.done.set()

    def _tell(self, listeners) -> None:
        """Run ``listeners`` on this device; one that fails is logged, never the device's failure."""
        for fn in listeners:
            try:
                fn(self.actor)
            except Exception:
                log.exception("step listener failed")

    def _died_idle(self) -> str | None:
        """Why this idle device's worker is gone, or None: a worker that dies between requests
        is started again at once (a device that says it can tell), so the next request finds
        it ready and /health does not call a device without a worker ok."""
        alive = getattr(self.actor.device, "alive", None)
        if alive is None or self.actor.dead is not None or self.restarting or alive():
            return None
        return self.actor.device.death(idle=True)

    def _recover(self, how: Callable[[str], list[Update]], why: str) -> list[Update]:
        """Run a recovery. Should it fail as well (the books it works on are what broke), the
        device is marked dead and every request on it ends with an error, built without those
        books: the thread lives on, answering arrivals with errors, instead of dying silently
        while the server still routes requests to it."""
        try:
            return how(why)
        except Exception:                # noqa: BLE001 -- the last line of defence
            a, eid = self.actor, error_id()
            log.critical("%s: recovery failed (%s); the device is marked down:\n%s", a.device.name, eid,
                         traceback.format_exc())
            a.dead = f"recovery failed (error id {eid})"
            self.restarting = False
            self._release_sources()      # the sources of caches it was importing free theirs
            error = f"device {a.device.name} failed: {a.dead}"
            return [a.end_without_books(st, error) for st in list(a.states.values())]

    def _put_back(self, unread: deque) -> None:
        """Messages not handled when one of them failed go back to the front of the inbox, in
        order, for the next turn (after the recovery): an arrival, a migrating request or an
        abort behind the failed message is never dropped with it."""
        if unread:
            with self._wake:
                self._inbox.extendleft(reversed(unread))
            unread.clear()

    def _handle(self, msg: Message) -> list[Update]:
        a = self.actor
        if isinstance(msg, Add):
            if a.dead is not None:
                return [Update(msg.st.req_id, [], FinishReason.ERROR, f"device {a.device.name} is down")]
            a.add(msg.st)
            a.prefix_routed += msg.for_prefix
        elif isinstance(msg, Abort):
            u = a.abort(msg.req_id)
            return [u] if u is not None else []
        elif isinstance(msg, MoveOut):
            self._move_out(msg)
        elif isinstance(msg, MoveIn):
            return self._move_in(msg)
        elif isinstance(msg, Release):
            a.release(msg.req_id)
        return []

    def _move_out(self, msg: MoveOut) -> None:
        """Send a request to another device, with its cache when asked and possible (else as
        tokens): between two steps of this device, so it is never half-computed."""
        a = self.actor
        st = a.states.get(msg.req_id)
        if st is None:               # it finished (or was cancelled) meanwhile
            return
        if not msg.dst.serving:      # down or restarting: the request would wait there, or fail
            log.info("not migrating %s to %s: that device is %s", msg.req_id, msg.dst.actor.device.name,
                     "restarting" if msg.dst.restarting else "down")
            return
        move = Migration(msg.kind, a.index, msg.dst.actor.index, a.clock(), st.num_tokens, reason=msg.reason)
        rows = None
        if msg.kind is Transfer.KV and a.can_export(msg.req_id):
            inp = a.export_input(msg.req_id)
            out = self._exchange(inp)
            if out.error:
                log.error("%s: exporting %s failed, it moves as tokens:\n%s", a.device.name, msg.req_id, out.error)
                a.recover_step(inp)
            rows = out.exported.get(msg.req_id)
        if rows is None:
            move.kind = Transfer.TOKEN
        else:
            move.cache_bytes = rows.nbytes
        st = a.detach(msg.req_id, keep_cache=rows is not None)
        st.moving = move
        a.moved_out[move.kind] += 1
        log.info("migrating %s from %s to %s as %s (%d tokens%s): %s", msg.req_id, a.device.name,
                 msg.dst.actor.device.name, move.kind.value, move.tokens,
                 f", {move.cache_bytes} bytes" if rows is not None else "", msg.reason or "asked")
        msg.dst.post(MoveIn(st, rows, self if rows is not None else None))

    def _move_in(self, msg: MoveIn) -> list[Update]:
        a = self.actor
        rid = msg.st.req_id
        imported = False
        try:
            if a.dead is not None or rid in self.aborted:   # it ends here, as it would have there
                a.attach(msg.st)
                return [a.fail(rid, f"device {a.device.name} is down") if a.dead is not None
                        else a.abort(rid)]
            imported = a.attach(msg.st, msg.rows)
            if imported:
                self._sources[rid] = msg.src
            return []
        finally:
            if msg.src is not None and not imported:
                msg.src.post(Release(rid))

    def _exchange(self, inp: StepInput):
        """One round trip with the worker; the sources of the caches it imported are told to free
        theirs (whatever the step's outcome: the copy no longer needs them)."""
        try:
            self.actor.device.submit(inp)
            return self.actor.device.collect()
        finally:
            self._release_settled()

    def _release_settled(self) -> None:
        """Tell the sources of imports that are no longer pending (done, or cancelled because the
        request lost its cache here first) to free their copies."""
        pending = self.actor.pending_imports()
        self._release_sources([rid for rid in self._sources if rid not in pending])

    def _release_sources(self, rids: list[str] | None = None) -> None:
        for rid in list(self._sources) if rids is None else rids:
            src = self._sources.pop(rid, None)
            if src is not None:
                src.post(Release(rid))

    def _step(self) -> list[Update]:
        a = self.actor
        p = a.plan()
        if p is None:
            self._planned_nothing = True
            return []
        self._tell(self.plan_listeners)
        out = self._exchange(p.inp)
        if out.error:                # the worker raised in this step; it keeps serving the others
            eid = error_id()
            log.error("%s: step failed (%s), its %d request(s) fail:\n%s", a.device.name, eid,
                      len(p.inp.scheduled), out.error)
            why = f"internal error while generating (error id {eid})"
            a.recover_step(p.inp)
            return [a.fail(s.req_id, why) for s in p.inp.scheduled if s.req_id in a.states]
        return a.account(p, out)

    def _worker_died(self, why: str) -> list[Update]:
        """Start a fresh worker and queue the requests again; fail the device if it cannot start."""
        a = self.actor
        named = why if why.startswith(a.device.name + ":") else f"{a.device.name}: {why}"   # a DeviceError names it
        log.error("%s; restarting it", named)
        self.restarting = True
        self._release_sources()
        updates = []
        for st in [s for s in a.states.values() if s.sent_to_device]:   # those the worker held
            st.num_crashes += 1
            if st.num_crashes > MAX_REQUEST_CRASHES:
                updates.append(a.fail(st.req_id, f"the device failed {st.num_crashes} times while "
                                                 "running this request"))
        try:
            for attempt in range(MAX_RESTART_TRIES):
                time.sleep(RESTART_BACKOFF_S * 2 ** attempt)
                if self._stop:
                    return updates
                try:
                    geometry = PoolGeometry.of(a.device.restart())
                except Exception as e:          # noqa: BLE001 -- any failure to start counts as a try
                    log.error("%s: restart %d failed: %s", a.device.name, attempt + 1, e)
                    continue
                if a.new_pool(geometry).geometry != a.pool.geometry:     # as the pool reads it
                    log.error("%s: the new worker's pool differs (%s, was %s)", a.device.name,
                              geometry, a.pool.geometry)
                    break
                self.restarts += 1
                a.requeue_all(geometry)
                log.warning("%s: worker restarted; %d request(s) queued again", a.device.name, len(a.states))
                return updates
            a.dead = why
            return updates + a.fail_all(f"device {a.device.name} failed: {why}")
        finally:
            self.restarting = False

    def _loop_failed(self, tb: str) -> list[Update]:
        """An exception outside the worker: log it, fail this device's requests, reset the books
        and the worker's request state; after MAX_LOOP_FAILURES in a row the device is dead."""
        a = self.actor
        eid = error_id()
        self.loop_failures += 1
        log.error("%s: scheduling loop failed (%s, %d in a row):\n%s", a.device.name, eid,
                  self.loop_failures, tb)
        why = f"internal error in the scheduler (error id {eid})"
        updates = a.fail_all(why)
        self._release_sources()
        try:
            a.requeue_all(a.pool.geometry)          # nothing is left to requeue: fresh books
            a.device.submit(StepInput(Command.RESET, -1))
            a.device.collect()
        except Exception as e:                      # noqa: BLE001
            log.error("%s: reset after the failure failed too: %s", a.device.name, e)
            self.loop_failures = MAX_LOOP_FAILURES
        if self.loop_failures >= MAX_LOOP_FAILURES:
            a.dead = why
        return updates


class Runtime:
    """The actors of one Scheduler, each on its own thread; ``on_updates`` gets every step's
    updates in one call, from that actor's thread. With a ``rebalancer`` (several devices), it
    places arrivals and its own thread sends its migrations once an epoch."""

    def __init__(self, scheduler, on_updates: Callable[[list[Update]], None],
                 rebalancer: Rebalancer | None = None, prefix_routing: bool = True):
        self.scheduler = scheduler
        self.rebalancer = rebalancer
        self.prefix_routing = prefix_routing and len(scheduler.actors) > 1
        self.listeners: list[Callable[[DeviceActor], None]] = []
        self.plan_listeners: list[Callable[[DeviceActor], None]] = []
        self.aborted: dict[str, None] = {}       # cancelled ids (bounded, oldest dropped first)
        if rebalancer is not None:
            on_updates = self._noting_departures(on_updates)
            self.listeners.append(lambda a: rebalancer.observe(view_of(a)))
        scheduler.threaded = True
        self.threads = [ActorThread(a, on_updates, self.listeners, self.aborted, self.plan_listeners)
                        for a in scheduler.actors]
        self._where: dict[int, ActorThread] = {id(t.actor): t for t in self.threads}
        self._stopping = threading.Event()
        _LIVE.add(self)
        for t in self.threads:
            t.start()
        if rebalancer is not None:
            threading.Thread(target=self._rebalance, name="tandem-rebalancer", daemon=True).start()

    def _noting_departures(self, on_updates):
        rb = self.rebalancer

        def routed(updates: list[Update]) -> None:
            for u in updates:
                if u.finish_reason is not None:
                    rb.depart(u.req_id)
            on_updates(updates)
        return routed

    def _rebalance(self) -> None:
        """Once an epoch: the rebalancer's migrations, sent to their source devices."""
        rb = self.rebalancer
        while not self._stopping.wait(rb.budgets.epoch_s):
            try:
                restarting = frozenset(t.actor.index for t in self.threads if t.restarting)
                down = frozenset(t.actor.index for t in self.threads if t.actor.dead is not None)
                for o in rb.epoch(restarting, down):
                    self.migrate(o.req_id, o.src, o.dst, o.transfer, o.reason)
            except Exception:                  # never silent, never fatal: the next epoch tries again
                log.exception("rebalancer epoch failed")

    def report(self, timeout_s: float | None = 30.0) -> bool:
        """Every actor runs the step listeners once, on its own thread, without stepping; returns
        once they all did (False if one did not within ``timeout_s``: a device stuck in a step;
        None waits for as long as it takes)."""
        reports = [Report() for _ in self.threads]
        for t, r in zip(self.threads, reports):
            t.post(r)
        if timeout_s is None:
            return all(r.done.wait() for r in reports)
        deadline = time.monotonic() + timeout_s
        return all(r.done.wait(max(0.0, deadline - time.monotonic())) for r in reports)

    def add(self, st: RequestState, device: int | None = None) -> None:
        """Hand a checked request (Scheduler.new_state) to ``device``, or to the one the
        rebalancer's placement (else the dispatcher) picks, cache-aware (``cached_on``)."""
        cached = self.cached_on(st) if device is None and self.prefix_routing else {}
        if device is None and self.rebalancer is not None:
            device = self._placed(st, cached)
        t = self.threads[device] if device is not None else self._where[id(self.dispatch(cached))]
        st.device = t.actor.index
        t.post(Add(st, cached.get(st.device, 0) > 0))

    def cached_on(self, st: RequestState) -> dict[int, int]:
        """Device -> leading token-blocks of the request's prompt its prefix cache holds now (as
        the device would look them up: at least the last prompt token left to compute; none for
        a request that scores its prompt). Read from the router's thread: a dictionary probe per
        block, and a device's answer may be one step old, which only affects where it goes."""
        if st.request.sampling.prompt_logprobs is not None:
            return {}
        prompt = st.request.prompt_token_ids
        out, keys = {}, []
        for t in self.threads:
            pool = t.actor.pool
            if pool.prefix is None or t.actor.dead is not None:
                continue
            limit = (len(prompt) - 1) // pool.geometry.block_size
            if not keys:
                block_keys(prompt, pool.geometry.block_size, keys, limit * pool.geometry.block_size,
                           st.request.prefix_salt)
            n = pool.cached_prefix(keys, limit)
            if n:
                out[t.actor.index] = n
        return out

    def _placed(self, st: RequestState, cached: dict[int, int]) -> int:
        """The placement's device for an arrival. A device down for good leaves the placement's
        books and the arrival is placed again among the others. One restarting its worker while
        another serves keeps the arrival in its books, and the dispatcher's device (a serving one;
        a restart takes seconds) runs it until it moves there once its device serves again."""
        g = self.threads[0].actor.pool.geometry
        blocks = g.blocks_for(st.num_tokens, st.cache_type)
        while True:
            if not self.accepting():
                raise DeviceError(self.why_down())
            d = self.rebalancer.arrive(st.req_id, blocks, cached)
            t = self.threads[d]
            if t.actor.dead is None:
                break
            self.rebalancer.device_down(d)      # the arrival leaves the books with it
        if t.serving or not self.serving():
            return d
        there = self.dispatch(cached).index
        self.rebalancer.sent_elsewhere(st.req_id, there)
        return there

    def dispatch(self, cached: dict[int, int] | None = None) -> DeviceActor:
        """The least-loaded device that is not dead, serving ones first: a device restarting its
        worker still takes arrivals (they wait in its inbox), so nothing is refused meanwhile.
        With ``cached`` (device -> cached token-blocks of the request's prompt), a serving device
        holding them goes first, within ``placement.affinity_slack`` requests of the least-loaded."""
        live = [t for t in self.threads if t.actor.dead is None]
        if not live:
            raise DeviceError(self.why_down())
        if cached:
            d = prefix_affinity(cached, {t.actor.index: t.actor.load() + len(t._inbox) for t in live if t.serving})
            if d is not None:
                return self.threads[d].actor
        return min(live, key=lambda t: (not t.serving, t.actor.load() + len(t._inbox))).actor

    def abort(self, req_id: str) -> None:
        """Cancel a request wherever it is (a migration may be moving it): every actor is told,
        the one holding it frees its blocks at its next turn; one it arrives at later ends it."""
        self.aborted[req_id] = None
        while len(self.aborted) > MAX_ABORTED_KEPT:
            self.aborted.pop(next(iter(self.aborted)), None)
        for t in self.threads:
            t.post(Abort(req_id))

    def migrate(self, req_id: str, src: int, dst: int, kind: Transfer = Transfer.TOKEN,
                reason: str = "") -> None:
        """Migration a request from device ``src`` to ``dst`` between two of src's steps: as its cache
        (KV; as tokens where the cache cannot be exported or does not fit ``dst``) or as its
        tokens, recomputed by ``dst`` first in line. No-op if it is no longer on ``src``."""
        if src == dst:
            raise ValueError(f"migrate: {req_id} would move from device {src} to itself")
        self.threads[src].post(MoveOut(req_id, self.threads[dst], kind, reason))

    def serving(self) -> bool:
        """Some device can run a step now (False while every one is dead or restarting)."""
        return any(t.serving for t in self.threads)

    def accepting(self) -> bool:
        """Some device is not dead: arrivals are taken (and wait out a restart)."""
        return any(t.actor.dead is None for t in self.threads)

    def why_down(self) -> str:
        return "no device can serve: " + "; ".join(
            f"{t.actor.device.name}: {'restarting' if t.restarting else t.actor.dead}" for t in self.threads)

    def num_waiting(self, rt_only: bool = False) -> int:
        """Requests waiting on every device; ``rt_only``: less the BE requests waiting once the
        devices' last plans were applied (an RT request runs before them, so they do not keep it
        out)."""
        return sum(max(0, t.num_queued() - (t.actor.waiting_be if rt_only else 0)) for t in self.threads)

    def chats_overdue(self, targets: float) -> bool:
        """Does every live device hold a chat (one of its last plan) that has waited more than
        ``targets`` TTFT targets for its first token by now? Then a new chat would wait behind
        chats that fill every step, wherever it is placed."""
        live = [t for t in self.threads if t.actor.dead is None]
        return bool(live) and all(t.actor.chat_wait_targets() > targets for t in live)

    def stop(self) -> None:
        self._stopping.set()
        _LIVE.discard(self)
        for t in self.threads:
            t.stop()
