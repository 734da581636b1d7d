"""Projections (engine.linear) against float64 products, and the CPU worker packing its weights.

Every torch build the project supports (the CPU wheels, the CUDA ones) has oneDNN, so these run
packed: in panels for the compiled kernel (engine/csrc/linear.cpp) and in oneDNN's layout (the
path without a compiler). On a build without oneDNN the products are checked on the dense
fallback, and the worker test fails, saying the build is the slow one."""
import pytest
import torch
import torch.nn.functional as F

from tandem.engine.kernels import cpu_ops
from tandem.engine.linear import Panels, linear, pack, packs
from tandem.engine.models.loader import load_spec
from tandem.engine.worker import WorkerConfig, _build_runner

PACKS = packs("cpu", torch.float32)


def built_ops():
    """The compiled CPU kernels, which the CI machine (gcc + ninja) must build, as the attention
    kernel's tests require too."""
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels must build on the CI machine (gcc + ninja)"
    return ops


@pytest.mark.parametrize("layout", ["panels", "onednn"])
@pytest.mark.parametrize("out_features", [96, 37])        # whole panels of 16, and a part-filled last one
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 64, 300])     # tiles of 6 rows and each remainder
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(layout, out_features, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 80, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(80, rows, generator=g).t()          # a transposed (non-contiguous) input too
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    if layout == "panels":
        packed = pack(w, built_ops())
        assert isinstance(packed, Panels)
    else:
        packed = pack(w) if PACKS else w
    got = linear(x, packed, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_panels_keep_leading_dimensions():
    """A [batch, tokens, in] input comes back as [batch, tokens, out], as from F.linear."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    torch.testing.assert_close(linear(x, pack(w, built_ops())).double(), F.linear(x.double(), w.double()),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cpu_kernels", [True, False])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_cpu_worker_packs_every_projection(family, cpu_kernels, request):
    """Every matrix the forward multiplies by is packed (in panels with the compiled kernels, in
    oneDNN's layout without them); the embedding table stays dense."""
    if not PACKS:
        pytest.fail("this torch has no oneDNN: the CPU worker multiplies by dense weights, slowly")
    if cpu_kernels:
        built_ops()
    path = request.getfixturevalue(family)
    spec = load_spec(path)
    cfg = WorkerConfig(str(path), spec, "float32", "cpu", 8, 1 << 20, None, 1, 1, False, cpu_kernels)
    model = _build_runner(cfg)[0].model
    packed = (lambda t: isinstance(t, Panels)) if cpu_kernels else (lambda t: t.is_mkldnn)
    layer_weights = [t for layer in model.layers
                     for t in [*vars(layer).values(), *layer._buffers.values()]
                     if isinstance(t, Panels) or (isinstance(t, torch.Tensor) and t.dim() == 2)]
    assert len(layer_weights) == 5 * spec.num_layers          # 4 projections + the K/V rows
    assert all(packed(t) for t in layer_weights)
    assert not [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "pos" not in n]
    assert packed(model.lm_head) and not model.embed.is_mkldnn
