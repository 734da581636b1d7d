"""Tool calls read from a reply (tool_choice auto): which <tool_call> blocks become calls, what
stays content, and what a stream may send before the reply ends, against hand-worked replies."""
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from tandem.server.tools import ContentStream, ToolChoice, ToolPlan, finish_reason, reply_parts, tool_call

PLAN = ToolPlan(({"name": "add"}, {"name": "get_weather"}), ToolChoice.AUTO)
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
DEEP = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 3000 + "]" * 3000 + "}}</tool_call>"
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
    # arguments that are no JSON object, as text or as JSON, stay text
    ('<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
     '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>',
     '<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', []),
    ("Not a call: <tool_call", "Not a call: <tool_call", []),
    # a name that is no string, and JSON nested past Python's recursion limit, stay text
    ('<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',
     '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>', []),
    (DEEP, DEEP, []),
]


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_auto_replies_split_into_content_and_calls(reply, content, calls):
    got_content, got_calls = PLAN.parse(reply)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def texts(parts: list) -> str:
    return "".join(p for p in parts if isinstance(p, str))


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_a_stream_sends_only_what_stays_content(reply, content, calls):
    """Fed a character at a time, what a stream may send is always a prefix of the final content,
    and never a byte of a call; at the end the rest of the content completes it."""
    stream, sent = ContentStream(PLAN), ""
    for n, c in enumerate(reply):
        sent += texts(stream.feed(c))
        assert (content or "")[:len(sent)] == sent, (n, sent)
    assert len(sent) <= len(content or "") and stream.sent == len(sent)


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_a_stream_sends_each_call_as_its_block_closes(reply, content, calls):
    """Fed a character at a time, the calls a stream sends early are the reply's calls, in order
    and indexed, each at the character that closes its block (the hand-worked cases above)."""
    stream, early = ContentStream(PLAN), []
    for n, c in enumerate(reply):
        for call in stream.feed(c):
            if isinstance(call, dict):
                assert reply[:n + 1].endswith("</tool_call>"), (n, call)
                early.append(call)
    assert [c["index"] for c in early] == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in early] == calls
    assert stream.calls_sent == len(calls)


ADD = ("add", {"a": 1, "b": 2})
ADD5 = ("add", {"a": 5, "b": 2})
UNKNOWN = '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'
PARTS = [
    # reply, its parts: texts, and calls as (name, arguments)
    ("Hello there.", ["Hello there."]),
    (CALL_ADD, [ADD]),
    # lines between calls or after the last make no text; whitespace goes with the next text
    ("Let me check. " + CALL_ADD + "\n" + CALL_ADD.replace("1", "5") + "\n\n", ["Let me check. ", ADD, ADD5]),
    ("\n" + CALL_ADD + "\nDone.", [ADD, "\n\nDone."]),
    # text between calls is a text of its own, in its place
    ("First " + CALL_ADD + " then " + CALL_ADD.replace("1", "5") + " and so.",
     ["First ", ADD, " then ", ADD5, " and so."]),
    # a block that is no call is text where it was written; an open block left at the end too
    (CALL_ADD + " " + UNKNOWN, [ADD, " " + UNKNOWN]),
    ("See: " + CALL_ADD + ' <tool_call>{"name": "add"', ["See: ", ADD, ' <tool_call>{"name": "add"']),
    ("Not a call: <tool_call", ["Not a call: <tool_call"]),
]


def readable(parts: list) -> list:
    return [p if isinstance(p, str) else (p["function"]["name"], json.loads(p["function"]["arguments"]))
            for p in parts]


@pytest.mark.parametrize("reply, parts", PARTS)
def test_an_auto_reply_is_its_texts_and_calls_in_the_order_written(reply, parts):
    """A reply's parts (what the Responses API makes its output items of), hand-worked: the same
    read whole, a character at a time, or in pieces of three; its calls are the reply's calls,
    and its texts the content, but for whitespace that ends it."""
    assert readable(reply_parts(PLAN, reply)) == parts
    for step in (1, 3):
        stream = ContentStream(PLAN)
        for k in range(0, len(reply), step):
            stream.feed(reply[k:k + step])
        assert readable(stream.parts()) == parts, step
    content, calls = PLAN.parse(reply)
    assert [p for p in parts if not isinstance(p, str)] == readable(calls)
    assert (content or "").rstrip() == "".join(p for p in parts if isinstance(p, str)).rstrip()


