"""OpenAI's Responses API through the openai client (its own types and stream parser), against
HF transformers: a greedy reply is HF's greedy continuation of the chat template over the
instructions and the input, whole or streamed; a cut-off reply is incomplete; a JSON schema
format holds (jsonschema_rs), and so do a required call's arguments; earlier calls and their
outputs reach the prompt as a chat's do; what it does not support is refused with 400 naming
the field."""
import json
import time
import urllib.request

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


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}
CITY = jsonschema_rs.validator_for(WEATHER["parameters"])


def test_a_required_call_is_a_function_call_item_whose_arguments_follow_the_schema(server, client):
    ask = dict(model=server.model, input="Weather in Oslo?", tools=[WEATHER, {"type": "function", "name": "now"}],
               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0)
    r = client.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and r.output == calls
    assert calls[0].name == "get_weather" and CITY.is_valid(json.loads(calls[0].arguments))
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    events = list(client.responses.create(**ask, stream=True))      # a named call streams as it is written
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) >= 2 and "".join(pieces) == calls[0].arguments
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    added = next(e.item for e in events if e.type == "response.output_item.added")
    final = [o for o in events[-1].response.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in final] == [(c.name, c.arguments) for c in calls]
    assert (added.type, added.id, added.call_id) == ("function_call", final[0].id, final[0].call_id)
    with client.responses.stream(**ask) as s:               # the client's own accumulator
        assert [(o.name, o.arguments) for o in s.get_final_response().output] == [("get_weather", calls[0].arguments)]


def test_a_response_that_called_goes_on_only_with_the_calls_output(server, client):
    """As OpenAI's: continuing a response that made a call needs the call's output."""
    r = client.responses.create(model=server.model, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    (call,) = [o for o in r.output if o.type == "function_call"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="And?", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.param == "input" and call.call_id in e.value.message
    later = client.responses.create(model=server.model, previous_response_id=r.id, max_output_tokens=2, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert later.status in ("completed", "incomplete")


def test_a_call_cut_off_is_incomplete(server, client):
    """A named call cut off by max_output_tokens: the response and its call item are
    incomplete, with the arguments it got to (not JSON yet), whole and streamed alike."""
    ask = dict(model=server.model, input="Weather?", tools=[WEATHER], max_output_tokens=3, temperature=0,
               tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**ask)
    (call,) = r.output
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    events = list(client.responses.create(**ask, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete"
    assert [(c.status, c.arguments) for c in done] == [("incomplete", call.arguments)]


def test_only_the_call_being_written_is_incomplete():
    """Required calls cut off while the next call had not written its name (so it has no item):
    the calls written whole are completed and the response incomplete; cut off inside a call's
    arguments, that call is incomplete."""
    from types import SimpleNamespace
    from tandem.server.responses import _output
    from tandem.server.tools import ToolChoice
    p = SimpleNamespace(rid="chatcmpl-abc", gen=SimpleNamespace(tools=SimpleNamespace(choice=ToolChoice.REQUIRED)))

    def call(args):
        return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    whole = {"content": None, "tool_calls": [call('{"city":"Paris"}'), call('{"city":"Oslo"}')]}
    assert [i["status"] for i in _output(p, whole, "length", None)] == ["completed", "completed"]
    cut = {"content": None, "tool_calls": [call('{"city":"Paris"}'), call('{"city":"Os')]}
    assert [i["status"] for i in _output(p, cut, "length", None)] == ["completed", "incomplete"]


def test_required_calls_stream_one_item_after_another(server, client):
    """Several required calls: each call's item is done (its arguments whole) before the next
    one's is added, as OpenAI streams output items; the arguments streamed are the final ones."""
    ask = dict(model=server.model, input="Weather in Oslo, Paris and Rome?", tools=[WEATHER],
               tool_choice="required", max_output_tokens=120, temperature=0)
    events = list(client.responses.create(**ask, stream=True))
    final = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(final) >= 2                  # this prompt makes the tiny model call more than once
    opened = []
    for e in events:
        if e.type == "response.output_item.added":
            assert not opened, f"{e.item.id} added while {opened} still open"
            opened.append(e.item.id)
        elif e.type == "response.output_item.done":
            assert opened == [e.item.id]
            opened.pop()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.item_id, d.arguments) for d in done] == [(c.id, c.arguments) for c in final]
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.id, i.arguments, i.status) for i in items] == [(c.id, c.arguments, c.status) for c in final]


def test_a_response_cut_off_before_its_call_is_named_can_be_continued(server, client, tiny_chat_model, tok):
    """A required call cut off before its name (no item at all) is kept as a turn that said
    nothing, so previous_response_id goes on from it, as HF's reply to that chat says."""
    first = client.responses.create(model=server.model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=1, temperature=0)
    assert first.status == "incomplete" and not [o for o in first.output if o.type == "function_call"]
    nxt = client.responses.create(model=server.model, input="Go on", previous_response_id=first.id,
                                  max_output_tokens=MAX, temperature=0)
    text, n_in, _ = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Weather?"},
                                                    {"role": "assistant", "content": ""},
                                                    {"role": "user", "content": "Go on"}], MAX)
    assert (nxt.output_text, nxt.usage.input_tokens) == (text, n_in)


