"""The --devices strings: CPU workers, one worker per named GPU, and a GPU named twice (two
workers sharing it, as the CUDA IPC migration check runs them)."""
import pytest

from tandem.sched.llm import parse_devices


@pytest.mark.parametrize("text, want", [
    ("cpu", ["cpu"]), ("cpu:3", ["cpu"] * 3), ("cuda:0", ["cuda:0"]),
    ("cuda:0,1", ["cuda:0", "cuda:1"]), ("cuda:0,0", ["cuda:0", "cuda:0"])])
def test_parse(text, want):
    assert parse_devices(text) == want


@pytest.mark.parametrize("text", ["cpu:0", "cpu:x", "cuda", "cuda:", "cuda:a", "gpu:0", "cuda:0;1"])
def test_rejected(text):
    with pytest.raises(ValueError, match="devices"):
        parse_devices(text)
