"""What a request may ask of sampling beyond temperature and top-k/p, against HF transformers:
log probabilities of output and prompt tokens (HF's log-softmax over the same sequence; a
float64 reference for the helper), logit bias and OpenAI's presence / frequency penalties (a
greedy loop over HF's logits with them applied), and the repetition penalty (HF's own)."""
import math

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.messages import SamplingSpec
from tandem.engine.sampling import log_probs, sample, token_logprobs
from tests.conftest import assert_pool_free, mixed_prompts

MAX_NEW = 12


def hf_logprobs(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: HF's float64 log-softmax before each generated token."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check_against(ref: torch.Tensor, token_ids: list[int], lps, k: int) -> None:
    assert len(lps) == len(token_ids) == ref.shape[0]
    for i, (tok, lp) in enumerate(zip(token_ids, lps)):
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=2e-4), f"token {i}"
        want_v, want_i = torch.topk(ref[i], k)
        assert list(lp.top_ids) == want_i.tolist(), f"token {i}: likeliest ids"
        assert list(lp.top_logprobs) == pytest.approx(want_v.tolist(), abs=2e-4)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    # a pool of 24 blocks of 8 tokens: eight prompts of up to 60 tokens preempt each other
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", policy="fcfs", block_size=8,
             kv_cache_bytes=24 * block_bytes, max_num_batched_tokens=64, threads_per_worker=1) as llm:
        yield llm


def test_greedy_and_sampled_logprobs_match_hf(llm, tiny_llama):
    """Each request gets its own count of alternatives (or none), greedy or sampled, in one batch
    that preempts and recomputes: every token's log probability is HF's."""
    prompts = mixed_prompts(8, 512, seed=21)
    ks = [5, None, 0, 20, 1, 3, None, 2]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                             logprobs=k) for i, k in enumerate(ks)]
    outs = llm.generate(prompts, params)
    assert sum(q.num_preemptions for q in llm.scheduler.queues) > 0, "meant to preempt"
    assert_pool_free(llm)
    sampled_not_top = 0
    for p, k, o in zip(prompts, ks, outs, strict=True):
        if k is None:
            assert o.logprobs is None
            continue
        check_against(hf_logprobs(tiny_llama, p, o.token_ids), o.token_ids, o.logprobs, k)
        sampled_not_top += sum(lp.logprob < hf_top - 1e-3 for lp, hf_top in
                               zip(o.logprobs, hf_logprobs(tiny_llama, p, o.token_ids).max(-1).values.tolist()))
    assert sampled_not_top > 0, "sampling at temperature 0.9 should pick some token other than the likeliest"


def test_logprobs_are_the_models_before_stop_masking(llm, tiny_llama):
    """Below min_tokens the stop id cannot be sampled, but its log probability is still the
    model's: the likeliest token listed first is the masked one."""
    prompt = mixed_prompts(1, 512, seed=5)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=1))[0]
    top = first.token_ids[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, min_tokens=3,
                                                stop_token_ids=[top], logprobs=2))[0]
    assert out.token_ids[0] != top
    assert out.logprobs[0].top_ids[0] == top
    check_against(hf_logprobs(tiny_llama, prompt, out.token_ids), out.token_ids, out.logprobs, 2)


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: HF's float64 log-softmax before each prompt token after the first."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits[:-1], dim=-1)


