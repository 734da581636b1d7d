"""Offline API behaviour on a tiny model: sampling controls, stops, validation, failures."""

import os
import threading
import time

import pytest

from tandem import LLM, BeamSearchParams, SamplingParams
from tandem.engine.messages import TokenLogprobs
from tandem.engine.params import StructuredOutputs
from tests.conftest import SPLIT_PROMPT, assert_pool_free, environ_of, hf_greedy, hf_whole, mixed_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", block_size=8, kv_cache_bytes=1 << 22,
             threads_per_worker=1) as m:
        yield m


def test_seeded_sampling_is_reproducible_across_batches(llm):
    prompts = mixed_prompts(6, 512, seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], sp)[0].token_ids
    together = llm.generate(prompts, sp)[0].token_ids
    assert alone == together
    other_seed = llm.generate([prompts[0]], SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone
    assert_pool_free(llm)


def test_an_llm_seed_makes_unseeded_sampling_repeatable(tiny_llama):
    """vLLM's LLM(seed=...): unseeded sampled requests give the same tokens in a new LLM with
    the same seed and calls, other tokens with another seed, and a request's own seed wins."""
    prompts, sp = mixed_prompts(3, 512, seed=8), SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1,
                 seed=seed) as m:
            calls = [o.token_ids for _ in range(2) for o in m.generate(prompts, sp)]
            runs[name] = (calls, m.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=1.0,
                                                                         seed=3))[0].token_ids)
    assert runs["a"] == runs["b"] and runs["a"][0] != runs["c"][0] and runs["a"][1] == runs["c"][1]
    assert runs["a"][0][:3] != runs["a"][0][3:], "the second call draws new seeds"
    with pytest.raises(ValueError, match="seed"):
        LLM(str(tiny_llama), "cpu:1", seed="5")


def test_top_k_one_is_greedy(llm, tiny_llama):
    p = mixed_prompts(1, 512, seed=4)
    out = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=5, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(tiny_llama, p, 10)[0]


def test_stop_token_ids_and_min_tokens(llm, tiny_llama):
    p = mixed_prompts(1, 512, seed=11, lo=10, hi=11)
    ref = hf_greedy(tiny_llama, p, 16)[0]
    stop = ref[3]
    first = ref.index(stop)
    out = llm.generate(p, SamplingParams(max_tokens=16, stop_token_ids=[stop], **GREEDY))[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    # below min_tokens the stop id is masked, so generation must run past `first`
    out = llm.generate(p, SamplingParams(max_tokens=16, stop_token_ids=[stop], min_tokens=first + 2,
                                         **GREEDY))[0]
    assert stop not in out.token_ids[:first + 2]
    assert len(out.token_ids) >= first + 2


def prompts_reaching_eos(model_dir, n: int, new: int = 16) -> list[list[int]]:
    """n random prompts whose greedy reply (by HF's model, many prompts at once) reaches EOS (id 2)
    within ``new`` tokens, at different points where possible; a random model rarely does, about
    one prompt in a hundred."""
    import random

    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    x = torch.tensor([[rng.randrange(3, 512) for _ in range(12)] for _ in range(2000)])
    with torch.no_grad():
        for _ in range(new - 1):
            x = torch.cat([x, hf(x).logits[:, -1].argmax(-1)[:, None]], 1)
    first = {}
    for row in x.tolist():
        if 2 in row[12:]:
            first.setdefault(row[12:].index(2), row[:12])
    return [first[k] for k in sorted(first, reverse=True)[:n]]


def test_eos_stops_unless_ignored(llm, tiny_llama):
    ending = prompts_reaching_eos(tiny_llama, 4)
    prompts = ending + mixed_prompts(4, 512, seed=21)
    ref = hf_greedy(tiny_llama, prompts, 16, eos=True)     # HF stops at EOS id 2
    assert sum(len(r) < 16 and r[-1] == 2 for r in ref) >= 4, "meant to hold replies that end at EOS"
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == ref
    assert [o.finish_reason for o in outs] == ["stop" if r[-1] == 2 else "length" for r in ref]
    ignored = llm.generate(ending, SamplingParams(max_tokens=16, **GREEDY))
    assert [o.token_ids for o in ignored] == hf_greedy(tiny_llama, ending, 16)
    assert all(o.finish_reason == "length" for o in ignored)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=50, max_tokens=10), "min_tokens"),
])
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_no_prompts_give_no_outputs_and_leave_the_llm_serving(llm):
    """vLLM's ``generate([])`` returns []: a pipeline's last, empty chunk is not an error."""
    assert llm.generate([], SamplingParams(max_tokens=4)) == []
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    with pytest.raises(ValueError, match="sampling_params: 1 given for 0 prompts"):
        llm.generate([], [SamplingParams()])
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_prompts_fail_before_any_work(llm):
    before = len(llm.scheduler.states)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5, 6, 7], list(range(3, 3 + llm.max_model_len))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5, 6, 7], [5, 100000]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams()])
    for bad, field in [(dict(chat_template_kwargs=5), "chat_template_kwargs"), (dict(documents=5), "documents"),
                       (dict(chat_template=5), "chat_template")]:
        with pytest.raises(ValueError, match=field):
            llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), **bad)
    for bad, field in [({"prompt_token_ids": [5, 6], "cache_salt": ""}, "cache_salt"),
                       ({"prompt_token_ids": [5, 6], "cache_salt": 3}, "cache_salt"),
                       ({"prompt_token_ids": [5, 6], "prompt": "x"}, "exactly one"),
                       ({"cache_salt": "a"}, "exactly one"),
                       ({"prompt_token_ids": "5 6"}, "prompt_token_ids"),
                       ({"prompt": [5, 6]}, "'prompt' must be a string"),
                       ({"prompt_token_ids": [5, 6], "multi_modal_data": {}}, "multi_modal_data")]:
        with pytest.raises(ValueError, match=field):
            llm.generate([[5, 6, 7], bad], SamplingParams(max_tokens=4))
    assert len(llm.scheduler.states) == before, "nothing may be queued by a rejected call"


