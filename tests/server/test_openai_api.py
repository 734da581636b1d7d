"""The real server on loopback, driven by the official openai client and by aiohttp."""
import json
import re

from typing import Annotated, Literal

import aiohttp
import jsonschema_rs
import openai
import pydantic
import pytest
import torch

from tests.conftest import SPLIT_PROMPT, hf_whole, raw_bytes
from tests.server.conftest import API_KEY, hf_texts


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(server, client, tiny_chat_model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.model]
    card = client.models.list().data[0].model_extra      # vLLM's additions to OpenAI's model object
    assert card["root"] == str(tiny_chat_model) and card["parent"] is None
    assert [p["object"] for p in card["permission"]] == ["model_permission"]
    assert client.models.retrieve(server.model).model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_the_response_says_how_the_request_was_served(server, client):
    """OpenAI's service_tier: flex requests are best-effort; default, auto and priority real-time."""
    msg = [{"role": "user", "content": "Hi"}]
    for asked, served in (("flex", "flex"), ("priority", "default"), ("auto", "default"), (None, "default")):
        extra = {"service_tier": asked} if asked else {}
        assert client.chat.completions.create(model=server.model, messages=msg, max_tokens=2,
                                              extra_body=extra).service_tier == served
    chunks = list(client.completions.create(model=server.model, prompt="Hi", max_tokens=2, stream=True,
                                            extra_body={"service_tier": "flex"},
                                            stream_options={"include_usage": True}))
    assert chunks and all(c.service_tier == "flex" for c in chunks)


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


def hf_logprobs(model_dir, prompt_ids: list[int], out_ids: list[int]):
    """[len(out_ids), V]: HF transformers' log-softmax (float64) before each output token."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out_ids])).logits[0].double()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)


SPLIT_TEXT = " 😁👍 猫好 \ufffd ok"     # characters of several tokens, a whole U+FFFD, plain words


def spelled(tok, tid: int) -> str:
    """A token as OpenAI's chat log probabilities spell it: its text, or where it holds part of a
    character, its bytes with those of no whole character as ``\\xNN``."""
    text = tok.decode([tid])
    return raw_bytes(tok, tid).decode("utf-8", "backslashreplace") if "\ufffd" in text else text


def test_chat_logprobs_match_hf(server, client, tiny_chat_model):
    """The official client parses them; each token's log probability and its three likeliest
    alternatives are HF's, and the tokens' bytes put together are the reply's text. A token that
    holds part of a character is spelled by its bytes, as OpenAI spells it, never as U+FFFD."""
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Name a colour"}], max_tokens=10,
        temperature=0.7, seed=3, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    body = r.model_dump()
    out_ids, prompt_ids = body["choices"][0]["token_ids"], body["prompt_token_ids"]
    content = r.choices[0].logprobs.content
    ref = hf_logprobs(tiny_chat_model, prompt_ids, out_ids)
    assert len(content) == len(out_ids) == 10
    for i, (e, tid) in enumerate(zip(content, out_ids)):
        assert e.logprob == pytest.approx(ref[i, tid].item(), abs=2e-4), i
        assert e.token == spelled(tok, tid) and bytes(e.bytes) == raw_bytes(tok, tid)
        top_v, top_i = torch.topk(ref[i], 3)
        assert [a.token for a in e.top_logprobs] == [spelled(tok, t) for t in top_i.tolist()]
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(top_v.tolist(), abs=2e-4)
        assert [bytes(a.bytes) for a in e.top_logprobs] == [raw_bytes(tok, t) for t in top_i.tolist()]
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == tok.decode(out_ids, skip_special_tokens=False)
    split = sorted(set(tok(SPLIT_TEXT)["input_ids"]))
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Emoji"}], max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "allowed_token_ids": split})
    out_ids, content = r.model_dump()["choices"][0]["token_ids"], r.choices[0].logprobs.content
    assert any("\ufffd" in tok.decode([t]) for t in out_ids), "meant to split a character"
    assert [e.token for e in content] == [spelled(tok, t) for t in out_ids]
    whole = tok("\ufffd")["input_ids"]          # the token that is the character U+FFFD
    assert [("\ufffd" in e.token) for e in content] == [t in whole for t in out_ids]
    assert b"".join(bytes(e.bytes) for e in content) == b"".join(raw_bytes(tok, t) for t in out_ids)


def test_no_logprobs_unless_asked(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=False)
    assert r.choices[0].logprobs is None
    c = client.completions.create(model=server.model, prompt="Hi", max_tokens=3, temperature=0)
    assert c.choices[0].logprobs is None


def rounded(x, places: int = 4):
    """x with every float rounded (nested lists and dicts)."""
    if isinstance(x, float):
        return round(x, places)
    if isinstance(x, list):
        return [rounded(v, places) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v, places) for k, v in x.items()}
    return x


@pytest.mark.asyncio
@pytest.mark.parametrize("chat, echo", [(True, False), (False, False), (False, True)])
async def test_streamed_logprobs_equal_the_whole_response(server, tiny_chat_model, chat, echo):
    """Streamed, each token's entry comes once, in order, as in the whole response (greedy), and a
    completion's text offsets run on across chunks."""
    from tests.server.test_token_ids import post
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 9, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "n": 2} | (
        {"messages": [{"role": "user", "content": "Count to five"}], "logprobs": True, "top_logprobs": 2}
        if chat else {"prompt": "Once upon a time", "logprobs": 2, "echo": echo})
    whole = await post(server.url, path, body)
    chunks = await post(server.url, path, body | {"stream": True})
    for i, c in enumerate(whole["choices"]):
        parts = [ch["logprobs"] for chunk in chunks for ch in chunk["choices"]
                 if ch["index"] == i and ch["logprobs"] is not None]
        if chat:     # the second request reuses the first's prompt blocks: the same values to float rounding
            assert rounded([e for p in parts for e in p["content"]]) == rounded(c["logprobs"]["content"])
            assert len(c["logprobs"]["content"]) == 9
            continue
        lp = c["logprobs"]
        assert {k: [x for p in parts for x in p[k]] for k in lp} == lp
        n = len(lp["tokens"])
        assert n == 9 + echo * len(c["prompt_token_ids"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(n)]
        assert "".join(ch["text"] for chunk in chunks for ch in chunk["choices"] if ch["index"] == i) == c["text"]
        assert c["text"].startswith("Once upon a time") == echo
        for tok, top, v in zip(lp["tokens"][echo:], lp["top_logprobs"][echo:], lp["token_logprobs"][echo:]):
            assert top[tok] == v and 2 <= len(top) <= 3 and max(top.values()) >= v


def test_completion_logprobs_match_hf(server, client, tiny_chat_model):
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    r = client.completions.create(model=server.model, prompt="The sky is", max_tokens=6, temperature=0,
                                  logprobs=4, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.model_dump()["choices"][0]
    ref = hf_logprobs(tiny_chat_model, c["prompt_token_ids"], c["token_ids"])
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in c["token_ids"]]
    assert lp.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(c["token_ids"])], abs=2e-4)
    for i, top in enumerate(lp.top_logprobs):
        v, ids = torch.topk(ref[i], 4)
        assert top == pytest.approx({tok.decode([t]): x for t, x in zip(ids.tolist(), v.tolist())}, abs=2e-4)


