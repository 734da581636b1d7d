"""Cost model: the fit recovers known coefficients; shapes add up as defined."""
import json
import random
from dataclasses import asdict, astuple, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from tandem.sched.cost_model import (STARTUP_WEIGHT, CostModel, OnlineCostModel, StepShape, SwapModel, attn_pairs,
                                    predict_many)


def causal_pairs(n: int, context: int) -> int:
    """The query-key pairs the engine's attention computes for n new tokens ending at ``context``:
    the entries of the causal mask it builds for them (engine.attention._dense)."""
    return int(torch.ones(n, context, dtype=torch.bool).tril(diagonal=context - n).sum())


def test_shape_accumulates():
    s = StepShape().add(10, 10, decode=False).add(1, 50, decode=True).add(1, 70, decode=True).add(4, 30, False)
    assert s == StepShape(prefill_tokens=14, prefill_attn=causal_pairs(10, 10) + causal_pairs(4, 30),
                          decode_tokens=2, decode_ctx=120)
    # on LoRA adapters: a prompt's rows are its new tokens, a decode's one; the adapter counts where it is new
    s = s.add(6, 6, decode=False, adapters=1, lora=True).add(1, 40, decode=True, lora=True).add(3, 9, False, lora=True)
    assert (s.prefill_tokens, s.decode_tokens, s.adapters, s.adapter_rows) == (23, 3, 1, 6 + 1 + 3)


def test_a_shapes_features_are_its_fields_in_order_and_a_fit_reads_them_so(monkeypatch):
    """``features`` (a refit's row per step) says what ``astuple`` does, every field in its place;
    a fit on them is the fit on rows built with ``astuple``, to the last bit."""
    s = StepShape(*range(11, 19))
    assert s.features() == astuple(s) == tuple(range(11, 19))
    rng = random.Random(1)
    samples = [(StepShape(*(rng.randint(0, 1000) for _ in range(8))), rng.uniform(0.001, 0.1)) for _ in range(64)]
    weights = [STARTUP_WEIGHT] * 8 + [1.0] * 56
    fit = CostModel.fit(samples, weights=weights)
    monkeypatch.setattr(StepShape, "features", astuple)
    assert CostModel.fit(samples, weights=weights) == fit


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300), st.integers(0, 300))
def test_a_chunk_counts_the_pairs_its_attention_computes(n, before):
    """A prompt whole or as a chunk over a cached context; as one int and within arrays."""
    assert attn_pairs(n, n + before) == causal_pairs(n, n + before)
    got = attn_pairs(np.array([n, 1, n]), np.array([n + before, before + 1, n]))
    assert got.tolist() == [causal_pairs(n, n + before), before + 1, causal_pairs(n, n)]


def test_fit_recovers_coefficients_and_stays_non_negative():
    true = CostModel(0.01, 2e-4, 1e-8, 5e-4, 3e-6)
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        s = StepShape()
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 512)
            s = s.add(n, n + rng.randint(0, 512), decode=False)
        for _ in range(rng.randint(0, 64)):
            s = s.add(1, rng.randint(1, 1024), decode=True)
        samples.append((s, true.predict(s) * (1 + rng.uniform(-0.01, 0.01))))
    fit = CostModel.fit(samples)
    for a, b in zip((fit.base, fit.per_prefill_token, fit.per_decode_token, fit.per_decode_ctx),
                    (true.base, true.per_prefill_token, true.per_decode_token, true.per_decode_ctx)):
        assert a == pytest.approx(b, rel=0.1)
    assert fit.mean_abs_error(samples) < 0.02
    # a feature that only hurts the fit gets 0, not a negative coefficient
    flat = [(StepShape(decode_tokens=d, decode_ctx=1000 - d), 0.05) for d in range(1, 60)]
    assert min(CostModel.fit(flat).__getattribute__(f) for f in
               ("base", "per_prefill_token", "per_prefill_attn", "per_decode_token", "per_decode_ctx")) >= 0


