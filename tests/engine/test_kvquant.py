"""INT8 channel-wise compression of cache rows against a numpy reference of ALISE's Eq. 8."""
import numpy as np
import pytest
import torch

from tandem.engine.kvquant import dequantize, quantize


def numpy_reference(x: np.ndarray, kinds: int, block: int) -> np.ndarray:
    """Quantize and dequantize token group by token group, channel by channel, in float64."""
    L, H, R, D = x.shape
    n = R // kinds
    out = np.empty_like(x, dtype=np.float64)
    for k in range(kinds):
        for g0 in range(0, n, block):
            rows = slice(k * n + g0, k * n + min(g0 + block, n))
            grp = x[:, :, rows, :].astype(np.float64)
            lo = grp.min(axis=2, keepdims=True)
            lam = (grp.max(axis=2, keepdims=True) - lo) / 255
            safe = np.where(lam > 0, lam, 1.0)
            q = np.clip(np.round((grp - lo) / safe), 0, 255)
            out[:, :, rows, :] = lo + lam * q
    return out


@pytest.mark.parametrize("n, block", [(16, 8), (13, 8), (5, 16), (1, 4)])
def test_matches_numpy_and_error_bound(n, block):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2, 2 * n, 16, generator=g) * torch.linspace(0.1, 5, 16)   # channels of different range
    r = quantize(x, 2, block)
    y = dequantize(r)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = numpy_reference(x.numpy(), 2, block)
    # float32 vs float64 may round a value sitting on a .5 boundary the other way: one level
    diff = np.abs(y.numpy() - ref)
    lam = (x.abs().max() * 2 / 255).item()
    assert (diff < 1e-5).mean() > 0.999 and diff.max() <= lam + 1e-5
    # the bound of Eq. 8 per group and channel: |x - x̂| <= λ / 2
    for k in range(2):
        for g0 in range(0, n, block):
            rows = slice(k * n + g0, k * n + min(g0 + block, n))
            grp = x[:, :, rows]
            half = (grp.amax(2) - grp.amin(2)) / 255 / 2
            assert ((grp - y[:, :, rows]).abs().amax(2) <= half + 1e-6).all()


def test_groups_keep_their_own_range():
    """An outlier in V's group or in another block does not coarsen K's first block."""
    x = torch.rand(1, 1, 2 * 16, 4)
    x[0, 0, 16 + 3] = 1000.0           # a V row
    x[0, 0, 12] = -1000.0              # K, second block of 8
    y = dequantize(quantize(x, 2, 8))
    assert (y[0, 0, :8] - x[0, 0, :8]).abs().max() <= 1 / 255 / 2 + 1e-6


def test_constant_channels_and_storage():
    x = torch.full((2, 2, 2 * 8, 4), 0.37)
    r = quantize(x, 2, 8)
    assert torch.equal(dequantize(r), x)
    assert r.q.dtype == torch.uint8
    # a quarter of fp32 plus two fp32 numbers per block and channel
    assert r.nbytes == x.numel() + 2 * 4 * (2 * 2 * 2 * 4)


def test_channels_wider_than_float32s_range():
    """A channel spanning ±3e38 has hi - lo, x - lo and λ·q past float32's maximum: it still
    comes back finite and within half a step of numpy's float64 rounding; ordinary channels beside
    it are unaffected."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 2 * 16, 8, generator=g)
    x[..., 3] = (torch.rand(2, 2, 2 * 16, generator=g) * 2 - 1) * 3e38
    x[..., 5] = torch.rand(2, 2, 2 * 16, generator=g) * 3e38       # one sign: within range before too
    y = dequantize(quantize(x, 2, 8))
    assert torch.isfinite(y).all()
    ref = numpy_reference(x.numpy(), 2, 8)
    xs = x.double().numpy().reshape(2, 2, 2, 2, 8, 8)             # [L, H, kind, group, row, channel]
    half_step = (xs.max(axis=4) - xs.min(axis=4)) / 255 / 2
    err = np.abs(y.double().numpy().reshape(xs.shape) - xs).max(axis=4)
    assert (err <= half_step * (1 + 1e-5) + 1e-6).all()
    # numpy's own rounding, up to one level where float32 and float64 round a .5 the other way
    diff = np.abs(y.double().numpy() - ref)
    assert (diff <= 2 * half_step.max(axis=(2, 3))[:, :, None, :] + 1e-6).all()
    ordinary = [c for c in range(8) if c not in (3, 5)]
    plain = numpy_reference(x[..., ordinary].numpy(), 2, 8)
    assert np.allclose(y[..., ordinary].numpy(), plain, atol=1e-5)