def test_what_a_response_echoes_can_be_sent_back(server, client):
    """A response says tool_choice auto with no tools; sent back, it is taken. Its body, as
    sent, validates against the openai client's Response type (every required field)."""
    from openai.types.responses import Response
    raw = client.responses.with_raw_response.create(model=server.model, input="Hi", max_output_tokens=2,
                                                    temperature=0).http_response.json()
    Response.model_validate(raw)
    assert raw["tool_choice"] == "auto" and raw["tools"] == []
    again = client.responses.create(model=server.model, input="Hi", max_output_tokens=2, temperature=0,
                                    tool_choice=raw["tool_choice"], tools=raw["tools"])
    assert again.output_text == raw["output"][0]["content"][0]["text"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=server.model, input="Hi", tool_choice="required")


def test_with_auto_tools_text_streams_as_it_is_written(server, client):
    """A reply that makes no call streams its text token by token, as without tools, and ends
    as the reply without a stream."""
    ask = dict(model=server.model, input="Hello", tools=[WEATHER], max_output_tokens=MAX, temperature=0)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}</tool_call>'


def test_an_auto_reply_is_its_texts_and_calls_in_the_order_written(server, client):
    """A reply written as text, a call, text, a second call and more text (forced by a regular
    expression): the same text and calls as the chat API's reply, as items in the order
    written, whole and streamed (each text token by token, each item done before the next is
    added), and as the client's accumulator assembles them."""
    ask = dict(model=server.model, input="Weather in Oslo and Rome?", tools=[WEATHER], max_output_tokens=150,
               temperature=0, extra_body={"structured_outputs": {"regex": r"Sure, one moment\. " + CALL +
                                                                          r" And then: " + CALL + r" Done\."}})
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Weather in Oslo and Rome?"}],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        max_tokens=150, temperature=0, extra_body=ask["extra_body"]).choices[0]
    assert chat.finish_reason == "tool_calls" and chat.message.content == "Sure, one moment.  And then:  Done."
    r = client.responses.create(**ask)
    assert [o.type for o in r.output] == ["message", "function_call", "message", "function_call", "message"]
    assert [o.content[0].text for o in r.output[::2]] == ["Sure, one moment. ", " And then: ", " Done."]
    assert [(o.name, o.arguments) for o in r.output[1::2]] == [
        (c.function.name, c.function.arguments) for c in chat.message.tool_calls]
    assert len({o.id for o in r.output}) == 5 and r.status == "completed"

    events = list(client.responses.create(**ask, stream=True))
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [o.model_dump(exclude={"id", "call_id"}) for o in final.output] == [
        o.model_dump(exclude={"id", "call_id"}) for o in r.output]
    opened = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item) for e in events if e.type == "response.output_item.done"]
    assert opened == [(i, o.type) for i, o in enumerate(final.output)]
    assert [(i, o.model_dump()) for i, o in done] == [(i, o.model_dump()) for i, o in enumerate(final.output)]
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    for i in range(1, len(final.output)):       # each item done before the next one is added
        assert kinds.index(("response.output_item.done", i - 1)) < kinds.index(("response.output_item.added", i))
    for i in (0, 2, 4):
        pieces = [e.delta for e in events if e.type == "response.output_text.delta" and e.output_index == i]
        assert len(pieces) >= 2 and "".join(pieces) == final.output[i].content[0].text
    with client.responses.stream(**ask) as s:               # the client's own accumulator
        assembled = s.get_final_response().output
    assert [(o.type, o.status, o.content[0].text if o.type == "message" else o.arguments) for o in assembled] == [
        (o.type, o.status, o.content[0].text if o.type == "message" else o.arguments) for o in r.output]


