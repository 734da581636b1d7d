"""Weights kept in GGUF's blocks (engine.blocks, engine/csrc/qlinear.cpp), checked against gguf-py's
own quantizer and dequantizer, float64 products, and HF transformers' greedy tokens."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tandem.engine.blocks import BlockKind, Blocks, find_blocks
from tandem.engine.linear import (Panels, Thin, embedding, embedding_into, linear, pack, row_projections,
                                  threshold_rows)
from tandem.engine.models.loader import load_spec
from tandem.engine.worker import WorkerConfig, _build_runner, pool_info
from tests.conftest import hf_greedy, mixed_prompts
from tests.engine.test_linear import built_ops

KINDS = {BlockKind.Q4_1: Q.Q4_1, BlockKind.Q8_0: Q.Q8_0}


def through_gguf(w: np.ndarray, kind: BlockKind) -> tuple[torch.Tensor, np.ndarray]:
    """gguf-py's blocks of ``w`` (raw bytes per block) and the float32 weights they hold."""
    raw = gguf_quantize(w, KINDS[kind])
    deq = gguf_dequantize(raw, KINDS[kind]).astype(np.float32).reshape(w.shape)
    return torch.from_numpy(deq), raw.reshape(-1, raw.shape[-1] // (w.shape[1] // 32))


def gguf_fields(raw: np.ndarray, kind: BlockKind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d, m and q of GGUF blocks, decoded from their bytes as ggml lays them out."""
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    if kind is BlockKind.Q8_0:
        return d, np.zeros_like(d), raw[:, 2:].copy().view(np.int8).astype(np.int64)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    nib = raw[:, 4:].astype(np.int64)                  # weight t low nibble, t + 16 high nibble
    return d, m, np.concatenate([nib & 15, nib >> 4], axis=1)


@pytest.mark.parametrize("kind", list(BlockKind))
def test_blocks_found_are_ggufs_own(kind):
    """find_blocks reads back, from the dequantized weights alone, the very blocks gguf-py wrote."""
    w = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    deq, raw = through_gguf(w, kind)
    found = find_blocks(deq)
    assert found is not None and found.kind is kind
    d, m, q = gguf_fields(raw, kind)
    np.testing.assert_array_equal(found.d.numpy().reshape(-1), d)
    np.testing.assert_array_equal(found.m.numpy().reshape(-1), m)
    np.testing.assert_array_equal(found.q.numpy().astype(np.int64).reshape(-1, 32), q)


def test_weights_that_are_not_blocks_stay_float():
    """Random float32 weights, and GGUF weights with one of them moved by one unit in the last
    place, are not blocks (the check is bit for bit)."""
    assert find_blocks(torch.randn(32, 64)) is None
    deq, _ = through_gguf(np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32), BlockKind.Q4_1)
    assert find_blocks(deq) is not None
    for row in (5, 33):                  # in the rows tried first, and past them
        moved = deq.clone()
        moved[row, 17] = torch.nextafter(moved[row, 17], torch.tensor(np.inf))
        assert find_blocks(moved) is None
    assert find_blocks(torch.randn(8, 48)) is None          # rows that are not whole blocks


@pytest.mark.parametrize("kind", list(BlockKind))
@pytest.mark.parametrize("out_features", [96, 37])        # whole panels of 16, and a part-filled last one
# float32 rows: tiles of 6 and unpacked panels from 24; bfloat16 rows: tiles of 8; each remainder
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 8, 9, 13, 16, 17, 23, 24, 31, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_products_match_float64(kind, out_features, rows, bias, dtype):
    """Products over the blocks are the float64 product of the GGUF's own weights to float32
    rounding: of float32 rows (a float32 model), and of a bfloat16 model's bfloat16 rows, which
    its blocks multiply as they are where the CPU has AVX-512 BF16 (the products of q and x
    exact, summed in float32, the blocks' scales applied after), else widened to float32."""
    g = torch.Generator().manual_seed(rows)
    deq, _ = through_gguf(torch.randn(out_features, 128, generator=g).numpy(), kind)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(128, rows, generator=g).t().to(dtype)          # a transposed (non-contiguous) input too
    ops = built_ops()
    packed = pack(deq, ops) if dtype == torch.float32 else pack(deq, ops, dtype=dtype).blocks
    assert isinstance(packed, Panels) and packed.kind is kind
    native = dtype == torch.bfloat16 and hasattr(ops, f"{kind.value}_bf16_linear")
    assert packed.takes == (torch.bfloat16 if native else torch.float32)
    padded = -(-out_features // 16) * 16 * 128               # weights, rows padded to whole panels
    assert packed.data.numel() / padded == {BlockKind.Q4_1: 0.75, BlockKind.Q8_0: 1.125}[kind]   # bytes a weight
    got = linear(x, packed, b)
    want = F.linear(x.double(), deq.double(), None if b is None else b.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


# row counts, given the weight's threshold
ROWS = {"1": lambda t: 1, "5": lambda t: 5, "thin": lambda t: t, "thin+1": lambda t: t + 1,
        "2thin+1": lambda t: 2 * t + 1}


@pytest.mark.parametrize("kind", list(BlockKind))
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_products_go_over_the_blocks_when_thin(kind, rows, bias):
    """A bfloat16 model's weight keeps its GGUF blocks beside its bfloat16 copy. Up to its
    threshold (``Thin.rows``, which depends on the CPU and the blocks' kernel) the product is a
    float32 sum over the exact weights, rounded to bfloat16 once (so it
    matches the float64 product of the GGUF's own weights to the last bit, but where the float32
    sum lay within rounding of a bfloat16 boundary); over the bfloat16 weights it would be off
    by about an ulp in many places. Thicker products are torch's over the bfloat16 weights."""
    thin = pack(through_gguf(torch.randn(64, 256).numpy(), kind)[0], built_ops(), dtype=torch.bfloat16)
    rows = ROWS[rows](thin.rows)
    g = torch.Generator().manual_seed(rows)
    deq, _ = through_gguf(torch.randn(64, 256, generator=g).numpy(), kind)
    b = torch.randn(64, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 256, generator=g).bfloat16()
    thin = pack(deq, built_ops(), dtype=torch.bfloat16)
    assert isinstance(thin, Thin) and thin.blocks.kind is kind and thin.dense.dtype == torch.bfloat16
    got = linear(x, thin, b)
    assert got.shape == (rows, 64) and got.dtype == torch.bfloat16
    if rows > thin.rows:
        assert torch.equal(got, F.linear(x, deq.bfloat16(), b))
        return
    exact = F.linear(x.double(), deq.double(), None if b is None else b.double())
    rounded = exact.bfloat16()
    ulp = (rounded.double().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert ((got.double() - rounded.double()).abs() <= ulp).all()
    assert (got == rounded).double().mean() >= 0.98


@pytest.mark.parametrize("kind", list(BlockKind))
def test_a_thin_products_rows_do_not_depend_on_each_other(kind):
    """Each row of a product over the blocks is summed alone, in one order: computed with 12 other
    rows it is the same to the last bit as computed alone (so a request's logits do not move
    with the others in its step while the step stays thin). The inputs span 2^-12 to 2^12, so
    that float32 sums in another order round differently (over inputs of one scale, sums of
    bfloat16 x times 4-bit q are mostly exact in any order)."""
    g = torch.Generator().manual_seed(3)
    deq, _ = through_gguf(torch.randn(80, 256, generator=g).numpy(), kind)
    blocks = pack(deq, built_ops(), dtype=torch.bfloat16).blocks
    x = (torch.randn(13, 256, generator=g) * 2.0 ** torch.randint(-12, 13, (13, 256), generator=g)).bfloat16()
    together = linear(x, blocks)
    for i in range(13):
        assert torch.equal(linear(x[i:i + 1], blocks), together[i:i + 1])


def test_embedding_rows_from_blocks_are_exact():
    deq, _ = through_gguf(np.random.default_rng(2).standard_normal((50, 64)).astype(np.float32), BlockKind.Q8_0)
    holder = torch.nn.Module()
    holder.table = torch.nn.Parameter(deq.clone(), requires_grad=False)
    embedding_into(holder, "table")
    assert isinstance(holder.table, Blocks)
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(embedding(ids, holder.table), F.embedding(ids, deq))


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("gguf-llama"), "llama", seed=3, gguf_blocks=True)


@pytest.fixture(scope="module")
def gguf_opt(tmp_path_factory):
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("gguf-opt"), "opt", seed=4, gguf_blocks=True)


def gguf_workers(request, family: str, dtype: str):
    """(weight_blocks, the model's spec, its CPU worker's runner, the runner's pool blocks), with
    weight_blocks on and then off."""
    built_ops()
    path = request.getfixturevalue(family)
    spec = load_spec(path)
    for blocks in (True, False):
        cfg = WorkerConfig(str(path), spec, dtype, "cpu", 8, 1 << 20, None, 1, 1, False, True, weight_blocks=blocks)
        yield (blocks, spec, *_build_runner(cfg))


@pytest.mark.parametrize("family", ["gguf_llama", "gguf_opt"])
def test_worker_keeps_a_gguf_models_blocks(family, request):
    """The CPU worker keeps every projection in Q4_1 panels, the LM head in Q8_0 and the token
    embedding in Q8_0 blocks; with weight_blocks off, all in float32 panels."""
    for blocks, spec, runner, _ in gguf_workers(request, family, "float32"):
        model = runner.model
        weights = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, Panels)]
        assert len(weights) == 5 * spec.num_layers          # 4 projections + the K/V rows
        assert {t.kind for t in weights} == {BlockKind.Q4_1 if blocks else None}
        assert model.lm_head.kind is (BlockKind.Q8_0 if blocks else None)
        assert isinstance(model.embed, Blocks) is blocks


@pytest.mark.parametrize("family", ["gguf_llama", "gguf_opt"])
def test_bfloat16_worker_keeps_the_blocks_beside_its_weights(family, request):
    """A bfloat16 CPU worker of a GGUF model holds each projection in bfloat16 with its Q4_1
    blocks beside it, the LM head with the Q8_0 ones, a tied head sharing the embedding table
    (not a copy), everything else in bfloat16; with weight_blocks off, bfloat16 alone."""
    for blocks, spec, runner, num_blocks in gguf_workers(request, family, "bfloat16"):
        model = runner.model
        thin = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, Thin)]
        info = pool_info(runner, num_blocks)          # for the cost model: the threshold
        assert info.thin_rows == (thin[0].rows if blocks else 0)
        products = runner.products()                  # and, asked for, the products' cost
        assert [r for r, _ in products] == ([0, *threshold_rows(info.thin_rows)] if blocks else [])
        assert all(t > 0 for _, t in products[1:])
        assert len(thin) == (5 * spec.num_layers if blocks else 0)     # 4 projections + the K/V rows
        assert all(t.blocks.kind is BlockKind.Q4_1 and t.dense.dtype == torch.bfloat16 for t in thin)
        head = model.lm_head
        assert isinstance(head, Thin) is blocks
        if blocks:
            assert head.blocks.kind is BlockKind.Q8_0 and head.dense is model.embed
        assert {t.dtype for t in [*model.parameters(), *model.buffers()]} == {torch.bfloat16}


