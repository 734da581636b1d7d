"""ShareGPT prompt selection: the first fitting pairs, or a seeded random draw (bench sim-apt --samples)."""
from itertools import islice

import pytest

import tandem.bench.workloads as wl
from tandem.bench.workloads import HELD_OUT_FROM, PromptPair, sharegpt_prompts


@pytest.fixture
def fake_sharegpt(monkeypatch):
    """40 pairs whose prompt is i words long (i = 1..40), plus a held-out one; a token per word."""
    pairs = [PromptPair(i, " ".join(["w"] * (i + 1)), "r") for i in range(40)]
    pairs.append(PromptPair(HELD_OUT_FROM, "w w w w w", "r"))
    monkeypatch.setattr(wl, "iter_sharegpt", lambda: iter(pairs))
    monkeypatch.setattr(wl, "chat_ids", lambda tok, text: text.split())
    return pairs


def lengths(ps):
    return [len(p.prompt.split()) for p in ps]


def test_first_pairs_in_file_order(fake_sharegpt):
    assert lengths(sharegpt_prompts(5, None, min_prompt_tokens=10, max_prompt_tokens=30)) == [10, 11, 12, 13, 14]


def test_random_draw_fits_the_bounds_and_depends_on_the_seed(fake_sharegpt):
    a = sharegpt_prompts(8, None, min_prompt_tokens=10, max_prompt_tokens=30, sample=1)
    b = sharegpt_prompts(8, None, min_prompt_tokens=10, max_prompt_tokens=30, sample=1)
    c = sharegpt_prompts(8, None, min_prompt_tokens=10, max_prompt_tokens=30, sample=2)
    assert a == b and a != c
    for draw in (a, c):
        assert len(draw) == 8 and len({p.index for p in draw}) == 8          # no pair twice
        assert all(10 <= n <= 30 for n in lengths(draw))
        assert all(p.index < HELD_OUT_FROM for p in draw)
    first = sharegpt_prompts(8, None, min_prompt_tokens=10, max_prompt_tokens=30)
    assert {p.index for p in a} != {p.index for p in first}                  # not just the first ones


def test_random_draw_of_more_than_fit_is_all_of_them(fake_sharegpt):
    draw = sharegpt_prompts(100, None, min_prompt_tokens=35, max_prompt_tokens=100, sample=3)
    assert sorted(lengths(draw)) == list(range(35, 41))


def first_tokens(items, n: int = 16) -> list[tuple]:
    return [tuple(it.prompt_ids[:n]) for it in items]


def test_each_rate_sends_a_server_prompts_it_has_not_seen(tiny_llama):
    """A server's prefix cache keeps what earlier rates sent it: a later rate that sent the same
    prompts again would find them computed."""
    from argparse import Namespace
    from tandem.bench.online import RateTraces
    args = Namespace(duration=20.0, seed=0, max_output=64, held_out=False, requests=None)
    traces = RateTraces(args, tiny_llama, None)
    starts = [s for rate in (0.5, 1.0, 2.0) for s in first_tokens(traces(rate))]
    assert len(starts) == 10 + 20 + 40 and len(set(starts)) == len(starts)
    assert traces(1.0) is traces(1.0)                             # every system gets the same trace
    same = RateTraces(Namespace(**{**vars(args), "requests": 12}), tiny_llama, None, same_prompts=True)
    assert first_tokens(same(0.5)) == first_tokens(same(2.0)) and len(same(0.5)) == 12


def test_best_effort_streams_never_repeat_a_prompt():
    streams = [list(islice(wl.synthetic_be_stream(seed, 49152, scale=0.5), 300)) for seed in (1, 2, 3)]
    starts = [s for items in streams for s in first_tokens(items)]
    assert len(set(starts)) == 900
    assert all(256 <= len(it.prompt_ids) <= 512 and 16 <= it.max_tokens <= 64 for it in streams[0])
