"""Scheduling policies: pure functions from a snapshot to a plan.

They see plain numbers (tokens, blocks, limits), never tensors or request
objects, so tests and the simulator can drive them without a model.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from tandem.engine.messages import CacheType, Phase


@dataclass(frozen=True, slots=True)
class Candidate:
    req_id: str
    num_tokens: int            # tokens known (prompt + generated)
    num_computed: int          # tokens already in the cache
    num_blocks: int            # blocks held now (waiting: those of its cached prefix that others hold,
                               # which it shares at no cost)
    arrival: float             # seconds; FCFS order key
    rt: bool = True            # service class: real-time (else best-effort)
    slo_s: float | None = None  # its current latency target: TTFT before the first token, TBT after
    pending_s: float = 0.0     # t_i: seconds since it arrived or last returned a token
    num_cpu: int = 0           # M^cpu: checkpointed slots to swap back in before it can run
    missed: bool = False       # RT whose first token came (or will come) after its TTFT target
    cache_type: CacheType = CacheType.KV   # what its blocks hold
    num_output: int = 0        # tokens generated so far
    predicted: int | None = None   # predicted output length (ALISE), None when unknown
    stalled_s: float = 0.0     # seconds its past tokens waited beyond one iteration each (aging)
    decoding_s: float | None = None  # seconds since its first token (None before it)
    spread: tuple[int, ...] = ()   # equally likely output lengths, ascending (ALISE); empty: ``predicted`` alone
    max_output: int | None = None  # output tokens it may reach at most (max_tokens, the context)
    foreign_slots: int = 0     # bidirectional pools: slots of a BE request's blocks that RT owners hold
    num_shared: int = 0        # of num_blocks, those other requests hold too (prefix caching)
    host_bytes: int = 0        # its cache swapped out to host memory: bytes copied back before it runs
    adapter: Hashable | None = None   # the LoRA adapter it runs with (None: the base model)

    def freed(self) -> int:
        """Blocks that preempting it gives back: its own, not those it shares."""
        return self.num_blocks - self.num_shared

    def residual(self, t_avg: float = 0.0, k: int = 1) -> float:
        """BROS residual time res_i = T_SLO,i - t_i - (k_i - 1) T_avg (inf without an SLO)."""
        if self.slo_s is None:
            return float("inf")
        return self.slo_s - self.pending_s - (k - 1) * t_avg

    def residual_tpot(self, t_avg: float = 0.0) -> float:
        """Residual time against a time-per-output-token target T: a request that has generated
        g tokens, the first d seconds ago, keeps its mean gap within T while its next token
        comes within g·T - d, i.e. it may use the slack its earlier tokens banked; one gap
        is held to at most 2T. Never less than the per-token residual."""
        own = self.residual(t_avg)
        if self.slo_s is None or self.decoding_s is None or self.num_output < 1:
            return own
        banked = self.num_output * self.slo_s - self.decoding_s
        return max(own, min(banked, 2 * self.slo_s - self.pending_s))


@dataclass(frozen=True, slots=True)
class Limits:
    max_num_seqs: int          # requests per iteration
    max_num_batched_tokens: int  # new tokens per iteration
    chunked_prefill: bool      # may a prompt be split across iterations


@dataclass(slots=True)
class Snapshot:
    running: list[Candidate]   # holding blocks, in priority order (earliest arrival first)
    waiting: list[Candidate]   # not holding blocks, in FCFS order (preempted first)
    num_free_blocks: int
    block_size: int
    blocks_per_token_block: int  # 2 for a KV cache (K and V)
    limits: Limits
    t_avg: float = 0.0         # moving average of the iteration time, seconds
    be_only_blocks: int = 0    # bidirectional pools: BE-only blocks an RT request may take over
    block_preemption: bool = False  # bidirectional pools: the pool preempts blocks, not the policy
    hidden_blocks_per_token_block: int = 0   # hidden caches: d_model / unit (0: not possible)
    rt_room_blocks: int = 0    # bidirectional pools: RT-only blocks with empty slots a BE request may fill


@dataclass(slots=True)
class Decision:             # not frozen: built once per request per iteration, where frozen __init__ costs 3x
    req_id: str
    num_new_tokens: int
    phase: Phase
    sample: bool               # this chunk ends at the last known token


@dataclass(slots=True)
class Plan:
    scheduled: list[Decision] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)   # lose their cache, recompute later
    reasons: dict[str, str] = field(default_factory=dict)
    # change of cache type: the request loses its cache and is planned again from scratch
    cache_types: dict[str, CacheType] = field(default_factory=dict)
    # estimated wait (seconds) of preempted requests before they run again (ALISE's EWT); with
    # swapping, those expected back soonest keep their cache in host memory first. Empty: the
    # policy has no estimate, and arrival order stands in for it
    ewt: dict[str, float] = field(default_factory=dict)
    # the priority level the policy gave each request it ordered (ALISE's levels; empty otherwise)
    levels: dict[str, int] = field(default_factory=dict)


def _blocks(snap: Snapshot, num_tokens: int, c: Candidate | None = None) -> int:
    per = snap.blocks_per_token_block
    if c is not None and c.cache_type is CacheType.HIDDEN:
        per = snap.hidden_blocks_per_token_block
    return -(-num_tokens // snap.block_size) * per


def _decide(c: Candidate, n: int) -> Decision:
    end = c.num_computed + n
    decode = n == 1 and c.num_computed > 0 and end == c.num_tokens
    return Decision(c.req_id, n, Phase.DECODE if decode else Phase.PREFILL, end == c.num_tokens)


def fcfs(snap: Snapshot) -> Plan:
    """vLLM-style first-come-first-served continuous batching.

    1. Running requests, in arrival order, each get their next chunk (1 token
       when decoding). When blocks run out, the latest-arrived running request
       is preempted (its cache discarded, recomputed later) until the chunk fits.
    2. If nothing was preempted, waiting requests are admitted in FCFS order
       while sequences, tokens and blocks allow; the first that does not fit
       stops admission (no overtaking).
    """
    plan = Plan()
    lim = snap.limits
    free = snap.num_free_blocks
    tokens_left = lim.max_num_batched_tokens
    running = list(snap.running)
    i = 0
    while i < len(running) and tokens_left > 0:
        c = running[i]
        n = min(c.num_tokens - c.num_computed, tokens_left)
        need = _blocks(snap, c.num_computed + n, c) - c.num_blocks
        while need > free and running[-1] is not c:
            victim = running.pop()
            free += victim.freed()
            plan.preempted.append(victim.req_id)
            plan.reasons[victim.req_id] = "preempted: blocks ran out for an earlier request"
        if need > free:
            running.pop()
            plan.preempted.append(c.req_id)
            plan.reasons[c.req_id] = "preempted: its own next chunk does not fit"
            break
        free -= need
        tokens_left -= n
        plan.scheduled.append(_decide(c, n))
        plan.reasons[c.req_id] = "running"
        i += 1
    if plan.preempted:
        return plan
    num_seqs = len(running)
    for c in snap.waiting:
        n = c.num_tokens - c.num_computed
        if num_seqs >= lim.max_num_seqs or tokens_left <= 0:
            break
        if n > tokens_left and not lim.chunked_prefill:
            plan.reasons[c.req_id] = "waiting: prompt exceeds this iteration's token budget"
            break
        n = min(n, tokens_left)
        need = _blocks(snap, c.num_computed + n, c) - c.num_blocks
        if need > free:
            plan.reasons[c.req_id] = "waiting: not enough free blocks"
            break
        free -= need
        tokens_left -= n
        num_seqs += 1
        plan.scheduled.append(_decide(c, n))
        plan.reasons[c.req_id] = "admitted"
    return plan


def fcfs_prefill_first(snap: Snapshot) -> Plan:
    """vLLM's scheduler before chunked prefill (v0.5, the baseline of Apt-Serve's paper).

    When the head of the waiting queue fits, the iteration is prefill-only: whole prompts are
    admitted in FCFS order while sequences, tokens and blocks allow (the first one always fits
    the token budget, as vLLM requires max_num_batched_tokens >= max_model_len). Otherwise it is
    a decode iteration over the running requests, as in ``fcfs`` (preempting the latest-arrived
    when blocks run out). Prefill iterations stall every running request's next token.
    """
    plan = Plan()
    lim = snap.limits
    free, tokens_left, seqs = snap.num_free_blocks, lim.max_num_batched_tokens, len(snap.running)
    for c in snap.waiting:
        n = c.num_tokens - c.num_computed
        need = _blocks(snap, c.num_tokens, c) - c.num_blocks
        if seqs >= lim.max_num_seqs or (n > tokens_left and plan.scheduled) or need > free:
            plan.reasons[c.req_id] = "waiting: does not fit this prefill iteration"
            break
        plan.scheduled.append(_decide(c, n))
        plan.reasons[c.req_id] = "admitted (prefill-only iteration)"
        free -= need
        tokens_left -= n
        seqs += 1
    return plan if plan.scheduled else fcfs(replace(snap, waiting=[]))