def test_echo_scores_the_prompt_as_hf_does(server, client, tiny_chat_model):
    """``echo`` with ``logprobs`` (how eval harnesses score a text): the prompt's text and tokens
    come first, the first token unscored, every other one with HF's log probability."""
    prompt = "The capital of France is Paris"
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}).model_dump()
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.model_dump()["choices"][0]
    pids, oids = c["prompt_token_ids"], c["token_ids"]
    assert c["text"] == prompt + plain["choices"][0]["text"]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(pids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(tiny_chat_model, pids[:1], pids[1:] + oids)
    want = [ref[i, t].item() for i, t in enumerate(pids[1:] + oids)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    assert lp.text_offset[len(pids)] == sum(len(t) for t in lp.tokens[:len(pids)])
    ids_prompt = client.completions.create(model=server.model, prompt=pids, max_tokens=2, echo=True,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert ids_prompt.choices[0].text.startswith(prompt) and ids_prompt.choices[0].logprobs is None
    one = client.completions.create(model=server.model, prompt=pids[:1], max_tokens=2, echo=True, logprobs=0,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert one.choices[0].logprobs.token_logprobs[0] is None and len(one.choices[0].logprobs.tokens) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, tiny_chat_model, stream):
    """What lm-evaluation-harness's local-completions sends to score texts (echo, max_tokens 0,
    logprobs 1): each prompt comes back alone, its text and HF's log probabilities (the first
    null), with no generated token (finish_reason "length", as vLLM answers; usage counts no
    completion token, where vLLM counts the one it ran). Without echo, max_tokens 0 asks for
    nothing and is refused, as vLLM refuses it."""
    import asyncio
    from transformers import AutoTokenizer
    from tests.server.conftest import call
    from tests.server.test_token_ids import post
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    prompts = ["The capital of France is Paris", "Once upon a time"]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0, "stream": stream}
    got = asyncio.run(post(server.url, "/v1/completions", body | (
        {"stream_options": {"include_usage": True}} if stream else {})))
    if stream:                  # each choice's chunks put together
        usage, parts = got[-1]["usage"], [[c["choices"][0] for c in got if c["choices"] and
                                           c["choices"][0]["index"] == i] for i in range(2)]
        choices = [{"text": "".join(p["text"] for p in ps), "finish_reason": ps[-1]["finish_reason"],
                    "logprobs": {k: [x for p in ps if p["logprobs"] for x in p["logprobs"][k]]
                                 for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}}
                   for ps in parts]
    else:
        usage, choices = got["usage"], got["choices"]
    pids = [tok(p)["input_ids"] for p in prompts]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == sum(map(len, pids)), usage
    for prompt, ids, c in zip(prompts, pids, choices):
        lp = c["logprobs"]
        assert c["text"] == prompt and c["finish_reason"] == "length"
        assert lp["tokens"] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
        ref = hf_logprobs(tiny_chat_model, ids[:1], ids[1:])
        want = [ref[i, t].item() for i, t in enumerate(ids[1:])]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=2e-4)
        assert lp["top_logprobs"][0] is None and all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    for refused in ({"prompt": "Hi", "max_tokens": 0}, {"prompt": "Hi", "max_tokens": 0, "echo": True,
                                                        "use_beam_search": True, "n": 2}):
        status, err = call(server, "POST", "/v1/completions", refused)
        assert status == 400 and err["error"]["param"] == "max_tokens", err
    status, err = call(server, "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})
    assert status == 400 and err["error"]["param"] == "max_tokens", err


@pytest.mark.parametrize("text", ["naïve café 東京 🙂 — ok", "\u00e9\u0301 ẞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"])
def test_token_bytes_put_characters_back_together(tiny_chat_model, text):
    """Characters split over several tokens: each token alone decodes to U+FFFD, but the tokens'
    bytes joined are the text's own UTF-8."""
    from transformers import AutoTokenizer
    from tandem.server.logprobs import TokenText
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    ids = tok(text)["input_ids"]
    text_of = TokenText(tok)
    assert any("\ufffd" in text_of(t)[0] for t in ids), "meant to split a character"
    assert b"".join(bytes(text_of(t)[1]) for t in ids) == text.encode()


def hf_pieces(tok, ids: list[int], text: str) -> tuple[list[str], list[str]]:
    """What each token adds to ``text`` (the sequence's whole text), from HF's decode of each prefix,
    as vLLM shows them: nothing while the prefix's text ends inside a character, then all that was
    held back; the last token adds what is left of ``text``. Also the text released before each."""
    pieces, before, done = [], [], ""
    for i in range(len(ids)):
        before.append(done)
        decoded = tok.decode(ids[:i + 1], skip_special_tokens=False)
        pieces.append("" if decoded.endswith("\ufffd") else decoded[len(done):])
        done = done if decoded.endswith("\ufffd") else decoded
    pieces[-1] += text[len(done):]
    return pieces, before


def check_pieces(tok, ids: list[int], lp: dict, text: str, dists: list, k: int, start: int = 0) -> None:
    """A completion's ``logprobs`` for ``ids`` (from ``start`` on): each token is what it adds to
    ``text`` (they join to it, each offset indexes its piece), and the ``k`` likeliest of each
    position's distribution in ``dists`` (HF's log probabilities, None where there is none) are
    each what it would have added in its place, or ``bytes:`` and its own bytes where it too would
    end inside a character."""
    pieces, before = hf_pieces(tok, ids, text)
    n = len(ids)
    tokens, offsets = lp["tokens"][start:start + n], lp["text_offset"][start:start + n]
    assert tokens == pieces and "".join(tokens) == text
    for i, (piece, at) in enumerate(zip(tokens, offsets)):
        assert at == offsets[0] + len("".join(tokens[:i]))
        assert text[at - offsets[0]:at - offsets[0] + len(piece)] == piece
    for i, (top, dist) in enumerate(zip(lp["top_logprobs"][start:start + n], dists)):
        if dist is None:
            assert top is None
            continue
        values, alts = torch.topk(dist, k)
        want = {pieces[i]: dist[ids[i]].item()}
        for a, v in zip(alts.tolist(), values.tolist()):
            if a != ids[i]:
                decoded = tok.decode(ids[:i] + [a], skip_special_tokens=False)
                key = "bytes:" + raw_bytes(tok, a).decode("utf-8", "backslashreplace") \
                    if decoded.endswith("\ufffd") else decoded[len(before[i]):]
                want[key] = v
        assert top == pytest.approx(want, abs=2e-4), i


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprob_tokens_are_what_each_adds_to_the_text(server, tiny_chat_model, stream):
    """Tokens that split a character: each logprob token is the text it adds (nothing for part of
    a character, the whole character on the token that completes it), as vLLM shows them, so the
    tokens join to the text and each text offset indexes its token's piece; so for an echoed
    prompt of token ids, whose text is the ids' decode."""
    import asyncio
    from transformers import AutoTokenizer
    from tests.server.test_token_ids import post
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    split = tok(SPLIT_TEXT)["input_ids"]
    assert sum("\ufffd" in tok.decode([t]) for t in split) >= 6, "meant to split characters"
    prompt = tok(" 猫 😁")["input_ids"]
    body = {"prompt": prompt, "max_tokens": 14, "temperature": 0, "ignore_eos": True, "logprobs": 3,
            "echo": True, "allowed_token_ids": sorted(set(split)), "return_token_ids": True, "stream": stream}
    got = asyncio.run(post(server.url, "/v1/completions", body))
    if stream:
        parts = [c["choices"][0] for c in got if c["choices"]]
        text = "".join(c["text"] for c in parts)
        ids = [t for c in parts for t in c.get("token_ids") or []]
        lp = {k: [x for c in parts if c["logprobs"] for x in c["logprobs"][k]] for k in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        c = got["choices"][0]
        text, ids, lp = c["text"], c["token_ids"], c["logprobs"]
    assert any("\ufffd" in tok.decode([t]) for t in ids), "meant to split a character"
    echo = tok.decode(prompt)
    assert text == echo + hf_whole(tok, ids)
    ref = hf_logprobs(tiny_chat_model, prompt[:1], prompt[1:] + ids)
    check_pieces(tok, prompt, lp, echo, [None, *ref[:len(prompt) - 1]], 3)
    check_pieces(tok, ids, lp, text[len(echo):], list(ref[len(prompt) - 1:]), 3, start=len(prompt))
    assert lp["text_offset"][len(prompt)] == len(echo)


@pytest.mark.parametrize("stream", [False, True])
def test_a_character_cut_by_max_tokens_is_left_out(server, tiny_chat_model, stream):
    """An output that max_tokens ends inside a character has the text of HF's decode of its ids
    less that character's bytes (vLLM leaves them out too, where the decode shows U+FFFD); the
    space before it stays, and so does a U+FFFD generated as a character. Streamed, the deltas
    join to that text."""
    import asyncio
    from transformers import AutoTokenizer
    from tests.server.test_token_ids import post
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    lead = tok(" 😁")["input_ids"][:-1]             # a space and the emoji's first bytes
    assert tok.decode(lead) == " \ufffd"
    for allowed, want in ((lead, " \ufffd \ufffd "), (tok("\ufffd")["input_ids"], "\ufffd" * 3)):
        for chat in (False, True):
            body = {"max_tokens": 3, "temperature": 0, "allowed_token_ids": allowed, "return_token_ids": True,
                    "stream": stream} | ({"messages": [{"role": "user", "content": "Hi"}]} if chat else
                                         {"prompt": "Hi", "stop": ["never"]})   # a stop string: text tracked
            got = asyncio.run(post(server.url, "/v1/chat/completions" if chat else "/v1/completions", body))
            if stream:
                parts = [c["choices"][0] for c in got if c["choices"]]
                text = "".join((p["delta"].get("content") or "") if chat else p["text"] for p in parts)
                ids = [t for p in parts for t in p.get("token_ids") or []]
            else:
                c = got["choices"][0]
                text, ids = c["message"]["content"] if chat else c["text"], c["token_ids"]
            assert len(ids) == 3 and text == want == hf_whole(tok, ids), (chat, text)


def test_logit_bias_through_the_api(server, client, tiny_chat_model):
    """OpenAI's logit_bias (ids as strings): the reply is HF's greedy one with the bias added;
    a key that is no token id of the model, or not an id at all, is refused naming the field."""
    from tests.engine.test_sampling_vs_hf import hf_biased_greedy
    from tests.server.conftest import call
    kw = dict(model=server.model, prompt="Roses are red", max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = client.completions.create(**kw).model_dump()["choices"][0]
    bias = {plain["token_ids"][0]: -100.0, 500: 5.0}
    got = client.completions.create(**kw, logit_bias={str(t): b for t, b in bias.items()}).model_dump()["choices"][0]
    assert got["token_ids"] == hf_biased_greedy(tiny_chat_model, plain["prompt_token_ids"], bias, 6)
    assert got["token_ids"][0] != plain["token_ids"][0]
    for lb in ({"49152": 1}, {"x1": 1}, {"1": 101}):
        status, out = call(server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": lb, "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == "logit_bias", out


def test_penalties_through_the_api(server, client, tiny_chat_model):
    """OpenAI's presence and frequency penalties (and vLLM's repetition penalty, HF's semantics):
    the reply is HF's greedy one with them applied. Below zero (below one for repetition) they
    favour tokens already seen, which changes this model's reply within a few tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    from tests.engine.test_sampling_vs_hf import hf_biased_greedy
    kw = dict(model=server.model, prompt="Roses are red", max_tokens=12, temperature=0)
    ids = lambda r: r.model_dump()["choices"][0]["token_ids"]  # noqa: E731
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt = plain.model_dump()["choices"][0]["prompt_token_ids"]
    got = client.completions.create(**kw, presence_penalty=-1.5, frequency_penalty=-2,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert ids(got) == hf_biased_greedy(tiny_chat_model, prompt, {}, 12, presence=-1.5, frequency=-2) != ids(plain)
    rep = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "repetition_penalty": 0.3})
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=0.3,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ids(rep) == want != ids(plain)


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: Literal["cat", "dog", "fish"]
    legs: Annotated[int, pydantic.Field(ge=0, le=8)]
    name: Annotated[str, pydantic.Field(max_length=5)]
    indoor: bool


def test_structured_chat_parses_into_the_clients_model(server, client):
    """The openai client's parse(): a pydantic model sent as a strict json_schema response format;
    the reply parses into the model and follows its schema (jsonschema_rs). Streamed, the same
    request sends the same text."""
    msgs = [{"role": "user", "content": "Describe a pet."}]
    r = client.chat.completions.parse(model=server.model, messages=msgs, response_format=Pet, max_tokens=60,
                                      temperature=0)
    choice = r.choices[0]
    assert isinstance(choice.message.parsed, Pet) and choice.finish_reason == "stop"
    assert jsonschema_rs.validator_for(Pet.model_json_schema()).is_valid(json.loads(choice.message.content))
    stream = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=60, temperature=0,
                                            stream=True, response_format={"type": "json_schema", "json_schema": {
                                                "name": "Pet", "schema": Pet.model_json_schema(), "strict": True}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_json_object_and_vllms_json_options(server, client):
    """json_object asks for an object even with a json_schema left in the format (it is not
    followed), in a message shaped as OpenAI's (refusal null); vLLM's JSON options are taken,
    guided_whitespace_pattern with guided_json too."""
    from tests.server.conftest import call
    status, r = call(server, "POST", "/v1/chat/completions", {
        "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "A number?"}],
        "response_format": {"type": "json_object", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
    message = r["choices"][0]["message"]
    assert status == 200 and message["content"].startswith("{"), r
    assert message["refusal"] is None and message["role"] == "assistant"
    shape = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for extra in ({"structured_outputs": {"json": shape, "disable_any_whitespace": True,
                                          "disable_additional_properties": True}},
                  {"guided_json": shape, "guided_whitespace_pattern": "[ ]?"}):
        r = client.completions.create(model=server.model, prompt="JSON:", max_tokens=12, temperature=0,
                                      extra_body=extra)
        assert r.choices[0].text.startswith('{"a"') or r.choices[0].text.startswith('{ "a"'), r.choices[0].text


def test_structured_completions_choice_and_regex(server, client):
    """vLLM's structured_outputs and its older guided_* fields on /v1/completions, sampled with n=3."""
    colors = ["red", "green", "blue"]
    r = client.completions.create(model=server.model, prompt="Pick a color:", max_tokens=10, n=3, temperature=1.0,
                                  seed=3, extra_body={"structured_outputs": {"choice": colors}})
    assert [c.text in colors and c.finish_reason == "stop" for c in r.choices] == [True] * 3
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    r = client.completions.create(model=server.model, prompt="Date:", max_tokens=20, n=3, temperature=1.0, seed=5,
                                  extra_body={"guided_regex": date})
    assert all(re.fullmatch(date, c.text) and c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}]
PARAMS = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS}


def merged_calls(chunks) -> list[tuple[str, str]]:
    """A stream's tool_calls deltas merged by index, as the OpenAI client's users do: (name, arguments)."""
    calls: dict[int, list[str]] = {}
    for t in (t for c in chunks for t in c.choices[0].delta.tool_calls or []):
        if t.index not in calls:
            assert t.id.startswith("call_") and t.function.name, t
            calls[t.index] = [t.function.name, ""]
        calls[t.index][1] += t.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def test_required_and_named_tool_calls(server, client):
    """tool_choice required (one call: parallel_tool_calls false) and a named function: the reply
    is a call to a given tool whose arguments follow its parameters (jsonschema_rs); streamed, the
    same call arrives with its arguments in pieces, as they are written. A named call finishes
    with "stop", as OpenAI's and vLLM's do (the caller chose it), a required one "tool_calls"."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kw = dict(model=server.model, messages=msgs, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=60, temperature=0)
        finish = "stop" if isinstance(choice, dict) else "tool_calls"
        r = client.chat.completions.create(**kw).choices[0]
        assert r.finish_reason == finish and r.message.content is None and len(r.message.tool_calls) == 1
        call = r.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in PARAMS and PARAMS[call.function.name].is_valid(json.loads(call.function.arguments))
        if isinstance(choice, dict):
            assert call.function.name == "add"
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        assert merged_calls(chunks) == [(call.function.name, call.function.arguments)]
        assert sum(1 for c in chunks if c.choices[0].delta.tool_calls) > 1, "the arguments came whole"
        assert chunks[-1].choices[0].finish_reason == finish


def test_stop_strings_and_ids_do_not_cut_a_forced_call(server, client):
    """A required or named call is written whole: a stop string found inside its arguments and
    a stop token id that it writes end text, not the call, which parses as without them."""
    msgs = [{"role": "user", "content": "Add two numbers."}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kw = dict(model=server.model, messages=msgs, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=60, temperature=0)
        whole = client.chat.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
        (call,) = whole.message.tool_calls
        args, ids = call.function.arguments, whole.model_extra["token_ids"]
        for stream in (False, True):
            got = client.chat.completions.create(**kw, stop=[args[1:4]], stream=stream,
                                                 extra_body={"stop_token_ids": ids[2:3]})
            if stream:
                chunks = [c for c in got if c.choices]
                assert merged_calls(chunks) == [(call.function.name, args)]
                assert chunks[-1].choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
            else:
                assert [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls] == \
                    [(call.function.name, args)]
        assert PARAMS[call.function.name].is_valid(json.loads(args))


def test_a_call_cut_off_by_max_tokens_ends_with_length(server, client):
    """A named function's arguments cut off after 3 tokens: the reply is the call begun, its
    arguments unfinished, with finish_reason length (not tool_calls), whole and streamed alike."""
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Add."}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=3, temperature=0)
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "length" and r.message.content is None
    (call,) = r.message.tool_calls
    assert call.function.name == "add" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert merged_calls(chunks) == [("add", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_auto_tool_calls_are_parsed_from_the_reply(server, client):
    """With tool_choice auto the reply's <tool_call> blocks become calls and the rest stays
    content, whole and streamed (the reply forced here by a regular expression)."""
    reply = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Add two numbers."}], tools=TOOLS,
              max_tokens=40, temperature=0, extra_body={"structured_outputs": {"regex": reply}})
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Sure. "
    (call,) = r.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and PARAMS["add"].is_valid(args)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("add", call.function.arguments)]


def test_a_json_format_beside_tools_is_replied_in_or_calls_are_made(server, client):
    """A response format beside tools the model may call, as OpenAI takes both: the reply follows
    the format, or is calls alone. The branch is forced here by a logit bias on the tokens that
    begin each ('{' or '<'); the content is checked with jsonschema_rs, each call against its
    tool's parameters, whole and streamed."""
    fmt = {"type": "object", "additionalProperties": False, "required": ["answer"],
           "properties": {"answer": {"enum": ["yes", "no"]}}}
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Is it raining in Oslo?"}], tools=TOOLS,
              max_tokens=100, temperature=0, parallel_tool_calls=False,
              response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt}})
    r = client.chat.completions.create(**kw, logit_bias={"107": 100, "39428": 100}).choices[0]     # '{', '{"'
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert jsonschema_rs.validator_for(fmt).is_valid(json.loads(r.message.content)), r.message.content
    kw["logit_bias"] = {"44": 100}                                                                  # '<'
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    (call,) = r.message.tool_calls
    assert PARAMS[call.function.name].is_valid(json.loads(call.function.arguments))
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert merged_calls(chunks) == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_reply_sends_each_call_as_its_block_closes(server, client):
    """Two calls in one reply (forced by a regular expression): streamed with logprobs, so every
    token's text arrives, the first call comes right after the token that closes its block and
    before the second block is written, the second after that; both equal the unstreamed reply's."""
    call = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Add twice."}], tools=TOOLS,
              max_tokens=120, temperature=0, extra_body={"structured_outputs": {"regex": "Sure\\. " + call + call}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 2
    seen, arrived = "", []
    for c in client.chat.completions.create(**kw, stream=True, logprobs=True):
        if not c.choices:
            continue
        seen += "".join(t.token for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else None) or [])
        for t in c.choices[0].delta.tool_calls or []:
            arrived.append((t.index, seen.count("</tool_call>"), t.function.name, t.function.arguments))
    assert seen.count("</tool_call>") == 2, seen
    assert arrived == [(i, i + 1, "add", w.function.arguments) for i, w in enumerate(whole.message.tool_calls)]


