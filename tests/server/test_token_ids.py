"""Token ids through the API, checked against HF transformers' greedy tokens and the model's own
tokenizer: ``return_token_ids`` (vLLM's extension: the output's and the prompt's ids beside the
text, whole and streamed; a model without a tokenizer streams its tokens as ids, which is what
the bench client times), and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import json

import aiohttp
import pytest

from tandem.bench.client import run_trace
from tandem.bench.workloads import TraceItem
from tests.conftest import hf_greedy
from tests.server.conftest import API_KEY, start_server, stop_server
from tests.server.test_alise_server import seed_predictor

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def post(url: str, path: str, body: dict, status: int = 200):
    """The whole JSON response, or the list of a stream's chunks."""
    async with aiohttp.ClientSession(headers=HEADERS) as s:
        async with s.post(url + path, json=body) as r:
            assert r.status == status, await r.text()
            if not body.get("stream"):
                return await r.json()
            chunks = []
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
            return chunks


def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.asyncio
async def test_completion_returns_the_prompt_and_output_ids(server, tiny_chat_model):
    prompt = "The quick brown fox"
    want_prompt = tokenizer(tiny_chat_model)(prompt)["input_ids"]
    want = hf_greedy(tiny_chat_model, [want_prompt], 9)[0]
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True, "n": 2}
    plain = await post(server.url, "/v1/completions", body)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    whole = await post(server.url, "/v1/completions", body | {"return_token_ids": True})
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == want_prompt and c["token_ids"] == want
    chunks = await post(server.url, "/v1/completions", body | {"return_token_ids": True, "stream": True})
    for i in range(2):
        mine = [c for ch in chunks for c in ch["choices"] if c["index"] == i]
        assert [c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c] == [want_prompt]
        assert [t for c in mine for t in c["token_ids"]] == want
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]