def test_an_auto_call_goes_out_as_its_block_closes(server, client):
    """A call followed by 300 forced tokens: the client reads up to the call's item done and
    hangs up, and the request is aborted, so the call went out while the reply was still being
    written (sent at the reply's end, it would have come after all 300 tokens)."""
    from tests.server.test_load import metric

    def aborted() -> float:
        with urllib.request.urlopen(server.url + "/metrics") as f:
            return metric(f.read().decode(), "vllm:request_success_total", finished_reason="abort")
    before = aborted()
    stream = client.responses.create(model=server.model, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                      max_output_tokens=300, temperature=0,
                                      extra_body={"structured_outputs": {"regex": CALL + "( a)*"}, "ignore_eos": True})
    for e in stream:
        if e.type == "response.output_item.done":
            assert e.item.type == "function_call" and e.item.name == "get_weather"
            break
    stream.close()
    for _ in range(100):
        if aborted() > before:
            break
        time.sleep(0.1)
    assert aborted() == before + 1


@pytest.mark.parametrize("said", [None, "Let me look."])
def test_earlier_calls_and_their_outputs_reach_the_prompt_as_a_chats_do(server, client, said):
    """The same conversation through the chat API (its tool messages checked against HF's
    template elsewhere): the same prompt length and the same greedy reply. Where the reply wrote
    text before its call (output items sent back by an agent that keeps no server state), the
    text and the call are one assistant message, as a chat sends it and a kept conversation
    holds it."""
    args = '{"city": "Oslo"}'
    before = [] if said is None else [{"type": "message", "role": "assistant",
                                       "content": [{"type": "output_text", "text": said}]}]
    r = client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=MAX, temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"}, *before,
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}])
    chat = client.chat.completions.create(
        model=server.model, max_tokens=MAX, temperature=0,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": said, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_a_calls_output_may_follow_it_in_the_kept_conversation(server, client):
    """A response that called a tool, continued with only that call's output and the response's
    id: the call is found in the kept conversation."""
    r = client.responses.create(model=server.model, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    nxt = client.responses.create(model=server.model, previous_response_id=r.id, tools=[WEATHER],
                                  max_output_tokens=4, temperature=0, input=[
                                      {"type": "function_call_output", "call_id": call.call_id, "output": "21\nC"}])
    assert nxt.status in ("completed", "incomplete") and nxt.usage.input_tokens > r.usage.input_tokens
    texts = [{"type": "input_text", "text": "21"}, {"type": "input_text", "text": "C"}]
    parts = client.responses.create(model=server.model, previous_response_id=r.id, tools=[WEATHER],
                                    max_output_tokens=4, temperature=0, input=[
                                        {"type": "function_call_output", "call_id": call.call_id, "output": texts}])
    assert parts.usage.input_tokens == nxt.usage.input_tokens      # text parts: the text they join to
    assert parts.output_text == nxt.output_text


def test_a_call_sent_back_with_the_response_that_made_it_is_refused_as_a_duplicate(server, client):
    """An agent that sends a response's output items back and names that response as
    previous_response_id too would put the call in the prompt twice: refused, as OpenAI refuses
    it, and so is the same call twice in one input."""
    r = client.responses.create(model=server.model, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    (call,) = r.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=2,
                                input=[call.model_dump(exclude_none=True), output])
    assert e.value.body["param"] == "input" and f"Duplicate item found with id {call.id}" in e.value.body["message"]
    twice = {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError, match="Duplicate item found with id call_9"):
        client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=2, input=[
            {"role": "user", "content": "Weather?"}, twice, twice, {**output, "call_id": "call_9"}])


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"extra_body": {"max_tokens": 4}}, "max_tokens"),           # a chat's fields would be dropped unread
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"extra_body": {"stop": ["x"]}}, "stop"),
    ({"input": [{"role": "user", "content": "Hi"},              # an output of no call before it
                {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": "Hi"},              # a call with no output after it
                {"type": "function_call", "call_id": "call_8", "name": "get_weather", "arguments": "{}"}]}, "input"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include"),
])
def test_what_it_cannot_do_is_refused_naming_the_field(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**({"model": server.model, "input": "Hi"} | extra))
    assert e.value.status_code == 400 and e.value.param.startswith(param), (e.value.param, e.value.message)


