"""The real model: SmolLM2-135M-Instruct from the packaged GGUF, against HF transformers."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.models.loader import packaged_smollm2
from tests.conftest import assert_pool_free

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def smol():
    # FCFS: these tests are about the model's tokens, and it skips the default policy's start-up
    # profile (about 25 s of the suite's time)
    with LLM("smollm2", "cpu:1", dtype="float32", kv_cache_bytes=256 << 20, policy="fcfs") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoModelForCausalLM
    gguf = packaged_smollm2()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                dtype=torch.float32).eval()


def test_chat_greedy_matches_hf(smol, hf_smol):
    outs = smol.generate(CHATS, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    for o in outs:
        g = hf_smol.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=MAX_NEW,
                             do_sample=False, pad_token_id=2)
        ref = g[0, len(o.prompt_token_ids):].tolist()
        assert o.token_ids == ref
        assert o.finish_reason == ("stop" if ref[-1] == 2 else "length")
        assert o.text == smol.tokenizer.decode(ref, skip_special_tokens=True)
    assert outs[0].prompt.startswith("<|im_start|>") and "Paris" in outs[0].text
    assert_pool_free(smol)


def test_chat_takes_one_conversation_or_several_as_vllms_does(smol, hf_smol):
    """LLM.chat: each conversation's prompt is what HF's chat template renders with the
    assistant's turn opened, and its reply HF's greedy one; one output per conversation."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    one = smol.chat(CHATS[2], greedy)
    two = smol.chat(CHATS[:2], greedy)
    assert len(one) == 1 and len(two) == 2
    for conv, o in zip([CHATS[2]] + CHATS[:2], one + two, strict=True):
        text = smol.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        ids = smol.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert o.prompt_token_ids == ids
        ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=2)
        assert o.token_ids == ref[0, len(ids):].tolist()
    for bad in ("hello", [], [[]], [CHATS[0], "hello"]):
        with pytest.raises(ValueError, match="messages"):
            smol.chat(bad, greedy)
    # content as text parts, joined by newlines as vLLM joins them
    parts = smol.chat([{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                     {"type": "text", "text": "colour."}]}], greedy)[0]
    text = smol.get_tokenizer().apply_chat_template([{"role": "user", "content": "Name a\ncolour."}],
                                                    tokenize=False, add_generation_prompt=True)
    assert parts.prompt_token_ids == smol.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    # tools go to the template, as vLLM's chat gives them (HF's rendering as the reference)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    tpl = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    conv = [{"role": "user", "content": "Weather?"}]
    o = smol.chat(conv, greedy, tools=tools, chat_template=tpl)[0]
    text = smol.get_tokenizer().apply_chat_template(conv, tools=tools, chat_template=tpl, tokenize=False,
                                                    add_generation_prompt=True)
    assert text.startswith("[get_weather]") and o.prompt == text
    with pytest.raises(ValueError, match="tools"):
        smol.chat(conv, greedy, tools={"name": "x"})
    # an assistant's turn of tool calls alone (content null or left out) and the tool's result
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    tpl = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }}>"
           "{% endfor %}{% else %}{{ m.role }}: {{ m.content }};{% endif %}{% endfor %}")
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "tool_calls": [call]}):
        conv = [{"role": "user", "content": "Weather?"}, turn, {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
        o = smol.chat(conv, greedy, tools=tools, chat_template=tpl)[0]
        text = smol.get_tokenizer().apply_chat_template(conv, tools=tools, chat_template=tpl, tokenize=False,
                                                        add_generation_prompt=True)
        assert o.prompt == text == "user: Weather?;<call get_weather>tool: sun;"
    with pytest.raises(ValueError, match="text parts"):
        smol.chat([{"role": "user", "content": None, "tool_calls": [call]}], greedy)
    with pytest.raises(ValueError, match="text parts"):
        smol.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)


def test_a_chat_can_continue_a_reply_begun_for_the_model(smol, hf_smol):
    """LLM.chat(continue_final_message=True): the assistant's last message is left open (HF's
    template with the same option) and the reply goes on from it, as HF's greedy one does."""
    conv = CHATS[0] + [{"role": "assistant", "content": "The capital of France is"}]
    o = smol.chat(conv, SamplingParams(max_tokens=6, temperature=0), add_generation_prompt=False,
                  continue_final_message=True)[0]
    text = smol.tokenizer.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    ids = smol.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert o.prompt_token_ids == ids
    ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert o.token_ids == ref[0, len(ids):].tolist() and "Paris" in o.text
    with pytest.raises(ValueError, match="continue_final_message"):
        smol.chat(conv, SamplingParams(max_tokens=2), continue_final_message=True)


def test_stop_string_cuts_text(smol):
    full = smol.generate(CHATS[3], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0]
    assert " " in full.text
    word = full.text.split()[2]
    cut = smol.generate(CHATS[3], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=[word]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word and full.stop_reason is None
    assert cut.text == full.text[:full.text.index(word)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    kept = smol.generate(CHATS[3], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=[word],
                                                  include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:full.text.index(word) + len(word)] and kept.token_ids == cut.token_ids


def test_detokenize_false_gives_the_ids_without_text(smol):
    """vLLM's detokenize=False: the same tokens, no text; stop strings need the text. clone()
    copies deeply: a clone's stop list is its own."""
    sp = SamplingParams(max_tokens=6, temperature=0, stop=["zzz-never"])
    quiet = sp.clone()
    quiet.stop.clear()
    quiet.detokenize = False
    assert sp.stop == ["zzz-never"] and sp.detokenize
    full, bare = (smol.generate(CHATS[3], p)[0] for p in (sp, quiet))
    assert bare.token_ids == full.token_ids and full.text and bare.text == ""
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)


def test_string_prompt(smol):
    out = smol.generate("The quick brown fox", SamplingParams(max_tokens=5, temperature=0))
    assert len(out) == 1 and len(out[0].token_ids) == 5 and out[0].finish_reason == "length"


def test_structured_output_keeps_the_models_answer(smol):
    """Under a JSON schema the real model still answers: the capital it names unconstrained (HF's
    greedy reply says Paris, above) is the value it writes, in JSON that follows the schema."""
    import json

    import jsonschema_rs

    from tandem.engine.params import StructuredOutputs
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}},
              "required": ["capital"], "additionalProperties": False}
    out = smol.generate(CHATS[:1], SamplingParams(max_tokens=30, temperature=0,
                                                  structured_outputs=StructuredOutputs(json=schema)))[0]
    assert out.finish_reason == "stop"
    reply = json.loads(out.text)
    assert jsonschema_rs.validator_for(schema).is_valid(reply) and "Paris" in reply["capital"], out.text