def _refits_learn(coefficient: str, value: float, feature: str, served, probe: int, seed: int) -> None:
    """A start-up profile whose steps all have ``feature`` 0 prices it at 0; after 128 served
    steps with ``served(rng, i)`` of it (costing ``value`` each, measured within 1%) are
    refitted, the model's ``coefficient`` is ``value`` within 5%, and a step with ``probe`` of
    it, priced ``probe * value`` short before, is priced right."""
    true = replace(CostModel(0.01, 2e-4, 1e-8, 5e-4, 3e-6), **{coefficient: value})
    rng = random.Random(seed)

    def shape(x: int) -> StepShape:
        s = StepShape().add(n := rng.randint(1, 512), n, decode=False)
        for _ in range(rng.randint(1, 64)):
            s = s.add(1, rng.randint(1, 1024), decode=True)
        return replace(s, **{feature: x})

    startup = [(s, true.predict(s)) for s in (shape(0) for _ in range(40))]
    online = OnlineCostModel(CostModel.fit(startup), startup, refit_every=64)
    probed = shape(probe)
    assert online(probed) == pytest.approx(true.predict(probed) - probe * value, rel=0.01)
    for i in range(128):
        s = shape(served(rng, i))
        online.observe(s, true.predict(s) * (1 + rng.uniform(-0.01, 0.01)))
    assert getattr(online.model, coefficient) == pytest.approx(value, rel=0.05)
    assert online(probed) == pytest.approx(true.predict(probed), rel=0.02)


def test_the_refits_learn_the_copy_back_of_swapped_out_caches_from_the_steps_that_make_it():
    """A start-up profile swaps nothing, so its model prices a copy back from host memory at 0;
    once served steps (one in eight copying 1-100 MB back at 5 GB/s) are refitted, the model
    finds the 0.2 ns per byte, and a step copying 50 MB is priced its 10 ms more."""
    _refits_learn("per_swap_in_byte", 2e-10, "swap_in_bytes",
                  lambda rng, i: rng.randint(1_000_000, 100_000_000) if i % 8 == 0 else 0, 50_000_000, seed=1)


def test_the_refits_learn_what_a_lora_adapter_adds_to_a_step():
    """The start-up profile runs the base model only, so its model prices a step's LoRA
    adapters at 0; once served steps run with 0-4 distinct adapters (4 ms each, whatever their
    rows) are refitted, the model finds the 4 ms, and a step with three adapters is priced its
    12 ms more."""
    _refits_learn("per_adapter", 0.004, "adapters", lambda rng, i: rng.randint(0, 4), 3, seed=2)


def test_the_refits_learn_what_each_row_on_a_lora_adapter_adds_beside_the_adapter_itself():
    """An adapter's products cost a part per adapter (4 ms) and a part per token row run with it
    (0.2 ms): served steps with 0-3 adapters over 1-512 of their rows are refitted after a start-up
    profile without adapters; the model finds both parts, so a 256-token chunk on one adapter is
    priced its 4 + 51.2 ms more, where a fit that knows only the adapters (its rows left out of
    the shapes) misprices it by more than 20 ms."""
    true = CostModel(0.01, 2e-4, 1e-8, 5e-4, 3e-6, per_adapter=0.004, per_adapter_row=2e-4)
    rng = random.Random(3)

    def served(adapters: int) -> StepShape:
        s = StepShape()
        for _ in range(rng.randint(1, 32)):
            s = s.add(1, rng.randint(1, 1024), decode=True, lora=rng.random() < 0.5 and adapters > 0)
        for a in range(adapters + rng.randint(0, 1)):
            s = s.add(n := rng.randint(1, 256), n + rng.randint(0, 256), decode=False,
                      adapters=int(a < adapters), lora=a < adapters)
        return s

    startup = [(s, true.predict(s)) for s in (served(0) for _ in range(40))]
    online = OnlineCostModel(CostModel.fit(startup), startup, refit_every=64)
    steps = [served(rng.randint(0, 3)) for _ in range(128)]
    measured = [true.predict(s) * (1 + rng.uniform(-0.01, 0.01)) for s in steps]
    for s, t in zip(steps, measured):
        online.observe(s, t)
    assert online.model.per_adapter == pytest.approx(0.004, rel=0.1)
    assert online.model.per_adapter_row == pytest.approx(2e-4, rel=0.05)
    chunk = StepShape().add(1, 300, decode=True).add(256, 256, decode=False, adapters=1, lora=True)
    assert chunk.adapter_rows == 256 and chunk.adapters == 1
    assert online(chunk) == pytest.approx(true.predict(chunk), rel=0.02)
    blind = CostModel.fit(startup + [(replace(s, adapter_rows=0), t) for s, t in zip(steps, measured)])
    assert abs(blind.predict(replace(chunk, adapter_rows=0)) - true.predict(chunk)) > 0.02


def _products(rows: int) -> float:
    """A step's products that change path past six rows: 2 ms a row over the blocks, then a
    25 ms jump and 1.5 ms a row over the dense weights (as engine.linear.Thin's do)."""
    return 0.002 * rows if rows <= 6 else 0.025 + 0.0015 * rows


TABLE = ((0, 0.0), *((r, _products(r)) for r in (1, 3, 6, 7, 12, 24, 48, 96, 192, 384)))


