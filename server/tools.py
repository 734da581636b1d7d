"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` for any chat model.

The tools reach the model as text, so no chat template needs to know of them: a system message
lists each tool's JSON and asks for calls written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (the Hermes format that most open instruct models were tuned on). Earlier
calls in the conversation are written back the same way in the assistant's turn, and each
tool's result goes in a user turn inside ``<tool_response>`` tags, which every template takes.

How the output becomes calls depends on ``tool_choice``:
- ``required``: the output is constrained (structured outputs) to a compact JSON array of calls,
  each ``{"name":<a tool's name>,"arguments":<that tool's parameters schema>}``, one call unless
  ``parallel_tool_calls``;
- a named function: the output is constrained to its parameters schema, and is its arguments;
- ``auto`` (the default with tools): nothing is constrained; the ``<tool_call>`` blocks of the
  output that hold a known tool's name and a JSON object of arguments become calls (only the
  first without ``parallel_tool_calls``), the rest stays text; beside a JSON reply format the
  output is either a reply in that format or call blocks alone (``reply_or_calls``);
- ``none``: the tools are not shown and nothing is parsed.

Streamed, a constrained call goes out as soon as its name is written and then its arguments
piece by piece, as OpenAI streams them; with ``auto`` each call goes out whole as its block
closes (before that, the block may still turn out not to be a call). A reply cut off by
``max_tokens`` keeps finish reason ``length``, so a client can tell its calls from finished
ones; a constrained call keeps the arguments it got to, an ``auto`` block left open is text.
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field

from tandem.engine.grammar import JSON_OPTIONS, json_schema, lark_json, map_schema
from tandem.engine.params import StructuredOutputs

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"             # tool_choice names one function


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One chat request's tools and what it lets the model do with them."""
    functions: tuple[dict, ...]     # each tool's ``function`` object: name, description, parameters
    choice: ToolChoice
    name: str | None = None         # the function a NAMED choice calls
    parallel: bool = True           # more than one call allowed (REQUIRED, AUTO)

    @property
    def calls(self) -> bool:
        """Whether the output may hold tool calls (and is parsed for them)."""
        return self.choice is not ToolChoice.NONE

    def constraint(self) -> StructuredOutputs | None:
        """What the output must match: calls (REQUIRED), one function's arguments (NAMED)."""
        if self.choice is ToolChoice.NAMED:
            return StructuredOutputs(json=self._params(self.name))
        if self.choice is not ToolChoice.REQUIRED:
            return None
        call = self._call_schema()
        calls = {"$defs": call.pop("$defs"), "type": "array", "minItems": 1, "items": call}
        return StructuredOutputs(json=calls | ({} if self.parallel else {"maxItems": 1}))

    def reply_or_calls(self, reply: StructuredOutputs) -> StructuredOutputs:
        """``auto`` with a JSON reply format (OpenAI's response_format beside tools): the output
        is either a reply that follows the format, or only ``<tool_call>`` blocks (one without
        ``parallel_tool_calls``), each holding a compact call of a listed tool, as a Lark
        grammar. It is read as any ``auto`` reply is: JSON content, or calls. ValueError naming
        the field where the format's schema is not one."""
        schema, options = json_schema(reply)
        calls = 'call ("\\n"? call)*' if self.parallel else "call"
        return StructuredOutputs(grammar=f"start: reply | calls\nreply: {lark_json(schema, options)}\n"
                                         f"calls: {calls}\n"
                                         f'call: "{OPEN_TAG}" "\\n"? {lark_json(self._call_schema(), JSON_OPTIONS)} '
                                         f'"\\n"? "{CLOSE_TAG}"\n')

    def _call_schema(self) -> dict:
        """One call, compact: ``{"name":N,"arguments":A}`` for a listed tool's name and arguments
        that follow its parameters. Each tool's parameters lie under the root's $defs, their own
        references rebased there, so a "#/$defs/..." or a recursive "#" in a tool's schema means
        what it meant in the tool."""
        defs = {f"tool{i}": rebased(self._params(f["name"]), f"#/$defs/tool{i}") for i, f in enumerate(self.functions)}
        one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"}}}
               for i, f in enumerate(self.functions)]
        return {"$defs": defs} | (one[0] if len(one) == 1 else {"anyOf": one})

    def _params(self, name: str) -> dict:
        f = next(f for f in self.functions if f["name"] == name)
        if "parameters" not in f:       # OpenAI: omitted parameters are an empty parameter list
            return NO_ARGUMENTS
        return f["parameters"] or ANY_OBJECT

    def system_text(self) -> str:
        """The tools as the model is shown them."""
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                           for f in self.functions)
        return ("You can call the functions listed below, one JSON description per line:\n"
                f"<tools>\n{listed}\n</tools>\n"
                "To call one, answer with its name and arguments as JSON inside tags, one call per "
                'pair of tags:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
                "</tool_call>\nA function's result comes back in <tool_response> tags.")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """An output's text -> (content, tool calls). A constrained output is calls only, those it
        began where it was cut off (``ArgumentStream``)."""
        if self.choice is ToolChoice.AUTO:
            return self._parse_tagged(text)
        stream = ArgumentStream(self)
        stream.push(text)
        return None, stream.calls

    def _parse_tagged(self, text: str) -> tuple[str | None, list[dict]]:
        """``<tool_call>`` blocks naming a known function with JSON arguments become calls; blocks
        that do not stay in the text, and the text around the calls is the content (None where it
        is only whitespace)."""
        calls, rest, pos = [], [], 0
        for m in CALL.finditer(text):
            call = self.call_in(m.group(0))
            if call is None:
                continue
            rest.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        rest.append(text[pos:])
        content = "".join(rest)
        # one call at most without parallel_tool_calls: the first (later blocks are left out
        # of the content too, as vLLM leaves them)
        return (content if content.strip() else None) if calls else text, calls if self.parallel else calls[:1]

    def call_in(self, block: str) -> dict | None:
        """The call a whole ``<tool_call>...</tool_call>`` block holds (a new id), or None where it
        names no listed function or its arguments are not a JSON object."""
        try:
            call = json.loads(CALL.fullmatch(block).group(1))
        except (ValueError, RecursionError):      # RecursionError: JSON nested past Python's limit
            return None
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(args, str):           # arguments written as JSON text
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in self._names() or not isinstance(args, dict):
            return None
        return tool_call(call["name"], json.dumps(args, ensure_ascii=False))

    def _names(self) -> set[str]:
        return {f["name"] for f in self.functions}