def test_prompt_logprobs_match_hf_across_chunks_and_preemptions(llm, tiny_llama):
    """Prompts that share a step's 64 tokens are scored chunk by chunk, and again when the pool
    preempts and recomputes them: each prompt token's log probability is HF's, the first None."""
    prompts = mixed_prompts(6, 512, seed=33, lo=30, hi=50)
    ks = [None, 3, 0, 1, 2, 5]          # the first fills most of a step: the second's prompt is cut
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=k,
                             logprobs=1 if i == 1 else None) for i, k in enumerate(ks)]
    before = sum(q.num_preemptions for q in llm.scheduler.queues)
    outs = llm.generate(prompts, params)
    assert sum(q.num_preemptions for q in llm.scheduler.queues) > before, "meant to preempt"
    assert_pool_free(llm)
    for p, k, o in zip(prompts, ks, outs, strict=True):
        if k is None:
            assert o.prompt_logprobs is None
            continue
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        check_against(hf_prompt_logprobs(tiny_llama, p), p[1:], o.prompt_logprobs[1:], k)
    check_against(hf_logprobs(tiny_llama, prompts[1], outs[1].token_ids), outs[1].token_ids, outs[1].logprobs, 1)


def test_prompt_logprobs_with_hidden_caches(tiny_opt):
    """Requests that keep hidden states instead of K/V (the multi-head model) score their prompts
    through the same rows."""
    prompts = mixed_prompts(3, 512, seed=8, lo=20, hi=40)
    with LLM(str(tiny_opt), "cpu:1", dtype="float32", policy="fcfs", block_size=8, threads_per_worker=1,
             max_num_batched_tokens=16, cache_type="hidden") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2))
    for p, o in zip(prompts, outs, strict=True):
        check_against(hf_prompt_logprobs(tiny_opt, p), p[1:], o.prompt_logprobs[1:], 2)


def hf_biased_greedy(model_dir, prompt: list[int], bias: dict[int, float], n: int, presence: float = 0.0,
                     frequency: float = 0.0) -> list[int]:
    """HF's logits for the whole sequence at each step, the bias added and OpenAI's penalties
    taken off (as its API reference writes them), the argmax taken."""
    from collections import Counter
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1].clone()
            for t, b in bias.items():
                logits[t] += b
            for t, c in Counter(seq[len(prompt):]).items():
                logits[t] -= c * frequency + presence
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_penalties_match_hf(llm, tiny_llama):
    """Repetition penalty against HF generate's own, presence and frequency against the loop above,
    each beside an unpenalized request; every one changes what the model would say unpenalized."""
    from tests.conftest import hf_greedy
    prompts = mixed_prompts(4, 512, seed=52, lo=4, hi=12)
    # the first prompt ends in the model's own greedy reply, which it would go on repeating: the
    # repetition penalty must count prompt tokens to change even its first token
    prompts[0] += hf_greedy(tiny_llama, prompts[:1], 12)[0]
    greedy = dict(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, [SamplingParams(**greedy, repetition_penalty=1.8),
                                  SamplingParams(**greedy, presence_penalty=1.5),
                                  SamplingParams(**greedy, frequency_penalty=-0.8, presence_penalty=0.3),
                                  SamplingParams(**greedy)])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    rep = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                      eos_token_id=None, pad_token_id=0)[0, len(prompts[0]):].tolist()
    plain = hf_greedy(tiny_llama, prompts, 16)
    want = [rep, hf_biased_greedy(tiny_llama, prompts[1], {}, 16, presence=1.5),
            hf_biased_greedy(tiny_llama, prompts[2], {}, 16, presence=0.3, frequency=-0.8), plain[3]]
    for i, (o, w) in enumerate(zip(outs, want, strict=True)):
        assert o.token_ids == w, f"request {i}"
    assert all(want[i] != plain[i] for i in range(3)), "each penalty was meant to change the reply"
    assert rep[0] != plain[0][0], "the prompt's tokens were meant to be penalized from the first token"
    for name, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        with pytest.raises(ValueError, match=f"^{name}"):
            SamplingParams(**{name: bad})


