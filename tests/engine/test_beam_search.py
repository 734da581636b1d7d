"""Beam search (vLLM's ``LLM.beam_search`` and ``use_beam_search``) against HF transformers.

Without an end of sequence, vLLM's search and HF's ``generate(num_beams=...)`` keep the same
beams (the width best of every beam's extensions) and rank the results by the same sum of log
probabilities, so HF's beams and scores are the reference. With EOS the two differ by design
(HF finishes a beam only when EOS ranks among the width best, and normalizes by the output's
length alone), so there the reference is vLLM's rule computed here from HF's logits, one whole
forward pass per beam.
"""
import json
import math

import pytest
import torch

from tandem import LLM, BeamSearchParams, SamplingParams
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [17, 4, 250, 33, 9, 81, 402, 77, 12, 5, 300, 8, 1, 99, 45,
                                                   66, 23, 11, 490, 7]]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_beams(hf, prompt: list[int], width: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """HF's beam search without EOS: the width best outputs and their summed log probabilities."""
    g = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, num_beams=width, num_return_sequences=width,
                    do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=0.0,
                    early_stopping=False, output_scores=True, return_dict_in_generate=True)
    return g.sequences[:, len(prompt):].tolist(), g.sequences_scores.tolist()   # length_penalty 0: sums


def vllm_rule(hf, prompt: list[int], width: int, steps: int, eos: int, penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search from HF's logits: each beam's 2 x width likeliest next tokens; those that
    are EOS finish, the width likeliest others go on; the width best of all at the end by score:
    summed log probability / (output tokens, a final EOS counted) ** penalty."""
    def score(seq):
        toks, cum = seq
        return cum / ((len(toks) - len(prompt)) ** penalty)
    beams, finished = [(list(prompt), 0.0)], []
    with torch.no_grad():
        for _ in range(steps):
            grown = []
            for toks, cum in beams:
                logp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].double(), -1)
                top = torch.topk(logp, 2 * width)
                for v, t in zip(top.values.tolist(), top.indices.tolist()):
                    (finished if t == eos else grown).append((toks + [t], cum + v))
            beams = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    best = sorted(finished + beams, key=score, reverse=True)[:width]
    return [(toks[len(prompt):], cum) for toks, cum in best]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(str(tiny_llama), ONE_DEVICE, dtype="float32", threads_per_worker=1, length_predictor="max_tokens",
             block_size=4) as llm:
        yield llm


@pytest.mark.parametrize("width", [2, 4])
def test_beams_match_hf_without_eos(llm, tiny_llama, width):
    """ignore_eos: the width best beams of three prompts searched together, in HF's order, with
    HF's log probabilities."""
    hf = hf_model(tiny_llama)
    steps = 7
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params,
                           concurrency_limit=2 if width == 4 else None)     # two prompts, then the third
    assert len(outs) == len(PROMPTS)
    for p, out in zip(PROMPTS, outs):
        ids, sums = hf_beams(hf, p, width, steps)
        assert [s.tokens for s in out.sequences] == [p + i for i in ids]
        for seq, want in zip(out.sequences, sums):
            assert seq.cum_logprob == pytest.approx(want, abs=1e-3)
            assert seq.cum_logprob == pytest.approx(sum(lp.logprob for lp in seq.logprobs), abs=1e-6)
            assert seq.finish_reason == "length"
    assert_pool_free(llm)


def test_width_one_is_greedy(llm, tiny_llama):
    out = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(1, 9, ignore_eos=True))
    assert out[0].sequences[0].tokens[len(PROMPTS[0]):] == hf_greedy(tiny_llama, [PROMPTS[0]], 9)[0]


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory):
    """The tiny model with its end-of-sequence token moved to one the first prompt's search meets
    only by listing twice the width's likeliest tokens: the fifth likeliest first token."""
    import shutil
    d = tmp_path_factory.mktemp("tiny-eos") / "m"
    shutil.copytree(tiny_llama, d)
    with torch.no_grad():
        logits = hf_model(tiny_llama)(torch.tensor([PROMPTS[0]])).logits[0, -1]
    eos = int(torch.topk(logits, 5).indices[4])
    for name in ("config.json", "generation_config.json"):
        f = d / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    return d, eos


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    with LLM(str(eos_model[0]), ONE_DEVICE, dtype="float32", threads_per_worker=1, length_predictor="max_tokens",
             policy="fcfs") as llm:
        yield llm


@pytest.mark.parametrize("penalty", [0.0, 0.5, -1.0, 2.0])
def test_beams_that_end_follow_vllms_rule(eos_model, eos_llm, penalty):
    """A beam that picks EOS finishes (finish_reason stop, EOS last in its tokens, not in its
    text) and competes at the end by its length-penalized score."""
    d, eos = eos_model
    hf = hf_model(d)
    width, steps = 3, 6
    outs = eos_llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                               BeamSearchParams(width, steps, length_penalty=penalty))
    assert_pool_free(eos_llm)
    ended = 0
    for p, out in zip(PROMPTS, outs):
        want = vllm_rule(hf, p, width, steps, eos, penalty)
        assert [s.tokens[len(p):] for s in out.sequences] == [w for w, _ in want]
        for seq, (ids, cum) in zip(out.sequences, want):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.finish_reason == ("stop" if ids[-1] == eos else "length")
            assert seq.stop_reason == (eos if ids[-1] == eos else None)
            ended += ids[-1] == eos
    # a penalty of 2 favours the long beams over the one that ended at its first token (it would
    # not, were the prompt counted in the length): there the order is what is checked
    assert ended or penalty == 2.0, "no returned beam ended in EOS: the test exercised nothing"


def test_steps_stop_at_the_context_end(llm, tiny_llama):
    """A prompt three tokens short of the context: the beams get three tokens, HF's, whatever
    max_tokens asked."""
    import random
    rng = random.Random(5)
    prompt = [rng.randrange(3, 512) for _ in range(llm.max_model_len - 3)]
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(2, 10, ignore_eos=True))[0]
    ids, _ = hf_beams(hf_model(tiny_llama), prompt, 2, 3)
    assert [s.tokens[len(prompt):] for s in out.sequences] == ids
    assert {s.finish_reason for s in out.sequences} == {"length"}


def test_bad_params_are_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(11, 4)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(2, 4, length_penalty=math.inf)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, temperature=-1)
    with pytest.raises(ValueError, match="params"):
        llm.beam_search(PROMPTS[0], SamplingParams())
    with pytest.raises(ValueError, match="allowed_token_ids"):
        BeamSearchParams(2, 4, allowed_token_ids=[5])
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(2, 4), concurrency_limit=0)
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search({"prompt_token_ids": [5] * llm.max_model_len}, BeamSearchParams(2, 4))


def test_scores_divide_by_the_generated_tokens_to_the_penalty():
    """vLLM's and HF's score, by hand: the summed log probability over G ** length_penalty, G at
    least 1; past a float's range the score is 0 or -inf, not an error."""
    from tandem.sched.beam import beam_score
    assert beam_score(-6.0, 3, 1.0) == -2.0
    assert beam_score(-6.0, 4, 0.5) == -3.0
    assert beam_score(-6.0, 0, 2.0) == -6.0
    assert beam_score(-6.0, 100, 400.0) == 0.0
    assert beam_score(-6.0, 100, -400.0) == -math.inf