def test_tools_and_earlier_calls_reach_the_prompt(server, client, tiny_chat_model):
    """The tools are listed in the system turn, an earlier call is written back in the assistant's
    turn and its result in a <tool_response> (read back from the prompt's ids with the model's
    tokenizer); with tool_choice none the tools are not shown."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "minus 3 and snow"}]

    def prompt(**kw):
        r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, temperature=0,
                                           extra_body={"return_token_ids": True}, **kw)
        return tok.decode(r.model_extra["prompt_token_ids"])
    shown = prompt(tools=TOOLS)
    assert json.dumps(TOOLS[1]) in shown and "The weather in a city" in shown
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>' in shown
    assert "<tool_response>\nminus 3 and snow\n</tool_response>" in shown
    hidden = prompt(tools=TOOLS, tool_choice="none")
    assert "The weather in a city" not in hidden and "<tool_response>\nminus 3 and snow" in hidden


def test_a_shared_system_prompt_is_reported_cached(server, client, tiny_chat_model):
    """The second chat with the same long system message reuses its blocks: usage says how many
    prompt tokens were cached (whole 16-token blocks of what the two templated prompts share,
    short of the last token), streamed or not, and /metrics counts them."""
    from transformers import AutoTokenizer
    from tests.server.test_load import metric
    from tests.server.test_tandem_server import scrape
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    system = {"role": "system", "content": "You answer questions about the weather on the islands of the "
                                           "Hebrides, politely, in one short sentence, citing no sources. " * 3}
    asks = [[system, {"role": "user", "content": q}] for q in ("Is it windy on Lewis?", "Is it raining on Skye?")]
    ids = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for m in asks]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared >= 48

    def hits() -> float:
        return metric(scrape(server), "vllm:prefix_cache_hits_total")

    def ask(messages, **kw):
        return client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                              temperature=0, **kw)
    assert ask(asks[0]).usage.prompt_tokens_details.cached_tokens == 0
    before = hits()
    second = ask(asks[1])
    assert second.usage.prompt_tokens == len(ids[1])
    assert second.usage.prompt_tokens_details.cached_tokens == shared // 16 * 16
    assert hits() - before == shared // 16 * 16
    chunks = list(ask(asks[1], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids[1]) - 1) // 16 * 16


def test_a_cache_salt_keeps_prompt_blocks_to_requests_with_the_same_salt(server, client):
    """vLLM's cache_salt: the same prompt under another salt, or under none, computes every token;
    under the same salt it reuses the whole 16-token blocks, short of its last token. An empty
    salt is refused, naming the field."""
    prompt = "Salted prompt blocks are shared only by requests that carry the same salt, " * 4

    def cached(**salt) -> int:
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body=salt)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    n, first = cached(cache_salt="tenant-a")
    assert n > 48 and first == 0
    assert cached(cache_salt="tenant-b") == (n, 0)
    assert cached(cache_salt="tenant-a") == (n, (n - 1) // 16 * 16)
    assert cached() == (n, 0)                   # no salt: its own chain
    assert cached() == (n, (n - 1) // 16 * 16)
    with pytest.raises(openai.BadRequestError) as e:
        cached(cache_salt="")
    assert e.value.body["param"] == "cache_salt"


PREFILLED = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]


@pytest.mark.parametrize("options", [{"add_generation_prompt": False, "continue_final_message": True},
                                     {"add_generation_prompt": False}])
def test_a_chat_rendered_with_vllms_template_options(server, client, tiny_chat_model, options):
    """continue_final_message leaves the assistant's last message open, so the reply continues it
    (a "prefilled" reply); add_generation_prompt false opens no new turn. The prompt's ids are
    HF's chat template rendered with the same options, and the greedy reply HF's continuation;
    /tokenize counts the same prompt."""
    from transformers import AutoTokenizer
    from tests.conftest import hf_greedy
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    want = tok(tok.apply_chat_template(PREFILLED, tokenize=False, **options), add_special_tokens=False)["input_ids"]
    assert want != tok(tok.apply_chat_template(PREFILLED, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    r = client.chat.completions.create(model=server.model, messages=PREFILLED, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True, **options})
    assert r.model_extra["prompt_token_ids"] == want
    assert r.choices[0].model_extra["token_ids"] == hf_greedy(tiny_chat_model, [want], 6)[0]
    import urllib.request
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"messages": PREFILLED, **options}).encode(),
                                 headers={**server.headers(), "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as f:
        assert json.loads(f.read())["tokens"] == want


@pytest.mark.parametrize("messages, options", [
    (PREFILLED, {"continue_final_message": True}),                  # with add_generation_prompt (default true)
    (PREFILLED[:1], {"add_generation_prompt": False, "continue_final_message": True}),   # no assistant message
])
def test_template_options_that_cannot_hold_are_refused(server, client, messages, options):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2, extra_body=options)
    assert e.value.param == "continue_final_message", e.value.message


def test_tokenize_spells_the_tokens_and_load_counts_requests(server, tiny_chat_model):
    """vLLM's return_token_strs: HF's own spelling of each token; vLLM's /load, open as /health
    is: the requests in flight (none between tests)."""
    from transformers import AutoTokenizer
    from tests.server.conftest import call
    status, out = call(server, "POST", "/tokenize", {"prompt": "Hello wide world", "return_token_strs": True})
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert status == 200 and out["tokens"] == tok("Hello wide world")["input_ids"]
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    assert "token_strs" not in call(server, "POST", "/tokenize", {"prompt": "Hello"})[1]
    assert call(server, "GET", "/load", headers={}) == (200, {"server_load": 0})
    import urllib.request
    req = urllib.request.Request(server.url + "/v1/completions", headers={**server.headers(), "Content-Type":
                                 "application/json"}, data=json.dumps({"prompt": "Hi", "max_tokens": 200,
                                                                       "stream": True, "ignore_eos": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")          # under way
        assert call(server, "GET", "/load", headers={}) == (200, {"server_load": 1})
        stream.read()


def test_an_assistants_refusal_part_is_its_text_in_the_prompt(server, client, tiny_chat_model):
    """OpenAI's assistant content parts may be refusals: in the prompt they read as their text,
    parts joined by newlines as vLLM joins text parts (HF's template over the joined string);
    the chat is served."""
    from transformers import AutoTokenizer
    from tests.server.conftest import call
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    parts = [{"type": "refusal", "refusal": "I can't help with that."}, {"type": "text", "text": "Ask me another."}]
    chat = [{"role": "user", "content": "Pick a lock."}, {"role": "assistant", "content": parts},
            {"role": "user", "content": "Then tell me a joke."}]
    joined = chat[:1] + [{"role": "assistant", "content": "I can't help with that.\nAsk me another."}] + chat[2:]
    want = tok(tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    status, out = call(server, "POST", "/tokenize", {"messages": chat})
    assert status == 200 and out["tokens"] == want
    r = client.chat.completions.create(model=server.model, messages=chat, max_tokens=2)
    assert r.usage.prompt_tokens == len(want)
    image = {"type": "image_url", "image_url": {"url": "http://x"}}        # an image part says the model reads text
    status, out = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]})
    assert status == 400 and out["error"]["message"].endswith(
        "'messages[0].content[0].type' is image_url, but the model served here reads text only: it must be one of "
        "text, refusal")
    status, out = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "txt", "text": "x"}]}]})                    # a mistyped part: what is accepted
    assert status == 400 and out["error"]["message"].endswith("'messages[0].content[0].type' must be one of text, "
                                                              "refusal")


def test_tokenize_counts_a_chat_with_its_tools_as_the_chat_is_served(server, client):
    """The tools are listed in the prompt's system turn: /tokenize counts them as the chat's usage
    does, and with tool_choice none it leaves them out, as the chat does."""
    import urllib.request
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=1).usage.prompt_tokens
    for choice in ("auto", "none"):
        chat = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, tools=TOOLS,
                                              tool_choice=choice)
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": choice}
        req = urllib.request.Request(server.url + "/tokenize", data=json.dumps(body).encode(),
                                     headers={**server.headers(), "Content-Type": "application/json"})
        with urllib.request.urlopen(req) as f:
            counted = json.loads(f.read())["count"]
        assert counted == chat.usage.prompt_tokens and (counted > plain if choice == "auto" else counted == plain)


def test_stop_reason_names_what_stopped_a_choice_and_a_stop_string_may_stay(server, client, tiny_chat_model):
    """vLLM's stop_reason: the stop string (or stop token id) that ended a choice, None for one cut
    off by max_tokens; include_stop_str_in_output keeps the string at the text's end. The texts
    are HF's greedy text cut at the string's first occurrence, whole and streamed alike."""
    want = hf_texts(tiny_chat_model, ["Once upon a time"], 12)[0]
    stop = want[4:7]
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0)
    for keep in (False, True):
        extra = {"ignore_eos": True, "include_stop_str_in_output": keep, "return_token_ids": True}
        r = client.completions.create(**kw, stop=[stop, "never-written"], extra_body=extra).choices[0]
        cut = want[:want.index(stop) + (len(stop) if keep else 0)]
        assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (cut, "stop", stop)
        chunks = list(client.completions.create(**kw, stop=[stop], stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (want, "length", None)
    ids = r.model_extra["token_ids"]
    at = ids[5]
    first = ids.index(at)
    # as in vLLM, the stop token's id is output, its text only with include_stop_str_in_output
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    for keep in (False, True):
        extra = {"ignore_eos": True, "stop_token_ids": [at], "return_token_ids": True,
                 "include_stop_str_in_output": keep}
        text = tok.decode(ids[:first + keep], skip_special_tokens=True)
        r = client.completions.create(**kw, extra_body=extra).choices[0]
        assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (text, "stop", at)
        assert r.model_extra["token_ids"] == ids[:first + 1]
        chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks) == text
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    said = chat.choices[0].message.content
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=12, temperature=0, stop=[said[3:6]],
                                          extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    c = chat.choices[0]
    assert (c.message.content, c.model_extra["stop_reason"]) == (said[:said.index(said[3:6]) + 3], said[3:6])


def test_prompt_logprobs_are_hfs_with_their_ranks(server, client, tiny_chat_model):
    """vLLM's prompt_logprobs: per prompt token after the first, the token's HF log probability
    and rank (the tokens at least as likely), and the k likeliest with ranks 1..k; a completion's
    in each choice, a chat's beside its choices; computed whole, so a prompt cached by an earlier
    request is scored the same; refused with stream=true, as vLLM does."""
    prompt = "The capital of France is Paris, and the capital of Spain is Madrid."
    kw = dict(model=server.model, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(**kw)                       # its blocks are now in the prefix cache
    r = client.completions.create(**kw, extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    c = r.choices[0].model_extra
    ids, got = c["prompt_token_ids"], c["prompt_logprobs"]
    ref = hf_logprobs(tiny_chat_model, ids[:1], ids[1:])
    assert len(got) == len(ids) and got[0] is None
    for p, (tid, at) in enumerate(zip(ids[1:], got[1:])):
        row = ref[p]
        top = row.topk(2).indices.tolist()
        assert list(at)[0] == str(tid) and set(at) == {str(tid), *map(str, top)}
        assert at[str(tid)]["logprob"] == pytest.approx(row[tid].item(), abs=2e-4)
        assert at[str(tid)]["rank"] == int((row >= row[tid] - 1e-6).sum()), p
        assert [at[str(t)]["rank"] for t in top if t != tid] == [i + 1 for i, t in enumerate(top) if t != tid]
    assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens == 0
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == len(chat.model_extra["prompt_token_ids"]) and scored[0] is None
    assert all(len(at) == 1 for at in scored[1:])
    both = client.completions.create(**kw, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3}).choices[0]
    assert all(len(t) <= 2 for t in both.logprobs.top_logprobs[1:])      # echo: its own 1 (and the token)
    assert all(len(at) >= 3 for at in both.model_extra["prompt_logprobs"][1:])
    assert both.logprobs.token_logprobs[1:len(ids)] == [got[p][str(t)]["logprob"] for p, t in enumerate(ids) if p]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_show_the_character_a_split_token_completes(server, client, tiny_chat_model):
    """A prompt token holding part of a character shows in prompt_logprobs the character where it
    completes one and "" where not (vLLM's correction): the tokens' texts after the first join to
    HF's decode of them, and no entry ends in U+FFFD."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    r = client.completions.create(model=server.model, prompt=SPLIT_PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 3, "return_token_ids": True})
    c = r.choices[0].model_extra
    ids, got = c["prompt_token_ids"], c["prompt_logprobs"]
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids), "the prompt must split characters"
    assert "".join(at[str(t)]["decoded_token"] for t, at in zip(ids[1:], got[1:])) == tok.decode(ids[1:])
    assert not any(e["decoded_token"].endswith("\ufffd") for at in got[1:] for e in at.values())
    c = client.completions.create(model=server.model, prompt="猫 and 😁", max_tokens=1,
                                  extra_body={"prompt_logprobs": 0}).choices[0].model_extra
    # by hand: the first token (part of 猫) is no context, so the third completes nothing after the second
    assert [next(iter(at.values()))["decoded_token"] for at in c["prompt_logprobs"][1:]] == ["", "", " and", "", " 😁"]


def test_text_parts_of_a_message_are_joined_by_newlines_as_vllm_does(server, client, tiny_chat_model):
    """A message's content parts become one text with a newline between parts (vLLM's joining),
    so a prompt split into parts is the prompt HF's chat template renders from the joined text."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    joined = [{"role": "user", "content": "Say\nhi"}]
    want = tok(tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    r = client.chat.completions.create(model=server.model, messages=parts, max_tokens=1,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == want


def test_vllms_ping_and_version_answer_without_a_key(server):
    """Load balancers probe vLLM's /ping (GET or POST); /version names the installed package's."""
    import urllib.request
    from importlib.metadata import version
    for method in ("GET", "POST"):
        with urllib.request.urlopen(urllib.request.Request(server.url + "/ping", method=method, data=None
                                                           if method == "GET" else b""), timeout=10) as r:
            assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})
    with urllib.request.urlopen(server.url + "/version", timeout=10) as r:
        assert json.loads(r.read()) == {"version": version("tandem")}


def test_min_p_of_one_keeps_only_the_likeliest_token(server, client, tiny_chat_model):
    """vLLM's min_p drops every token less likely than min_p times the likeliest: at 1 only the
    likeliest is left, so sampling at temperature 1 gives HF's greedy text (the tiny model's
    flat distribution makes 12 sampled tokens that match it by chance all but impossible)."""
    want = hf_texts(tiny_chat_model, ["Once upon a time"], 12)[0]
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text != want, "the case needs a flat distribution"
    kw["extra_body"] |= {"min_p": 1.0}
    assert client.completions.create(**kw).choices[0].text == want


def test_chat_template_kwargs_reach_the_template(tiny_chat_model):
    """vLLM's chat_template_kwargs are variables of the template: a template that reads one renders
    it (the rendering written out by hand), its own arguments cannot be set through them."""
    from transformers import AutoTokenizer
    from tandem.sched.llm import ChatTemplate
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                         "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate().render(tok, msgs) == "<user>Hi<assistant>"
    off = ChatTemplate(kwargs={"enable_thinking": False})
    off.check(msgs)
    assert off.render(tok, msgs) == "/no_think <user>Hi<assistant>"
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize'"):
        ChatTemplate(kwargs={"tokenize": True}).check(msgs)


def test_chat_template_kwargs_are_accepted_over_http(server, client, tiny_chat_model):
    """SmolLM2's template reads no such variable: the prompt is the one rendered without it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    msgs = [{"role": "user", "content": "Hi"}]
    want = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, extra_body={
        "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.model_extra["prompt_token_ids"] == want


def test_truncate_prompt_tokens_over_http(server, client, tiny_chat_model):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what is computed and counted,
    in a completion and in a chat (whose rendered prompt loses its start)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    ids = tok("The capital of France is")["input_ids"]
    r = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == hf_texts(tiny_chat_model, [ids[-3:]], 8)[0]
    msgs = [{"role": "user", "content": "Hi there"}]
    chat_ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, extra_body={
        "return_token_ids": True, "truncate_prompt_tokens": 4})
    assert r.model_extra["prompt_token_ids"] == chat_ids[-4:] and r.usage.prompt_tokens == 4
    # -1: a prompt past the context keeps the ids that leave room for max_tokens
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    long_ids = [(37 * i) % 1000 + 100 for i in range(ctx + 20)]
    r = client.completions.create(model=server.model, prompt=long_ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == ctx - 5
    assert r.choices[0].text == hf_texts(tiny_chat_model, [long_ids[5 - ctx:]], 5)[0]


def test_bad_words_over_http(server, client, tiny_chat_model):
    """A word of the greedy reply, banned: the reply is HF's with its spellings' tokens banned."""
    from transformers import AutoTokenizer
    from tests.conftest import hf_greedy
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    ids = tok("Once upon a time")["input_ids"]
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    plain_ids = plain.choices[0].model_extra["token_ids"]
    word = tok.decode(plain_ids[3:4])
    banned = [tok(w, add_special_tokens=False)["input_ids"] for w in (word.lstrip(), " " + word.lstrip())]
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                    "bad_words": [word]})
    got = r.choices[0].model_extra["token_ids"]
    assert got == hf_greedy(tiny_chat_model, [ids], 12, bad_words_ids=banned)[0] != plain_ids


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_kept_when_asked(server, client, tiny_chat_model, stream):
    """skip_special_tokens false: the text of special tokens (forced here by allowed_token_ids)
    is HF's tokenizer's with them kept, whole and streamed; by default it is left out."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    allowed = [tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<file_sep>"),
               tok(" hello", add_special_tokens=False)["input_ids"][0]]
    texts = {}
    for skip in (True, False):
        kw = dict(model=server.model, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=4,
                  extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed,
                              "skip_special_tokens": skip})
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
            text, ids = "".join(c.text for c in chunks), [t for c in chunks for t in c.model_extra["token_ids"]]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, ids = choice.text, choice.model_extra["token_ids"]
        assert set(ids) <= set(allowed) and set(allowed[:2]) & set(ids)
        texts[skip] = text
        assert text == tok.decode(ids, skip_special_tokens=skip)
    assert texts[False] != texts[True]


def test_vllms_per_request_histograms(server, client):
    """vLLM's per-request histograms, read with Prometheus' own parser: their counts and sums move
    by what the responses say was served (tokens and max_tokens once per choice, as vLLM's engine
    counts each of n; n once per request), and each phase is observed once per choice (their
    times are checked on hand-made timestamps in test_step_metrics)."""
    from prometheus_client.parser import text_string_to_metric_families
    from tests.server.test_tandem_server import scrape
    names = ("prompt_tokens", "generation_tokens", "params_n", "params_max_tokens", "prefill_time_seconds",
             "decode_time_seconds", "inference_time_seconds", "time_per_output_token_seconds")

    def totals() -> dict:
        out = {}
        for fam in text_string_to_metric_families(scrape(server)):
            for s in fam.samples:
                if s.name.endswith(("_count", "_sum")) and s.name.startswith("vllm:request_"):
                    key = s.name.removeprefix("vllm:request_")
                    out[key] = out.get(key, 0.0) + s.value
        return out
    before, usage = totals(), []
    for n, max_tokens in ((1, 5), (3, 7)):
        r = client.completions.create(model=server.model, prompt="Count the hens", max_tokens=max_tokens, n=n,
                                      temperature=0.7, seed=1, extra_body={"ignore_eos": True})
        usage.append((n, max_tokens, r.usage))
    after = totals()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert all(d[f"{k}_count"] == (2 if k == "params_n" else 4) for k in names), d
    assert d["prompt_tokens_sum"] == sum(n * u.prompt_tokens for n, _, u in usage)     # each choice's
    assert d["generation_tokens_sum"] == sum(u.completion_tokens for _, _, u in usage) == 5 + 3 * 7
    assert d["params_n_sum"] == 1 + 3 and d["params_max_tokens_sum"] == 5 + 3 * 7     # n: once per request


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
RAG = ("{% for d in documents %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>\n{% endfor %}"
       "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
       "assistant:{% endif %}")


def test_a_chat_template_given_to_the_server_and_one_a_request_brings(tiny_chat_model, tmp_path):
    """--chat-template (a file) renders every chat instead of the model's; with
    --trust-request-chat-template a request's own template (here reading vLLM's documents)
    renders that request. Each prompt is the tokenizer's ids of the rendering written out by
    hand; a request template that does not compile, renders nothing, fails in the sandbox or runs
    past its time is refused naming chat_template, and the server goes on serving."""
    from transformers import AutoTokenizer
    from tests.server.conftest import call, start_server, stop_server
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    # each rendering's limit cut from 10 s to 3 (the template past it would run for hours)
    s = start_server(tiny_chat_model, tmp_path, "--chat-template", str(path), "--trust-request-chat-template",
                     inject="import tandem.sched.llm as m\nm.TEMPLATE_SECONDS = 3.0")
    try:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

        def prompt_ids(**extra):
            code, r = call(s, "POST", "/v1/chat/completions", {"model": s.model, "messages": msgs, "max_tokens": 1,
                                                               "return_token_ids": True, **extra})
            assert code == 200, r
            return r["prompt_token_ids"]
        assert prompt_ids() == tok("[system] Be brief.\n[user] Hi\n[assistant] ", add_special_tokens=False)["input_ids"]
        docs = [{"title": "Lewis", "text": "windy"}, {"title": "Skye", "text": "wet"}]
        want = tok("<doc Lewis>windy</doc>\n<doc Skye>wet</doc>\nsystem: Be brief.\nuser: Hi\nassistant:",
                   add_special_tokens=False)["input_ids"]
        assert prompt_ids(chat_template=RAG, documents=docs) == want
        assert call(s, "POST", "/tokenize", {"messages": msgs, "chat_template": RAG, "documents": docs})[1]["tokens"] \
            == want
        for bad in ("{% for m in messages %}",                      # does not compile
                    "{% if false %}x{% endif %}",                   # renders nothing
                    "{% for i in range(10 ** 9) %}{% endfor %}x",   # the sandbox's range limit
                    # 10^10 loop turns: stopped after its time (rendered in a child process)
                    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"):
            code, r = call(s, "POST", "/v1/chat/completions", {"model": s.model, "messages": msgs,
                                                               "chat_template": bad})
            assert code == 400 and r["error"]["param"] == "chat_template", (bad, r)
        # a rendering past what the context can hold is refused by its characters, before tokenizing
        code, r = call(s, "POST", "/v1/chat/completions", {"model": s.model, "messages": msgs,
                                                           "chat_template": "{{ 'a' * 2000000 }}"})
        assert code == 400 and r["error"]["code"] == "context_length_exceeded" and "characters" in r["error"]["message"]
        assert call(s, "POST", "/v1/completions", {"model": s.model, "prompt": "a", "max_tokens": 2})[0] == 200
    finally:
        assert stop_server(s) == 0


def test_chat_templates_in_process(tiny_chat_model, tmp_path):
    """The same in LLM: its chat_template replaces the model's, LLM.chat's renders one call; a
    model without a template says how to give one; a string that is neither a file nor a template
    is refused naming the argument."""
    from tandem import LLM, SamplingParams
    from tandem.sched.llm import ChatTemplate, template_text
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    msgs = [{"role": "user", "content": "Hi"}]
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", chat_template=TEMPLATE, threads_per_worker=1) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0)
        assert llm.chat(msgs, sp)[0].prompt_token_ids == tok("[user] Hi\n[assistant] ",
                                                             add_special_tokens=False)["input_ids"]
        out = llm.chat(msgs, sp, chat_template=RAG, documents=[{"title": "T", "text": "x"}])[0]
        want = tok("<doc T>x</doc>\nuser: Hi\nassistant:", add_special_tokens=False)["input_ids"]
        assert out.prompt_token_ids == want
    tok.chat_template = None
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        ChatTemplate().render(tok, msgs)
    with pytest.raises(ValueError, match="^chat_template: 'chat.jinja' is neither a file nor a Jinja template"):
        template_text("chat.jinja")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert template_text(str(tmp_path / "t.jinja")) == TEMPLATE == template_text(TEMPLATE)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chats_echo_begins_the_reply_with_the_message_it_continues(server, client, stream):
    """vLLM's chat echo: a reply continuing the assistant's last message (continue_final_message)
    begins with that message's text, whole and streamed; where a new assistant turn is opened
    after a user's message, nothing is echoed."""
    def content(messages, **extra) -> str:
        kw = dict(model=server.model, messages=messages, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True, **extra})
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    reply = content(PREFILLED, **cont)
    assert content(PREFILLED, echo=True, **cont) == "My favourite fruit is" + reply
    assert content(PREFILLED[:1], echo=True) == content(PREFILLED[:1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_without_an_opened_turn_has_the_last_messages_role(server, client, stream):
    """As vLLM: with add_generation_prompt false the reply goes on in the last message's turn, and
    its role is that message's (a user's here); with the assistant's turn opened, "assistant"."""
    for opened, role in ((False, "user"), (True, "assistant")):
        kw = dict(model=server.model, messages=PREFILLED[:1], max_tokens=3, temperature=0,
                  extra_body={"add_generation_prompt": opened})
        if stream:
            got = [c.choices[0].delta.role for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices and c.choices[0].delta.role]
            assert got == [role]
        else:
            assert client.chat.completions.create(**kw).choices[0].message.role == role


def test_return_tokens_as_token_ids_names_each_logprob_token_by_id(server, client):
    """vLLM's return_tokens_as_token_ids: every token in the log probabilities (sampled and
    alternatives, chat and completion) reads "token_id:<id>", the sampled ones' ids those of
    return_token_ids; the values are those of the same request without it."""
    kw = dict(model=server.model, max_tokens=5, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    for ids_too in (False, True):
        c = client.completions.create(prompt="Once upon", logprobs=2, **kw,
                                      extra_body=extra | {"return_tokens_as_token_ids": ids_too}).choices[0]
        ch = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                            top_logprobs=2, **kw,
                                            extra_body=extra | {"return_tokens_as_token_ids": ids_too}).choices[0]
        if not ids_too:
            plain_c, plain_ch = c, ch
            continue
        want = [f"token_id:{t}" for t in c.model_extra["token_ids"]]
        assert c.logprobs.tokens == want and c.logprobs.token_logprobs == plain_c.logprobs.token_logprobs
        assert [sorted(d.values()) for d in c.logprobs.top_logprobs] == \
            [sorted(d.values()) for d in plain_c.logprobs.top_logprobs]
        assert all(k.startswith("token_id:") for d in c.logprobs.top_logprobs for k in d)
        got = ch.logprobs.content
        assert [e.token for e in got] == [f"token_id:{t}" for t in ch.model_extra["token_ids"]]
        assert [e.bytes for e in got] == [list(e.token.encode()) for e in got]
        assert [e.logprob for e in got] == [e.logprob for e in plain_ch.logprobs.content]


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_completions_are_hfs_beams(server, client, tiny_chat_model, stream):
    """vLLM's use_beam_search, n = 3, for two prompts: each prompt's three choices are HF's three
    best beams, best first, their text HF's tokenizer's of those ids; streamed, each choice's text
    and ids come whole, as vLLM sends a search's result."""
    from transformers import AutoTokenizer
    from tests.engine.test_beam_search import hf_beams, hf_model
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    prompts = ["Once upon a time", "The capital of France is"]
    kw = dict(model=server.model, prompt=prompts, n=3, max_tokens=6, temperature=0,
              extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True,
                          "length_penalty": 0.5})
    if stream:
        got = {}
        for c in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for ch in c.choices:
                text, ids, finish = got.setdefault(ch.index, ("", [], None))
                got[ch.index] = (text + ch.text, ids + (ch.model_extra.get("token_ids") or []),
                                 ch.finish_reason or finish)
            usage = c.usage or None
        choices = [got[i] for i in sorted(got)]
    else:
        r = client.completions.create(**kw)
        usage = r.usage
        choices = [(c.text, c.model_extra["token_ids"], c.finish_reason)
                   for c in sorted(r.choices, key=lambda c: c.index)]
    hf = hf_model(tiny_chat_model)
    assert len(choices) == 6
    for j, p in enumerate(prompts):
        want, _ = hf_beams(hf, tok(p)["input_ids"], 3, 6)
        mine = choices[3 * j:3 * j + 3]
        assert [ids for _, ids, _ in mine] == want
        assert [text for text, _, _ in mine] == [tok.decode(w, skip_special_tokens=True) for w in want]
        assert {f for _, _, f in mine} == {"length"}
    assert usage.completion_tokens == 36


def test_beam_search_log_probabilities_are_hfs(server, client, tiny_chat_model):
    """With logprobs, each beam's tokens carry their log probability under the model and the
    likeliest alternatives, as HF's model gives them after the beam's own earlier tokens; a huge
    length penalty ranks without failing."""
    from transformers import AutoTokenizer
    from tests.engine.test_beam_search import hf_model
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    hf = hf_model(tiny_chat_model)
    prompt = tok("Once upon a time")["input_ids"]
    for penalty in (1.0, 1e6):
        r = client.completions.create(model=server.model, prompt="Once upon a time", n=2, max_tokens=4, temperature=0,
                                      logprobs=3, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                              "return_token_ids": True, "length_penalty": penalty})
        for c in r.choices:
            ids = c.model_extra["token_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0].double(), -1)
            for pos, (t, got, alts) in enumerate(zip(ids, c.logprobs.token_logprobs, c.logprobs.top_logprobs)):
                row = logp[len(prompt) + pos - 1]
                assert got == pytest.approx(row[t].item(), abs=1e-3)
                want = torch.topk(row, 3)
                assert sorted(alts.values(), reverse=True) == pytest.approx(want.values.tolist(), abs=1e-3)
            assert len(c.logprobs.tokens) == len(ids) == 4


def test_a_beam_that_ends_leaves_its_end_token_out(tiny_chat_model, tmp_path):
    """The tiny chat model with its end token moved to the fifth likeliest first token of the
    prompt: a beam that picks it finishes with stop_reason that token, which is in neither its
    text nor (unless include_stop_str_in_output) its token ids, as vLLM answers; HF's forward
    pass gives that token's log probability."""
    import json as _json
    import shutil
    from transformers import AutoTokenizer
    from tests.engine.test_beam_search import hf_model
    from tests.server.conftest import start_server, stop_server
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    prompt = tok("Once upon a time")["input_ids"]
    with torch.no_grad():
        first = torch.log_softmax(hf_model(tiny_chat_model)(torch.tensor([prompt])).logits[0, -1].double(), -1)
    eos = int(torch.topk(first, 5).indices[4])
    d = tmp_path / "eos-model"
    shutil.copytree(tiny_chat_model, d)
    for name in ("config.json", "generation_config.json"):
        if (d / name).exists():
            cfg = _json.loads((d / name).read_text())
            (d / name).write_text(_json.dumps(cfg | {"eos_token_id": eos}))
    srv = start_server(d, tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        for keep in (False, True):
            r = c.completions.create(model=srv.model, prompt="Once upon a time", n=3, max_tokens=5, temperature=0,
                                     logprobs=0, extra_body={"use_beam_search": True, "return_token_ids": True,
                                                             "length_penalty": 0.0, "include_stop_str_in_output": keep})
            ended = [ch for ch in r.choices if ch.finish_reason == "stop"]
            assert [(ch.text, ch.model_extra["stop_reason"]) for ch in ended] == [("", eos)]
            assert ended[0].model_extra["token_ids"] == ([eos] if keep else [])
            if keep:
                assert ended[0].logprobs.token_logprobs == pytest.approx([first[eos].item()], abs=1e-3)
            else:                     # no token, no log probabilities (as any empty output)
                assert ended[0].logprobs is None
            assert r.usage.completion_tokens == sum(len(ch.model_extra["token_ids"]) for ch in r.choices)
    finally:
        stop_server(srv)


def test_beam_search_reports_the_prompt_it_found_cached(server, client):
    """A search of a prompt served before finds its blocks in the prefix cache: its usage says
    how many prompt tokens, as many as a plain completion of that prompt reports."""
    prompt = "The quick brown fox jumps over the lazy dog " * 5
    kw = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    plain = client.completions.create(**kw).usage       # computes the prompt's blocks
    again = client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens
    beams = client.completions.create(**kw, n=2, extra_body={"use_beam_search": True}).usage
    assert again > 0 and beams.prompt_tokens_details.cached_tokens == again
    assert beams.prompt_tokens == plain.prompt_tokens


def test_beam_search_chat_is_hfs_beams(server, client, tiny_chat_model):
    """A chat's beams search from its rendered prompt (HF's own chat template rendering); values
    that ask nothing of sampling are accepted with it."""
    from transformers import AutoTokenizer
    from tests.engine.test_beam_search import hf_beams, hf_model
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=server.model, messages=messages, n=2, max_tokens=5, temperature=0,
                                       top_p=1, logprobs=False, response_format={"type": "text"},
                                       extra_body={"use_beam_search": True, "ignore_eos": True, "top_k": -1,
                                                   "return_token_ids": True})
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    want, _ = hf_beams(hf_model(tiny_chat_model), prompt, 2, 5)
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in got] == want
    assert [c.message.content for c in got] == [tok.decode(w, skip_special_tokens=True) for w in want]
    assert r.usage.completion_tokens == 10


def test_fields_no_endpoint_reads_are_ignored_and_said_once_in_the_log(server, client):
    """As vLLM: a request with a field the endpoint does not take (a typo, another API's option)
    is served, and the log names the field, once for each set of names, at most eight of them."""
    kw = dict(model=server.model, max_tokens=2)
    for _ in range(3):
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw,
                                       extra_body={"foo_bar_field": 1})
    r = client.completions.create(prompt="Hi", **kw, extra_body={"max_token": 5, "zz_typo": True})
    assert r.usage.completion_tokens == 2
    many = {f"field_{i:02d}": i for i in range(12)}
    client.completions.create(prompt="Hi", **kw, extra_body=many)
    lines = [line for line in server.log.read_text().splitlines() if "ignored (not parameters of its endpoint)" in line]
    assert [line.split("endpoint): ")[1] for line in lines if "foo_bar_field" in line] == ["foo_bar_field"]
    assert sum(line.endswith("endpoint): max_token, zz_typo") for line in lines) == 1
    assert sum(line.endswith("field_07, and 4 more") for line in lines) == 1
