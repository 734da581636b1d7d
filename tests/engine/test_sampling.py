"""The sampler draws from the right distribution (checked against numpy softmax)."""
import numpy as np
import pytest
import torch

from tandem.engine.messages import SamplingSpec
from tandem.engine.sampling import sample

LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -3.0], dtype=np.float64)


def expected(temperature, top_k, top_p, min_p=0.0):
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0)                # vLLM's min-p, before top-k and top-p
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if top_k > 0:
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    if top_p < 1:
        order = np.argsort(-p)
        cum_before = np.cumsum(p[order]) - p[order]
        nucleus = np.zeros_like(keep)
        nucleus[order[cum_before < top_p]] = True          # the smallest prefix reaching top_p
        keep &= nucleus
    q = np.where(keep, p, 0)
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0), (0.5, -1, 1.0, 0), (1.3, 3, 1.0, 0), (1.0, -1, 0.7, 0), (0.8, 4, 0.8, 0),
    (1.0, -1, 1.0, 0.3), (1.5, 4, 0.9, 0.2), (1.0, -1, 0.6, 0.5)])
def test_frequencies_match_softmax(temperature, top_k, top_p, min_p):
    n = 6000
    counts = np.zeros(len(LOGITS))
    specs = [SamplingSpec(temperature, top_p, top_k, seed=s, min_tokens=0, stop_token_ids=(), min_p=min_p)
             for s in range(n)]
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(n, 1)
    for t in sample(logits, specs, [0] * n):
        counts[t] += 1
    want = expected(temperature, top_k, top_p, min_p)
    assert np.all(counts[want == 0] == 0), "sampled outside the allowed support"
    se = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(counts / n - want) <= 5 * se + 1e-9), (counts / n, want)


def test_greedy_and_min_tokens_mask():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    specs = [SamplingSpec(0.0, 1.0, -1, 0, min_tokens=2, stop_token_ids=(1,))] * 2
    assert sample(logits, specs, [0, 2]) == [2, 1]


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-9])
def test_a_vanishing_temperature_samples_the_argmax(temperature):
    """numpy's limit of softmax(logits / T) as T -> 0 is all mass on the largest logit; float32
    division by such a T overflows to inf, whose softmax is NaN."""
    logits = torch.tensor([[3.0, 40.0, -35.0, 39.9, 0.0]] * 8)
    specs = [SamplingSpec(temperature, 1.0, -1, seed=s, min_tokens=0, stop_token_ids=()) for s in range(8)]
    limit = int(np.argmax(logits[0].numpy()))
    assert sample(logits, specs, [0] * 8) == [limit] * 8


def test_each_row_keeps_its_own_parameters_in_a_mixed_batch():
    """Rows of one batch with different temperature / top-k / top-p each draw from their own
    distribution (the filters are applied per row in batched operations), greedy rows among them
    stay greedy."""
    cases = [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.3, 3, 1.0), (1.0, -1, 0.7), (0.8, 4, 0.8), (0.0, -1, 1.0)]
    n = 4000
    specs, rows = [], []
    for s in range(n):
        for c, (t, k, p) in enumerate(cases):
            specs.append(SamplingSpec(t, p, k, seed=s * 31 + c, min_tokens=0, stop_token_ids=()))
            rows.append(c)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(specs), 1)
    counts = np.zeros((len(cases), len(LOGITS)))
    for c, tok in zip(rows, sample(logits, specs, [0] * len(specs))):
        counts[c, tok] += 1
    for c, (t, k, p) in enumerate(cases):
        if t == 0:
            assert counts[c, 0] == n
            continue
        want = expected(t, k, p)
        assert np.all(counts[c][want == 0] == 0), (c, counts[c])
        se = np.sqrt(want * (1 - want) / n)
        assert np.all(np.abs(counts[c] / n - want) <= 5 * se + 1e-9), (c, counts[c] / n, want)


def test_seeded_rows_are_batch_invariant():
    """A seeded row samples the same token alone and inside any batch."""
    spec = SamplingSpec(1.0, 0.9, 5, seed=1234, min_tokens=0, stop_token_ids=())
    other = SamplingSpec(0.7, 1.0, -1, seed=9, min_tokens=0, stop_token_ids=())
    torch.manual_seed(0)
    row = torch.randn(1, 300)
    for gen_index in range(20):
        alone = sample(row.clone(), [spec], [gen_index])[0]
        batch = torch.cat([torch.randn(3, 300), row, torch.randn(2, 300)])
        mixed = sample(batch, [other] * 3 + [spec] + [other] * 2, [gen_index] * 6)
        assert mixed[3] == alone


@pytest.mark.parametrize("probs, top_p, kept", [
    ([0.25] * 4, 0.5, 2), ([0.25] * 4, 0.25, 1), ([0.5, 0.25, 0.25], 0.5, 1), ([0.5, 0.25, 0.25], 0.75, 2),
    ([0.25] * 4, 0.51, 3)])
def test_top_p_keeps_the_smallest_set_that_reaches_it(probs, top_p, kept):
    """Exact masses (dyadic, as ties after top-k give): a token whose predecessors already hold
    top_p is dropped (HF's TopPLogitsWarper and vLLM keep the same sets)."""
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None]
    specs = [SamplingSpec(1.0, top_p, -1, seed=s, min_tokens=0, stop_token_ids=()) for s in range(400)]
    seen = {t for t in sample(logits.repeat(400, 1), specs, [0] * 400)}
    assert seen == set(range(kept))


def test_an_enormous_temperature_still_suppresses_stop_tokens():
    """Past float32's range a temperature turned the suppressed ids' -inf into NaN, and token 0,
    suppressed, came out every time. It is uniform over the allowed tokens instead."""
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    specs = [SamplingSpec(1e300, 1.0, -1, seed=s, min_tokens=4, stop_token_ids=(0,)) for s in range(300)]
    seen = sample(logits.repeat(300, 1), specs, [0] * 300)
    assert 0 not in seen and set(seen) == {1, 2, 3}


def test_a_uniform_draw_of_zero_never_gives_an_impossible_token(monkeypatch):
    """The race's noise is -log U; torch draws a U of exactly 0 about once in 2^24. Were every
    U 0, each row whose top-k keeps one token must still give that token (an infinite draw
    would race p / inf = 0 against the dropped tokens' 0 and give token 0)."""
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.zero_())
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 1.0, 4.0, 0.0]])
    specs = [SamplingSpec(1.0, 1.0, 1, seed=7, min_tokens=0, stop_token_ids=())] * 2
    assert sample(logits.clone(), specs, [0, 0]) == [1, 2]