def test_the_products_measured_are_interpolated_between_and_past_their_rows():
    """P(R): numpy's interpolation between the points measured, their end segments' lines past them."""
    xs, ys = [r for r, _ in TABLE], [t for _, t in TABLE]
    model = CostModel(0.0, 0.0, 0.0, 0.0, 0.0, projections=TABLE)
    for r in range(0, 385):
        got = model.predict(StepShape(prefill_tokens=r // 2, decode_tokens=r - r // 2))
        assert got == pytest.approx(float(np.interp(r, xs, ys)), rel=1e-12, abs=1e-15)
        assert got == pytest.approx(_products(r) if r else 0.0, rel=1e-12)      # TABLE's two lines hold between
    assert model.predict(StepShape(prefill_tokens=1000)) == pytest.approx(_products(1000), rel=1e-12)
    again = CostModel(**json.loads(json.dumps(asdict(model))))              # as sim_cli keeps it
    assert again == model and again.predict(StepShape(prefill_tokens=50)) == model.predict(StepShape(prefill_tokens=50))


@pytest.mark.parametrize("table", [((0, 0.0),), ((0, 0.0), (1, 0.002), (1, 0.003)), ((0, 0.0), (4, 0.01), (2, 0.02))])
def test_a_table_of_products_needs_two_points_in_increasing_rows(table):
    """Interpolation needs two points at least and rows in order: anything else is refused where
    the model is made (a table read back from a file, say), not met as a division by zero."""
    with pytest.raises(ValueError, match="projections"):
        CostModel(0.01, 0.0, 0.0, 0.0, 0.0, projections=table)


def test_the_fit_takes_the_products_as_measured_and_fits_the_rest():
    """An engine whose products jump past six rows: one intercept cannot fit both kinds of step;
    with the products measured, the rest is recovered -- even from steps past the threshold only,
    which then price the thin steps right (the jump is measured, not fitted), and refits keep them."""
    def truth(s):
        return 0.02 + 2e-4 * s.prefill_tokens + 1e-3 * s.decode_tokens + 3e-6 * s.decode_ctx \
            + _products(s.prefill_tokens + s.decode_tokens)
    rng = random.Random(2)
    samples = []
    for _ in range(300):
        s = StepShape()
        for _ in range(rng.choice([0, 0, 1])):
            n = rng.randint(1, 400)
            s = s.add(n, n, decode=False)
        for _ in range(rng.choice([1, 2, 4, 6, 8, 16, 32])):
            s = s.add(1, rng.randint(1, 500), decode=True)
        samples.append((s, truth(s)))
    fit = CostModel.fit(samples, TABLE)
    assert fit.projections == TABLE and fit.mean_abs_error(samples) < 1e-6
    for got, want in zip((fit.base, fit.per_prefill_token, fit.per_decode_token, fit.per_decode_ctx),
                         (0.02, 2e-4, 1e-3, 3e-6)):
        assert got == pytest.approx(want, rel=1e-4)
    assert CostModel.fit(samples).mean_abs_error(samples) > 0.05           # one intercept for both
    thin = [x for x in samples if x[0].prefill_tokens + x[0].decode_tokens <= 6]
    assert 30 < len(thin) < 250
    from_thick = CostModel.fit([x for x in samples if x not in thin], TABLE)
    assert from_thick.mean_abs_error(thin) < 1e-6
    online = OnlineCostModel(fit, startup=samples, refit_every=50)
    for s, t in samples[:50]:
        online.observe(s, t)
    assert online.refits == 1 and online.model.projections == TABLE and online.model.mean_abs_error(samples) < 1e-6


def test_a_kind_of_step_that_runs_off_its_fitted_price_is_priced_at_the_median_of_its_last_steps():
    """Decode-only steps run at 0.6 of the fitted price, steps with a prompt chunk at 1.3 (one at
    2.0, which a median ignores). From its fourth step on, each kind is priced at the median
    of its last eight, the other kind untouched: by hand, 15 ms -> 9 ms, 30 ms -> 39 ms."""
    model = CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0)
    decode, prompt = StepShape().add(1, 8, decode=True), StepShape().add(20, 20, decode=False)
    assert (model.predict(decode), model.predict(prompt)) == (pytest.approx(0.015), pytest.approx(0.030))
    online = OnlineCostModel(model, refit_every=10**9)
    plain = OnlineCostModel(model, refit_every=10**9, kind_correction=False)
    for i in range(3):
        for m in (online, plain):
            m.observe(decode, 0.015 * 0.6)
        assert online(decode) == pytest.approx(0.015)           # fewer than four steps of the kind
    for m in (online, plain):
        m.observe(decode, 0.015 * 0.6)
    assert online(decode) == pytest.approx(0.009) and online(prompt) == pytest.approx(0.030)
    for r in (1.3, 2.0, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3):
        for m in (online, plain):
            m.observe(prompt, 0.030 * r)
    assert online(prompt) == pytest.approx(0.039) and online(decode) == pytest.approx(0.009)
    assert (plain(prompt), plain(decode)) == (pytest.approx(0.030), pytest.approx(0.015))
    both = predict_many(online, [0, 20], [0, attn_pairs(20, 20)], [1, 0], [8, 0])
    assert both.tolist() == [online(decode), online(prompt)]
    # every later step at the corrected price: no margin left to add for the decodes
    for _ in range(40):
        online.observe(decode, 0.009)
        plain.observe(decode, 0.009)
    assert online.overrun() == 1.0
    assert plain.overrun() == pytest.approx(1.3)               # the 2.0 and seven 1.3s of 52 steps


def test_steps_that_copy_caches_back_stay_out_of_the_correction():
    """Eight decode steps copying a swapped-out cache back took 1.5 times their price (the copy
    waited for a busy link): the decodes are still priced as fitted, 15 ms, where their own
    median would have made it 22.5 ms; a plain decode step at 0.8 then counts as before."""
    model = CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0)
    decode = StepShape().add(1, 8, decode=True)
    copying = replace(decode, swap_in_bytes=4096)
    online = OnlineCostModel(model, refit_every=10**9)
    for _ in range(8):
        online.observe(copying, 1.5 * model.predict(copying))
    assert online(decode) == pytest.approx(0.015) and online.factor(False) == 1.0
    for _ in range(4):
        online.observe(decode, 0.8 * 0.015)
    assert online(decode) == pytest.approx(0.012)
    # when a refit takes the ratios again: it prices the plain decodes as they ran (12 ms) and
    # the copies at their mean, which seven of eight took 18 ms of (ratios 0.82 under it)
    refitted = OnlineCostModel(model, refit_every=16)
    for _ in range(8):
        refitted.observe(decode, 0.012)
    for r in (1.2,) * 7 + (3.3,):
        refitted.observe(copying, r * 0.015)
    assert refitted.refits == 1 and refitted.model.predict(decode) == pytest.approx(0.012)
    assert refitted.factor(False) == 1.0


