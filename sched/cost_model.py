"""Iteration-time cost model (BROS §4.1 form, per-request attention terms; SPEC §2.2).

    t(step) = base + a_p * Σ_prefill Ln + c_p * Σ_prefill pairs(Ln, La)
                   + a_d * (#decodes)   + c_d * Σ_decode La
                   + ρ * Σ_hidden H + s_in * B_in + l * A + l_r * R_A

Ln: new tokens of a request in the step; La: its context length after the
step; pairs(Ln, La) = Ln·La - Ln(Ln-1)/2, the query-key pairs of its causal attention
(each new token attends the context before it and itself). Prefill and decode have
separate coefficients; one intercept covers the
per-step overhead (launch, IPC, scheduling). H: for a request keeping a hidden
cache (Apt-Serve), the KV blocks its context held before the step, whose K and
V it projects again; ρ is Apt-Serve's recompute coefficient (SPEC §1.3), so a
model refitted on measured steps refines ρ online. B_in: the bytes of swapped-out caches copied
back from host memory before the step's forward, which waits for them; s_in, seconds per byte,
is 0 until refits see steps that swap in (the simulator gives it the link's speed). [open choice]
A swap-out is no term: a GPU worker copies it on a side stream beside the steps that follow
(engine.hostcopy), and a plan learns which caches it swaps out only while it packs the step.
A: the LoRA adapters the step's requests run with, each counted once, and R_A: the token rows
of its requests that run with one (a prompt chunk's Ln, a decode's 1): an adapter adds its own
small products to every projection of every layer, a fixed part per adapter whatever its rows
and a part that grows with them; l and l_r are 0 until refits see steps with adapters.
[open choice] Two terms: SmolLM2 in float32 on 2-core EPYCs (bench/README.md, "LoRA adapters"):
a decode step of 8 rows cost 5.2 / 19.6 ms more with one / four adapters with AVX-512, as
linear; on a Zen 2 with AVX2 10-11 / 24-25 ms, the first adapter costing about twice each
further one, where the fit's 8.9-9.1 ms per adapter priced the steps within 5-10%. A prompt
chunk's cost on an adapter grows with its rows: 14 / 34 / 78 ms more than on the base model
at 32 / 128 / 256 tokens (rank 16 on every projection), which one term per adapter priced at
8.4 ms each. With the row term, fitted on the same steps (decodes of 8 rows on 0, 1 and 4
adapters, and prompts alone): 5.1 ms per adapter and 0.59 ms per row, the decode steps priced
within 3.2% on average against 8.9% and the prompt steps within 6.4% against 8.4% (base
model) and 7.9% against 4.8% (on an adapter: the row term prices its part at 24 / 81 / 156
ms, the fit's compromise with the first adapter's extra cost in the decodes). A hidden cache
on an adapter re-projects its context through the adapter's K and V products at every step;
those rows are not counted in R_A (ρ prices the re-projection as on the base model).
Fitted by least squares from measured steps; every coefficient is kept non-negative.

An engine whose thin products take another path (a bfloat16 CPU worker multiplies steps of at
most ``thin_rows`` token rows over a GGUF's blocks, engine.linear.Thin) measures what its
projections cost at row counts about that threshold before a cost model is first fitted
(``Scheduler.products``), and every step adds that cost as measured, interpolated
linearly in its rows R = Σ Ln + #decodes (extrapolated past the last point):

    + P(R)

The other terms are fitted to what P leaves. [open choice] Past the threshold the products
jump and run on at another slope. A fitted intercept for the steps past it was poorly
determined by the start-up profile, whose only steps past it were prompts of 128-1,024 tokens
(13-101 ms across starts of one server). With P measured, the fit has no such term. SmolLM2 in
bfloat16 on a 2-core Zen 4 EPYC (`python -m bench startup-profile`, two profiles, threshold 64
rows): on 300 held-out serving steps of 48-128 rows, mean |error| 18.5 / 13.0% with P against
25.1 / 18.4% without; on 240 other serving steps 13.9 / 12.0% against 16.5 / 10.4%. On one
thread in process the fit with a second intercept had 9.1-9.8% on such steps, with P 5.7-6.1%.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

STARTUP_WEIGHT = 0.01   # a start-up sample's weight in the online refits, a measured step's being 1
FEATURES = ("prefill_tokens", "prefill_attn", "decode_tokens", "decode_ctx", "hidden_blocks", "swap_in_bytes",
            "adapters", "adapter_rows")     # StepShape's fields, in their order
_features = attrgetter(*FEATURES)
MIN_STEPS = 5       # measured steps a fit needs at least


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0      # Σ Ln over prefill chunks
    prefill_attn: int = 0        # Σ attn_pairs(Ln, La) over prefill chunks
    decode_tokens: int = 0       # number of decoding requests
    decode_ctx: int = 0          # Σ La over decoding requests
    hidden_blocks: int = 0       # Σ KV blocks of context re-projected by hidden-cache requests
    swap_in_bytes: int = 0       # bytes of swapped-out caches copied back before the forward
    adapters: int = 0            # distinct LoRA adapters its requests run with
    adapter_rows: int = 0        # token rows of its requests that run with a LoRA adapter

    def features(self) -> tuple:
        """The fields in FEATURES' order (``dataclasses.astuple``'s values, without its copying:
        a refit builds a row per kept step)."""
        return _features(self)

    def add(self, num_new: int, context: int, decode: bool, hidden_blocks: int = 0,
            swap_in_bytes: int = 0, adapters: int = 0, lora: bool = False) -> "StepShape":
        """This shape plus one request's ``num_new`` tokens at ``context`` (its length after the
        step); ``hidden_blocks``: the KV blocks it re-projects (a hidden cache's context before);
        ``swap_in_bytes``: its cache's bytes copied back from host memory first; ``adapters``: 1
        where it brings a LoRA adapter no request before it in the step runs with; ``lora``: it
        runs with an adapter (its rows count in ``adapter_rows``)."""
        h, b, a = self.hidden_blocks + hidden_blocks, self.swap_in_bytes + swap_in_bytes, self.adapters + adapters
        r = self.adapter_rows + num_new * lora
        if decode:
            return StepShape(self.prefill_tokens, self.prefill_attn, self.decode_tokens + 1,
                             self.decode_ctx + context, h, b, a, r)
        return StepShape(self.prefill_tokens + num_new, self.prefill_attn + attn_pairs(num_new, context),
                         self.decode_tokens, self.decode_ctx, h, b, a, r)


def attn_pairs(num_new, context):
    """Query-key pairs of causal attention for ``num_new`` tokens that end at position
    ``context``: each attends the context before it and itself, so

        pairs = Ln·La - Ln(Ln-1)/2

    (an int, or elementwise for numpy arrays). [open choice] SPEC's term is Ln·La, which counts
    a whole prompt's pairs twice over (Ln·La = Ln² where it has Ln(Ln+1)/2) and a chunk's over a
    long context about once, so one coefficient priced the start-up profile's whole prompts and
    a server's chunks on two scales. Under the default policy on a 2-core Zen 4 EPYC (SmolLM2
    bf16, batch jobs beside chats), with Ln·La the measured / predicted median of steps with a
    prompt chunk rose with the chunk's context in both of two runs (0.96-1.01 under 150 tokens,
    1.12-1.15 at 450-600); with the pairs it rose less in two runs of three, and 10.0% of the
    steps sized to a chat's TBT target overran it against 14.4% (bench/README.md, "A prompt
    chunk's attention"): within the runs' spread."""
    return num_new * context - num_new * (num_new - 1) // 2


def projection_seconds(table: tuple[tuple[int, float], ...], rows):
    """P(rows): ``table``'s (rows, seconds) interpolated linearly, past either end along the
    nearest two points; ``rows`` an int or an array of them. The scalar and the array take the
    same operations in the same order, so they agree to the last bit."""
    if isinstance(rows, np.ndarray):
        xs, ys = np.array([r for r, _ in table]), np.array([t for _, t in table])
        i = np.clip(np.searchsorted(xs, rows, side="right") - 1, 0, len(xs) - 2)
        return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (rows - xs[i])
    i = min(max(bisect.bisect_right(table, (rows, math.inf)) - 1, 0), len(table) - 2)
    (x0, y0), (x1, y1) = table[i], table[i + 1]
    return y0 + (y1 - y0) / (x1 - x0) * (rows - x0)


@dataclass(frozen=True, slots=True)
class CostModel:
    base: float                  # seconds per step
    per_prefill_token: float     # seconds per prefill token
    per_prefill_attn: float      # seconds per query-key pair of a prompt chunk's attention (attn_pairs)
    per_decode_token: float      # seconds per decoding request
    per_decode_ctx: float        # seconds per context token of a decoding request
    per_hidden_block: float = 0.0  # seconds per KV block a hidden cache re-projects (Apt-Serve's ρ)
    per_swap_in_byte: float = 0.0  # seconds per byte copied back from host memory before a step
    per_adapter: float = 0.0     # seconds per distinct LoRA adapter in a step
    per_adapter_row: float = 0.0  # seconds per token row run with a LoRA adapter
    projections: tuple[tuple[int, float], ...] = ()   # (rows, seconds) the engine measured: P(R)

    def __post_init__(self):
        # read back from JSON, the pairs are lists
        table = tuple((int(r), float(t)) for r, t in self.projections)
        if table and (len(table) < 2 or any(a[0] >= b[0] for a, b in zip(table, table[1:]))):
            raise ValueError(f"projections: at least two points, rows strictly increasing: {table}")
        object.__setattr__(self, "projections", table)

    def predict(self, s: StepShape) -> float:
        t = (self.base + self.per_prefill_token * s.prefill_tokens + self.per_prefill_attn * s.prefill_attn
             + self.per_decode_token * s.decode_tokens + self.per_decode_ctx * s.decode_ctx
             + self.per_hidden_block * s.hidden_blocks + self.per_swap_in_byte * s.swap_in_bytes
             + self.per_adapter * s.adapters + self.per_adapter_row * s.adapter_rows)
        return t + projection_seconds(self.projections, s.prefill_tokens + s.decode_tokens) if self.projections else t

    def many(self, prefill_tokens, prefill_attn, decode_tokens, decode_ctx, swap_slots=0,
             swap_in_bytes=0, adapters=0, adapter_rows=0) -> np.ndarray:
        """``predict`` of one shape per element of the arrays (no hidden blocks): the same sum in the
        same order, so each equals ``predict`` to the last bit. Swap slots cost nothing here."""
        t = (self.base + self.per_prefill_token * prefill_tokens + self.per_prefill_attn * prefill_attn
             + self.per_decode_token * decode_tokens + self.per_decode_ctx * decode_ctx
             + self.per_swap_in_byte * np.asarray(swap_in_bytes) + self.per_adapter * np.asarray(adapters)
             + self.per_adapter_row * np.asarray(adapter_rows))
        if self.projections:
            t = t + projection_seconds(self.projections, np.asarray(prefill_tokens) + decode_tokens)
        return t

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]],
            projections: tuple[tuple[int, float], ...] = (), weights=None) -> "CostModel":
        """Least squares over (shape, seconds) samples, coefficients kept non-negative; with
        ``projections`` (P), fitted to what P leaves of each step; with ``weights``, each
        sample's squared error counts that much.

        Active set: fit, drop the most negative coefficient's feature, refit, until none is negative.
        """
        if len(samples) < MIN_STEPS:
            raise ValueError(f"need at least {MIN_STEPS} measured steps to fit a cost model")
        X = np.array([(1.0, *s.features()) for s, _ in samples])
        y = np.array([t - (projection_seconds(projections, s.prefill_tokens + s.decode_tokens) if projections else 0.0)
                      for s, t in samples])
        scale = X.max(axis=0)
        scale[scale == 0] = 1.0
        Xs = X / scale
        if weights is not None:
            root = np.sqrt(np.asarray(weights, dtype=float))
            Xs, y = Xs * root[:, None], y * root
        active = list(range(X.shape[1]))
        while True:
            sol, *_ = np.linalg.lstsq(Xs[:, active], y, rcond=None)
            if sol.min() >= 0 or len(active) == 1:
                break
            active.pop(int(sol.argmin()))
        coef = np.zeros(X.shape[1])
        coef[active] = np.clip(sol, 0, None)
        return cls(*(float(x) for x in coef / scale), projections=projections)

    def ratios(self, samples: list[tuple[StepShape, float]]) -> list[float]:
        """Measured / predicted per sample: the spread a mean model leaves out."""
        return [t / p for s, t in samples if (p := self.predict(s)) > 0]

    def mean_abs_error(self, samples: list[tuple[StepShape, float]]) -> float:
        """Mean |predicted - measured| / measured over samples."""
        return sum(abs(self.predict(s) - t) / t for s, t in samples) / len(samples)


@dataclass(frozen=True, slots=True)
class SwapModel:
    """t_swap = base + per_slot * M^cpu (SPEC §2.2), from a bandwidth probe of the device."""
    base: float = 0.0
    per_slot: float = 0.0

    def predict(self, slots: int) -> float:
        return self.base + self.per_slot * slots if slots else 0.0

    def many(self, slots: np.ndarray) -> np.ndarray:
        """``predict`` of each element."""
        return np.where(slots != 0, self.base + self.per_slot * slots, 0.0)


class OnlineCostModel:
    """The iteration cost model the scheduler uses: fitted at start-up, refined from measured steps.

    T = max(t_exec, t_swap): swaps are issued before the step and overlap it (SPEC §2.2).
    Every ``refit_every`` observed steps it refits on the start-up samples plus the last
    ``window`` measured steps, each start-up sample weighing ``STARTUP_WEIGHT`` of a measured
    one: they still price what recent traffic lacks (a feature no recent step has is fitted
    from them alone), and hardly move what it has.

    [open choice] At full weight, the profile's large steps (a 1,024-token prompt, batches of
    512-token prompts: a second or more each, where a serving step takes 40-170 ms) led the
    least squares: replaying the steps the default policy served on a 2-core Zen 4 EPYC
    (SmolLM2 bf16, three logged runs of ``bench mixed``, each step priced by the model refitted
    from the steps before it), the steps with a batch prompt chunk came out at a median
    measured / predicted of 1.03-1.09 (p90 1.18-1.24) and the decode-only steps at 0.73-0.75,
    as the servers' own models had them. Weighing 0.01: 0.97-1.03 (p90 1.12-1.17) and
    0.83-0.93; 0.1 and 0.03 fell between; the start-up samples left out once 256 steps were
    measured did the same as 0.01.

    Between refits the fitted model's price of a step is corrected by its kind's recent level
    (:meth:`factor`):

        t̂ = f_k · t(step),   f_k = median of measured / t over the last ``KIND_WINDOW`` steps of kind k

    k: with a prompt chunk, or decodes only; f_k = 1 until ``KIND_MIN`` such steps were measured,
    and the kept steps' ratios are taken again under each refit's model. f_k is rounded to 6
    decimals: below that it is a clock's rounding (the simulator's step times are off their
    price by up to 1e-12, and passed on to the prices such differences changed which request
    went first past capacity, and a run's results with it). A step that copied swapped-out
    caches back is left out of f_k: its time holds the copy (s_in's, and where a GPU copies on a
    side link, the wait for the swap-outs queued before it), which comes and goes with memory
    pressure, not with the kind. (With them in, the paper-scale simulation's copies raised f_k
    for every step: at 3 req/s, past capacity, the default policy kept 79 / 48 / 46% of the
    chats on TTFT & P99 TBT over seeds 0-2 against 86 / 67 / 38%, and 0.41 / 0.25 / 0.24 batch
    requests/s against 0.55 / 0.29 / 0.24; with them out and f_k rounded, its runs are the same
    as without a correction, since the simulator's other steps take their price.)

    [open choice] A refit's window held mostly steps with a batch chunk, and the linear form
    fitted on them priced the decode-only steps 1.1-1.2 times what they took; until the first
    refit a server's steps ran 1.1-1.2 times the start-up fit's price. Six ``bench mixed`` runs
    of the default policy on a 2-core Zen 2 EPYC (SmolLM2 float32), each log priced again from
    its server's start-up profile (``bench steps --profile``; bench/README.md, "Each kind of step
    priced at its recent level"): mean |log measured / predicted| 11.2-14.2% fitted alone,
    6.0-8.0% corrected; steps under 0.85 of their price 11.6-19.6% against 0.4-1.0%; the first
    256 steps over 1.1 23-50% against 9-12%; the 90th percentile (the deadline's margin)
    1.11-1.18 against 1.09-1.11. Served with it, 4.6-5.2% of the steps holding chat decodes ran
    past the TBT target against 6.7-8.3%, the batch work within the runs' spread.

    The relative prediction error of each observed step is tracked (EWMA and count),
    and so is the ratio measured / predicted of the last ``TAIL_WINDOW`` steps, whose upper
    quantile (:meth:`overrun`) is the margin a deadline needs against the model's misses; both
    against the corrected price, the one the scheduler planned with.
    """

    TAIL_WINDOW = 256
    KIND_WINDOW = 8     # steps of a kind whose median measured / fitted corrects that kind's prices
    KIND_MIN = 4        # steps of a kind measured before its correction applies

    def __init__(self, model: CostModel, startup: list[tuple[StepShape, float]] = (),
                 swap: SwapModel = SwapModel(), window: int = 1024, refit_every: int = 128,
                 kind_correction: bool = True):
        self.model, self.swap = model, swap
        self.kind_correction = kind_correction     # False: the fitted model's prices as they are
        self.startup = list(startup)
        self.recent: deque = deque(maxlen=window)
        self.refit_every = refit_every
        self.observed = 0
        self.refits = 0
        self.error_ewma: float | None = None     # mean |pred - measured| / measured, EWMA (alpha 0.05)
        self.last_error: float | None = None
        self.ratios: deque = deque(maxlen=self.TAIL_WINDOW)   # measured / predicted, recent steps
        # measured / fitted of the last steps of each kind: [decodes only, with a prompt chunk]
        self.kinds = (deque(maxlen=self.KIND_WINDOW), deque(maxlen=self.KIND_WINDOW))
        self._factors = [1.0, 1.0]      # f_k of each kind, kept as its ratios change (prices read it often)

    def factor(self, prompt: bool) -> float:
        """f_k of the steps with a prompt chunk (``prompt``) or of the decode-only ones."""
        return self._factors[int(prompt)]

    def _refactor(self, prompt: int) -> None:
        """f_k of kind ``prompt`` (1: with a prompt chunk) from its kept ratios."""
        kept = self.kinds[prompt]
        ok = self.kind_correction and len(kept) >= self.KIND_MIN
        self._factors[prompt] = round(float(np.median(kept)), 6) if ok else 1.0

    def __call__(self, shape: StepShape, swap_slots: int = 0) -> float:
        return max(self.model.predict(shape) * self.factor(shape.prefill_tokens > 0), self.swap.predict(swap_slots))

    def many(self, prefill_tokens, prefill_attn, decode_tokens, decode_ctx, swap_slots=0,
             swap_in_bytes=0, adapters=0, adapter_rows=0) -> np.ndarray:
        """The call's prediction for one shape (no hidden blocks) per element of the arrays."""
        f = np.where(np.asarray(prefill_tokens) > 0, self.factor(True), self.factor(False))
        return np.maximum(self.model.many(prefill_tokens, prefill_attn, decode_tokens, decode_ctx,
                                          swap_in_bytes=swap_in_bytes, adapters=adapters,
                                          adapter_rows=adapter_rows) * f,
                          self.swap.many(np.asarray(swap_slots)))

    def overrun(self, q: float = 0.9, cap: float = 1.5) -> float:
        """The q-quantile of measured / predicted over the recent steps, within [1, cap]: a step
        predicted to take t takes at most ``overrun() * t`` in a fraction q of cases. 1.0 until
        a few steps were seen."""
        if len(self.ratios) < 8:
            return 1.0
        ordered = sorted(self.ratios)
        return min(cap, max(1.0, ordered[min(len(ordered) - 1, int(q * len(ordered)))]))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0:
            return
        prompt = int(shape.prefill_tokens > 0)
        fitted = self.model.predict(shape)
        predicted = fitted * self.factor(prompt)
        err = abs(predicted - seconds) / seconds
        self.last_error = err
        if predicted > 0:
            self.ratios.append(seconds / predicted)
            if not shape.swap_in_bytes:
                self.kinds[prompt].append(seconds / fitted)
                self._refactor(prompt)
        self.error_ewma = err if self.error_ewma is None else 0.95 * self.error_ewma + 0.05 * err
        self.recent.append((shape, seconds))
        self.observed += 1
        if self.observed % self.refit_every == 0:
            self.model = CostModel.fit(self.startup + list(self.recent), self.model.projections,
                                       [STARTUP_WEIGHT] * len(self.startup) + [1.0] * len(self.recent))
            self.refits += 1
            self._rekind()

    def _rekind(self) -> None:
        """The kinds' kept ratios taken again under the model just refitted."""
        for prompt, kept in enumerate(self.kinds):
            ratios = [t / p for s, t in self.recent if (s.prefill_tokens > 0) == prompt and not s.swap_in_bytes
                      and (p := self.model.predict(s)) > 0]
            kept.clear()
            kept.extend(ratios[-self.KIND_WINDOW:])
            self._refactor(prompt)


def predict_many(cost, prefill_tokens=0, prefill_attn=0, decode_tokens=0, decode_ctx=0, swap_slots=0,
                 swap_in_bytes=0, adapters=0, adapter_rows=0) -> np.ndarray:
    """``cost(StepShape(prefill_tokens, prefill_attn, decode_tokens, decode_ctx, 0, swap_in_bytes,
    adapters, adapter_rows), swap_slots)`` for each element of the (broadcast) arrays: a policy prices every
    candidate's own step this way once per plan. In numpy when the cost function has ``many``
    (the cost models here), else one call per element (any other ``(shape, swap_slots) -> seconds``
    callable)."""
    arrays = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (
        prefill_tokens, prefill_attn, decode_tokens, decode_ctx, swap_slots, swap_in_bytes, adapters,
        adapter_rows)))
    many = getattr(cost, "many", None)
    if many is not None:
        return (np.asarray(many(*arrays[:5], swap_in_bytes=arrays[5], adapters=arrays[6], adapter_rows=arrays[7]),
                           dtype=float) + np.zeros(arrays[0].shape))
    return np.array([cost(StepShape(*map(int, row[:4]), 0, *map(int, row[5:])), int(row[4]))
                     for row in zip(*arrays)], dtype=float).reshape(arrays[0].shape)


