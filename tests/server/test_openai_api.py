"""The real server on loopback, driven by the official openai client and by aiohttp."""
import json
import re

import aiohttp
import openai
import pytest

from tests.server.conftest import API_KEY, hf_texts


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.model]


def test_streamed_chat_with_usage(server, client):
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    full = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == text, "streamed and whole text must agree (greedy)"
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_completion_n2_seed_and_stop(server, client):
    r = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=10, n=2,
                                  temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 20
    again = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=10, n=2,
                                      temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices], "seeded sampling reproduces"
    base = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    words = re.findall(r"\w{2,}", base)
    assert words, base
    cut = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=20,
                                    temperature=0, stop=[words[0]], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(words[0])]


@pytest.mark.asyncio
async def test_streamed_stop_string_never_leaks(server):
    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 20,
                    "temperature": 0, "ignore_eos": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                base = (await r.json())["choices"][0]["text"]
            stop = base[len(base) // 2: len(base) // 2 + 3]
            pieces = []
            async with s.post(server.url + "/v1/completions", json=body | {"stop": stop, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        pieces.append(json.loads(line[6:]))
            text = "".join(p["choices"][0]["text"] for p in pieces if p.get("choices"))
            return base, stop, text
    base, stop, text = await run()
    assert text == base[:base.index(stop)]


def test_several_prompts_in_one_completion_request(server, client, tiny_chat_model):
    """OpenAI's prompt may be a list: n choices per prompt, indexed prompt by prompt, each the
    reply that prompt gets alone (HF's greedy tokens); usage counts every prompt's tokens."""
    from transformers import AutoTokenizer
    prompts = ["Once upon a time", "The capital of France", [5, 17, 33, 99]]
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    want = hf_texts(tiny_chat_model, prompts, 8)
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert r.usage.prompt_tokens == len(tok(prompts[0])["input_ids"]) + len(tok(prompts[1])["input_ids"]) + 4
    assert r.usage.completion_tokens == 6 * 8
    # seeded sampling: each prompt's choices are what it gets alone with the same seed
    sampled = client.completions.create(model=server.model, prompt=prompts[:2], max_tokens=8, n=2,
                                        temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    alone = client.completions.create(model=server.model, prompt=prompts[1], max_tokens=8, n=2,
                                      temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in sampled.choices[2:]] == [c.text for c in alone.choices]
    streamed = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == want


@pytest.mark.parametrize("prompt, n", [(["a"] * 65, 1), (["a", "b"], 33), (["a", ""], 1), (["a", [1, -2]], 1)])
def test_bad_prompt_lists_are_refused(server, client, prompt, n):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=2, n=n)
    assert e.value.body["param"] in ("prompt", "n")