def accumulate(deltas: list[dict]) -> list[tuple]:
    """tool_calls deltas merged by index, as an OpenAI client does: (id, name, arguments)."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function", d
            calls[d["index"]] = [d["id"], d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
        calls[d["index"]][2] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
NAMES = ("add", "get_weather")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(st.text(max_size=5), JSON, max_size=3)),
                min_size=1, max_size=3), st.booleans(), st.lists(st.integers(1, 12), max_size=60))
def test_required_calls_stream_their_arguments_as_written(calls, ascii_only, cuts):
    """A reply of tool_choice required (compact JSON, written here by json.dumps, with strings that
    hold quotes, braces and backslashes), fed in random pieces: the deltas merge into its calls,
    each sent as soon as its name is complete; every prefix (a reply cut off by max_tokens) parses
    to the calls begun so far, each with a prefix of its arguments."""
    plan = ToolPlan(tuple({"name": n} for n in NAMES), ToolChoice.REQUIRED)
    dump = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=ascii_only)   # noqa: E731
    text = dump([{"name": n, "arguments": a} for n, a in calls])
    want = [(n, dump(a)) for n, a in calls]
    heads = [m.end() for m in re.finditer(r'\{"name":"(add|get_weather)","arguments":', text)]
    stream, deltas, pos = ContentStream(plan), [], 0
    for k in cuts + [len(text)]:
        piece, pos = text[pos:pos + k], pos + k
        got = stream.feed(piece)
        assert all(isinstance(d, dict) for d in got)
        deltas += got
        assert len(accumulate(deltas)) == sum(h <= pos for h in heads)      # begun as its name ends
    assert [(n, a) for _, n, a in accumulate(deltas)] == want
    assert all(json.loads(a) == c[1] for (_, _, a), c in zip(accumulate(deltas), calls))
    for k in range(len(text) + 1):
        content, got = plan.parse(text[:k])
        assert content is None and [c["function"]["name"] for c in got] == [n for h, (n, _) in zip(heads, calls) if h <= k]
        assert all(want[i][1].startswith(c["function"]["arguments"]) for i, c in enumerate(got))


def test_a_named_function_streams_its_arguments_from_the_first_piece():
    """With a named function the reply is the arguments: the call goes out with the first text,
    then each piece as it comes."""
    named = ToolPlan(({"name": "add"},), ToolChoice.NAMED, "add")
    stream, text = ContentStream(named), '{"a":1,"b":"x}\\"}'
    assert stream.feed("") == []
    first = stream.feed(text[:3])
    assert [(d["index"], d["function"]) for d in first] == [(0, {"name": "add", "arguments": '{"a'})]
    rest = [stream.feed(c) for c in text[3:]]
    assert all(d == [{"index": 0, "function": {"arguments": c}}] for d, c in zip(rest, text[3:]))
    assert accumulate(first + sum(rest, [])) == [(first[0]["id"], "add", text)]
    assert stream.calls_sent == 1 and stream.sent == 0
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in named.parse(text[:5])[1]] == [("add", text[:5])]


def test_calls_finish_with_tool_calls_only_when_the_reply_ended_by_itself():
    call = [tool_call("add", "{}")]
    assert finish_reason(call, "stop") == finish_reason(call, "stop", PLAN) == "tool_calls"
    assert finish_reason(call, "stop", ToolPlan(({"name": "add"},), ToolChoice.NAMED, "add")) == "stop"
    assert finish_reason(call, "length") == "length" and finish_reason([], "stop") == "stop"


def test_required_calls_of_a_function_without_parameters_take_no_arguments():
    """OpenAI: a function whose ``parameters`` are omitted takes an empty parameter list, so under
    tool_choice required its calls' arguments must be ``{}``; one with a schema follows it, and
    ``parameters: {}`` (a schema that allows anything) allows any object. Checked with the
    jsonschema_rs validator over the output constraint."""
    import jsonschema_rs
    plan = ToolPlan(({"name": "now"}, {"name": "anything", "parameters": {}},
                     {"name": "add", "parameters": {"type": "object", "required": ["a"],
                                                    "properties": {"a": {"type": "integer"}}}}),
                    ToolChoice.REQUIRED)
    ok = jsonschema_rs.validator_for(plan.constraint().json).is_valid
    assert ok([{"name": "now", "arguments": {}}])
    assert not ok([{"name": "now", "arguments": {"tz": "UTC"}}])
    assert ok([{"name": "anything", "arguments": {"tz": "UTC"}}])
    assert ok([{"name": "add", "arguments": {"a": 1}}]) and not ok([{"name": "add", "arguments": {}}])
    assert not ok([{"name": "now", "arguments": []}])


def test_without_parallel_calls_an_auto_reply_makes_its_first_call_only():
    """``parallel_tool_calls: false``: the first call, parsed whole or streamed; the later blocks
    are neither calls nor content (vLLM's filtering)."""
    one = ToolPlan(PLAN.functions, ToolChoice.AUTO, parallel=False)
    reply = "Let me check. " + CALL_ADD + "\n" + CALL_ADD.replace("1", "5")
    content, calls = one.parse(reply)
    assert content == "Let me check. \n"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}]
    stream, early = ContentStream(one), []
    for c in reply:
        early += stream.feed(c)
    assert texts(early) == "Let me check. " and texts(stream.parts()) == "Let me check. "
    early = [d for d in early if isinstance(d, dict)]
    assert [(d["index"], json.loads(d["function"]["arguments"])) for d in early] == [(0, {"a": 1, "b": 2})]
    assert [c["id"] for c in stream.final(reply)[1]] == [early[0]["id"]]


