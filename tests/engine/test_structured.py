"""Structured outputs against independent references. A greedy request under a regular expression
or a choice of strings must take, wherever the language leaves a choice, the token a brute force
over HF transformers' logits takes: the likeliest whose text keeps the output a prefix of some
match (Python's ``regex`` module, partial matching; or plain string prefixes), and the end token
only once the output matches whole. JSON-schema outputs must pass the
``jsonschema_rs`` validator. All of it in batches that preempt and recompute; a request moved to
another worker mid-output goes on in its grammar."""
import json
import re
import string

import jsonschema_rs
import pytest
import regex
import torch

from tandem import LLM, SamplingParams
from tandem.engine.params import StructuredOutputs
from tests.conftest import assert_pool_free

PROMPTS = ["Write a code:", "The answer is", "Once upon a time there was", "hi", "Pick one.",
           "List of numbers: 1, 2,", "A long prompt that takes a few more blocks of the small pool " * 3]
# ASCII only: a token that is part of a multi-byte character decodes to U+FFFD in the reference
PATTERNS = [r"[0-9]{2,4}(-[a-c]{1,3})?", r"(yes|no|maybe)!?", r"[A-Z][a-z]{1,6}( [a-z]{1,5}){0,2}\."]
CHOICES = ["apple pie", "apple", "banana split", "cherry", "a"]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "kind", "ok", "pos"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 3}},
                         "kind": {"enum": ["cat", "dog", 3]},
                         "ok": {"type": "boolean"},
                         "pos": {"type": "object", "additionalProperties": False, "required": ["x"],
                                 "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}}}}}


def start(model_dir, workers: int) -> LLM:
    from tandem.engine.models.loader import load_spec
    spec = load_spec(model_dir)
    block_bytes = spec.num_layers * 8 * spec.unit * 4
    # 24 blocks of 8 tokens per worker: four long outputs and ten short ones preempt each other
    return LLM(str(model_dir), f"cpu:{workers}", dtype="float32", policy="fcfs", block_size=8,
               kv_cache_bytes=24 * block_bytes, max_num_batched_tokens=64, threads_per_worker=1)


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with start(tiny_chat_model, 1) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm2(tiny_chat_model):
    with start(tiny_chat_model, 2) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(tiny_chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    return model, tok, tok.batch_decode([[i] for i in range(len(tok))])    # each token's own text


def check_greedy(hf, prompt: list[int], out: list[int], prefix_ok, complete, eos: tuple[int, ...]) -> None:
    """Each of ``out``'s tokens against one HF forward over prompt + out: where the language leaves
    a choice (two next characters, or one and the end), the token is the likeliest whose text
    keeps the output a prefix of the language (``prefix_ok``), or an end token if the text is in it
    (``complete``) and that ranks first. Where it forces the next characters, the token need only
    spell a prefix of them: the grammar then offers just the canonical token of the forced text
    (llguidance's forced tokens), which a brute force over the vocabulary cannot know."""
    model, tok, pieces = hf
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:]
    assert out and out[-1] in eos, "the output ends with an end token"
    for i, t in enumerate(out):
        text = tok.decode(out[:i])
        nexts = {c for c in string.printable if prefix_ok(text + c)}
        if len(nexts) == 1 and not complete(text):
            assert t not in eos and prefix_ok(tok.decode(out[:i + 1])), (i, text)
            continue
        for want in torch.argsort(logits[i], descending=True).tolist():
            if want in eos:
                if complete(text):
                    break
            elif want not in special and prefix_ok(text + pieces[want]):    # ASCII: texts concatenate
                break
        assert t == want, (i, text, tok.decode([t]), tok.decode([want]))


def run(llm, constraints: list[StructuredOutputs], max_new: int):
    """Constrained requests behind four long unconstrained ones that fill the pool, so that the
    constrained ones (the newest) are the ones preempted and recomputed."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constraints))]
    fill = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4] + prompts, [fill] * 4 + [
        SamplingParams(max_tokens=max_new, temperature=0, structured_outputs=c) for c in constraints])
    assert sum(q.num_preemptions for q in llm.scheduler.queues) > 0, "the pool was meant to preempt"
    assert_pool_free(llm)
    return prompts, outs[4:]


def test_regex_and_choice_follow_the_brute_force_greedy(llm, hf):
    constraints = [StructuredOutputs(regex=p) for p in PATTERNS] * 2 + [StructuredOutputs(choice=CHOICES)] * 4
    prompts, outs = run(llm, constraints, 24)
    eos = llm.spec.eos_token_ids
    tok = hf[1]
    for prompt, c, o in zip(prompts, constraints, outs, strict=True):
        if c.regex is not None:
            rx = regex.compile(c.regex)
            prefix_ok = lambda s, rx=rx: rx.fullmatch(s, partial=True) is not None  # noqa: E731
            complete = lambda s, rx=rx: rx.fullmatch(s) is not None  # noqa: E731
        else:
            prefix_ok = lambda s: any(x.startswith(s) for x in CHOICES)  # noqa: E731
            complete = lambda s: s in CHOICES  # noqa: E731
        check_greedy(hf, tok(prompt)["input_ids"], o.token_ids, prefix_ok, complete, eos)
        assert complete(o.text) and o.finish_reason == "stop", (c, o.text)


def test_json_schema_outputs_validate(llm):
    """Greedy and seeded sampled outputs alike are JSON that follows the schema; the same requests
    without it are not JSON at all (the random model does not write it by chance)."""
    validator = jsonschema_rs.validator_for(SCHEMA)
    so = [StructuredOutputs(json=SCHEMA), StructuredOutputs(json=json.dumps(SCHEMA)),
          StructuredOutputs(json_object=True)]
    prompts = PROMPTS[:6]
    params = [SamplingParams(max_tokens=80, temperature=0 if i % 2 else 1.0, seed=i, structured_outputs=so[i % 2])
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert validator.is_valid(json.loads(o.text)), o.text
    free = llm.generate(prompts, [SamplingParams(max_tokens=80, temperature=0)] * len(prompts))
    for o in free:
        with pytest.raises(ValueError):
            json.loads(o.text)
    obj = llm.generate(["{"], SamplingParams(max_tokens=6, temperature=0, structured_outputs=so[2]))[0]
    assert obj.text.startswith("{"), obj.text


def test_a_complete_grammar_ends_the_output_before_min_tokens(llm, hf):
    """min_tokens holds the end token back only while the grammar allows something else: once the
    choice is complete the output ends there, as the reference does."""
    c = StructuredOutputs(choice=["cherry", "apple"])
    out = llm.generate(["hi"], SamplingParams(max_tokens=10, min_tokens=8, temperature=0, structured_outputs=c))[0]
    check_greedy(hf, hf[1]("hi")["input_ids"], out.token_ids, lambda s: any(x.startswith(s) for x in c.choice),
                 lambda s: s in c.choice, llm.spec.eos_token_ids)
    assert out.text in c.choice and out.finish_reason == "stop" and len(out.token_ids) < 8


def follows(llm, hf, so: StructuredOutputs, text: str) -> bool:
    """Whether the constraint takes ``text`` whole, as the tokenizer spells it."""
    from tandem.engine.grammar import compile_grammar
    m = llm._vocabulary.matcher(compile_grammar(so), [])
    return m.consume_tokens(hf[1](text, add_special_tokens=False)["input_ids"]) and m.is_accepting()


def test_vllms_json_options_change_what_the_grammar_takes(llm, hf):
    """``disable_additional_properties`` closes the objects that list properties (nested ones and
    those under $defs too, not a property named like a keyword), against jsonschema_rs on the
    schema closed by hand; ``whitespace_pattern`` lets JSON have that whitespace; without them
    the output is compact and objects are open."""
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "properties": {"$ref": "#/$defs/p"}},
        "$defs": {"p": {"type": "object", "properties": {"y": {"type": "integer"}}}}}
    shut = json.loads(json.dumps(schema))
    for obj in (shut, shut["properties"]["a"], shut["$defs"]["p"]):
        obj["additionalProperties"] = False
    texts = ['{"a":{"x":1}}', '{"a":{"x":1,"z":2}}', '{"a":{},"properties":{"y":2,"q":1}}', '{"a":{},"b":3}']
    for text in texts:
        want = jsonschema_rs.validator_for(shut).is_valid(json.loads(text))
        assert follows(llm, hf, StructuredOutputs(json=schema, disable_additional_properties=True), text) == want
        assert follows(llm, hf, StructuredOutputs(json=schema), text), text
    spaced = '{"a": {"x": 1}}'
    assert not follows(llm, hf, StructuredOutputs(json=schema), spaced)
    assert not follows(llm, hf, StructuredOutputs(json=schema, disable_any_whitespace=True), spaced)
    assert follows(llm, hf, StructuredOutputs(json=schema, whitespace_pattern="[ ]?"), spaced)
    assert follows(llm, hf, StructuredOutputs(json_object=True, whitespace_pattern="[ ]?"), spaced)
    with pytest.raises(ValueError, match="whitespace_pattern: only with json"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", whitespace_pattern=" "))


def test_logprobs_under_a_grammar_are_over_the_tokens_it_allows(llm, hf):
    """vLLM applies a grammar's mask before its log probabilities: where a choice leaves many
    first tokens, the sampled token's log probability is HF's log-softmax over the tokens whose
    text begins a choice (a brute force over the vocabulary), and the likeliest listed are those."""
    model, tok, pieces = hf
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    ok = [i for i, p in enumerate(pieces) if i not in special and p and any(c.startswith(p) for c in CHOICES)]
    out = llm.generate(["hi"], SamplingParams(max_tokens=8, temperature=0, logprobs=5,
                                              structured_outputs=StructuredOutputs(choice=CHOICES)))[0]
    with torch.no_grad():
        logits = model(torch.tensor([tok("hi")["input_ids"]])).logits[0, -1].float()
    ref = torch.full_like(logits, float("-inf"))
    ref[ok] = torch.log_softmax(logits[ok], dim=-1)
    first, top = out.logprobs[0], torch.topk(ref, 5)
    assert len(ok) > 5 and first.logprob == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-4)
    assert list(first.top_ids) == top.indices.tolist()
    assert list(first.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_literal_only_a_special_token_spells_is_refused(llm, hf):
    """llguidance does not write a special token's text (an end marker) as text: a choice or
    regular expression that must begin with one could only end at once, short of it, so it is
    refused; one that may begin otherwise runs."""
    end = hf[1].eos_token
    for so in (StructuredOutputs(choice=[end]), StructuredOutputs(regex=re.escape(end) + "[a-z]")):
        with pytest.raises(ValueError, match="no token of this model can begin"):
            llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=so))
    out = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0,
                                              structured_outputs=StructuredOutputs(choice=[end, "yes"])))[0]
    assert out.text == "yes"


@pytest.mark.parametrize("bad, why", [
    (StructuredOutputs(regex="[a-"), "unclosed character class"),
    (StructuredOutputs(json={"type": "no-such-type"}), "no-such-type"),
    (StructuredOutputs(json="{not json"), "not JSON"),
    (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
    # compiles and allows a first token; llguidance's lexer runs past its limits at the second
    (StructuredOutputs(regex="a{300000}"), "too large for this server to follow"),
])
def test_bad_constraints_are_refused_before_running(llm, bad, why):
    with pytest.raises(ValueError, match=why):
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=bad))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", choice=["b"]))


@pytest.mark.parametrize("kind", ["kv", "token"])
def test_a_migrated_request_keeps_its_place_in_the_grammar(llm2, hf, kind):
    """Moved to the other worker mid-output (its cache copied, or its tokens prefilled again), a
    constrained request goes on from where it was in the grammar: the brute-force greedy's tokens."""
    from tandem.sched.request import Transfer
    from tests.engine.test_migration import MOVE_AFTER, run as run_moved
    pattern = r"[a-z]{2,9}( [a-z]{2,9}){5,8}[.!]"
    prompt = hf[1]("Once upon a time there was")["input_ids"]
    sp = SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(regex=pattern))
    seen, st = run_moved(llm2, prompt, sp, Transfer(kind), f"moved-{kind}")
    assert st.device == 1 and len(seen) > MOVE_AFTER + 2, (st.device, seen)
    rx = regex.compile(pattern)
    check_greedy(hf, prompt, seen, lambda s: rx.fullmatch(s, partial=True) is not None,
                 lambda s: rx.fullmatch(s) is not None, llm2.spec.eos_token_ids)


def test_the_vocabulary_is_read_while_the_workers_load_not_at_the_first_constrained_request(llm):
    """Reading SmolLM2's vocabulary for llguidance takes 0.2 s, which the first constrained
    request after start-up paid."""
    assert "_vocabulary" in vars(llm)
