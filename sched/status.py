"""One device's state as plain JSON-ready data, for the status endpoint and the dashboard. Built
on the device actor's own thread right after its step (it alone changes its books), so the
numbers of one device are taken at one instant."""
from __future__ import annotations

from collections import Counter

from tandem.engine.messages import CacheType
from tandem.sched.actor import reason_kind
from tandem.sched.scheduler import load_by_class, pool_view

MAX_LISTED = 256          # requests listed per device (the oldest first); the counts cover them all


def device_status(actor, now: float) -> dict:
    """Pool by owner and by cache type, requests running and waiting per class, and each
    request's place: running or waiting, why (the policy's last word on it), its level, its LoRA
    adapter; how many wait for each reason; the adapters of the requests running and waiting."""
    load = {c.value: {"running": v[0], "waiting": v[1], "blocks": v[2]} for c, v in load_by_class([actor]).items()}
    held = _Held(actor.pool)
    waiting_why: Counter = Counter()
    plan = actor.last_plan
    requests = []
    adapters: dict[str, set[str]] = {"running": set(), "waiting": set()}
    for state, ids in (("running", actor.running), ("waiting", actor.waiting)):
        for rid in list(ids):
            st = actor.states.get(rid)
            if st is None:
                continue
            blocks = held.add(rid, st.cache_type)
            if st.request.lora is not None:
                adapters[state].add(st.request.lora.name)
            if state == "waiting":
                why = plan.reasons.get(rid, "waiting: arrived after the last iteration's plan")
                waiting_why[(st.request.service_class.value, reason_kind(why))] += 1
            if len(requests) >= MAX_LISTED:
                continue
            r = st.request
            requests.append({
                "id": rid, "class": r.service_class.value, "state": state, "cache_type": st.cache_type.value,
                "prompt_tokens": len(r.prompt_token_ids), "generated": len(st.output_token_ids),
                "predicted_len": r.predicted_len, "blocks": blocks, "age_s": round(now - r.arrival_time, 3),
                "level": plan.levels.get(rid), "why": plan.reasons.get(rid), "preemptions": st.num_preemptions,
                "swapped": actor.host is not None and rid in actor.host,
                "adapter": None if r.lora is None else r.lora.name})
    geometry = actor.pool.geometry
    return {
        "index": actor.index, "name": actor.device.name, "dead": actor.dead,
        "pool": {"total": geometry.num_blocks, **pool_view([actor]),
                 "by_cache_type": held.by_type()},
        "classes": {c: load.get(c, {"running": 0, "waiting": 0, "blocks": 0}) for c in ("rt", "be")},
        "iteration_s": actor.t_avg, "steps": actor.step_id, "preemptions": actor.num_preemptions,
        "tokens_computed": actor.tokens_computed,
        "swaps": dict(actor.swaps), "host_pool_bytes": actor.host.used if actor.host is not None else 0,
        "requests": requests,
        "adapters": {state: sorted(names) for state, names in adapters.items()},
        "waiting_reasons": [{"class": c, "why": why, "requests": n} for (c, why), n in sorted(waiting_why.items())],
    }


class _Held:
    """Blocks held per cache type, each block once: with prefix caching, requests that share a
    prompt's start hold the same blocks."""

    def __init__(self, pool):
        self.pool = pool
        self.shared = getattr(pool, "prefix", None) is not None
        self.ids: dict[CacheType, set[int]] = {t: set() for t in CacheType}
        self.counts: Counter = Counter()

    def add(self, rid: str, cache_type: CacheType) -> int:
        """Count ``rid``'s blocks; return how many it holds."""
        if not self.shared:
            n = self.pool.num_blocks_of(rid)
            self.counts[cache_type] += n
            return n
        table = self.pool.table(rid)
        self.ids[cache_type].update(table)
        return len(table)

    def by_type(self) -> dict[str, int]:
        return {t.value: len(self.ids[t]) if self.shared else self.counts[t] for t in CacheType}
