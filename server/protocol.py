"""Parse and validate OpenAI request bodies into engine inputs (no scheduling here)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.params import SamplingParams
from tandem.sched.request import ServiceClass
from tandem.server.errors import ApiError, bad_request

MAX_N = 16
MAX_STOPS = 16              # stop strings per request
MAX_STOP_CHARS = 512        # each: the stream holds back up to this many characters while matching


@dataclass(slots=True)
class GenRequest:
    """One validated /v1/completions or /v1/chat/completions call."""
    prompt: object                  # str, token id list, or chat messages (engine.LLM.encode_prompt)
    sampling: SamplingParams        # max_tokens may still be None: filled from the context
    n: int
    stream: bool
    include_usage: bool
    service_class: ServiceClass
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    max_tokens_given: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _get(body: dict, key: str, kind, default, check=None, why: str = ""):
    """body[key] if present and not null, checked for type (and range); else default."""
    v = body.get(key)
    if v is None:
        return default
    ok = {"int": _is_int, "num": _is_num, "bool": lambda x: isinstance(x, bool),
          "str": lambda x: isinstance(x, str)}[kind](v)
    if not ok:
        raise bad_request(f"'{key}' must be of type {kind}, got {type(v).__name__}", param=key)
    if check is not None and not check(v):
        raise bad_request(f"'{key}' is out of range: {why} (got {v!r})", param=key)
    return v


UNSUPPORTED_TRUTHY = ("logprobs", "top_logprobs", "echo", "tools", "functions", "logit_bias",
                      "best_of", "suffix", "prediction", "audio", "modalities")


def _reject_unsupported(body: dict) -> None:
    for key in UNSUPPORTED_TRUTHY:
        v = body.get(key)
        harmless = v is None or v is False or v == [] or v == {} or (_is_int(v) and v <= (key == "best_of"))
        if not harmless:
            raise bad_request(f"'{key}' is not supported by this server", param=key,
                              code="unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        v = _get(body, key, "num", 0, lambda x: -2 <= x <= 2, "must be in [-2, 2]")
        if v != 0:
            raise bad_request(f"'{key}' other than 0 is not supported", param=key,
                              code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", param="response_format")


def parse_common(body: dict, *, chat: bool, default_ttft_s: float | None,
                 default_tbt_s: float | None) -> tuple[SamplingParams, dict]:
    """Sampling fields shared by both endpoints; raises ApiError(400) naming the parameter."""
    _reject_unsupported(body)
    mt_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, mt_key, "int", None, lambda x: x > 0, "must be >= 1")
    if max_tokens is None and not chat:
        max_tokens = 16                                      # OpenAI's completions default
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise bad_request(f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up "
                          f"to {MAX_STOPS} of them", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad_request("'stop_token_ids' must be a list of non-negative integers", param="stop_token_ids")
    min_tokens = _get(body, "min_tokens", "int", 0, lambda x: x >= 0, "must be >= 0")
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("'min_tokens' must not exceed max_tokens", param="min_tokens")
    sp = SamplingParams.__new__(SamplingParams)      # max_tokens may be filled in later
    sp.max_tokens = max_tokens
    sp.temperature = float(_get(body, "temperature", "num", 1.0, lambda x: 0 <= x <= 2, "must be in [0, 2]"))
    sp.top_p = float(_get(body, "top_p", "num", 1.0, lambda x: 0 < x <= 1, "must be in (0, 1]"))
    sp.top_k = _get(body, "top_k", "int", -1, lambda x: x >= -1, "must be -1 (off) or >= 0")
    sp.seed = _get(body, "seed", "int", None)
    sp.stop, sp.stop_token_ids = stop, list(stop_ids)
    sp.ignore_eos = _get(body, "ignore_eos", "bool", False)
    sp.min_tokens = min_tokens
    n = _get(body, "n", "int", 1, lambda x: 1 <= x <= MAX_N, f"must be in [1, {MAX_N}]")
    stream = _get(body, "stream", "bool", False)
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)):
        raise bad_request("'stream_options' must be an object with a boolean include_usage",
                          param="stream_options")
    if so is not None and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", param="stream_options")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default", "flex"):
        raise bad_request("'service_tier' must be one of auto, default, flex", param="service_tier")
    ttft = _get(body, "slo_ttft_ms", "num", None, lambda x: x > 0, "must be > 0")
    tbt = _get(body, "slo_tbt_ms", "num", None, lambda x: x > 0, "must be > 0")
    be = tier == "flex"         # best-effort: no latency target unless the request sets one
    extra = dict(n=n, stream=stream, include_usage=bool(so and so.get("include_usage")),
                 service_class=ServiceClass.BE if be else ServiceClass.RT,
                 slo_ttft_s=ttft / 1000 if ttft else None if be else default_ttft_s,
                 slo_tbt_s=tbt / 1000 if tbt else None if be else default_tbt_s,
                 max_tokens_given=max_tokens is not None)
    return sp, extra


def parse_chat(body: dict, **defaults) -> GenRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"messages[{i}]: role must be system, developer, user or assistant",
                              param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):        # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}]: only text content parts are supported",
                                  param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}]: content must be a string", param=f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    sp, extra = parse_common(body, chat=True, **defaults)
    return GenRequest(out, sp, **extra)


def parse_completion(body: dict, **defaults) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        pass
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("batched prompts are not supported; send one prompt per request "
                          "(or use the Batch API)", param="prompt")
    else:
        raise bad_request("'prompt' must be a string or an array of token ids", param="prompt")
    sp, extra = parse_common(body, chat=False, **defaults)
    return GenRequest(prompt, sp, **extra)


def check_model(body: dict, served: str) -> str:
    model = body.get("model", served)
    if model is None:
        model = served
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return model
