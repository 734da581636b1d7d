"""The compiled CPU decode-attention kernel equals the torch reference path."""
import pytest
import torch

from tandem.engine.attention import decode_attention
from tandem.engine.kernels import cpu_ops
from tests.conftest import int8_blocks_as_read


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hkv, g", [(3, 3), (4, 1)])
def test_paged_decode_matches_reference(dtype, tol, hkv, g):
    ops = cpu_ops()
    assert ops is not None, "the CPU kernel must build on the CI machine (gcc + ninja)"
    torch.manual_seed(0)
    nd, hd, S = 7, 64, 400
    pool = torch.randn(hkv, S, hd).to(dtype)
    lens = torch.tensor([1, 5, 17, 33, 2, 64, 40])
    L = int(lens.max())
    k_rows = torch.randint(0, S, (nd, L))      # arbitrary rows: any block layout or direction
    v_rows = torch.randint(0, S, (nd, L))
    q = torch.randn(nd, hkv, g, hd).to(dtype)
    got = ops.paged_decode(q, pool, k_rows, v_rows, lens, 0.125)
    # independent reference: loop per request with plain softmax attention in float64
    for r in range(nd):
        n = int(lens[r])
        k = pool[:, k_rows[r, :n]].double()                      # [hkv, n, hd]
        v = pool[:, v_rows[r, :n]].double()
        p = torch.softmax(q[r].double() @ k.transpose(-1, -2) * 0.125, dim=-1)
        torch.testing.assert_close(got[r].double(), p @ v, atol=tol, rtol=tol)
    ref = decode_attention(q, pool, k_rows, v_rows, lens, 0.125)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("wide", [False, True])
def test_paged_decode_q8_matches_reference(dtype, tol, wide):
    """Over the int8 pool: closed blocks read as lo + λ·q, open blocks from staging. ``wide``: one
    channel spans ±3e38, so hi - lo and λ·q pass float32's maximum (the query ignores that
    channel, so only V's rows carry it into the output, which stays finite)."""
    from tandem.engine.quantpool import QuantPool
    ops = cpu_ops()
    assert ops is not None
    torch.manual_seed(1)
    hkv, g, hd, B, nb, nd = 3, 3, 64, 8, 30, 6
    pool = QuantPool(1, hkv, nb, B, hd, dtype, open_capacity=2)     # staging grows as blocks open
    pool.open(torch.arange(nb))
    values = torch.randn(1, hkv, nb * B, hd)
    q = torch.randn(nd, hkv, g, hd)
    unit = torch.ones(hd, dtype=torch.float64)      # each output channel compared in its own unit
    if wide:
        values[..., 5] = (torch.rand(1, hkv, nb * B) * 2 - 1) * 3e38
        q[..., 5] = 0
        unit[5] = 3e38
    values, q = values.to(dtype), q.to(dtype)
    pool.write(torch.arange(nb * B), values)
    closed = torch.arange(0, nb, 3)
    pool.close(closed)
    layer = pool[0]
    lens = torch.tensor([1, 9, 24, 70, 33, 120])
    L = int(lens.max())
    k_rows = torch.randint(0, nb * B, (nd, L))
    v_rows = torch.randint(0, nb * B, (nd, L))
    got = ops.paged_decode_q8(q, layer.stage, layer.q, layer.scale, layer.low, layer.stage_of,
                              k_rows, v_rows, lens, B, 0.125)
    assert torch.isfinite(got).all()
    # independent reference: what each row should hold, from the values written and numpy's code
    expect = int8_blocks_as_read(values[0], closed.tolist(), B)        # [hkv, rows, hd]
    for r in range(nd):
        n = int(lens[r])
        k, v = expect[:, k_rows[r, :n]], expect[:, v_rows[r, :n]]
        p = torch.softmax(q[r].double() @ k.transpose(-1, -2) * 0.125, dim=-1)
        torch.testing.assert_close(got[r].double() / unit, p @ v / unit, atol=max(tol, 1e-4), rtol=tol)
    ref = decode_attention(q, layer, k_rows, v_rows, lens, 0.125)
    torch.testing.assert_close(got.double() / unit, ref.double() / unit, atol=tol, rtol=tol)


def test_a_load_killed_midway_does_not_stop_later_loads():
    """torch's build lock is a file every load takes; a process killed while holding it (a
    worker killed at start-up) left it behind, and every later load -- a restarted worker, the
    next server -- waited for it for ever. Here a process takes that lock exactly as torch's
    loader does and is killed; a fresh process must still load the kernels."""
    import os
    import signal
    import subprocess
    import sys
    from tandem.engine.kernels import _build_dir
    from tandem.paths import exclusive
    assert cpu_ops() is not None                       # built (once per machine) before the clock runs
    build = _build_dir()
    lock = build / "lock"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        # Other test workers load the kernels too and would clear the planted lock at once: hold
        # the loaders' flock while planting it and while the fresh process starts, so that the
        # lock it meets is the killed process's.
        with exclusive(build / "load.flock"):
            taker = subprocess.run([sys.executable, "-c", (
                "import os, signal\n"
                "from torch.utils.file_baton import FileBaton\n"
                f"assert FileBaton({str(lock)!r}).try_acquire()\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n")], timeout=120)
            assert taker.returncode == -signal.SIGKILL and lock.exists(), "the lock was meant to be left behind"
            loader = subprocess.Popen([sys.executable, "-c", "from tandem.engine.kernels import cpu_ops\n"
                                       "print(cpu_ops().__name__)"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env)
        try:
            out, err = loader.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            loader.kill()
            pytest.fail("a load waited for the lock of a killed process")
        assert out.strip() == "tandem_cpu_ops", err
    finally:
        lock.unlink(missing_ok=True)
