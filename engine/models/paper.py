"""Random-weight models at the real shapes of the papers' models, for paper-scale runs with no
checkpoint to download: ``opt13b-random`` (OPT-13B, multi-head), ``llama8b-random``
(Llama-3-8B, grouped-query 32/8), and ``smollm2-random`` (SmolLM2-135M's shape, for machines
where the packaged GGUF is not installed: a GPU machine without network).

A model of this kind is a directory holding the HF ``config.json`` and ``random_weights.json``
(seed and standard deviation) but no weights: the worker draws them on its own device when it
loads (``init_random``), so nothing of 16-26 GB is ever written or read. The tokenizer is
SmolLM2's when that package is installed (its ids fit both vocabularies), so text prompts
work; the outputs are of course meaningless: these models are for speed and memory.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

MARKER = "random_weights.json"

CONFIGS: dict[str, dict] = {
    # facebook/opt-13b
    "opt13b-random": dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=50272,
                          hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
                          max_position_embeddings=2048, word_embed_proj_dim=5120, do_layer_norm_before=True,
                          activation_function="relu", enable_bias=True, layer_norm_elementwise_affine=True,
                          bos_token_id=2, eos_token_id=2, pad_token_id=1, torch_dtype="float16"),
    # HuggingFaceTB/SmolLM2-135M-Instruct: the served model's shape where its GGUF cannot go
    "smollm2-random": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
                           hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                           hidden_act="silu", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                           torch_dtype="bfloat16"),
    # meta-llama/Meta-Llama-3-8B
    "llama8b-random": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                           hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
                           tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                           torch_dtype="bfloat16"),
}


def is_random(hf_dir: str | os.PathLike) -> bool:
    return (Path(hf_dir) / MARKER).is_file()


def write_random_model(name: str, cache_dir: str | os.PathLike, seed: int = 0, std: float = 0.02) -> Path:
    """The directory of ``name`` (a key of CONFIGS) under ``cache_dir``, written once."""
    out = Path(cache_dir) / name
    if is_random(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    _copy_tokenizer(out)
    (out / MARKER).write_text(json.dumps({"seed": seed, "std": std}))
    return out


def _copy_tokenizer(out: Path) -> None:
    tok = _smollm2_tokenizer()
    if tok is not None:                     # else token-id prompts only
        tok.save_pretrained(out)


@functools.cache
def _smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the packaged GGUF once per process (about 3.5 s)."""
    from tandem.engine.models.loader import SMOLLM2_GGUF, packaged_smollm2
    try:
        gguf = packaged_smollm2()
    except ValueError:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=SMOLLM2_GGUF)


@torch.no_grad()
def init_random(model: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Fill every parameter where it lies: matrices and embeddings N(0, std), norm scales 1,
    biases 0 (by shape: 1-D parameters named like a norm's weight are scales). An untied LM
    head gets its own matrix, as the real model has."""
    meta = json.loads((Path(hf_dir) / MARKER).read_text())
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    if cfg.get("tie_word_embeddings", True) is False:
        model.lm_head = torch.nn.Parameter(torch.empty_like(model.embed), requires_grad=False)
    params = list(model.named_parameters())
    device = params[0][1].device
    if device.type == "meta":              # shapes only (tests, sizing)
        return
    gen = torch.Generator(device=device).manual_seed(int(meta["seed"]))
    for name, p in params:
        if name.endswith(("norm", "ln1_w", "ln2_w", "lnf_w")):     # scales (Qwen3's Q/K norms: [2, hd])
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, float(meta["std"]), generator=gen)
        else:
            p.zero_()