def test_auto_truncation_leaves_out_the_first_whole_turns_that_keep_the_input_past_the_context(
        server, client, tiny_chat_model, tok):
    """A conversation past the context: refused by default, and with truncation "auto" answered
    as HF answers the instructions and the fewest last turns that fit with room for the output
    (turns counted and fitted here with HF's tokenizer)."""
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    words = " ".join(f"w{i}" for i in range(ctx // 12))
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Question {i}: {words}"}, {"role": "assistant", "content": words}]
    turns.append({"role": "user", "content": "Last question?"})
    system = [{"role": "system", "content": "Be brief."}]

    def prompt_len(msgs):
        return len(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"])
    assert prompt_len(system + turns) > ctx - MAX
    first = next(i for i in range(0, len(turns), 2) if prompt_len(system + turns[i:]) <= ctx - MAX)
    assert 0 < first < len(turns) - 1
    kw = dict(model=server.model, instructions="Be brief.", input=turns, max_output_tokens=MAX, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert e.value.code == "context_length_exceeded"
    r = client.responses.create(**kw, truncation="auto")
    text, n_in, _ = hf_reply(tiny_chat_model, tok, system + turns[first:], MAX)
    assert r.truncation == "auto" and r.output_text == text and r.usage.input_tokens == n_in
    # the kept conversation is whole: its input items are every turn sent
    items = client.responses.input_items.list(r.id, order="asc", limit=100).data
    assert len(items) == len(turns)


def test_an_unsupported_part_is_named_where_it_is(server, client):
    """An image part of a message: the error names the part's type and what is accepted, not
    only that the item has none of the accepted forms."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                         {"type": "input_image", "image_url": "x"}]}])
    assert e.value.param == "input[0].content"
    assert e.value.message.endswith("'input[0].content[1].type' is input_image, but the model served here reads "
                                    "text only: it must be one of input_text, output_text")


def test_a_batch_of_responses(server, client, tiny_chat_model, tok):
    """The Batch API's /v1/responses endpoint: each line's body is a response object with HF's
    greedy reply, served best-effort; a bad line's error names its Responses field."""
    import io
    import time
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/responses",
             "body": {"model": server.model, "input": f"Question {i}?", "max_output_tokens": MAX, "temperature": 0}}
            for i in range(3)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/responses",
                 "body": {"model": server.model, "input": "x", "max_output_tokens": 0}})
    f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.monotonic() + 240
    while b.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.3)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 1), b
    out = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, client.files.content(b.output_file_id)
                                                              .text.splitlines())}
    for i in range(3):
        text, _, _ = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": f"Question {i}?"}], MAX)
        body = out[f"q{i}"]
        assert body["object"] == "response" and body["service_tier"] == "flex"
        assert body["output"][0]["content"][0]["text"] == text
    err = json.loads(client.files.content(b.error_file_id).text)
    assert err["custom_id"] == "bad" and err["response"]["body"]["error"]["param"] == "max_output_tokens"


def test_a_stored_response_is_retrieved_continued_and_deleted(server, client, tiny_chat_model, tok):
    """store (the default): GET gives the response back; previous_response_id continues its
    conversation, as HF's greedy reply to the whole chat says (the earlier instructions left
    out); DELETE forgets it; store false keeps nothing."""
    first = client.responses.create(model=server.model, instructions="Be brief.", input="Hi there",
                                    max_output_tokens=MAX, temperature=0)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=server.model, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=MAX, temperature=0)
    text, n_in, _ = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Hi there"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "And then?"}], MAX)
    assert second.previous_response_id == first.id
    assert (second.output_text, second.usage.input_tokens) == (text, n_in)
    third = client.responses.create(model=server.model, input="More?", previous_response_id=second.id,
                                    max_output_tokens=2, temperature=0, store=False)
    assert third.usage.input_tokens > second.usage.total_tokens     # both earlier turns came first
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="x", previous_response_id=first.id)
    assert e.value.param == "previous_response_id"


