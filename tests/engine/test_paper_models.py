"""The random-weight paper-scale models: their shapes are the real models' (parameter counts
against HF transformers' own classes and the published sizes), and a random checkpoint of this
kind loads and serves without any weight file."""
import json

import pytest
import torch

from tandem.engine.models.loader import build_model, load_spec, resolve_model
from tandem.engine.models.paper import MARKER

PUBLISHED = {"opt13b-random": 12.85e9, "llama8b-random": 8.03e9, "smollm2-random": 134.5e6}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_are_the_real_models(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_dir = resolve_model(name, tmp_path)
    assert (hf_dir / MARKER).is_file() and not list(hf_dir.glob("*.safetensors"))
    spec = load_spec(hf_dir)
    with torch.device("meta"):
        ours = build_model(hf_dir, spec, torch.bfloat16, "meta")
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    assert n_ours == n_hf, (n_ours, n_hf)
    assert abs(n_ours / PUBLISHED[name] - 1) < 0.01, n_ours
    assert spec.head_dim == (64 if name == "smollm2-random" else 128)


def test_random_checkpoint_loads_and_serves(tmp_path):
    """A tiny config marked random: weights are drawn at load (norm scales 1, biases 0,
    matrices N(0, std)), and the engine generates from it."""
    from tandem import LLM, SamplingParams
    from tandem.engine.models.tiny import write_tiny_model
    d = write_tiny_model(tmp_path / "m", "opt", seed=0, d_model=64)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / MARKER).write_text(json.dumps({"seed": 3, "std": 0.5}))
    spec = load_spec(d)
    m = build_model(d, spec, torch.float32, "cpu")
    named = dict(m.named_parameters())
    assert torch.equal(named["layers.0.ln1_w"], torch.ones(64))
    assert torch.equal(named["layers.0.qkv_b"], torch.zeros(3 * 64))
    assert abs(named["layers.1.fc1_w"].std().item() - 0.5) < 0.02
    with LLM(str(d), "cpu:1", dtype="float32", threads_per_worker=1) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6