@dataclass(slots=True)
class ArgumentStream:
    """A constrained reply's calls while it is generated, a character at a time. The grammar
    makes the output compact JSON: with a named function the whole output is its arguments; with
    ``required`` it is ``[{"name":N,"arguments":A},...]``, keys in that order, so a call's name is
    known at the ``,"arguments":`` after it, and its arguments run from there to the ``}`` that
    closes the call's object. Outside strings the nesting depth says which ``}`` that is: the
    array is depth 1, a call's object 2."""
    plan: ToolPlan
    calls: list[dict] = field(default_factory=list)     # each call begun, arguments so far
    depth: int = 0
    quoted: bool = False            # inside a JSON string
    escaped: bool = False           # right after a backslash inside one
    head: str | None = None         # required: a call object's text up to its arguments
    in_args: bool = False

    def push(self, new: str) -> list[dict]:
        """The ``tool_calls`` deltas of the reply's ``new`` text, by index: a call begun here goes
        whole (id, type, name and its arguments so far), a call begun before as a piece of its
        arguments."""
        known = len(self.calls)
        if self.plan.choice is ToolChoice.NAMED and new and not self.calls:
            self.calls.append(tool_call(self.plan.name, ""))
            self.in_args = True
        chars: dict[int, list[str]] = {}
        for ch in new:
            if self._follow(ch):
                continue
            if self.in_args:
                chars.setdefault(len(self.calls) - 1, []).append(ch)
            elif self.head is not None:
                self._read_head(ch)
        pieces = {i: "".join(cs) for i, cs in chars.items()}
        for i, piece in pieces.items():
            self.calls[i]["function"]["arguments"] += piece
        begun = [self.calls[i] | {"index": i, "function": dict(self.calls[i]["function"])}
                 for i in range(known, len(self.calls))]
        return [{"index": i, "function": {"arguments": piece}} for i, piece in sorted(pieces.items())
                if i < known] + begun

    def _follow(self, ch: str) -> bool:
        """Follow one character; True for the braces of a required call's own object."""
        if self.quoted:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.quoted = False
            return False
        required = self.plan.choice is ToolChoice.REQUIRED
        if ch == '"':
            self.quoted = True
        elif ch in "{[":
            self.depth += 1
            if required and self.depth == 2:
                self.head = ""
                return True
        elif ch in "}]":
            self.depth -= 1
            if required and self.depth == 1:
                self.head, self.in_args = None, False
                return True
        return False

    def _read_head(self, ch: str) -> None:
        """A required call's ``"name":N,"arguments":`` text; at its end the call begins."""
        self.head += ch
        key = ',"arguments":'
        if not self.quoted and self.depth == 2 and self.head.endswith(key):
            name = json.loads(self.head[len('"name":'):-len(key)])
            self.calls.append(tool_call(name, ""))
            self.head, self.in_args = None, True