def test_kept_responses_outlive_a_restart(tiny_chat_model, tmp_path):
    """Kept in the data dir's database: after a restart the response is there, and a request
    continues its conversation (the same prompt length as one that sends the turns itself)."""
    from tests.server.conftest import start_server, stop_server
    srv = start_server(tiny_chat_model, tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        first = c.responses.create(model=srv.model, input="Hi there", max_output_tokens=4, temperature=0)
    finally:
        stop_server(srv)
    srv = start_server(tiny_chat_model, tmp_path)            # same data dir
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        later = c.responses.create(model=srv.model, input="And then?", previous_response_id=first.id,
                                   max_output_tokens=2, temperature=0)
        whole = c.responses.create(model=srv.model, max_output_tokens=2, temperature=0, store=False, input=[
            {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}])
        assert later.usage.input_tokens == whole.usage.input_tokens and later.output_text == whole.output_text
    finally:
        stop_server(srv)


def test_the_store_keeps_the_newest_responses(tmp_path):
    from tandem.server.store import Store
    store = Store(tmp_path)
    for i in range(5):
        store.keep_response({"id": f"resp_{i}", "n": i}, [{"role": "user", "content": str(i)}], keep=3,
                            inputs=[{"id": f"msg_{i}"}])
    assert [store.get_response(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert [store.response_inputs(f"resp_{i}") for i in (1, 2)] == [[], [{"id": "msg_2"}]]
    assert store.db.execute("SELECT COUNT(*) FROM response_inputs").fetchone()[0] == 3   # the forgotten's go too
    assert store.get_response("resp_4") == ({"id": "resp_4", "n": 4}, [{"role": "user", "content": "4"}])
    assert store.delete_response("resp_3") and not store.delete_response("resp_3")
    assert store.response_inputs("resp_3") == []
    store.add_response_job("resp_4", {"input": "x"})      # running in the background: kept past its turn
    for i in range(5, 9):
        store.keep_response({"id": f"resp_{i}"}, [], keep=3, inputs=[])
    assert [store.get_response(f"resp_{i}") is not None for i in (4, 5, 6)] == [True, False, True]
    store.end_response_job("resp_4")
    store.keep_response({"id": "resp_9"}, [], keep=3, inputs=[])
    assert store.get_response("resp_4") is None
    store.close()


def test_a_kept_responses_input_items_are_listed(server, client):
    """OpenAI's input items of a kept response, through the openai client: its own input (not the
    turns it continues), with ids, text as parts, newest first by default, in pages."""
    first = client.responses.create(model=server.model, input="Hi there", max_output_tokens=2, temperature=0)
    (only,) = client.responses.input_items.list(first.id).data
    assert (only.type, only.role, only.status) == ("message", "user", "completed")
    assert [(c.type, c.text) for c in only.content] == [("input_text", "Hi there")] and only.id.startswith("msg_")
    given = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
             {"role": "user", "content": [{"type": "input_text", "text": "And"}, {"type": "input_text", "text": "?"}]}]
    r = client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=2, temperature=0,
                                previous_response_id=first.id, input=given)
    asc = client.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in asc] == ["message", "function_call", "function_call_output", "message"]
    assert (asc[1].call_id, asc[1].name, asc[1].arguments, asc[2].output) == ("call_1", "get_weather",
                                                                              '{"city":"Oslo"}', "21 C")
    assert [c.text for c in asc[3].content] == ["And", "?"]
    assert [i.id for i in client.responses.input_items.list(r.id).data] == [i.id for i in asc][::-1]
    page = client.responses.input_items.list(r.id, order="asc", limit=3)
    assert [i.id for i in page.data] == [i.id for i in asc[:3]] and page.has_more
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=3)] == [i.id for i in asc]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def wait_for(c, rid: str, kind: str | None = None):
    """The background response once its events (read again from its start, as they come) reach
    ``kind``, or once they end (None): no polling, no clock."""
    with c.responses.retrieve(rid, stream=True) as events:
        for e in events:
            if e.type == kind:
                break
    return c.responses.retrieve(rid)


def test_a_background_response_is_queued_then_polled_to_the_greedy_reply(server, client, tiny_chat_model, tok):
    text, n_in, n_out = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Write a poem"}], MAX)
    r = client.responses.create(model=server.model, input="Write a poem", max_output_tokens=MAX, temperature=0,
                                background=True)
    assert r.status == "queued" and r.background is True and r.output == [] and r.usage is None
    done = wait_for(client, r.id)
    assert done.status in ("completed", "incomplete")
    assert done.output_text == text and (done.usage.input_tokens, done.usage.output_tokens) == (n_in, n_out)
    assert done.background is True and done.id == r.id and done.created_at == r.created_at
    assert client.responses.cancel(r.id).status == done.status         # ended: cancelling changes nothing
    later = client.responses.create(model=server.model, input="Again", previous_response_id=r.id,
                                    max_output_tokens=2, temperature=0)
    whole = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Write a poem"},
                                            {"role": "assistant", "content": text},
                                            {"role": "user", "content": "Again"}], 2)
    assert (later.output_text, later.usage.input_tokens) == whole[:2]


def test_a_background_stream_is_read_again_from_any_event(server, client, tiny_chat_model, tok):
    text, _, n_out = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Tell a tale"}], MAX)
    events = list(client.responses.create(model=server.model, input="Tell a tale", max_output_tokens=MAX,
                                          temperature=0, background=True, stream=True))
    assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e.response.status for e in events[:3]] == ["queued", "queued", "in_progress"]
    assert events[-1].type == ("response.incomplete" if n_out == MAX else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    rid = events[0].response.id
    for after in (None, 3, len(events) - 2):
        again = list(client.responses.retrieve(rid, stream=True, **({} if after is None else
                                                                   {"starting_after": after})))
        tail = events if after is None else events[after + 1:]
        assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in tail]
        assert [getattr(e, "delta", None) for e in again] == [getattr(e, "delta", None) for e in tail]
    assert client.responses.retrieve(rid).output_text == text


