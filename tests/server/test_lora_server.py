"""LoRA adapters through the live server: served from the command line and loaded at run time,
named by a request's model as vLLM's are, with the OpenAI client; their tokens against PEFT's."""
from __future__ import annotations

import io
import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from tests.conftest import write_adapter
from tests.server.conftest import API_KEY, hf_texts, start_server, stop_server
from tests.server.test_batches import jsonl, wait_batch

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    return (write_adapter(tiny_chat_model, tmp / "sql", TARGETS, seed=5),
            write_adapter(tiny_chat_model, tmp / "late", ["k_proj", "gate_proj", "up_proj"], r=4, seed=6))


@pytest.fixture(scope="module")
def lora_server(tiny_chat_model, adapters, tmp_path_factory):
    s = start_server(tiny_chat_model, tmp_path_factory.mktemp("lora-srv"), "--lora-modules",
                     f"sql={adapters[0]}", "--allow-runtime-lora-updating")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0)


def _texts(client, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def _post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **server.headers()})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_adapter_is_a_model_requests_name(lora_server, client, tiny_chat_model, adapters):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {lora_server.model, "sql"}
    assert listed["sql"].parent == lora_server.model and listed["sql"].root == str(adapters[0])
    assert client.models.retrieve("sql").parent == lora_server.model
    want = hf_texts(tiny_chat_model, PROMPTS, 8, adapter=adapters[0])
    assert want != hf_texts(tiny_chat_model, PROMPTS, 8)
    assert _texts(client, "sql") == want
    assert _texts(client, lora_server.model) == hf_texts(tiny_chat_model, PROMPTS, 8)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="sql2", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_adapters_load_and_unload_while_serving(lora_server, client, tiny_chat_model, adapters):
    late = str(adapters[1])
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": late}) == (
        200, "Success: LoRA adapter 'late' added successfully.")
    assert _texts(client, "late") == hf_texts(tiny_chat_model, PROMPTS, 8, adapter=adapters[1])
    status, body = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": late})
    assert status == 400 and json.loads(body)["error"]["message"] == "The lora adapter 'late' has already been loaded."
    status, body = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": lora_server.model, "lora_path": late})
    assert status == 400 and "is the served model's name" in json.loads(body)["error"]["message"]
    status, body = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"})
    assert status == 400 and json.loads(body)["error"]["message"] == "LoRA adapter 'x': /no/such/dir: no such directory"
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"}) == (
        200, "Success: LoRA adapter 'late' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    status, body = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_an_adapter_saved_again_and_loaded_again_is_the_new_one(lora_server, client, tiny_chat_model, adapters,
                                                                 tmp_path):
    """Retrained into the same directory, unloaded and loaded again under its name: the new
    weights serve (none of the old ones' cached blocks either), even once the directory is
    gone."""
    swap = tmp_path / "swap"
    shutil.copytree(adapters[1], swap)
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(swap)})[0] == 200
    assert _texts(client, "w") == hf_texts(tiny_chat_model, PROMPTS, 8, adapter=adapters[1])
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "w"})[0] == 200
    shutil.copytree(adapters[0], swap, dirs_exist_ok=True)
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(swap)})[0] == 200
    shutil.rmtree(swap)                 # the server read it when it loaded it: the workers need no files
    assert _texts(client, "w") == hf_texts(tiny_chat_model, PROMPTS, 8, adapter=adapters[0])
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "w"})[0] == 200


def test_an_adapter_not_computed_here_stops_the_command_line(tiny_chat_model, tiny_opt, tmp_path, capsys):
    """A DoRA adapter, and one trained for another model (OPT's module names), stop the command
    line before anything loads."""
    from tandem.server.__main__ import parse_args
    dora = write_adapter(tiny_chat_model, tmp_path / "dora", ["q_proj"], use_dora=True)
    opt = write_adapter(tiny_opt, tmp_path / "opt", ["q_proj", "fc1"])
    for adapter, says in ((dora, "DoRA (use_dora) is not supported"),
                          (opt, "module fc1 is not one of this model's projections")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--model", str(tiny_chat_model), "--lora-modules", f"d={adapter}"])
        assert e.value.code == 2 and f"lora-modules: d: {adapter}: {says}" in capsys.readouterr().err


def test_a_batch_job_runs_on_an_adapter(lora_server, client, tiny_chat_model, adapters):
    rows = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}}
            for model in ("sql", lora_server.model) for i, p in enumerate(PROMPTS)]
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 4, b
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"]
           for o in map(json.loads, client.files.content(b.output_file_id).text.splitlines())}
    assert [got[f"sql-{i}"] for i in range(2)] == hf_texts(tiny_chat_model, PROMPTS, 8, adapter=adapters[0])
    assert [got[f"{lora_server.model}-{i}"] for i in range(2)] == hf_texts(tiny_chat_model, PROMPTS, 8)


def test_the_adapters_in_use_are_shown(lora_server, client):
    """While a request on an adapter runs, /status (what the dashboard shows) lists it with its
    adapter, and /metrics has vLLM's gauge naming the adapter."""
    stream = client.completions.create(model="sql", prompt="Once upon a time", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        status = json.loads(urllib.request.urlopen(lora_server.url + "/status", timeout=30).read())
        listed = [r for d in status["devices"] for r in d["requests"]]
        assert [r["adapter"] for r in listed] == ["sql"]
        assert [d["adapters"] for d in status["devices"]] == [{"running": ["sql"], "waiting": []}]
        metrics = urllib.request.urlopen(lora_server.url + "/metrics", timeout=30).read().decode()
        assert 'vllm:lora_requests_info{running_lora_adapters="sql",waiting_lora_adapters=""}' in metrics
    finally:
        stream.close()


def test_runtime_loading_is_off_unless_asked(server, adapters):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters[0])}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        status, out = _post(server, path, body)
        assert status == 404 and json.loads(out)["error"]["message"].startswith(
            "loading and unloading LoRA adapters while the server runs is off: start it with "
            "--allow-runtime-lora-updating")