def test_a_correction_within_the_clocks_rounding_is_none():
    """Steps off their price by a part in 1e12 (a clock's rounding, as the simulator's) leave
    every price exactly as fitted; off by a part in 1e4, they correct it."""
    model = CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0)
    decode = StepShape().add(1, 8, decode=True)
    online = OnlineCostModel(model, refit_every=10**9)
    for _ in range(8):
        online.observe(decode, model.predict(decode) * (1 + 3e-12))
    assert online(decode) == model.predict(decode) and online.factor(False) == 1.0
    for _ in range(8):
        online.observe(decode, model.predict(decode) * (1 + 1e-4))
    assert online.factor(False) == 1.0001


def _serve_decodes(online: OnlineCostModel, now: CostModel, rng: random.Random, steps: int) -> list[StepShape]:
    """``steps`` served steps of 1-24 decodes at contexts of 50-700 tokens, each taking what ``now``
    prices it at, observed by ``online``; their shapes."""
    served = []
    for _ in range(steps):
        s = StepShape()
        for _ in range(rng.randint(1, 24)):
            s = s.add(1, rng.randint(50, 700), decode=True)
        served.append(s)
        online.observe(s, now.predict(s))
    return served


def test_after_a_refit_the_correction_is_taken_again_under_the_new_model():
    """The start-up profile ran 30% slower than the served steps; until the first refit the
    served decodes are priced at the median of what they measured against the start-up fit,
    and after it (the refit prices them as they run) at the refitted model's price, within 1%:
    a correction kept from before the refit would price them 23% low."""
    then = CostModel(0.026, 2.6e-4, 1.3e-8, 1.3e-3, 3.9e-6)
    now = CostModel(0.020, 2e-4, 1e-8, 1e-3, 3e-6)
    startup = []
    for batch, ctx in ((1, 64), (8, 64), (4, 512), (32, 128), (16, 900)):
        s = StepShape()
        for _ in range(batch):
            s = s.add(1, ctx, decode=True)
        startup += [(s, then.predict(s))] * 2
    online = OnlineCostModel(CostModel.fit(startup), startup=startup, refit_every=64)
    served = _serve_decodes(online, now, random.Random(7), 63)
    assert online.refits == 0 and abs(online(served[-1]) / now.predict(served[-1]) - 1) < 0.01
    assert abs(online.model.predict(served[-1]) / now.predict(served[-1]) - 1.3) < 0.01
    online.observe(served[0], now.predict(served[0]))
    assert online.refits == 1 and abs(online.model.predict(served[-1]) / now.predict(served[-1]) - 1) < 0.01
    assert max(abs(online(s) / now.predict(s) - 1) for s in served) < 0.01