@pytest.mark.parametrize("model, devices", [
    ("no-such-model", "cpu:1"), ("/nonexistent/dir", "cpu:1"), ("/nonexistent/m.gguf", "cpu:1")])
def test_unknown_model_is_a_value_error(model, devices):
    with pytest.raises(ValueError, match="model"):
        LLM(model, devices)


@pytest.mark.parametrize("devices", ["gpu:1", "cpu:0", "cuda:", "cpu:x"])
def test_bad_devices(devices, tiny_llama):
    with pytest.raises(ValueError, match="devices"):
        LLM(str(tiny_llama), devices)


def test_a_budget_too_small_for_the_pool_fails_before_a_worker_starts(tiny_llama, monkeypatch):
    """Two pool blocks at least (a block holds a token block's K or its V): their size by hand
    (layers x block x kv heads x head dim x 4 bytes, float32); one byte short of two is refused
    naming kv_cache_bytes, where a worker used to load the model first and fail with its
    traceback inside the message."""
    import json
    import tandem.sched.llm as llm_module
    cfg = json.loads((tiny_llama / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    block = cfg["num_hidden_layers"] * 8 * heads * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4

    def started(*a, **k):
        raise AssertionError("a worker was started before the budget was checked")
    monkeypatch.setattr(llm_module, "WorkerHandle", started)
    with pytest.raises(ValueError, match="kv_cache_bytes: the budget buys 1 blocks"):
        LLM(str(tiny_llama), "cpu:1", dtype="float32", block_size=8, kv_cache_bytes=2 * block - 1)
    with pytest.raises(AssertionError, match="a worker was started"):
        LLM(str(tiny_llama), "cpu:1", dtype="float32", block_size=8, kv_cache_bytes=2 * block)


@pytest.mark.parametrize("kwargs, field", [
    (dict(threads_per_worker=-1), "threads_per_worker"),
    (dict(max_model_len=-5), "max_model_len"),
    (dict(max_model_len="512"), "max_model_len"),
    (dict(kv_cache_fraction="0.5"), "kv_cache_fraction"),
    (dict(kv_cache_bytes=1 << 20, kv_cache_fraction=0.5), "kv_cache_fraction"),
    (dict(omp_wait_policy="spin"), "omp_wait_policy"),
    (dict(length_learned_max=-1), "length_learned_max"),
    (dict(gpu_memory_utilization=0.9), "^gpu_memory_utilization: vLLM's; size each device's KV pool with "
                                       "kv_cache_bytes or kv_cache_fraction$"),
    (dict(tensor_parallel_size=2), "^tensor_parallel_size: vLLM's; tensor parallelism is not supported"),
    (dict(quantization="awq"), "^quantization: vLLM's"),
    (dict(tandem_off=5), "^tandem_off: a mechanism's name or a list of them, got 5"),
    (dict(chat_template=5), "^chat_template: a Jinja template or the path of a file holding one, got 5"),
    (dict(block_size=10**9), "^block_size: at most 1024 tokens a block"),
    (dict(enable_prefix_caching=True, bidirectional_blocks=True, policy="bros"),
     "^enable_prefix_caching: not with bidirectional_blocks"),
])
def test_bad_llm_arguments_fail_before_anything_loads(kwargs, field, tiny_llama, monkeypatch):
    import tandem.sched.llm as llm_module

    def loaded(*a, **k):
        raise AssertionError("the length predictor was loaded before the arguments were checked")
    monkeypatch.setattr(llm_module.LLM, "_lengths", loaded)
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), "cpu:1", **kwargs)


