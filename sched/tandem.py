"""Tandem: the default policy. BROS's SLO packing, ALISE's remaining-time order and Apt-Serve's
cache choice in one iteration plan; Mell places requests across devices outside the policy.

Who decides what, each in its own module:

    question                                    mechanism   where
    ------------------------------------------  ----------  ---------------------------------
    how long may this iteration take            BROS        Bros._budget: the residual time of
      (and how many requests may it hold)                   the most urgent RT request that can
                                                            still make it, while a prompt waits
                                                            at most the tightest TBT target;
                                                            adaptive batch size
    who runs first inside a class               ALISE       Alise.order: levels of estimated
      RT: (late last, level, SLO slack)                     remaining time T_rem, with aging;
      BE: (level, T_rem, arrival)                           a chat overdue for its first token
                                                            or for its next one while it holds its
                                                            cache is no longer last (Tandem._overdue)
    may a request that holds nothing start      ALISE       Footprint: the predicted peak of the
                                                            caches it cannot displace, with it,
                                                            fits the pool; with swapping, an RT
                                                            request past half its TTFT target
                                                            starts anyway (Tandem._late)
    may it start before a more urgent one       Tandem      Tandem._overtakes: with swapping,
      that waits for blocks                                 before its first token and in free
                                                            blocks only
    how much time a prompt chunk may take       Tandem      Tandem._kept: what the decodes after it
                                                            in the order that are due leave, unless
                                                            the prompt is due itself and can still
                                                            make its target; a prompt past its TTFT
                                                            target is fitted to the residual without
                                                            the overrun margin, counting the time
                                                            per output token the decoding chats
                                                            banked (Tandem._chunk_limit)
    which cache a starting request keeps        Apt-Serve   AptServe.hidden_choice: the prefill
                                                            knapsack; only on models where a
                                                            hidden cache is smaller than KV
    may BE work take an RT request's place      BROS        Tandem._may_replace: between its
                                                            tokens, if its slack allows; never
                                                            before its first token
    whose blocks a request that must grow takes BROS+ALISE  RT: BE first, lowest ranked first,
                                                            then RT (BROS's order); BE: only
                                                            from BE ranked below it
    what a preempted request's cache does       ALISE       the actor: swap to host memory by
                                                            estimated wait (EWT), int8; on a
                                                            bidirectional pool (BROS) BE slots
                                                            are lent to RT and checkpointed
    which device                                Mell        sched/rebalancer.py (placement)

Memory pressure is met in that order of cost: BE blocks lent to RT (bidirectional pools), a
hidden cache for a new request whose KV cache does not fit, swapping the lowest-ranked
request out by EWT, recompute when the host pool is full.

An RT request's TBT target bounds each gap between its tokens (as BROS plans it), or with
``mean_tbt`` its mean time per output token: slack banked by early tokens lets an iteration
run up to twice the target (more BE work and longer prompt chunks fit; its P99 gap grows).

Each mechanism can be switched off (``off``) for ablations: ``slo`` (iterations are not
bounded by RT deadlines: every request that fits runs), ``lengths`` (BROS's own order:
RT by SLO slack, BE by arrival; no look-ahead admission), ``hidden`` (KV caches only), ``late``
(look-ahead admission keeps late chats out too), ``overdue`` (a chat that missed its TTFT stays
behind the others, for its first token and every later one, however long it waits).
Swapping is switched off by preemption_mode "recompute", Mell by another placement.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import replace
from enum import Enum

from tandem.engine.messages import CacheType
from tandem.sched.alise import Alise, Footprint
from tandem.sched.aptserve import AptServe
from tandem.sched.bros import BlockBudget, Bros, CostFn, Load
from tandem.sched.policy import Candidate, Plan, Snapshot, _blocks


class Mechanism(str, Enum):
    """A part of the tandem policy that an ablation can switch off."""
    SLO = "slo"              # BROS: iterations sized by the most urgent RT deadline
    LENGTHS = "lengths"      # ALISE: order by predicted remaining time, look-ahead admission
    HIDDEN = "hidden"        # Apt-Serve: hidden caches where they save memory
    LATE = "late"            # an RT prompt past part of its TTFT target starts despite look-ahead admission
    OVERDUE = "overdue"      # an RT request whose next token waited several targets leaves the late chats' place


MECHANISMS = tuple(m.value for m in Mechanism)
# why a waiting request started where look-ahead admission, or a more urgent request, held it back
STARTED_LATE = "scheduled (RT): started late, its TTFT target near, though its predicted growth may not fit"
STARTED_AHEAD = "scheduled (RT): started ahead, in free blocks, while a more urgent request waits for more"
STARTED = {"late": STARTED_LATE, "ahead": STARTED_AHEAD}     # short name -> the reason /metrics counts


class Tandem(Bros):
    """``cost(shape, swap_slots)`` predicts an iteration; ``rho`` is the start-up value of the
    hidden cache's recompute cost per KV block (refined by the cost model when it has one);
    ``mean_tbt``: an RT request's TBT target bounds its mean time per output token (TPOT), not
    each gap (see Candidate.residual_tpot); ``late_after``: the part of its TTFT target an RT
    prompt waits before look-ahead admission stops keeping it out (``_late``); ``overdue_after``:
    the TTFT targets an RT prompt waits before it leaves the late chats' place (``_overdue``)."""

    name = "tandem"
    # BE work that does not fit passes to the BE requests after it that need fewer tokens (a
    # running one's decode, a shorter chunk) rather than ending the packing, as BROS's does: the
    # step runs for the chats anyway, and a batch prompt whose chunk does not fit beside them held
    # every batch decode behind it. On the mixed bench (2-core AMD EPYC, 2026-12-07, SLOs 969 /
    # 171 ms, 0.5 chats/s, one run each) with prompt chunks over a prefix on the compiled kernel:
    # 0.43 and 0.47 BE req/s with 93 and 97% of chats on TTFT & TPOT, against 0.31 and 83%
    # stopping at the first misfit; without that kernel, 0.19 and 83% (stopping: 0.16-0.43, 77-87%).
    skip_misfits = True

    def __init__(self, cost: CostFn, max_num_seqs: int, rho: float = 0.0, hybrid: bool = True,
                 idle_budget_s: float | None = None, off: frozenset[Mechanism] = frozenset(),
                 mean_tbt: bool = False, swapping: bool = False, late_after: float = 0.5,
                 overdue_after: float = 10.0):
        super().__init__(cost, max_num_seqs, idle_budget_s=idle_budget_s)
        self.off = frozenset(Mechanism(m) for m in off)
        self.mean_tbt = mean_tbt
        self.swapping = swapping         # preempted caches are swapped, not recomputed
        self.late_after = math.inf if Mechanism.LATE in self.off else late_after
        self.overdue_after = math.inf if Mechanism.OVERDUE in self.off else overdue_after
        self.alise = Alise(cost)
        self.apt = AptServe(rho, hybrid=hybrid and Mechanism.HIDDEN not in self.off, cost=cost)
        self._rank: dict[str, tuple] = {}
        self._held: Footprint | None = None
        self._running: set[str] = set()
        self._started: dict[str, str] = {}     # this iteration's starts by a rule of this policy's own
        self._banked = math.inf                # this plan's limit for a late prompt's chunk (``_budget``)

    # ---- the hooks BROS's packing calls ------------------------------------------------
    def _rt_order(self, snap: Snapshot, res) -> list[Candidate]:
        """RT candidates in (late last, level, urgency) order; it also notes where the due decodes
        (``_kept``) stand in it, once per iteration."""
        if Mechanism.LENGTHS in self.off:
            order = Bros._rt_order(snap, res)
        else:
            rt = [c for c in snap.running + snap.waiting if c.rt]
            order = sorted(rt, key=lambda c: (c.missed and not self._overdue(c), self._rank[c.req_id][1], res(c)))
        self._pos = {c.req_id: i for i, c in enumerate(order)}
        self._due_at = [i for i, c in enumerate(order)
                        if not c.missed and c.num_tokens - c.num_computed == 1 and self._due(c, snap.t_avg)]
        self._due_items = [(order[i], 1) for i in self._due_at]
        return order

    def _overdue(self, c: Candidate) -> bool:
        """An RT request whose next token has waited ``overdue_after`` of its targets: its first
        token that many TTFT targets after it arrived, or, while it holds its cache (running), a
        later token that many TBT targets after the one before. It goes back among the chats that
        can still make their targets, at its level (with its residual far below theirs, first
        within it), instead of behind all of them, and like a prompt on target its chunk leaves
        the time of the due decodes after it (``_kept``): it takes back the prompts' share of an
        iteration, not the decodes'.

        Late chats run on what the others leave. On this CPU, where a TBT target holds a few
        iterations, the chats on target can leave nothing for many seconds: a chat that had
        just missed its target waited 15-45 s for its first token while newer chats got theirs
        in 0.3 s. [open choice] Ten targets, from the simulator (``sim-tandem``, one trace per
        rate): with this CPU's fitted cost model at 0.75 / 1 / 1.25 req/s the longest wait for
        a first token fell from 11.7 / 25.6 / 91.5 s to 10.8 / 17.8 / 25.4 s, with 82 / 80 / 72%
        of chats on TTFT & TPOT against 82 / 80 / 76%. At paper scale, over three traces, it
        changed nothing at 2 req/s, moved attainment by -2 to +4 points at 2.5, and at 3 req/s
        (past capacity) moved TTFT & P99 TBT by -7 to +8 points, lowered the normalized latency
        in two traces of three, and cut the longest first-token wait from 17-82 s to 5.5-7.4 s.
        Three and six targets did about the same on this CPU (at most 10.1-10.3 / 15.6-15.8 /
        25.3-29.9 s). Letting the overdue prompt take the
        decodes' time too bounded the waits more (at most 10.6 / 13.8 / 16.5 s) but ran its
        whole prompt alone while the decodes waited (78% on target at 1 req/s); moved first
        among the late chats only, it still waited behind every chat on target (38% on TTFT &
        P99 TBT at 3 req/s at paper scale).

        A chat that missed its first token is late for the rest of its reply, and its decodes
        waited behind the chats on target too: past capacity on this CPU its stream stopped for
        38-62 s mid-reply (``bench mixed --trace-status``). With the rule for its later tokens,
        the simulator at this CPU's scale (200 chats, seed 0; 0.75 / 1 req/s) cut the longest gap
        from 4.5 / 18.7 s to 2.5 / 3.7 s with the same chats on target (82 / 80%); with every
        step 1.3x its cost model's time (three seeds) from 23-61 / 92-171 s to 4-9 / 6-16 s, for
        -4 to +1 points of chats on target at 0.75 req/s and -9 to -2 at 1 req/s. [open choice]
        Only while it holds its cache: a swapped-out chat moved among the chats on target took
        their blocks back in turn, and at paper scale at 3 req/s 19% of chats met TTFT & TPOT
        (16,537 preemptions) against 94%; held to running chats, paper scale is unchanged."""
        return (c.slo_s is not None and c.pending_s > self.overdue_after * c.slo_s
                and (c.num_output == 0 or c.req_id in self._running))

    def _kept(self, r: Candidate, t_avg: float) -> list[tuple[Candidate, int]]:
        """The decodes after ``r`` in the RT order that are due (``_due``), unless ``r`` itself is
        due and can still make its target: its prompt chunk leaves their time in the iteration.
        The order (level first) puts a prompt predicted to reply briefly before a chat decoding a
        long reply, and a chunk sized to the whole budget would then push that chat's token past
        its TBT target, iteration after iteration while prompts arrive, though the prompt had time
        to spare. A prompt overdue for its first token (``_overdue``) keeps their time too, and so
        does one that is due but cannot make its target (``_too_late``): running first it would
        make them late too and save nothing.
        [open choice] Only the time is kept, not the order: putting due requests first
        in the order itself (which also decides who gets blocks) cut the paper-scale simulation's
        chats on TTFT & P99 TBT at 3 req/s from 60% to 24%, with 3,637 preemptions against 1,448."""
        if not self._overdue(r) and (r.missed or (self._due(r, t_avg) and not self._too_late(r, t_avg))):
            return []
        return self._due_items[bisect.bisect_right(self._due_at, self._pos[r.req_id]):]

    def _chunk_limit(self, r: Candidate, t_res_min: float) -> float:
        """A prompt that has missed its TTFT target is fitted to the most urgent residual itself,
        not to the residual shrunk by the cost model's overrun margin (``Bros._budget``), and with
        each decoding chat's residual counted against its time per output token (``_banked_budget``:
        the time its earlier tokens banked, one gap at most twice its target); within the idle bound
        while a new prompt can still make its first token. The margin keeps a step that
        is predicted to fit within the chats' targets nine times in ten, and on this CPU, where a
        late prompt runs on what the chats on target leave, it left such a prompt no chunk at all
        for seconds. Under a 92 ms TBT target with 12-13 chats decoding (50-57 ms steps, priced
        50-53 ms, a 1.25x margin) the smallest chunk did not fit, and at 1 chat/s four first tokens
        came 6-9 s after their prompts (a 2-core Zen 2, SmolLM2 in float32, ``bench online``). With
        this rule, on that trace (six runs, three of them alternated with three of the code before),
        the longest first-token wait was 5.7-6.8 s against 7.7-15.2 s and the second longest 1.3-2.6
        s against 5.9-11.1 s, with 67-73% of chats on TTFT & TPOT against 67-77%. [open choice] From
        the simulator at this CPU's scale (``sim-tandem --preset fitted``, 0.75 / 1 / 1.25 req/s,
        seeds 0-2): the longest first-token wait fell from 14.5 / 26.9 / 34.1 s to 7.6 / 12.8 / 18.9
        s on seed 0 and the TTFT p99 by 21-58%, TTFT & TPOT moved by 0 to +4 points, normalized
        latency by 0 to -22%, BE by at most 0.02 req/s; the price is the chats' gaps: at 0.75 and 1
        req/s 0.2-1.5 points more of them past the target, and each chat's P99 gap 11-21% longer at
        1 req/s. At paper scale it moved attainment by at most a point up to 2.5 req/s; at 3 (past
        capacity) TTFT & P99 TBT went from 81 / 50 / 51% to 86 / 67 / 38% on seeds 0 / 1 / 2. Only
        the RT work moves: BE work is still packed within the margin. The RT decodes after the chunk
        in the order may fill the step to the same limit, so an overdue prompt's chunk still leaves
        the due decodes after it (``_kept``) their time.

        The banked time: once the cost model priced the steps with a prompt chunk at what they
        took (``OnlineCostModel``'s per-kind correction) a prompt that arrived in a burst while a
        dozen chats decoded got only what their gaps left, and at 1 chat/s (``bench online``, 538
        / 92 ms targets) its first token came up to 3.6-6.7 s after it. Spending what the chats
        banked, in three pairs of runs alternated with the code before: TTFT p99 1.3-1.9 s against
        3.0-6.4 s (at most 1.3-1.9 s against 3.6-6.7 s), 77% of chats on TTFT & TPOT in two pairs
        and 60% against 77% in one (five more first tokens 0.54-1.18 s after their prompts), fewer
        gaps past 92 ms (2.3-3.7% against 3.4-4.7%); at 2 req/s (past what this CPU serves) 33-38%
        against 33-35%. The price is in the simulator at paper scale, where a chat's P99 gap is at
        stake: at 2.5 req/s TTFT & P99 TBT 93 / 93 / 88% against 95 / 94 / 91% on seeds 0 / 1 / 2,
        TTFT & TPOT within a point, the longest first-token wait 4.2 / 4.1 / 7.6 s against 4.2 /
        4.3 / 12.0; at 3 (past capacity) 73 / 52 / 50% against 86 / 67 / 38%; the effective
        throughput (90% on TTFT & P99 TBT) 2.57 / 2.54 / 2.38 req/s against 2.78 / 2.57 / 2.51. At
        this CPU's scale (``--preset fitted``, batch jobs beside, seeds 0-2) the TTFT p99 fell in
        seven points of nine, the longest first-token wait in eight, TTFT & TPOT moved by -2 to
        +4 points. [open choice] From the miss on: spending it only from three TTFT targets on
        cost less at paper scale (94.5 / 93.3 / 90.8% at 2.5 req/s, 79 / 64 / 42% at 3) but cut
        the tail less: in the simulator at this CPU's scale (at 1.25 req/s on seed 0 the longest
        wait 16.5 s, against 10.8 s from the miss and 15.7 s before) and on the engine (three
        more runs of ``bench online`` at 1 chat/s: TTFT p99 1.8-4.1 s, at most 1.8-4.9 s, 73-80%
        of chats on TTFT & TPOT). Spending it only where the prompt would otherwise get no chunk
        at all cost paper scale too (94 / 94 / 90% at 2.5 req/s) and cut the
        simulated CPU tail less."""
        return self._banked if r.missed else t_res_min

    def _too_late(self, r: Candidate, t_avg: float) -> bool:
        """Would ``r``'s next token miss its target even if the rest of its prompt ran alone now?
        Its residual is below the cost model's price of that prompt as one step.

        On this CPU a long prompt is such a one from its arrival. Under a 171 ms TBT target two
        prompts of 544 and 612 tokens (on a 2-core AVX2 EPYC, SmolLM2 in float32, where a prompt
        token costs about 1.6 ms in these steps) were chunked 50-60 tokens at a time over 13-15
        iterations while they took each iteration's whole budget: their first tokens came 2.1 and
        2.3 s after arrival, against a 969 ms target, and the chats ranked after them went 1.0-1.1
        s without a token, eight of fourteen at once."""
        return self._res(r, t_avg) < self._time(Load(), r, r.num_tokens - r.num_computed)

    def _due(self, c: Candidate, t_avg: float) -> bool:
        """Must ``c`` run in this iteration to keep its target? Yes unless its urgency covers this
        iteration and the next (BROS's safeguard for replacing RT work: urgency - t >= T_avg)."""
        return self._urgency(c, t_avg) < 2 * t_avg

    def _be_queue(self, snap: Snapshot, plan: Plan) -> list[Candidate]:
        if Mechanism.LENGTHS in self.off:
            return super()._be_queue(snap, plan)
        be = [c for c in snap.running + snap.waiting if not c.rt and c.req_id not in plan.preempted]
        return sorted(be, key=lambda c: self._rank[c.req_id])

    def _admits(self, c: Candidate, budget: BlockBudget) -> bool:
        """Running requests always; others when their predicted growth fits, or (``_late``) when
        their first token is due and their prompt fits the blocks free now; counted from then on."""
        if self._held is None or c.req_id in self._running:
            return True
        if not self._held.admits(c):
            if not self._late(c, budget):
                return False
            self._started[c.req_id] = STARTED_LATE
        self._held.add(c)
        return True

    def _unadmit(self, c: Candidate) -> None:
        """A request admitted in this plan that does not run after all leaves admission's books, so
        it keeps no later request out."""
        if self._held is not None and c.req_id not in self._running:
            self._held.remove(c)
            self._started.pop(c.req_id, None)

    def _late(self, c: Candidate, budget: BlockBudget) -> bool:
        """With swapping, an RT request before its first token whose wait has passed half its
        TTFT target (``late_after``) starts even where look-ahead admission would keep it out,
        if its whole prompt fits the blocks free when this plan began (``budget.snap``): the
        growth that admission guards against ends at worst in a swap, a copy, while the first
        token's target is lost for good. Without it, in a 2,600-token pool (OPT-13B's cost model,
        2 req/s, SLOs 1 s / 1 s, three seeds) 75-78% of the chats met their TTFT and TPOT with
        the predictor and 48-72% without one, where BROS met 82-88%: the admission's guesses of
        256 tokens for unpredicted requests kept newcomers out for seconds. [open choice] Half
        the target, from a sweep: a quarter met 95-98% there, half 93-97%, three quarters 88-97%;
        at paper scale (12k tokens) all were alike up to 2.5 req/s, and at 3 req/s a quarter
        preempted more (1,976 against 1,448) and kept 46% of chats on TTFT and P99 TBT at 61
        ms/token, where half kept 60% at 46 ms/token.

        [open choice] Only where the pool has room for its prompt: once the simulator copied a
        GPU's swap-outs beside the steps, as the engine does, late starts into a full pool cost
        at paper scale at 3 req/s (73% of chats on TTFT and P99 TBT against 85% with no late
        starts: the chats they displaced lost their gaps, and 33 of the 86 chats started late
        missed their first token anyway, 17 of whom made it with no late starts). Over three
        traces at 3 req/s, counting the blocks free when the plan began kept 84 / 50 / 53%,
        about as many as no late starts (85 / 58 / 47%), where no check kept 73 / 48 / 50% and
        the blocks left after the more urgent requests of the same plan 68 / 43 / 47%; in the
        2,600-token pool it kept 93% of the chats on target over seven seeds, against 94% with
        no check and 76% with no late starts (bench/README.md)."""
        return (self.swapping and c.rt and c.num_output == 0 and c.slo_s is not None
                and c.pending_s > c.slo_s * self.late_after
                and budget.need(c, c.num_tokens - c.num_computed) <= budget.snap.num_free_blocks)

    def _overtakes(self, r: Candidate, n: int, budget: BlockBudget) -> bool:
        """With swapping (preempted caches are swapped, not recomputed): a request
        before its first token starts in blocks free now, preempting nobody, while a more urgent
        request waits for more blocks than are free (a swapped-out chat comes back whole). Its
        TTFT target is at stake; the waiting request's next token can wait a little, its mean
        time per token hardly moves. The waiting request keeps its place, and may preempt the
        newcomer when it arrived first (RT preempts only later arrivals), which a swap makes
        cheap. Without it, chats arriving behind a swapped 600-token chat in a full pool waited
        1.5-4 s for its return (OPT-13B's cost model, a 2,600-token pool, 2 req/s)."""
        if self.swapping and r.num_output == 0 and budget.need(r, n) <= budget.room(r):
            self._started.setdefault(r.req_id, STARTED_AHEAD)
            return True
        return False

    def _res(self, c: Candidate, t_avg: float) -> float:
        """Each gap against the TBT target, or with ``mean_tbt`` the mean time per output token
        (slack earlier tokens banked counts, one gap at most twice the target)."""
        return c.residual_tpot(t_avg) if self.mean_tbt else super()._res(c, t_avg)

    def _may_replace(self, r: Candidate, t_iter: float, t_avg: float) -> bool:
        """BE work borrows an RT request's slack between two of its tokens (BROS), never before
        its first one: a prompt deferred while its TTFT slack lasts gets its first token just
        before the target (or past it, when its chunks take longer than estimated), and moving
        RT work later frees nothing for BE work in the long run."""
        return r.num_output > 0 and super()._may_replace(r, t_iter, t_avg)

    def _budget(self, q_rt, res) -> float:
        """BROS's budget, and while an RT prompt can still make its TTFT, at most the tightest RT
        target seen (a TBT target): BROS would stretch an iteration with BE work to the prompt's
        TTFT slack when no decoding RT request bounds it (an idle chat server running a batch
        job), and the first token would come at about the TTFT target instead of as soon as the
        prompt is computed."""
        if Mechanism.SLO in self.off:
            return math.inf
        budget = super()._budget(q_rt, res)
        self._banked = self._banked_budget(q_rt, res)
        if self.idle_budget_s and any(c.num_output == 0 and not c.missed for c in q_rt):
            budget = min(budget, self._margin(self.idle_budget_s))
            self._banked = min(self._banked, self.idle_budget_s)
        return budget

    def _banked_budget(self, q_rt, res) -> float:
        """The budget before its margin (``_unshrunk``) with each decoding RT request's time per
        output token in place of its gap: the slack its earlier tokens banked counts, one gap at
        most twice its target (``Candidate.residual_tpot``), over the RT requests that set the
        budget (those that can still make their targets, whose residual is at least the budget)."""
        saveable = [c.residual_tpot() for c in q_rt if not c.missed and res(c) >= self._unshrunk]
        return max(self._unshrunk, min(saveable, default=self._unshrunk))

    def _victims(self, c: Candidate, running: list[Candidate], t_avg: float) -> list[Candidate]:
        if Mechanism.LENGTHS in self.off:
            return super()._victims(c, running, t_avg)
        be = sorted((x for x in running if not x.rt), key=lambda x: self._rank[x.req_id], reverse=True)
        return be + [x for x in super()._victims(c, running, t_avg) if x.rt]

    def _be_room(self, b: Candidate, n: int, snap: Snapshot, budget: BlockBudget, plan: Plan,
                 taken: set[str]) -> bool:
        """A BE request's blocks: free ones, else (a running one, so the best-ranked BE request
        always progresses) those of running BE requests ranked below it that are not in this
        iteration, lowest first. Without ranks (lengths off), BROS's rule."""
        if Mechanism.LENGTHS in self.off:
            return super()._be_room(b, n, snap, budget, plan, taken)
        if budget.reserve(b, n):
            return True
        if b.req_id not in self._running:
            return False
        mine = self._rank[b.req_id]
        victims = sorted((x for x in snap.running if not x.rt and x.req_id not in taken and x.req_id != b.req_id
                          and x.req_id not in plan.preempted and x.req_id not in budget.held
                          and self._rank[x.req_id] > mine), key=lambda x: self._rank[x.req_id], reverse=True)
        return budget.take_from(b, n, victims, plan, "preempted: its blocks went to a BE request with less "
                                                     "remaining time")

    # ---- one iteration -------------------------------------------------------------------
    def __call__(self, snap: Snapshot) -> Plan:
        keyed = self.alise.order(snap)
        self._rank = {c.req_id: (key[0], key[1], i) for i, (key, c, _) in enumerate(keyed)}
        snap, hidden = self._cache_choice(snap)       # a cache type does not enter T_rem: the order holds
        self._running = {c.req_id for c in snap.running}
        self._held = None if Mechanism.LENGTHS in self.off else Footprint(snap, snap.running, self._rank)
        self._started = {}
        if Mechanism.SLO in self.off:
            self.b_curr = self.max_num_seqs
        plan = super().__call__(snap)
        if Mechanism.SLO in self.off:
            self.b_curr = self.max_num_seqs
        by_id = {c.req_id: c for c in snap.waiting}
        for d in plan.scheduled:
            c = by_id.get(d.req_id)
            if c is not None and c.req_id in hidden:
                plan.cache_types[c.req_id] = hidden[c.req_id]
            if d.req_id in self._started:
                plan.reasons[d.req_id] = self._started[d.req_id]
        plan.levels = {c.req_id: key[1] for key, c, _ in keyed}
        plan.ewt = self.alise.ewt(keyed, plan) if Mechanism.LENGTHS not in self.off else {}
        return plan

    def _cache_choice(self, snap: Snapshot) -> tuple[Snapshot, dict[str, CacheType]]:
        """The snapshot with a hidden cache for each waiting request (holding nothing) whose KV
        cache would not fit the free blocks left by those ranked before it, where a hidden cache
        would fit and pays; returns it and the requests whose cache type changes.

        A hidden cache pays when the time the request has waited, p_i, exceeds what it would
        cost the requests running beside it over its predicted life:

            p_i > N_running · ρ · m_i · L̂_i

        (ρ seconds per KV block re-projected each step, m_i its KV blocks, L̂_i its predicted
        length). [open choice] Apt-Serve's per-iteration value p_i - U·ρ·m_i charges one step of
        recompute only; with it, in the paper-scale simulation with batch jobs always pending,
        most long BE prompts took hidden caches and every step slowed (RT normalized latency 68
        vs 38 ms/token, BE 1.5 vs 2.8 req/s at 0.5 RT req/s, against KV caches only)."""
        hb, kvb = snap.hidden_blocks_per_token_block, snap.blocks_per_token_block
        if not self.apt.hybrid or not 0 < hb < kvb:
            return snap, {}
        fresh = sorted((c for c in snap.waiting if c.num_blocks == 0 and c.num_computed == 0 and c.num_cpu == 0),
                       key=lambda c: (not c.rt, c.arrival) if Mechanism.LENGTHS in self.off else self._rank[c.req_id])
        if not fresh:
            return snap, {}
        free, rho = snap.num_free_blocks, self.apt.rho
        want: dict[str, CacheType] = {}
        for c in fresh:
            kv, hid = _blocks(snap, c.num_tokens), -(-c.num_tokens // snap.block_size) * hb
            pays = c.pending_s > max(1, len(snap.running)) * rho * kv * Alise.predicted(c)[0]
            ct = CacheType.KV if kv <= free or not (hid <= free and pays) else CacheType.HIDDEN
            free -= min(free, kv if ct is CacheType.KV else hid)
            if ct is not c.cache_type:
                want[c.req_id] = ct
        if not want:
            return snap, {}
        waiting = [replace(c, cache_type=want[c.req_id]) if c.req_id in want else c for c in snap.waiting]
        return replace(snap, waiting=waiting), want
