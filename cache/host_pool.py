"""Swap space on the host: the books of the caches preempted requests keep there (ALISE §3.5).

A request preempted with swapping on keeps its computed cache in the worker's host pool instead
of recomputing it later. The pool holds up to ``capacity_bytes``; each holder is known by its
bytes and its estimated wait time (EWT, seconds until it is expected to run again; policies
without an estimate pass their own order key). When a newcomer does not fit, holders expected
to wait longer than it give their place up, longest wait first: a cache that returns soon saves
the same recompute for less host memory over time. Those evicted lose their cache and recompute.
It never touches tensors.
"""
from __future__ import annotations


class HostPool:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"swap space: must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self._held: dict[str, tuple[int, float]] = {}    # req_id -> (bytes, EWT key)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def bytes_of(self, req_id: str) -> int:
        held = self._held.get(req_id)
        return held[0] if held else 0

    def admit(self, req_id: str, nbytes: int, ewt: float, keep: frozenset[str] = frozenset()
              ) -> list[str] | None:
        """Hold ``nbytes`` for req_id. If they do not fit, holders with a longer EWT (and not in
        ``keep``) are evicted, longest first, only as far as needed; returns the evicted ids, or
        None (and no change) when even evicting all of them would not make room."""
        if req_id in self._held:
            raise ValueError(f"request {req_id} already holds host memory")
        free = self.capacity - self.used
        evict: list[str] = []
        if nbytes > free:
            longer = sorted((r for r, (_, w) in self._held.items() if w > ewt and r not in keep),
                            key=lambda r: -self._held[r][1])
            for r in longer:
                if nbytes <= free:
                    break
                evict.append(r)
                free += self._held[r][0]
            if nbytes > free:
                return None
        for r in evict:
            self.release(r)
        self._held[req_id] = (nbytes, ewt)
        self.used += nbytes
        return evict

    def release(self, req_id: str) -> int:
        """Give req_id's host memory back; how many bytes it held (0: none)."""
        held = self._held.pop(req_id, None)
        if held is None:
            return 0
        self.used -= held[0]
        return held[0]

    def clear(self) -> None:
        self._held.clear()
        self.used = 0

    def check_invariants(self) -> None:
        total = sum(b for b, _ in self._held.values())
        if total != self.used or self.used > self.capacity:
            raise AssertionError(f"host pool: used {self.used}, held {total}, capacity {self.capacity}")