@dataclass(slots=True)
class ContentStream:
    """What of a chat-with-tools reply a stream may send while it is generated, in the order it
    was written (``feed``). With ``auto``: the text outside ``<tool_call>`` blocks, holding back
    what could begin one and an open block (it may turn out not to be a call); each call as
    soon as its block closes, so a client can run the first while the model writes the next; a
    block that is no call, as text. Text after a call is a new part of the reply (the Responses
    API's next message): its whitespace is held until more than whitespace follows, so the
    lines between two calls, or after the last, make no part. Everything sent is a prefix of
    the final content (``final``): whitespace held goes out with the text after it, or at the
    end. A constrained reply is calls only, sent as they are written."""
    plan: ToolPlan
    unsent: str = ""                # auto: text not read yet: where a tag may begin, or an open block
    later: list[str] = field(default_factory=list)     # auto: pieces after an open block's unsent start
    tail: str = ""                  # auto: the unread text's last characters, where a closing tag may begin
    held: str = ""                  # auto: content read but not sent (whitespace before a part's text)
    open: bool = False              # auto: a part of the reply's text is being sent
    sent: int = 0                   # characters of content sent (a prefix of the final content)
    calls_sent: int = 0             # calls sent before the reply ends: the first of its final calls
    args: ArgumentStream | None = None      # a constrained reply's calls so far
    auto_sent: list[dict] = field(default_factory=list)     # auto: the calls sent, with the ids they went out with
    written: list[str | dict] = field(default_factory=list)     # auto: what ``feed`` gave, in order

    def __post_init__(self):
        if self.plan.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED):
            self.args = ArgumentStream(self.plan)

    def feed(self, new: str) -> list[str | dict]:
        """What to send of the reply's ``new`` text, in order: content as text, and ``tool_calls``
        deltas, each with its ``index`` among the reply's calls (constrained:
        ``ArgumentStream.push``). A closed block never changes, so these are the first of the
        calls ``ToolPlan.parse`` finds in the whole reply."""
        if self.args is not None:
            deltas = self.args.push(new)
            self.calls_sent = len(self.args.calls)
            return deltas
        if self.unsent.startswith(OPEN_TAG) and CLOSE_TAG not in self.tail + new:
            self.later.append(new)          # an open block is read again only once it may close
            self.tail = (self.tail + new)[1 - len(CLOSE_TAG):]
            return []
        out: list[str | dict] = []
        self.unsent = self._read("".join([self.unsent, *self.later, new]), out)
        self.later, self.tail = [], self.unsent[1 - len(CLOSE_TAG):]
        self.written += out
        return out

    def _read(self, text: str, out: list[str | dict]) -> str:
        """Read ``text`` into ``out``; the text left to read with more."""
        while (cut := text.find(OPEN_TAG)) >= 0:
            self._say(text[:cut], out)
            close = text.find(CLOSE_TAG, cut)
            if close < 0:
                return text[cut:]
            block, text = text[cut:close + len(CLOSE_TAG)], text[close + len(CLOSE_TAG):]
            call = self.plan.call_in(block)
            if call is None:
                self._say(block, out)
            elif self.plan.parallel or not self.auto_sent:
                out.append(call | {"index": len(self.auto_sent)})
                self.auto_sent.append(call)
                self.calls_sent, self.open = len(self.auto_sent), False
        keep = next((k for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1) if text.endswith(OPEN_TAG[:k])), 0)
        self._say(text[:len(text) - keep], out)
        return text[len(text) - keep:]

    def _say(self, text: str, out: list[str | dict]) -> None:
        """Content read: sent within a part, held while a part would begin with whitespace only."""
        self.held += text
        if self.held and (self.open or self.held.strip()):
            out.append(self.held)
            self.sent += len(self.held)
            self.held, self.open = "", True

    def parts(self) -> list[str | dict]:
        """At the reply's end, its parts in the order written: its texts (each a Responses API
        message) and its calls, as sent; the content not sent (whitespace held, and text read
        last: an open block, or what could have begun one) ends the last text, or is one where
        it is more than whitespace."""
        parts = list(self.written)
        if (rest := "".join([self.held, self.unsent, *self.later])) and (self.open or rest.strip()):
            parts.append(rest)
        merged: list[str | dict] = []
        for part in parts:
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        return merged

    def final(self, reply: str) -> tuple[str | None, list[dict]]:
        """The whole reply's (content, calls), as ``ToolPlan.parse`` gives them; the calls already
        streamed keep the ids they went out with (a constrained reply's are not read again)."""
        if self.args is not None:
            return None, self.args.calls
        content, calls = self.plan.parse(reply)
        return content, self.auto_sent + calls[len(self.auto_sent):]