def test_each_worker_loads_torch_under_the_wait_policy_asked_for(tiny_llama):
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: in a spawned worker, or in the fork
    server a worker is forked from. The environment a worker's process began with (its own, or
    its fork server's) is the one torch loaded under; each policy must find its own, whichever
    started the fork server."""
    outs, before = [], {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    policies = ("ACTIVE", "PASSIVE", "BRIEF", "ACTIVE")
    for policy in policies:
        with LLM(str(tiny_llama), "cpu:1", policy="fcfs", kv_cache_bytes=1 << 22, threads_per_worker=1,
                 omp_wait_policy=policy) as m:
            env = environ_of(m._workers[0].proc.pid)
            # BRIEF: no policy (libgomp's own), a spin count instead
            assert env.get("OMP_WAIT_POLICY") == (None if policy == "BRIEF" else policy)
            assert env.get("GOMP_SPINCOUNT") == ((before["GOMP_SPINCOUNT"] or "30000") if policy == "BRIEF"
                                                 else before["GOMP_SPINCOUNT"])
            outs.append(m.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))[0].token_ids)
    assert outs == hf_greedy(tiny_llama, [[5, 6, 7]], 4) * len(policies)
    assert {k: os.environ.get(k) for k in before} == before          # this process's own, as before


@pytest.mark.parametrize("exported", [{}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"},
                                      {"OMP_WAIT_POLICY": "BRIEF"}])
def test_a_fork_server_is_shared_only_by_workers_whose_openmp_environment_is_its_own(monkeypatch, exported):
    """Workers are forked from one fork server only where libgomp would read the same
    environment in them: the key is what the environment holds, not the policy's name."""
    from tandem.engine.worker import _wait_policy
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in exported.items():
        monkeypatch.setenv(k, v)
    keys = {}
    for policy in (None, "ACTIVE", "PASSIVE", "BRIEF"):
        with _wait_policy(policy) as key:
            keys[policy] = key
            assert key == (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
        assert {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} == \
            {k: exported.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert keys["BRIEF"] == (None, exported.get("GOMP_SPINCOUNT", "30000"))
    assert keys["PASSIVE"] == ("PASSIVE", exported.get("GOMP_SPINCOUNT"))
    # the environment as it is and BRIEF are one only where a spin count, and no policy, was exported
    assert (keys[None] == keys["BRIEF"]) is ("OMP_WAIT_POLICY" not in exported and "GOMP_SPINCOUNT" in exported)


def test_max_model_len_cuts_the_context_and_never_passes_the_models(tiny_llama, caplog):
    import json
    positions = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    with caplog.at_level("WARNING", logger="tandem.sched.llm"):
        with LLM(str(tiny_llama), "cpu:1", policy="fcfs", max_model_len=positions + 1000,
                 kv_cache_bytes=1 << 22, threads_per_worker=1) as m:
            assert m.max_model_len == positions
    assert f"past the model's {positions} positions" in caplog.text
    with LLM(str(tiny_llama), "cpu:1", policy="fcfs", max_model_len=40, kv_cache_bytes=1 << 22,
             threads_per_worker=1) as m:
        out = m.generate([list(range(5, 35))], SamplingParams(max_tokens=10, **GREEDY))[0]
        assert len(out.token_ids) == 10
        # vLLM's max_tokens=None: as many as the context holds after the prompt (40 - 30)
        rest = m.generate([list(range(5, 35))], SamplingParams(max_tokens=None, **GREEDY))[0]
        assert rest.token_ids[:10] == out.token_ids and len(rest.token_ids) == 10 and rest.finish_reason == "length"
        with pytest.raises(ValueError, match="context of 40"):
            m.generate([list(range(5, 45))], SamplingParams(max_tokens=1, **GREEDY))


def test_outputs_read_as_vllm_users_expect(llm, tiny_llama):
    p = mixed_prompts(1, 512, seed=6)
    out = llm.generate(p, SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.request_id == out.req_id and len(out.outputs) == 1
    first = out.outputs[0]
    assert first.token_ids == hf_greedy(tiny_llama, p, 6)[0] and first.finish_reason == "length"
    assert first.text == out.text


def test_a_character_cut_by_max_tokens_is_left_out_of_the_text(tiny_chat_model):
    """generate and chat: an output that max_tokens ends inside a character has the text of HF's
    decode of its ids less that character's bytes, as vLLM's; a U+FFFD generated whole stays;
    so with a stop string (the text tracked as it grows)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    lead = tok(" 😁")["input_ids"][:-1]             # a space and the emoji's first bytes
    whole = tok("\ufffd")["input_ids"]
    cut = SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=lead)
    stop = SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=lead, stop=["never"])
    kept = SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=whole)
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as m:
        outs = m.generate(["Hi", "Hi", "Hi"], [cut, stop, kept])
        outs += m.chat([{"role": "user", "content": "Hi"}], cut)
    assert [o.text for o in outs] == [" \ufffd \ufffd ", " \ufffd \ufffd ", "\ufffd" * 3, " \ufffd \ufffd "]
    assert [o.text for o in outs] == [hf_whole(tok, o.token_ids) for o in outs]


def test_a_token_that_is_part_of_a_character_shows_the_character_it_completes(tiny_chat_model):
    """Log probabilities' decoded_token for a token holding part of a character is the character
    where it completes one (after up to four tokens) and "" where not, as vLLM corrects it: the
    prompt tokens' texts after the first join to HF's decode of them, with no U+FFFD; alternatives
    and generated tokens show none either."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    ids = tok(SPLIT_PROMPT)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids), "the prompt must split characters"
    sp = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=3, logprobs=3)
    forced = SamplingParams(max_tokens=30, temperature=0, logprobs=0,
                            structured_outputs=StructuredOutputs(regex="猫猫 and 😁"))
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1) as m:
        (out, cut, written) = m.generate([SPLIT_PROMPT, "猫 and 😁", "Hi"], [sp, sp, forced])
        # generated ids " 猫猫" (the context runs from the first output token): by hand, the third
        # completes " 猫" after the two before it, the sixth "猫" after the two before it
        outputs = m._positions(tok(" 猫猫")["input_ids"], [TokenLogprobs(0.0)] * 6, True, 0)
    assert [next(iter(at.values())).decoded_token for at in outputs] == ["", "", " 猫", "", "", "猫"]
    # the prompt's first token (part of 猫) is no context: the third completes nothing after the second
    assert [next(iter(at.values())).decoded_token for at in cut.prompt_logprobs[1:]] == ["", "", " and", "", " 😁"]
    scored = out.prompt_logprobs
    assert scored[0] is None and [next(iter(at)) for at in scored[1:]] == ids[1:]
    assert "".join(at[t].decoded_token for t, at in zip(ids[1:], scored[1:])) == tok.decode(ids[1:])
    alternatives = [lp.decoded_token for at in [*scored[1:], *out.logprobs] for lp in at.values()]
    assert not any(t.endswith("\ufffd") for t in alternatives)
    # generated text whose first token is part of a character (the output is its own context)
    ids = written.token_ids[:-1]        # the end token the grammar wrote last
    assert written.token_ids[-1] == tok.eos_token_id and len(ids) > 2
    assert written.text == tok.decode(ids) == "猫猫 and 😁" and tok.decode(ids[:1]).endswith("\ufffd")
    assert "".join(at[t].decoded_token for t, at in zip(ids, written.logprobs)) == written.text


def test_vllm_arguments_that_ask_for_nothing_missing_are_taken(tiny_llama):
    """A ported script's LLM(..., tensor_parallel_size=1, enforce_eager=True, ...) runs; an
    argument neither engine knows is Python's TypeError."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_memory_fraction'"):
        LLM(str(tiny_llama), "cpu:1", gpu_memory_fraction=0.9)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1,
             policy="fcfs", tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=True,
             trust_remote_code=True, disable_log_stats=True, quantization=None, enable_lora=True,
             max_lora_rank=64) as m:
        out = m.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 4)[0]
    assert out.multi_modal_placeholders == {} and out.outputs[0].lora_request is None


def test_numpy_numbers_and_tuples_are_taken_as_python_numbers_and_lists(llm, tiny_llama):
    """What a script computed with numpy, or wrote as tuples, means what the Python values mean:
    the same tokens as HF (ids and stop ids given as numpy values and tuples), and numpy values
    that are not of a field's kind are refused as Python's would be."""
    import numpy as np
    prompt = mixed_prompts(1, 512, seed=12, lo=5, hi=9)[0]
    want = hf_greedy(tiny_llama, [prompt], 6)[0]
    sp = SamplingParams(max_tokens=np.int64(6), temperature=np.float32(0.0), top_k=np.int32(-1),
                        ignore_eos=True, stop_token_ids=(np.int64(want[3]),),
                        logit_bias={str(want[0]): np.float32(0.0), np.int64(7): 0})
    assert (sp.max_tokens, sp.temperature, sp.stop_token_ids) == (6, 0.0, [want[3]])
    assert SamplingParams(stop=("a", "b"), bad_words=("c",)).stop == ["a", "b"]
    assert type(sp.max_tokens) is int and type(sp.temperature) is float and sp.logit_bias == {want[0]: 0.0, 7: 0}
    outs = llm.generate([{"prompt_token_ids": tuple(prompt)}, {"prompt_token_ids": np.array(prompt)}], sp)
    for o in outs:
        assert o.prompt_token_ids == prompt and o.token_ids == want[:4] and o.stop_reason == want[3]
    for bad, field in [(dict(max_tokens=np.float64(6)), "max_tokens"), (dict(top_k=np.float32(2)), "top_k"),
                       (dict(stop_token_ids=(1.5,)), "stop_token_ids"), (dict(logit_bias={"x1": 1}), "logit_bias"),
                       (dict(logit_bias={"-3": 1}), "logit_bias")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            SamplingParams(**bad)


@pytest.mark.parametrize("field, says", [("best_of", "use n"), ("guided_decoding", "structured_outputs="),
                                         ("logits_processors", "not supported")])
def test_vllm_sampling_fields_not_here_say_what_to_use(field, says):
    with pytest.raises(ValueError, match=f"^{field}: vLLM's; .*{says}"):
        SamplingParams(max_tokens=4, **{field: 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'best_off'"):
        SamplingParams(best_off=2)


def test_no_stops_given_as_none_as_vllm_accepts():
    sp = SamplingParams(stop=None, stop_token_ids=None)
    assert sp.stop == [] and sp.stop_token_ids == []


def test_a_shut_down_llm_refuses_work_instead_of_starting_again(tiny_llama):
    """vLLM's engine is gone once shut down; here generate() had started a fresh worker that no
    later shutdown() stopped."""
    m = LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1)
    m.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))
    worker = m.scheduler.actors[0].device
    m.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        m.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))
    assert not worker.proc.is_alive()


def test_a_generate_waiting_in_another_thread_raises_when_the_llm_shuts_down(tiny_llama):
    """shutdown() from one thread while another waits in generate(): the waiting call raises
    (it waited for ever before, and a process whose thread it was never exited)."""
    m = LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1)
    m.scheduler.step_log = steps = []
    caught = []

    def run():
        try:
            m.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=400, **GREEDY))
        except RuntimeError as e:
            caught.append(e)
    waiting = threading.Thread(target=run, daemon=True)
    waiting.start()
    for _ in range(6000):               # until its first step ran (at most a minute)
        if steps:
            break
        time.sleep(0.01)
    m.shutdown()
    waiting.join(60)
    assert not waiting.is_alive() and len(caught) == 1 and "while these requests ran" in str(caught[0])


def test_an_llm_dropped_after_generating_stops_its_worker(tiny_llama):
    """vLLM shuts its engine down when the LLM is collected; here the actor thread's hold on the
    LLM kept it, and its worker process, alive until the interpreter exited."""
    import gc
    m = LLM(str(tiny_llama), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1)
    m.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))
    worker, actors = m.scheduler.actors[0].device.proc, [t._thread for t in m.runtime.threads]
    del m
    gc.collect()
    worker.join(timeout=30)
    assert not worker.is_alive()
    for t in actors:
        t.join(timeout=10)
        assert not t.is_alive()


@pytest.mark.parametrize("policy", ["bros", "alise", "tandem"])
def test_policies_that_price_iterations_start_on_a_pool_smaller_than_their_profile(policy, tiny_llama):
    """The start-up profile's requests (up to 1,024 prompt tokens) are cut to what the pool holds:
    a pool of 24 tokens still gets a cost model, where the profile used to measure too few steps
    and the server refused to start; its requests then give HF's tokens."""
    from tandem.engine.models.loader import load_spec
    spec = load_spec(tiny_llama)
    block_bytes = spec.num_layers * 8 * spec.unit * 4                 # one block of 8 tokens, fp32
    prompts = mixed_prompts(3, 512, seed=8, lo=6, hi=12)
    with LLM(str(tiny_llama), "cpu:1", dtype="float32", block_size=8, kv_cache_bytes=6 * block_bytes,
             threads_per_worker=1, policy=policy, length_predictor="max_tokens") as m:
        assert m.scheduler.actors[0].pool.geometry.num_blocks == 6
        assert m.scheduler.cost is not None
        outs = m.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
        assert_pool_free(m)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 8)