def test_overrun_is_the_upper_quantile_of_measured_over_predicted():
    model = CostModel(0.01, 1e-3, 0.0, 5e-3, 0.0)
    online = OnlineCostModel(model, refit_every=10**9)
    shape = StepShape().add(1, 8, decode=True)               # predicted: 0.015 s
    assert online.overrun() == 1.0                           # nothing measured yet
    rng = random.Random(1)
    ratios = [1.0] * 85 + [1.3] * 15                         # 15% of steps run 30% long
    rng.shuffle(ratios)
    for r in ratios:
        online.observe(shape, 0.015 * r)
    assert online.overrun(0.9) == pytest.approx(1.3)
    assert online.overrun(0.5) == pytest.approx(1.0)
    for _ in range(OnlineCostModel.TAIL_WINDOW):             # faster than predicted: no margin
        online.observe(shape, 0.010)
    assert online.overrun() == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 4096), st.integers(0, 64), st.integers(0, 10**6),
                          st.integers(0, 500), st.integers(0, 10**9), st.integers(0, 4), st.integers(0, 4096)),
                min_size=0, max_size=20),
       st.floats(0.0, 0.05), st.floats(0.0, 1e-4), st.floats(0.0, 1e-9), st.floats(0.0, 0.01), st.floats(0.0, 1e-3))
def test_many_prices_each_shape_as_one_call_does(rows, swap_base, per_slot, per_byte, per_adapter, per_row):
    """A policy prices every candidate's step at once: each element must be what the call on that
    one shape, its swap slots, the bytes it copies back and its LoRA adapters and their rows
    return, to the last bit (plans compare such times)."""
    for table in ((), TABLE):       # without and with the products measured (engine.linear.Thin's)
        model = CostModel(0.02, 1.3e-4, 2e-9, 6e-5, 6.3e-7, per_swap_in_byte=per_byte, per_adapter=per_adapter,
                          per_adapter_row=per_row, projections=table)
        online = OnlineCostModel(model, swap=SwapModel(swap_base, per_slot))
        cols = list(zip(*rows)) if rows else [()] * 8
        pt, attn, dt, ctx, slots, nbytes, ads, ad_rows = (list(c) for c in cols)
        want = [online(StepShape(a, b, c, d, 0, n, m, r), k) for a, b, c, d, k, n, m, r in rows]
        assert predict_many(online, pt, attn, dt, ctx, slots, nbytes, ads, ad_rows).tolist() == want
        assert predict_many(lambda s, k: online(s, k), pt, attn, dt, ctx, slots, nbytes, ads, ad_rows).tolist() == want
        assert predict_many(online.model, pt, attn, dt, ctx).tolist() == [online.model.predict(StepShape(*r[:4]))
                                                                           for r in rows]


def test_the_refits_follow_the_served_steps_and_take_what_they_lack_from_the_start_up():
    """The start-up profile's large steps were measured on a machine busier than it is now (all
    costs 30% higher), and the served steps so far are decodes only. A refit prices the served
    decodes as they now run, and prompts from the start-up samples alone (no served step
    has one)."""
    then = CostModel(0.026, 2.6e-4, 1.3e-8, 1.3e-3, 3.9e-6)
    now = CostModel(0.020, 2e-4, 1e-8, 1e-3, 3e-6)
    rng = random.Random(5)
    startup = []
    for reqs, prompt in ((1, 1024), (1, 512), (4, 512), (2, 256), (1, 32)):
        s = StepShape()
        for _ in range(reqs):
            s = s.add(prompt, prompt, decode=False)
        startup.append((s, then.predict(s)))
    for batch, ctx in ((1, 64), (8, 64), (4, 512), (32, 128)):
        s = StepShape()
        for _ in range(batch):
            s = s.add(1, ctx, decode=True)
        startup += [(s, then.predict(s))] * 4
    online = OnlineCostModel(CostModel.fit(startup), startup=startup, refit_every=128)
    served = _serve_decodes(online, now, rng, 128)
    assert online.refits == 1
    assert max(abs(online.model.predict(s) / now.predict(s) - 1) for s in served) < 0.01
    assert online.model.per_prefill_token == pytest.approx(then.per_prefill_token, rel=0.1)