# A paper-scale setting: OPT-13B in fp16 on one A100-40GB, from published figures
# (vLLM-era measurements: ~20-30 ms per decode step at small batch, weights
# 26 GB so a step streams them once; prefill ~0.13 ms per token at 13 B params).
# A decoding request reads its whole KV cache every step: 0.82 MB per context token
# (40 layers x 5120 x 2 x fp16) at ~1.3 TB/s of the A100's 1.56 TB/s HBM = 0.63 us per token.
# (Until 2026-11-22 this was 4e-8, 16x too cheap: memory pressure cost every policy too little,
# and FCFS in the simulator beat the 2.6 req/s the Apt-Serve paper measured for vLLM.)
# per_prefill_attn was set when the term was Ln·La; it prices query-key pairs since 2026-12-05,
# so a whole prompt's attention costs half what it did (1 ms of a 1,000-token prompt's 131 ms);
# the simulated tables in bench/README.md dated before then were run with the old term.
OPT_13B_A100 = CostModel(base=0.020, per_prefill_token=1.3e-4, per_prefill_attn=2.0e-9,
                         per_decode_token=6.0e-5, per_decode_ctx=2 * 40 * 5120 * 2 / 1.3e12)
OPT_13B_A100_KV_TOKENS = 12_000      # ~12 GB left for KV at 0.8 MB per token (40 layers x 5120 x 2 x fp16)
# Apt-Serve's hidden cache on that device: a hidden request re-projects K and V (2 x [d, d] per
# layer) for every context token at every step. Per token that is 4 d^2 L flops = 16% of the
# 2 x 13e9 flops a prefill token costs (per_prefill_token above), and one KV block of our pool
# holds K or V of 16 tokens, i.e. 8 tokens' worth of K+V: seconds per KV block of context.
OPT_13B_A100_RHO = 8 * (4 * 5120 ** 2 * 40) / (2 * 13e9) * OPT_13B_A100.per_prefill_token