def test_report_returns_once_every_device_ran_its_listeners(llm):
    """What the server waits for before it says it is ready: each device's step listeners (the
    metrics) have seen it, though it has not stepped; a slow listener is waited for."""
    import threading
    import time
    runtime = llm.start_runtime()
    seen, main = [], threading.get_ident()

    def slow(actor):
        time.sleep(0.3)
        seen.append((actor.index, threading.get_ident() != main))
    runtime.listeners.append(slow)
    try:
        runtime.report(timeout_s=None)
        assert seen == [(0, True)]              # on the device's own thread, before report returned
    finally:
        runtime.listeners.remove(slow)


def test_n_choices_per_prompt(llm, tiny_llama):
    """SamplingParams.n, as vLLM's: one output per prompt whose ``outputs`` are its n choices,
    indexed; greedy, each is HF's reply; sampled with a seed, choice i is what seed + i gives
    alone (as the server seeds its n); with logprobs each has its cumulative log probability."""
    prompts = mixed_prompts(2, 512, seed=21)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, n=3, **GREEDY))
    assert len(outs) == 2
    for out, ref in zip(outs, hf_greedy(tiny_llama, prompts, 8)):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [ref] * 3 and out.token_ids == ref
    sp = dict(max_tokens=8, temperature=1.0, seed=40, ignore_eos=True, logprobs=0)
    (both,) = llm.generate(prompts[:1], SamplingParams(n=2, **sp))
    alone = [llm.generate(prompts[:1], SamplingParams(**(sp | {"seed": 40 + i})))[0] for i in range(2)]
    assert [c.token_ids for c in both.outputs] == [a.token_ids for a in alone]
    assert both.outputs[0].token_ids != both.outputs[1].token_ids
    for c in both.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs)) and c.finished()
    (one,) = llm.generate(prompts[:1], SamplingParams(max_tokens=4, **GREEDY))
    assert [(c.index, c.text, c.token_ids) for c in one.outputs] == [(0, one.text, one.token_ids)]
    assert one.cumulative_logprob is None and one.finished and one.lora_request is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n:"):
            SamplingParams(n=bad)
    assert_pool_free(llm)


def test_generate_without_params_takes_the_models_sampling_defaults(tiny_llama, tmp_path):
    """vLLM's generation_config "auto": generate() with no SamplingParams takes the model's
    generation_config.json (top_k 1 is greedy, max_new_tokens 5 the length: HF's greedy 5
    tokens); "vllm" takes SamplingParams' own (16 tokens)."""
    import json
    import shutil
    model = tmp_path / "tuned"
    shutil.copytree(tiny_llama, model)
    gen_file = model / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    gen_file.write_text(json.dumps(gen | {"top_k": 1, "max_new_tokens": 5}))
    prompt = mixed_prompts(1, 512, seed=31)
    lengths = {}
    for mode in ("auto", "vllm"):
        with LLM(str(model), "cpu:1", dtype="float32", kv_cache_bytes=1 << 22, threads_per_worker=1,
                 generation_config=mode, seed=0) as m:           # seeded: a sampled end token stays away
            out = m.generate(prompt)[0]
            lengths[mode] = len(out.token_ids)
            if mode == "auto":
                assert out.token_ids == hf_greedy(model, prompt, 5)[0]
    assert lengths == {"auto": 5, "vllm": 16}
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(model), "cpu:1", generation_config="model")
