"""Parse and validate OpenAI request bodies into engine inputs (no scheduling here)."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tandem.engine.params import SamplingParams, StructuredOutputs
from tandem.sched.beam import MAX_BEAM_WIDTH, BeamSearchParams
from tandem.sched.llm import CHAT, ChatTemplate, message_text
from tandem.sched.request import ServiceClass
from tandem.server.errors import ApiError, bad_request, structured_error
from tandem.server.schema import (ASKS_NOTHING, CHAT_BODY, CHAT_UNSUPPORTED, COMPLETION_BODY,
                                  COMPLETION_UNSUPPORTED, DETOKENIZE_BODY, MAX_TOKENS_CAP, STRUCTURED,
                                  TOKENIZE_BODY, validate)
from tandem.server.tools import ToolPlan, render_messages, tool_plan

MAX_CHOICES = 64            # prompts x n in one request

@dataclass(slots=True)
class GenRequest:
    """One validated /v1/completions or /v1/chat/completions call."""
    prompts: list                   # each a str, token id list, or chat messages (LLM.encode_prompt)
    sampling: SamplingParams        # max_tokens may still be None: filled from the context
    n: int
    stream: bool
    include_usage: bool
    service_class: ServiceClass
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    max_tokens_given: bool          # by the client; a default (a completion's 16, the model's) fits the room left
    max_tokens_param: str = "max_tokens"   # the field that gave it (a chat's max_completion_tokens)
    return_token_ids: bool = False  # token ids beside the text (streamed: each chunk's new ones)
    echo: bool = False              # a completion's prompt before its output (text, log probabilities)
    echo_only: bool = False         # max_tokens 0 with echo: the prompt alone (the token that scores it unshown)
    structured_param: str | None = None   # the field that asked for structured output (errors name it)
    tools: ToolPlan | None = None   # a chat's tools: its output is parsed for calls (server.tools)
    cache_salt: str | None = None   # prefix caching: blocks are shared only with the same salt
    template: ChatTemplate = CHAT   # how a chat's messages are rendered
    prompt_logprobs: int | None = None    # vLLM's prompt_logprobs asked for: the likeliest this many shown
    chat_echo: str = ""             # a chat's vLLM echo: the text its reply's content begins with
    tokens_as_ids: bool = False     # vLLM's return_tokens_as_token_ids: log probabilities name "token_id:<id>"
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: the n choices are a search's n best beams
    reply_role: str = "assistant"   # a chat reply's role: the last message's where no assistant turn is opened


def _val(body: dict, key: str, default):
    """body[key] (already valid: see server.schema), or ``default`` when absent or null."""
    v = body.get(key)
    return default if v is None else v


def asks_nothing(v, neutral: tuple = ()) -> bool:
    """Null, false, empty, or one of a field's ``neutral`` values (which a boolean never is)."""
    return v is None or v is False or v in ("", [], {}) or (not isinstance(v, bool) and v in neutral)


def reject_unsupported(body: dict, keys: tuple[str, ...]) -> None:
    """400 naming the first of ``keys`` the body asks something of. Null, false and empty values
    ask nothing (an empty suffix is what some clients send by default), and so does the value
    ``ASKS_NOTHING`` names (best_of 1)."""
    for key in keys:
        if not asks_nothing(body.get(key), (ASKS_NOTHING[key],) if key in ASKS_NOTHING else ()):
            raise bad_request(f"'{key}' is not supported by this server", param=key,
                              code="unsupported_parameter")