def reply_parts(plan: ToolPlan, reply: str) -> list[str | dict]:
    """An ``auto`` reply's parts (``ContentStream.parts``), as a stream of it sends them."""
    stream = ContentStream(plan)
    stream.feed(reply)
    return stream.parts()


def finish_reason(calls: list[dict], finish: str | None, plan: ToolPlan | None = None) -> str | None:
    """"tool_calls" for a reply that made calls and ended by itself, but "stop" where the request
    named the function (OpenAI's and vLLM's: the caller, not the model, chose to call); one cut
    off by max_tokens (or aborted) keeps its own reason, so a client can tell that its calls may
    be unfinished."""
    named = plan is not None and plan.choice is ToolChoice.NAMED
    return "tool_calls" if calls and finish == "stop" and not named else finish


def rebased(schema, base: str):
    """``schema`` moved to ``base`` (a JSON pointer, "#/$defs/x") of a larger one: each local
    reference ("#", "#/...") points where it pointed before the move."""
    def rebase(s: dict) -> dict:
        ref = s.get("$ref")
        local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
        return s | {"$ref": base + ref[1:]} if local else s
    return map_schema(schema, rebase)


def tool_call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_plan(body: dict) -> ToolPlan | None:
    """A validated chat body's tools and tool_choice; None when it gives no tools. ValueError
    (naming the field) for a choice that names no given tool."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, ToolChoice.NONE.value):
            raise ValueError("tool_choice: needs 'tools'")
        return None
    functions = tuple(t["function"] for t in tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: two tools have the same name")
    parallel = body.get("parallel_tool_calls") is not False
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice: names '{name}', which is not one of the tools")
        return ToolPlan(functions, ToolChoice.NAMED, name, parallel)
    return ToolPlan(functions, ToolChoice(choice or "auto"), None, parallel)


def render_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Chat messages with tool calls and results written as text the template takes, and the
    tools listed in the system message (added when the chat has none)."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{OPEN_TAG}\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": _arguments(c["function"]["arguments"])},
                                                         ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None and plan.calls:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + plan.system_text()}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


def _arguments(text: str):
    """A call's arguments as sent back (a JSON string) -> the JSON value, or the text as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text