@pytest.mark.parametrize("body, param", [
    ({"background": True, "store": False}, "background"),
    ({"background": "yes"}, "background")])
def test_a_background_response_that_would_not_be_kept_is_refused(server, client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="x", max_output_tokens=2, extra_body=body)
    assert e.value.param == param


def test_only_a_background_response_is_cancelled_or_streamed_again(server, client):
    r = client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(r.id, stream=True))
    assert e.value.param == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")


HOLD = """
import os, asyncio
import tandem.server.app as app
_run_choice = app.run_choice
async def run_choice(sub, metrics, req, ch, sink=None, n=1):
    async def held(c, delta):       # after each token that brings text, wait while the hold file is there
        await sink(c, delta)
        while delta and os.path.exists({path!r}):
            await asyncio.sleep(0.02)
    return await _run_choice(sub, metrics, req, ch, held if sink is not None else None, n)
app.run_choice = run_choice
"""


def test_a_background_response_is_cancelled_while_it_runs(tiny_chat_model, tmp_path):
    """Held after its first token, so it is running when cancelled: it stays cancelled, its
    stream ends, and the server serves the next request."""
    from tests.server.conftest import start_server, stop_server
    hold = tmp_path / "hold"
    hold.touch()
    srv = start_server(tiny_chat_model, tmp_path, inject=HOLD.format(path=str(hold)))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        r = c.responses.create(model=srv.model, input="Count to ten", max_output_tokens=MAX, temperature=0,
                               background=True)
        assert wait_for(c, r.id, "response.in_progress").status == "in_progress"
        stream = c.responses.retrieve(r.id, stream=True)
        first = next(iter(stream))
        assert first.type == "response.created"
        cancelled = c.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and c.responses.retrieve(r.id).status == "cancelled"
        rest = [e.type for e in stream]             # ends: no completed event after a cancel
        assert "response.completed" not in rest and "response.incomplete" not in rest
        assert c.responses.cancel(r.id).status == "cancelled"
        hold.unlink()
        assert c.responses.create(model=srv.model, input="Hi", max_output_tokens=2).status in ("completed",
                                                                                                "incomplete")
        assert c.responses.retrieve(r.id).status == "cancelled"
    finally:
        stop_server(srv)


FULL_DISK = """
import errno, os
import tandem.server.errors as errors
import tandem.server.store as store
errors.STORAGE_RETRY_S = 0.1
_keep = store.Store.keep_response
def keep(self, response, *a, **kw):     # a response's end is refused while the file is there, as by a full disk
    if response["status"] != "queued" and os.path.exists({path!r}):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _keep(self, response, *a, **kw)
store.Store.keep_response = keep
_end, ends = store.Store.end_response_job, []
def end(self, rid):               # and the first write that closes a response's job, after its end was kept
    ends.append(rid)
    if len(ends) == 1:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _end(self, rid)
store.Store.end_response_job = end
"""


def test_a_full_disk_delays_a_responses_end_and_loses_nothing(tiny_chat_model, tmp_path, tok):
    """The data dir refuses to keep responses as they end. A background response stayed in
    progress for ever (or failed): it now stays in progress while the writes are refused and
    ends completed, with the greedy reply, once the disk takes them (a refused write closing its
    job afterwards failed it). A response asked for
    meanwhile is refused with a 507 saying why: as a status, or streamed, as an error event
    (the stream broke off, a traceback in the log)."""
    from tests.server.conftest import start_server, stop_server
    full = tmp_path / "full"
    full.touch()
    srv = start_server(tiny_chat_model, tmp_path, inject=FULL_DISK.format(path=str(full)))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        text, n_in, n_out = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Write a poem"}], MAX)
        r = c.responses.create(model=srv.model, input="Write a poem", max_output_tokens=MAX, temperature=0,
                               background=True)
        for _ in range(600):
            if srv.log.read_text().count("the data dir refused a write") >= 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the response's end was never refused: " + srv.log.read_text()[-2000:])
        assert c.responses.retrieve(r.id).status == "in_progress", srv.log.read_text()[-2000:]
        with pytest.raises(openai.APIStatusError) as e:
            c.responses.create(model=srv.model, input="Hi", max_output_tokens=2)
        assert e.value.status_code == 507 and "data dir refused the write" in e.value.body["message"]
        events = list(c.responses.create(model=srv.model, input="Hi", max_output_tokens=2, stream=True))
        assert events[-1].type == "error" and "data dir refused the write" in events[-1].message, events[-1]
        full.unlink()
        done = wait_for(c, r.id)
        assert done.status in ("completed", "incomplete") and done.output_text == text
        assert (done.usage.input_tokens, done.usage.output_tokens) == (n_in, n_out)
        assert "Traceback" not in srv.log.read_text()
    finally:
        stop_server(srv)


