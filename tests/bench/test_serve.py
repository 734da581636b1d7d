"""A real server whose model fails to load exits with status 1, its log saying why, and the
bench's server launcher stops waiting at once (waiting out its start-up timeout raises "did
not answer") with its log's last line."""
import os
import shutil
import sys

import pytest

from tandem.bench.peers import ServerStartError, free_port, serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_model_that_fails_to_load_is_not_waited_for(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", str(broken), "--port", str(port), "--data-dir",
           str(tmp_path / "data"), "--kv-cache-bytes", str(64 << 20), "--watch-parent", str(os.getpid()),
           "--dtype", "float32"]
    with pytest.raises(ServerStartError, match="server exited with 1 before") as failed:
        with serve(cmd, port, start_timeout_s=240, cwd=ROOT, log_path=tmp_path / "server.log"):
            pass
    log = (tmp_path / "server.log").read_text()
    assert "tandem: model failed to load: " in log
    # the error carries the log's last line and where the rest is
    last = [ln for ln in log.splitlines() if ln.strip()][-1].strip()
    assert str(failed.value).endswith(f": {last} (the whole log: {tmp_path / 'server.log'})")