def test_logit_bias_steers_greedy_tokens_as_hf_with_the_bias(llm, tiny_llama):
    """A ban (-100) on the token HF would pick first and a push (+4) on a few others: the same
    greedy tokens as HF's with the bias, in a batch with an unbiased request; the log
    probabilities stay the model's own (the banned token still listed likeliest)."""
    prompts = mixed_prompts(2, 512, seed=44, lo=8, hi=20)
    first = hf_biased_greedy(tiny_llama, prompts[0], {}, 1)[0]
    bias = {first: -100.0, 17: 4.0, 301: 4.0, 99: 2.5}
    outs = llm.generate(prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias,
                                                 logprobs=1),
                                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    want = hf_biased_greedy(tiny_llama, prompts[0], bias, 8)
    assert outs[0].token_ids == want and first not in want
    assert outs[0].logprobs[0].top_ids[0] == first
    assert outs[1].token_ids == hf_biased_greedy(tiny_llama, prompts[1], {}, 8)
    with pytest.raises(ValueError, match="logit_bias: 512 is not a token id"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, logit_bias={512: 1.0}))
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, [(3, 1.0)]):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_token_logprobs_against_float64(k):
    """The helper on its own: rows that ask, in any order among rows that do not."""
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(5, 40, generator=g) * 3
    specs = [SamplingSpec(0.0, 1.0, -1, 0, 0, (), logprobs=-1 if r in (1, 3) else k) for r in range(5)]
    rows, lp = log_probs(logits, specs)
    tokens = sample(logits.clone(), specs, [0] * 5)
    got = token_logprobs(rows, lp, specs, tokens)
    assert sorted(got) == [0, 2, 4]
    for r, t in got.items():
        x = logits[r].double().tolist()
        m = max(x)
        lse = m + math.log(sum(math.exp(v - m) for v in x))
        assert t.logprob == pytest.approx(x[tokens[r]] - lse, abs=1e-5)
        order = sorted(range(40), key=lambda i: -x[i])[:k]
        assert list(t.top_ids) == order
        assert list(t.top_logprobs) == pytest.approx([x[i] - lse for i in order], abs=1e-5)


def test_logprobs_out_of_range_is_refused():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="^logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="^prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_offline_logprobs_read_as_vllm_s_dicts(tiny_chat_model):
    """vLLM's offline shape: per position a dict of token id -> Logprob(logprob, rank,
    decoded_token) holding the token there and the k likeliest, the values HF's log-softmax,
    the ranks HF's (1: the likeliest), the texts the HF tokenizer's for each token alone (whole
    characters here); the prompt's too (None first), and a beam's; without text (detokenize off), no decoded_token."""
    from transformers import AutoTokenizer
    from tandem import BeamSearchParams
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    prompt = tok("The weather in Oslo is")["input_ids"]
    k = 3
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", threads_per_worker=1) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=k,
                                                    prompt_logprobs=2))[0]
        bare = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1,
                                                     detokenize=False))[0]
        beam = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=3))[0]

    def check(positions, ids, ref, k):
        for i, (tid, d) in enumerate(zip(ids, positions)):
            top = torch.topk(ref[i], k).indices.tolist()
            assert set(d) == {tid, *top}, f"position {i}"
            for t, lp in d.items():
                rank = int((ref[i] >= ref[i, t] - 1e-9).sum()) if t == tid else top.index(t) + 1
                assert (lp.logprob, lp.rank) == (pytest.approx(ref[i, t].item(), abs=2e-4), rank)
                assert lp.decoded_token == tok.decode([t])
    check(out.outputs[0].logprobs, out.token_ids, hf_logprobs(tiny_chat_model, prompt, out.token_ids), k)
    assert out.prompt_logprobs[0] is None
    check(out.prompt_logprobs[1:], prompt[1:], hf_prompt_logprobs(tiny_chat_model, prompt), 2)
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(out.logprobs, out.token_ids)))
    assert all(lp.decoded_token is None for d in bare.logprobs for lp in d.values())
    for seq in beam.sequences:
        gen = seq.tokens[len(prompt):]
        ref = hf_logprobs(tiny_chat_model, prompt, gen)
        assert [d[t].logprob for d, t in zip(seq.logprobs, gen)] == pytest.approx(
            [ref[i, t].item() for i, t in enumerate(gen)], abs=2e-4)