def test_a_background_response_outlives_a_restart(tiny_chat_model, tmp_path, tok):
    """Stopped (SIGTERM) while they run, background responses run again once the server is back:
    one to HF's reply; one sampled without a seed to the events its first run sent (a reader goes
    on after the last it saw); one whose previous response was forgotten meanwhile fails, saying why."""
    import sqlite3
    from tests.server.conftest import start_server, stop_server
    text, _, _ = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Name three rivers"}], MAX)
    hold = tmp_path / "hold"
    srv = start_server(tiny_chat_model, tmp_path, inject=HOLD.format(path=str(hold)))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        before = c.responses.create(model=srv.model, input="Hi", max_output_tokens=2)
        hold.touch()
        r = c.responses.create(model=srv.model, input="Name three rivers", max_output_tokens=MAX, temperature=0,
                               background=True)
        orphan = c.responses.create(model=srv.model, input="And?", previous_response_id=before.id,
                                    max_output_tokens=MAX, background=True)
        sampled = c.responses.create(model=srv.model, input="Say anything", max_output_tokens=MAX, temperature=2,
                                     background=True)
        for rid in (r.id, orphan.id):
            assert wait_for(c, rid, "response.in_progress").status == "in_progress"
        with c.responses.retrieve(sampled.id, stream=True) as events:
            seen = []
            for e in events:                # to its first text, where it is held
                seen.append(e)
                if e.type == "response.output_text.delta":
                    break
    finally:
        assert stop_server(srv) == 0
    with sqlite3.connect(tmp_path / "data" / "tandem.sqlite3") as db:
        db.execute("DELETE FROM responses WHERE id=?", (before.id,))
    srv = start_server(tiny_chat_model, tmp_path)            # same data dir, nothing held
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        done = wait_for(c, r.id)
        assert done.status in ("completed", "incomplete")
        assert done.output_text == text and done.created_at == r.created_at
        failed = wait_for(c, orphan.id)
        assert failed.status == "failed" and failed.error.code == "invalid_prompt" and before.id in failed.error.message
        again = list(c.responses.retrieve(sampled.id, stream=True))[:len(seen)]
        assert [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in again] == \
            [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in seen]
        assert wait_for(c, sampled.id).output_text.startswith(seen[-1].delta)
    finally:
        stop_server(srv)


