"""OpenAI's Responses API through the openai client (its own types and stream parser), against
HF transformers: a greedy reply is HF's greedy continuation of the chat template over the
instructions and the input, whole or streamed; a cut-off reply is incomplete; a JSON schema
format holds (jsonschema_rs); what it does not support is refused with 400 naming the field."""
import json

import jsonschema_rs
import openai
import pytest

from tests.conftest import hf_greedy
from tests.server.conftest import API_KEY

MAX = 10


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_chat_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_chat_model)


def hf_reply(model_dir, tok, messages: list[dict], max_new: int) -> tuple[str, int, int]:
    """HF's greedy reply to a chat: its text, the prompt's token count and the reply's."""
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    out = hf_greedy(model_dir, [ids], max_new)[0]
    return tok._tokenizer.decode(out, skip_special_tokens=True), len(ids), len(out)


def test_a_response_is_the_greedy_reply_to_instructions_and_input(server, client, tiny_chat_model, tok):
    text, n_in, n_out = hf_reply(tiny_chat_model, tok, [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Hello there"}], MAX)
    r = client.responses.create(model=server.model, instructions="Be brief.", input="Hello there",
                                max_output_tokens=MAX, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (n_in, n_out, n_in + n_out)
    if n_out == MAX:        # the tiny model never ends by itself within MAX tokens
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_messages_with_text_parts_and_earlier_turns(server, client, tiny_chat_model, tok):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "How are you?"}]
    text, _, _ = hf_reply(tiny_chat_model, tok, turns, MAX)
    r = client.responses.create(model=server.model, max_output_tokens=MAX, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"}])
    assert r.output_text == text


def test_a_streamed_response_sends_the_events_the_client_assembles(server, client, tiny_chat_model, tok):
    text, n_in, n_out = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Tell me a story"}], MAX)
    events = list(client.responses.create(model=server.model, input="Tell me a story", max_output_tokens=MAX,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if n_out == MAX else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == n_out and final.usage.input_tokens == n_in
    with client.responses.stream(model=server.model, input="Tell me a story", max_output_tokens=MAX,
                                 temperature=0) as s:          # the client's own accumulator
        last = list(s)[-1]
    assert last.type == kinds[-1] and last.response.output_text == text


def test_a_json_schema_format_holds(server, client):
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = client.responses.create(model=server.model, input="A number?", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert r.status == "completed" and jsonschema_rs.validator_for(schema).is_valid(json.loads(r.output_text))


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_what_it_cannot_do_is_refused_naming_the_field(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**({"model": server.model, "input": "Hi"} | extra))
    assert e.value.status_code == 400 and e.value.param.startswith(param), (e.value.param, e.value.message)