@pytest.mark.asyncio
async def test_chat_returns_the_templated_prompt_and_output_ids(server, tiny_chat_model):
    messages = [{"role": "user", "content": "Name three colours"}]
    tok = tokenizer(tiny_chat_model)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_prompt = tok(text, add_special_tokens=False)["input_ids"]
    want = hf_greedy(tiny_chat_model, [want_prompt], 7)[0]
    body = {"messages": messages, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = await post(server.url, "/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == want_prompt and whole["choices"][0]["token_ids"] == want
    chunks = await post(server.url, "/v1/chat/completions", body | {"stream": True})
    assert [ch["prompt_token_ids"] for ch in chunks if "prompt_token_ids" in ch] == [want_prompt]
    assert [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids", [])] == want


@pytest.fixture(scope="module")
def server_without_tokenizer(tiny_llama, tmp_path_factory):
    """The default policy with a length predictor, which has no text to read of id prompts."""
    tmp = tmp_path_factory.mktemp("srv-ids")
    seed_predictor(tmp / "seed")
    s = start_server(tiny_llama, tmp, "--policy", "tandem", "--length-predictor", str(tmp / "seed"))
    yield s
    stop_server(s)


@pytest.mark.asyncio
async def test_a_model_without_a_tokenizer_streams_its_tokens_as_ids(server_without_tokenizer, tiny_llama):
    s = server_without_tokenizer
    prompts = [[5, 9, 200, 31], [77, 3, 3, 120, 64, 8]]
    want = hf_greedy(tiny_llama, prompts, 6)
    for p, w in zip(prompts, want):
        chunks = await post(s.url, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                       "ignore_eos": True, "stream": True,
                                                       "return_token_ids": True})
        assert [t for ch in chunks for c in ch["choices"] for t in c["token_ids"]] == w
    # the bench's client times each token of such a model (random-weight runs at paper scale)
    items = [TraceItem(0.05 * i, p, 6, "rt") for i, p in enumerate(prompts)]
    recs, _ = await run_trace(s.url, s.model, items, "tandem", api_key=API_KEY, drain_s=60, progress=False)
    assert all(r.ok and r.ttft is not None and r.output_tokens == 6 for r in recs), [r.error for r in recs]
    assert all(1 <= len(r.token_times) <= 6 for r in recs)
    # log probabilities name such a model's tokens by id, and an echo adds no text
    out = await post(s.url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 2, "temperature": 0,
                                                "ignore_eos": True, "echo": True, "logprobs": 1})
    c = out["choices"][0]
    assert c["text"] == "" and c["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompts[0] + want[0][:2]]


@pytest.mark.asyncio
async def test_stop_strings_without_a_tokenizer_are_refused_not_ignored(server_without_tokenizer):
    """No text is ever made, so a stop string could never match: 400 naming ``stop`` (stop token
    ids still work), and the server keeps serving. Structured outputs, which read the tokens'
    text, are refused the same way."""
    s = server_without_tokenizer
    body = {"prompt": [5, 9, 200, 31], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(headers=HEADERS) as c:
        async with c.post(s.url + "/v1/completions", json=body | {"stop": ["x"]}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert err["param"] == "stop" and "stop_token_ids" in err["message"]
    err = (await post(s.url, "/v1/completions", body | {"guided_regex": "[0-9]+"}, status=400))["error"]
    assert err["param"] == "guided_regex" and "tokenizer" in err["message"]
    out = await post(s.url, "/v1/completions", body | {"return_token_ids": True})
    first = out["choices"][0]["token_ids"][0]
    out = await post(s.url, "/v1/completions", body | {"stop_token_ids": [first], "return_token_ids": True})
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["token_ids"] == [first]


@pytest.mark.asyncio
async def test_tokenize_and_detokenize_agree_with_the_models_tokenizer(server, tiny_chat_model):
    tok = tokenizer(tiny_chat_model)
    text = "Tokenize me, please: 12 + 30 = 42"
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi there"}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    max_len = json.loads((tiny_chat_model / "config.json").read_text())["max_position_embeddings"]
    for body, want in (({"prompt": text}, tok(text)["input_ids"]), ({"messages": messages}, chat_ids)):
        out = await post(server.url, "/tokenize", body)
        assert out == {"count": len(want), "max_model_len": max_len, "tokens": want}
        back = await post(server.url, "/detokenize", {"tokens": want})
        assert back == {"prompt": tok.decode(want, skip_special_tokens=False)}
    assert (await post(server.url, "/detokenize", {"tokens": []})) == {"prompt": ""}
    for body in ({}, {"prompt": text, "messages": messages}):
        err = (await post(server.url, "/tokenize", body, status=400))["error"]
        assert err["param"] == "prompt" and "exactly one" in err["message"]
    err = (await post(server.url, "/detokenize", {"tokens": [5, len(tok) + 10**6]}, status=400))["error"]
    assert err["param"] == "tokens"
    err = (await post(server.url, "/tokenize", {"prompt": text, "model": "other"}, status=404))["error"]
    assert err["code"] == "model_not_found"


@pytest.mark.asyncio
async def test_tokenize_without_a_tokenizer_is_refused(server_without_tokenizer):
    s = server_without_tokenizer
    assert "no tokenizer" in (await post(s.url, "/tokenize", {"prompt": "hi"}, status=400))["error"]["message"]
    assert "no tokenizer" in (await post(s.url, "/detokenize", {"tokens": [5]}, status=400))["error"]["message"]


@pytest.mark.asyncio
async def test_the_api_document_describes_every_field_returned(server):
    """With return_token_ids and log probabilities, each response is valid under /openapi.json's
    schema (checked by jsonschema_rs) and names no field the document leaves out, at the top and
    in its choices."""
    import jsonschema_rs
    async with aiohttp.ClientSession() as c:
        async with c.get(server.url + "/openapi.json") as r:
            doc = await r.json()
    calls = (("/v1/completions", {"prompt": "Hello", "n": 2}),
             ("/v1/completions", {"prompt": "Hello", "logprobs": 2, "echo": True, "prompt_logprobs": 1,
                                  "stop": ["e"]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "logprobs": True,
                                       "top_logprobs": 2, "prompt_logprobs": 2}))
    for path, body in calls:
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        out = await post(server.url, path, body | {"max_tokens": 3, "return_token_ids": True})
        jsonschema_rs.validate(schema, out)
        assert set(out) <= set(schema["properties"]), path
        documented = set(schema["properties"]["choices"]["items"]["properties"])
        assert all(set(ch) <= documented for ch in out["choices"]), (path, documented)