def test_a_responses_log_probabilities_are_hfs(server, client, tiny_chat_model, tok):
    """include ['message.output_text.logprobs'] with top_logprobs: each output token's log
    probability and its likeliest alternatives are HF's, whole and streamed (the deltas' own
    add up to the done event's and the final response's)."""
    from tests.conftest import hf_greedy
    from tests.server.test_openai_api import hf_logprobs
    import torch
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "Name a colour"}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    out = hf_greedy(tiny_chat_model, [ids], MAX)[0]
    ref = hf_logprobs(tiny_chat_model, ids, out)
    args = dict(model=server.model, input="Name a colour", max_output_tokens=MAX, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=3)
    whole = client.responses.create(**args).output[0].content[0]
    assert len(whole.logprobs) == len(out)
    for i, (e, tid) in enumerate(zip(whole.logprobs, out)):
        assert e.token == tok.decode([tid]) and e.logprob == pytest.approx(ref[i, tid].item(), abs=2e-4), i
        top_v, top_i = torch.topk(ref[i], 3)
        assert [a.token for a in e.top_logprobs] == [tok.decode([t]) for t in top_i.tolist()]
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(top_v.tolist(), abs=2e-4)
    assert b"".join(bytes(e.bytes) for e in whole.logprobs).decode() == whole.text
    events = list(client.responses.create(**args, stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[0].content[0]
    for got in (deltas, done.logprobs, final.logprobs):     # the same tokens, the same values up to batching
        assert [(d.token, d.bytes, [a.token for a in d.top_logprobs]) for d in got] == \
            [(d.token, d.bytes, [a.token for a in d.top_logprobs]) for d in whole.logprobs]
        assert [d.logprob for d in got] == pytest.approx([d.logprob for d in whole.logprobs], abs=2e-4)
    plain = client.responses.create(model=server.model, input="Name a colour", max_output_tokens=MAX, temperature=0,
                                    top_logprobs=2)             # without include, as OpenAI's: none
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.text


def test_log_probabilities_are_of_the_text_not_the_end_token(server, client):
    """A reply a JSON schema ends (its end token stops it): the tokens' bytes join to its text,
    whole and streamed alike."""
    args = dict(model=server.model, input="Give a flag", max_output_tokens=40, temperature=0,
                include=["message.output_text.logprobs"], text={"format": {
                    "type": "json_schema", "name": "flag", "schema": {
                        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                        "additionalProperties": False}}})
    r = client.responses.create(**args)
    part = r.output[0].content[0]
    assert r.status == "completed" and json.loads(part.text)["on"] in (True, False)
    assert b"".join(bytes(e.bytes) for e in part.logprobs).decode() == part.text
    events = list(client.responses.create(**args, stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [d.token for d in deltas] == [d.token for d in part.logprobs]
    assert [d.token for d in events[-1].response.output[0].content[0].logprobs] == [d.token for d in part.logprobs]


def test_ended_responses_events_are_forgotten_oldest_first_past_a_count_or_a_size(monkeypatch):
    """The events of background responses that ended are kept for readers that come back, up to
    a number of responses and a number of bytes together; those of a running one always."""
    import asyncio
    from tandem.server import background
    monkeypatch.setattr(background, "KEPT_LOGS", 3)
    monkeypatch.setattr(background, "KEPT_LOG_BYTES", 100)

    async def main():
        bg = background.Background(store=None)
        for rid, size in (("a", 10), ("b", 10), ("c", 10), ("d", 10)):
            bg.logs[rid] = background.EventLog()
            await bg.logs[rid].write(b"x" * size)
        bg._forget_old()
        kept_by_count = list(bg.logs)
        bg.tasks["e"] = None                              # running: never forgotten
        for rid, size in (("e", 500), ("f", 85)):
            bg.logs[rid] = background.EventLog()
            await bg.logs[rid].write(b"x" * size)
        bg._forget_old()
        return kept_by_count, list(bg.logs)
    assert asyncio.run(main()) == (["b", "c", "d"], ["d", "e", "f"])


KILLED_AT = """
import os
import tandem.server.store as store
_init = store.Store.__init__
def init(self, *a, **kw):         # the process dies as the statement begins, as under SIGKILL
    _init(self, *a, **kw)
    self.db.set_trace_callback(lambda sql: os._exit(9) if sql.startswith({sql!r}) else None)
store.Store.__init__ = init
"""


@pytest.mark.parametrize("sql", ["INSERT OR REPLACE INTO response_jobs", "DELETE FROM response_jobs"])
def test_a_stop_while_a_background_response_is_kept_leaves_it_to_run_or_ended(sql, tiny_chat_model, tmp_path, tok):
    """The server dies as it writes a background response's request (after keeping it queued)
    or removes it (after keeping its end). A response kept queued with no request stayed queued
    for ever; one kept ended with its request still there ran again after the next start (in
    progress, its output gone, to end again). Each write and the response's now commit together:
    what the data dir holds is in progress with its request, or ended without one (or nothing,
    where the client never got an id), and the next start ends it with the greedy reply."""
    import sqlite3
    from tests.server.conftest import start_server, stop_server
    srv = start_server(tiny_chat_model, tmp_path, inject=KILLED_AT.format(sql=sql))
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    try:
        c.responses.create(model=srv.model, input="Write a poem", max_output_tokens=MAX, temperature=0,
                           background=True)
    except openai.APIConnectionError:
        pass                                # it died before answering
    assert srv.proc.wait(timeout=600) == 9
    with sqlite3.connect(tmp_path / "data" / "tandem.sqlite3") as db:
        kept = {rid: json.loads(r)["status"] for rid, r in db.execute("SELECT id, response FROM responses")}
        jobs = {rid for (rid,) in db.execute("SELECT id FROM response_jobs")}
    assert {rid for rid, status in kept.items() if status in ("queued", "in_progress")} == jobs, (kept, jobs)
    text, _, _ = hf_reply(tiny_chat_model, tok, [{"role": "user", "content": "Write a poem"}], MAX)
    srv = start_server(tiny_chat_model, tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        for rid in kept:
            done = wait_for(c, rid)
            assert done.status in ("completed", "incomplete") and done.output_text == text
    finally:
        stop_server(srv)
