"""The --devices strings: CPU workers, one worker per named GPU, and a GPU named twice (two
workers sharing it, as the CUDA IPC migration check runs them); a GPU the machine lacks, and more
CPU workers than cores."""
import pytest

from tandem.sched.llm import parse_devices


@pytest.mark.parametrize("text, want", [
    ("cpu", ["cpu"]), ("cpu:3", ["cpu"] * 3), ("cuda:0", ["cuda:0"]),
    ("cuda:0,1", ["cuda:0", "cuda:1"]), ("cuda:0,0", ["cuda:0", "cuda:0"])])
def test_parse(text, want):
    assert parse_devices(text) == want


@pytest.mark.parametrize("text", ["cpu:0", "cpu:", "cpu:x", "cuda", "cuda:", "cuda:a", "gpu:0", "cuda:0;1",
                                  "cpu:²", "cuda:0,²"])
def test_rejected(text):
    with pytest.raises(ValueError, match="devices"):
        parse_devices(text)


def test_a_cuda_device_the_machine_lacks_is_refused_before_loading(monkeypatch, tiny_llama):
    """A worker on a missing GPU would fail only after the model loaded; the devices are checked
    first, against what torch sees (none here, one on a one-GPU machine)."""
    import torch
    from tandem import LLM
    from tandem.sched.llm import check_devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"^devices: cuda:1 does not exist \(no CUDA device is visible here\)"):
        check_devices(["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="^devices: cuda:0 does not exist"):
        LLM(str(tiny_llama), "cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_devices(["cuda:0", "cuda:0"])
    with pytest.raises(ValueError, match=r"cuda:1 does not exist \(this machine has cuda:0 to cuda:0\)"):
        check_devices(["cuda:1"])


def test_more_cpu_workers_than_cores_are_warned_of(monkeypatch, caplog):
    import os
    from tandem.sched.llm import check_devices
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_devices(["cpu", "cpu"])
    assert "CPU workers" not in caplog.text
    check_devices(["cpu"] * 3)
    assert "devices: 3 CPU workers on 2 cores" in caplog.text
