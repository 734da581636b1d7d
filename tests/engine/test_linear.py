"""Projections (engine.linear) against float64 products, and the CPU worker packing its weights.

Every torch build the project supports (the CPU wheels, the CUDA ones) has oneDNN, so these run
packed. On a build without it the products are checked on the dense fallback, and the worker
test fails, saying the build is the slow one."""
import pytest
import torch
import torch.nn.functional as F

from tandem.engine.linear import linear, pack, packs
from tandem.engine.models.loader import load_spec
from tandem.engine.worker import WorkerConfig, _build_runner

PACKS = packs("cpu", torch.float32)


def prepared(w: torch.Tensor) -> torch.Tensor:
    """The weight as the CPU worker holds it in float32."""
    return pack(w) if PACKS else w


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(80, rows, generator=g).t()          # a transposed (non-contiguous) input too
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, prepared(w), b)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_cpu_worker_packs_every_projection(family, request):
    """Every matrix the forward multiplies by is packed; the embedding table stays dense."""
    if not PACKS:
        pytest.fail("this torch has no oneDNN: the CPU worker multiplies by dense weights, slowly")
    path = request.getfixturevalue(family)
    spec = load_spec(path)
    cfg = WorkerConfig(str(path), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1, False, False)
    model = _build_runner(cfg)[0].model
    layer_weights = [t for layer in model.layers for n, t in layer.named_buffers() if t.dim() == 2]
    assert len(layer_weights) == 5 * spec.num_layers          # 4 projections + the K/V rows
    assert all(t.is_mkldnn for t in layer_weights)
    assert not [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "pos" not in n]
    assert model.lm_head.is_mkldnn and not model.embed.is_mkldnn