def parse_common(body: dict, *, chat: bool, default_ttft_s: float | None,
                 default_tbt_s: float | None, model_defaults: dict | None = None) -> tuple[SamplingParams, dict]:
    """Sampling fields shared by both endpoints, from a body that passed its schema; raises
    ApiError(400) naming the parameter for what the schema cannot say. ``model_defaults``: the
    model's own sampling defaults (``LLM.sampling_defaults``) for the fields the body leaves out,
    its max_tokens a cap on any, as vLLM applies a model's generation_config."""
    reject_unsupported(body, CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED)
    model = model_defaults or {}
    mt_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = given = _val(body, mt_key, None)
    if max_tokens is None and not chat:
        max_tokens = 16                                      # OpenAI's completions default
    if model.get("max_tokens") is not None:
        max_tokens = model["max_tokens"] if max_tokens is None else min(max_tokens, model["max_tokens"])
    stop = _val(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    min_tokens = _val(body, "min_tokens", 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("'min_tokens' must not exceed max_tokens", param="min_tokens")
    sp = SamplingParams.__new__(SamplingParams)      # max_tokens may be filled in later
    sp.max_tokens = max_tokens
    sp.temperature = float(_val(body, "temperature", model.get("temperature", 1.0)))
    sp.top_p = float(_val(body, "top_p", model.get("top_p", 1.0)))
    sp.top_k = _val(body, "top_k", model.get("top_k", -1))
    sp.min_p = float(_val(body, "min_p", model.get("min_p", 0.0)))
    sp.seed = _val(body, "seed", None)
    sp.stop, sp.stop_token_ids = list(stop), list(_val(body, "stop_token_ids", []))
    sp.ignore_eos = _val(body, "ignore_eos", False)
    sp.include_stop_str_in_output = _val(body, "include_stop_str_in_output", False)
    sp.min_tokens = min_tokens
    sp.logprobs = _logprobs(body, chat)
    sp.prompt_logprobs = body.get("prompt_logprobs")
    sp.logit_bias = _logit_bias(body)
    sp.presence_penalty = float(_val(body, "presence_penalty", model.get("presence_penalty", 0.0)))
    sp.frequency_penalty = float(_val(body, "frequency_penalty", model.get("frequency_penalty", 0.0)))
    sp.repetition_penalty = float(_val(body, "repetition_penalty", model.get("repetition_penalty", 1.0)))
    sp.structured_outputs, structured_param = _structured(body)
    sp.allowed_token_ids = body.get("allowed_token_ids")
    sp.bad_words = list(_val(body, "bad_words", []))
    sp.truncate_prompt_tokens = body.get("truncate_prompt_tokens")
    sp.skip_special_tokens = _val(body, "skip_special_tokens", model.get("skip_special_tokens", True))
    sp.n = 1                                 # the server runs each of n choices as its own request
    sp.detokenize = True
    stream = _val(body, "stream", False)
    if stream and sp.prompt_logprobs is not None:       # as vLLM: they come with a whole response
        raise bad_request("'prompt_logprobs' are not available with stream=true", param="prompt_logprobs")
    so = body.get("stream_options")
    if so is not None and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", param="stream_options")
    if so and so.get("continuous_usage_stats"):
        raise bad_request("'stream_options.continuous_usage_stats' is not supported by this server (the last "
                          "chunk carries the usage with include_usage)", param="stream_options.continuous_usage_stats",
                          code="unsupported_parameter")
    be = body.get("service_tier") == "flex"   # best-effort: no latency target unless the request sets one
    ttft, tbt = body.get("slo_ttft_ms"), body.get("slo_tbt_ms")
    extra = dict(n=_val(body, "n", 1), stream=stream, include_usage=bool(so and so.get("include_usage")),
                 service_class=ServiceClass.BE if be else ServiceClass.RT,
                 slo_ttft_s=ttft / 1000 if ttft else None if be else default_ttft_s,
                 slo_tbt_s=tbt / 1000 if tbt else None if be else default_tbt_s,
                 max_tokens_given=given is not None, max_tokens_param=mt_key,
                 return_token_ids=_val(body, "return_token_ids", False), structured_param=structured_param,
                 cache_salt=body.get("cache_salt"), prompt_logprobs=sp.prompt_logprobs,
                 tokens_as_ids=_val(body, "return_tokens_as_token_ids", False))
    if _val(body, "use_beam_search", False):
        extra["beam"] = beam_params(body, sp, extra["n"], chat)
    return sp, extra


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# what a beam search cannot honour: each step takes the likeliest tokens as the model gives them
BEAM_EXCLUDES = ("prompt_logprobs", "stop", "stop_token_ids", "logit_bias",
                 "allowed_token_ids", "bad_words", "response_format", "structured_outputs", *GUIDED,
                 "tools", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
BEAM_NEUTRAL = {"top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "min_tokens": (0,), "presence_penalty": (0,),
                "frequency_penalty": (0,), "repetition_penalty": (1,), "response_format": ({"type": "text"},)}


def beam_params(body: dict, sp: SamplingParams, n: int, chat: bool) -> BeamSearchParams:
    """vLLM's ``use_beam_search``: a search of width n; 400 naming a field it cannot honour."""
    for key in BEAM_EXCLUDES:
        if not asks_nothing(body.get(key), BEAM_NEUTRAL.get(key, ())):
            raise bad_request(f"'{key}' cannot be combined with use_beam_search", param=key)
    if not chat and body.get("echo") and sp.logprobs is not None:    # as vLLM: no prompt is scored
        raise bad_request("'echo' with 'logprobs' cannot be combined with use_beam_search", param="echo")
    if n > MAX_BEAM_WIDTH:
        raise bad_request(f"n: a beam search keeps at most {MAX_BEAM_WIDTH} beams (n is its width), got {n}",
                          param="n")
    return BeamSearchParams(n, sp.max_tokens or MAX_TOKENS_CAP,    # no max_tokens: the context's room
                            sp.ignore_eos, sp.temperature, float(_val(body, "length_penalty", 1.0)),
                            sp.include_stop_str_in_output, sp.skip_special_tokens)


def _structured(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """What the output must match, and the field that said so: OpenAI's ``response_format``
    (json_object, json_schema), vLLM's ``structured_outputs`` or its older ``guided_*`` fields;
    at most one of them."""
    rf = body.get("response_format")
    asked = {}
    if rf is not None and rf["type"] != "text":
        if rf["type"] == "json_schema" and rf.get("json_schema") is None:
            raise bad_request("'response_format' of type json_schema needs 'json_schema'", param="response_format")
        # json_object asks for an object whatever else the format holds (a json_schema left over)
        schema = (rf.get("json_schema") or {}).get("schema") if rf["type"] == "json_schema" else None
        asked["response_format"] = StructuredOutputs(json=schema) if schema is not None else \
            StructuredOutputs(json_object=True)
    so = body.get("structured_outputs")
    if so is not None:          # {} asks for a constraint and names none: refused below
        unknown = sorted(set(so) - set(STRUCTURED))
        if unknown:
            raise bad_request(f"'structured_outputs.{unknown[0]}' is not supported by this server; its fields "
                              f"are {', '.join(STRUCTURED)}", param="structured_outputs")
        asked["structured_outputs"] = StructuredOutputs(**{k: v for k, v in so.items() if v is not None})
    for key in GUIDED:
        if body.get(key) is not None:
            asked[key] = StructuredOutputs(**{key.removeprefix("guided_"): body[key]})
    if len(asked) > 1:
        raise bad_request(f"give only one of {', '.join(asked)}", param=list(asked)[1])
    spacing = body.get("guided_whitespace_pattern")
    if not asked:
        if spacing is not None:
            raise bad_request("'guided_whitespace_pattern' needs a JSON constraint to apply to",
                              param="guided_whitespace_pattern")
        return None, None
    (param, value), = asked.items()
    if spacing is not None:         # vLLM's older spelling of structured_outputs.whitespace_pattern
        value = replace(value, whitespace_pattern=spacing)
    try:
        value.validate()
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    return value, param


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as decimal strings) as token id -> bias."""
    lb = body.get("logit_bias")
    if not lb:
        return None
    if not all(re.fullmatch(r"[0-9]{1,20}", k) for k in lb):
        raise bad_request("'logit_bias' keys must be token ids written as decimal strings", param="logit_bias")
    return {int(k): float(v) for k, v in lb.items()}


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens to list per output token (None: no log probabilities). A chat
    asks with ``logprobs: true`` and ``top_logprobs``; a completion with ``logprobs: k``."""
    if not chat:
        return body.get("logprobs")
    top = _val(body, "top_logprobs", 0)
    if not body.get("logprobs"):
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top


def chat_messages(messages: list[dict], tools: ToolPlan | None = None) -> list[dict]:
    """Validated chat messages as the chat template takes them: text content, OpenAI's
    ``developer`` role as ``system``, tool calls and results as text (server.tools)."""
    flat, called = [], set()
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m.get("content"), list) else []
        refusal = next((j for j, p in enumerate(parts) if isinstance(p, dict) and p.get("type") == "refusal"), None)
        if refusal is not None and m["role"] != "assistant":
            raise bad_request(f"'messages[{i}].content[{refusal}]': a refusal part is an assistant's",
                              param=f"messages[{i}].content")
        content = message_text(m)          # content parts: text and refusals (the schema's); "" for a
        if content is None:                # turn of tool calls alone
            raise bad_request(f"'messages[{i}].content' is required", param=f"messages[{i}].content")
        if m["role"] == "tool" and m.get("tool_call_id") is None:     # OpenAI's rule: a result answers a call
            raise bad_request(f"'messages[{i}].tool_call_id' is required in a tool message",
                              param=f"messages[{i}].tool_call_id")
        if m["role"] == "tool" and m["tool_call_id"] not in called:    # ... made earlier in the chat
            raise bad_request(f"'messages[{i}]': a tool message answers a call in an earlier assistant message's "
                              f"'tool_calls', and none has id {m['tool_call_id']!r}",
                              param=f"messages[{i}].tool_call_id")
        called.update(c.get("id") for c in m.get("tool_calls") or () if isinstance(c, dict))
        role = "system" if m["role"] == "developer" else m["role"]
        flat.append({"role": role, "content": content, "tool_calls": m.get("tool_calls")})
    return render_messages(flat, tools)


def chat_input(body: dict, trust_template: bool) -> tuple[ToolPlan | None, list[dict], ChatTemplate]:
    """A validated chat body's tools, its messages as the template takes them and how they are
    rendered (with the body's own template only where ``trust_template``); raises ApiError naming
    the field."""
    source, docs = body.get("chat_template"), body.get("documents")
    if source is not None and not trust_template:
        raise bad_request("'chat_template' in a request is refused: this server renders only its own chat "
                          "template (start it with --trust-request-chat-template to allow them)",
                          param="chat_template")
    template = ChatTemplate(_val(body, "add_generation_prompt", True), _val(body, "continue_final_message", False),
                            body.get("chat_template_kwargs") or {}, source, None if docs is None else tuple(docs),
                            isolated=source is not None)
    try:
        plan = tool_plan(body)
        messages = chat_messages(body["messages"], plan)
        template.check(messages)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(":")[0]) from None
    return plan, messages, template


def parse_chat(body: dict, trust_template: bool = False, **defaults) -> GenRequest:
    validate(body, CHAT_BODY)
    sp, extra = parse_common(body, chat=True, **defaults)
    plan, messages, template = chat_input(body, trust_template)
    constraint = plan.constraint() if plan is not None else None
    if constraint is not None:
        if sp.structured_outputs is not None:
            raise bad_request("tool_choice: a required or named tool call cannot also follow "
                              f"'{extra['structured_param']}'", param="tool_choice")
        # the call is written whole: stop strings and ids end text, they would cut it unparsable
        sp.structured_outputs, extra["structured_param"] = constraint, "tools"
        sp.stop, sp.stop_token_ids = [], []
    elif plan is not None and plan.calls and sp.structured_outputs is not None \
            and sp.structured_outputs.kind() in ("json", "json_object"):     # (a grammar may write call blocks)
        try:        # a reply held to a JSON value could never call a tool: the format, or calls
            sp.structured_outputs = plan.reply_or_calls(sp.structured_outputs)
        except ValueError as e:
            raise structured_error(str(e), extra["structured_param"]) from None
    return GenRequest([messages], sp, **extra, tools=plan if plan is not None and plan.calls else None,
                      template=template, chat_echo=chat_echo(body, messages, template),
                      reply_role="assistant" if template.add_generation_prompt else messages[-1]["role"])


def chat_echo(body: dict, messages: list[dict], template: ChatTemplate) -> str:
    """vLLM's chat ``echo``: the last message's text where it has the reply's role (the assistant's,
    or its own where no assistant turn is opened); "" otherwise or without echo."""
    last = messages[-1]
    if not body.get("echo") or (template.add_generation_prompt and last["role"] != "assistant"):
        return ""
    return last["content"] or ""


def parse_tokenize(body: dict, trust_template: bool = False) -> tuple:
    """A /tokenize body's prompt, its text or its chat messages (exactly one of them; the
    messages with their tools, as a chat renders them), and how a chat is rendered."""
    validate(body, TOKENIZE_BODY)
    given = [k for k in ("prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if given == ["prompt"]:
        return body["prompt"], CHAT
    _, messages, template = chat_input(body, trust_template)
    return messages, template


def parse_detokenize(body: dict) -> list[int]:
    validate(body, DETOKENIZE_BODY)
    return body["tokens"]


def parse_completion(body: dict, **defaults) -> GenRequest:
    """A completion body. ``max_tokens: 0`` with ``echo`` asks for the prompt alone, scored where
    ``logprobs`` asks (as evaluation harnesses send it, and vLLM answers it): the request runs
    for one token, which the response leaves out."""
    validate(body, COMPLETION_BODY)
    prompt = body["prompt"]
    several = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    prompts = prompt if several else [prompt]
    if body.get("max_tokens") == 0 and (not body.get("echo") or body.get("use_beam_search")):
        raise bad_request("'max_tokens' must be >= 1 (got 0): 0 asks for the prompt alone, only with echo "
                          "(and no use_beam_search)", param="max_tokens")
    sp, extra = parse_common(body, chat=False, **defaults)
    extra["echo"] = _val(body, "echo", False)
    if extra["echo"] and sp.logprobs is not None:   # the echoed prompt's log probabilities
        sp.prompt_logprobs = max(sp.logprobs, sp.prompt_logprobs or 0)
    if sp.max_tokens == 0:
        sp.max_tokens, extra["echo_only"] = 1, True
    if len(prompts) * extra["n"] > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n = {extra['n']} asks for more than {MAX_CHOICES} "
                          "choices", param="n")
    return GenRequest(prompts, sp, **extra)


def check_model(body: dict, served: str, aliases: tuple[str, ...] = (), adapters=()) -> str:
    """The served model's name, for a request that names it, one of its ``aliases`` (vLLM's
    further served names, the --model path as given) or nothing; a LoRA adapter's name, for one
    that names one of ``adapters``; 404 for any other."""
    model = body.get("model", served)
    if model is None:
        model = served
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if model in adapters:
        return model
    if model != served and model not in aliases:
        raise ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return served