def test_the_products_timed_past_the_threshold_stop_at_the_budget_and_never_fall():
    """Past one row beyond the threshold the rows are timed only within the budget; the seconds
    never fall as the rows grow, so the cost model's line past the last point never falls. A
    clock of its own, whose every reading comes sooner after the last (10 s in all, so the
    rounds it times grow shorter), stands for the machine's: no wall-clock time is asserted."""
    from tandem.engine.linear import product_seconds

    def sooner_each_time():
        now, step = [0.0], [1.0]

        def clock():
            now[0] += step[0]
            step[0] *= 0.9
            return now[0]
        return clock
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    rows = threshold_rows(6)
    assert rows[:4] == (1, 3, 6, 7) and rows[-1] >= 256
    assert [r for r, _ in product_seconds(weights, rows, budget_s=0.0, clock=sooner_each_time())] == [0, 1, 3, 6, 7]
    table = product_seconds(weights, rows, repeats=1, budget_s=60.0, clock=sooner_each_time())
    assert [r for r, _ in table] == [0, *rows]
    assert all(a[1] <= b[1] for a, b in zip(table, table[1:]))


@pytest.mark.parametrize("family", ["gguf_llama", "gguf_opt"])
def test_the_products_timed_at_load_are_those_each_row_of_a_step_takes(family, request, monkeypatch):
    """What the cost model adds as measured (engine.linear.row_projections) is what a step does:
    every weight a prompt's rows are multiplied by during a real step, once each, and nothing
    else that takes all of them (the LM head takes the sampled row only)."""
    import tandem.engine.lora as lora
    from tandem.engine.worker import InProcessDevice
    from tandem.sched.profiling import dummy_request
    from tandem.sched.scheduler import SchedConfig, Scheduler
    built_ops()
    path = request.getfixturevalue(family)
    spec = load_spec(path)
    dev = InProcessDevice("cpu", WorkerConfig(str(path), spec, "bfloat16", "cpu", 8, 1 << 20, None, 1, 1, False, True))
    calls = []

    def recorded(x, w, b=None):
        calls.append((x.reshape(-1, x.shape[-1]).shape[0], id(w)))
        return linear(x, w, b)
    for module in (lora, __import__(f"tandem.engine.models.{'llama' if family == 'gguf_llama' else 'opt'}",
                                    fromlist=["linear"])):
        monkeypatch.setattr(module, "linear", recorded)
    sched = Scheduler(SchedConfig(max_num_batched_tokens=64), [dev], spec.eos_token_ids, spec.max_model_len)
    sched.add(dummy_request("r", list(range(3, 12)), 1))             # one step: a prompt of nine rows
    sched.step()
    every_row = sorted(w for rows, w in calls if rows == 9)
    assert every_row == sorted(id(w) for w in row_projections(dev.runner.model))
    assert len(every_row) == 4 * spec.num_layers and len(calls) == len(every_row) + 1


@pytest.mark.parametrize("family", ["gguf_llama", "gguf_opt"])
def test_greedy_tokens_over_blocks_match_hf(family, request):
    from tandem import LLM, SamplingParams
    path = request.getfixturevalue(family)
    built_ops()
    prompts = mixed_prompts(6, 512, seed=5)
    want = hf_greedy(path, prompts, 16)
    with LLM(str(path), "cpu:1", dtype="float32", threads_per_worker=1, kv_cache_bytes=1 << 22) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