def test_required_calls_keep_the_references_of_each_tools_schema():
    """A tool's ``$defs`` / ``definitions`` references and a recursive ``#`` mean in the calls'
    constraint what they mean in the tool's own schema (a pydantic model with a nested model has
    ``$defs``): arguments pass the constraint exactly when they pass the tool's schema alone, by
    jsonschema_rs. A property named like a keyword holding a reference is rebased too."""
    import jsonschema_rs
    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = {
        "weather": {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
                    "$defs": {"Loc": loc}},
        "tree": {"type": "object", "required": ["v", "child"], "properties": {
            "v": {"type": "integer"}, "child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}},
        "old": {"type": "object", "properties": {"default": {"$ref": "#/definitions/n"}}, "required": ["default"],
                "definitions": {"n": {"type": "integer"}}, "examples": [{"default": {"$ref": "#"}}]}}
    plan = ToolPlan(tuple({"name": k, "parameters": v} for k, v in tools.items()), ToolChoice.REQUIRED)
    ok = jsonschema_rs.validator_for(plan.constraint().json).is_valid
    tries = {"weather": [{"loc": {"city": "Oslo"}}, {"loc": {"town": "Oslo"}}, {"loc": "Oslo"}],
             "tree": [{"v": 1, "child": {"v": 2, "child": None}}, {"v": 1, "child": {"v": "x", "child": None}},
                      {"v": 1, "child": [{"name": "tree", "arguments": {}}]}],
             "old": [{"default": 3}, {"default": "3"}]}
    for name, args in tries.items():
        alone = jsonschema_rs.validator_for(tools[name]).is_valid
        assert [ok([{"name": name, "arguments": a}]) for a in args] == [alone(a) for a in args], name
        assert alone(args[0]) and not alone(args[1])
    assert plan.constraint().json["$defs"]["tool2"]["examples"] == tools["old"]["examples"]


def test_a_json_format_beside_auto_tools_takes_a_reply_or_calls_only():
    """OpenAI's response_format with tools the model may call: the output follows the format or
    is call blocks alone, each a listed tool's compact call; hand-written outputs through the
    grammar's matcher over SmolLM2's vocabulary, and what is accepted read back as content or
    calls."""
    from tandem.engine.grammar import Vocabulary, compile_grammar
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.engine.params import StructuredOutputs
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    d = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    tok = load_tokenizer(d)
    vocab = Vocabulary((d / "tokenizer.json").read_text(), len(tok), (tok.eos_token_id,))
    add = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    tools = ({"name": "add", "parameters": add}, {"name": "now"})
    fmt = StructuredOutputs(json={"type": "object", "required": ["answer"], "additionalProperties": False,
                                  "properties": {"answer": {"enum": ["yes", "no"]}}})
    call = '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>'
    now = '<tool_call>{"name":"now","arguments":{}}</tool_call>'
    outputs = {'{"answer":"yes"}': (True, True), '{"answer": "yes"}': (False, False),
               '{"answer":"maybe"}': (False, False), '{}': (False, False), call: (True, True),
               call + "\n" + now: (True, False), call + now: (True, False), call + "\n\n" + now: (False, False),
               call.replace('"a":1', '"a":"1"'): (False, False), call.replace("add", "sub"): (False, False),
               now.replace("{}", '{"a":1}'): (False, False), "Sure. " + call: (False, False),
               '{"answer":"no"}' + call: (False, False), '<tool_call>{"name": "now", "arguments": {}}</tool_call>':
               (False, False)}

    def accepts(grammar: str, text: str) -> bool:
        m = vocab.matcher(grammar, [])
        return m.consume_tokens(tok(text, add_special_tokens=False)["input_ids"]) and m.is_accepting()

    for parallel in (True, False):
        plan = ToolPlan(tools, ToolChoice.AUTO, parallel=parallel)
        grammar = compile_grammar(plan.reply_or_calls(fmt))
        vocab.check(grammar)
        for text, ok in outputs.items():
            assert accepts(grammar, text) == ok[not parallel], (parallel, text)
    plan = ToolPlan(tools, ToolChoice.AUTO)
    assert plan.parse('{"answer":"yes"}') == ('{"answer":"yes"}', [])
    content, calls = plan.parse(call + "\n" + now)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1}), ("now", {})]
    # the format's own options hold in its branch: spacing allowed by a pattern, closed objects
    spaced = ToolPlan(tools, ToolChoice.AUTO).reply_or_calls(
        StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "integer"}}},
                          whitespace_pattern=" ?", disable_additional_properties=True))
    assert accepts(compile_grammar(spaced), '{ "k": 1 }') and not accepts(compile_grammar(spaced), '{"k":1,"j":2}')
    with pytest.raises(ValueError, match="structured_outputs.json: not JSON"):
        plan.reply_or_calls(StructuredOutputs(json="{not json"))
