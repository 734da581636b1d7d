"""The compiled CPU decode-attention kernel equals the torch reference path."""
import pytest
import torch

from engine.attention import decode_attention
from engine.kernels import cpu_ops


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
