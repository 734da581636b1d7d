"""Tool calls read from a reply (tool_choice auto): which <tool_call> blocks become calls, what
stays content, and what a stream may send before the reply ends, against hand-worked replies."""
import json

import pytest

from tandem.server.tools import ContentStream, ToolChoice, ToolPlan

PLAN = ToolPlan(({"name": "add"}, {"name": "get_weather"}), ToolChoice.AUTO)
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CASES = [
    # reply, content, calls as (name, arguments)
    ("Hello there.", "Hello there.", []),
    (CALL_ADD, None, [("add", {"a": 1, "b": 2})]),
    ("Let me check. " + CALL_ADD + "\n" + CALL_ADD.replace("1", "5"), "Let me check. \n",
     [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 2})]),
    # an unknown tool, JSON that does not parse, and a call without arguments stay text
    ('<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call> then ' + CALL_ADD,
     '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call> then ', [("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add"}</tool_call>', '<tool_call>{"name": "add"}</tool_call>', []),
    # "parameters" for "arguments" (some models write it), and arguments already a JSON string
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>', None, [("add", {"a": 3})]),
    ("Not a call: <tool_call", "Not a call: <tool_call", []),
]


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_auto_replies_split_into_content_and_calls(reply, content, calls):
    got_content, got_calls = PLAN.parse(reply, finished=True)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_a_stream_sends_only_what_stays_content(reply, content, calls):
    """Fed a character at a time, what a stream may send is always a prefix of the final content,
    and never a byte of a call; at the end the rest of the content completes it."""
    stream, sent = ContentStream(PLAN), ""
    for n, c in enumerate(reply):
        sent += stream.push(c)
        assert (content or "")[:len(sent)] == reply[:len(sent)] == sent, (n, sent)
    assert len(sent) <= len(content or "") and stream.sent == len(sent)


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_a_stream_sends_each_call_as_its_block_closes(reply, content, calls):
    """Fed a character at a time, the calls a stream sends early are the reply's calls, in order
    and indexed, each at the character that closes its block (the hand-worked cases above)."""
    stream, early = ContentStream(PLAN), []
    for n, c in enumerate(reply):
        stream.push(c)
        for call in stream.closed_calls(c, lambda: reply[:n + 1]):
            assert reply[:n + 1].endswith("</tool_call>"), (n, call)
            early.append(call)
    assert [c["index"] for c in early] == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in early] == calls
    assert stream.calls_sent == len(calls)


def test_constrained_choices_stream_nothing_and_parse_their_json():
    named = ToolPlan(({"name": "add"},), ToolChoice.NAMED, "add")
    required = ToolPlan(({"name": "add"},), ToolChoice.REQUIRED)
    text = '[{"name":"add","arguments":{"a":1}}]'
    assert ContentStream(named).push('{"a":1}') == ContentStream(required).push(text) == ""
    stream, call = ContentStream(required), f"<tool_call>{text}</tool_call>"
    stream.push(call)
    assert stream.closed_calls(call, lambda: call) == [], "a constrained reply's call is known only at its end"
    assert [c["function"]["arguments"] for c in named.parse('{"a":1}', True)[1]] == ['{"a":1}']
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in required.parse(text, True)[1]] \
        == [("add", {"a": 1})]
    assert required.parse(text[:-3], finished=False) == (text[:-3], []), "cut off by max_tokens: no call"
