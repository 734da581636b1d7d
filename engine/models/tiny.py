"""Write tiny random-weight checkpoints (HF format) for tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_model(path: str | Path, family: str = "llama", *, seed: int = 0,
                     vocab_size: int = 512, d_model: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, max_len: int = 512,
                     init_std: float = 0.2, tokenizer_from: str | Path | None = None,
                     gguf_blocks: bool = False, config: dict | None = None) -> Path:
    """Save a random LlamaForCausalLM (grouped-query), OPTForCausalLM (multi-head),
    Qwen2ForCausalLM (grouped-query, with Q/K/V biases), Qwen3ForCausalLM (per-head Q/K norms) or
    MistralForCausalLM.

    ``init_std`` is larger than HF's default so that logits are well separated and
    greedy decoding is not decided by round-off. ``tokenizer_from``: a checkpoint
    directory whose tokenizer is copied in (the vocabulary grows to fit it), so
    text prompts and chat templates work. ``gguf_blocks``: every matrix goes through GGUF's
    quantizer and back (gguf-py), as in a GGUF model dequantized to float32: the projections in
    Q4_1, the embedding tables in Q8_0 (SmolLM2's GGUF's types). ``config``: more of the
    config's fields (``rope_parameters``, ``attention_bias``, ``sliding_window``, ...).
    """
    import transformers
    from transformers import AutoTokenizer
    path = Path(path)
    tok = None
    if tokenizer_from is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        vocab_size = max(vocab_size, len(tok))
    torch.manual_seed(seed)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family in LLAMA_LIKE:
        cfg = getattr(transformers, f"{LLAMA_LIKE[family]}Config")(**dict(
            vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, head_dim=d_model // num_heads,
            num_key_value_heads=num_kv_heads, max_position_embeddings=max_len,
            tie_word_embeddings=True, initializer_range=init_std, **ids) | (config or {}))
        model = getattr(transformers, f"{LLAMA_LIKE[family]}ForCausalLM")(cfg)
    elif family == "opt":
        cfg = transformers.OPTConfig(**dict(vocab_size=vocab_size, hidden_size=d_model, ffn_dim=4 * d_model,
                                            num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                            max_position_embeddings=max_len, word_embed_proj_dim=d_model,
                                            do_layer_norm_before=True, init_std=init_std, **ids) | (config or {}))
        model = transformers.OPTForCausalLM(cfg)
    else:
        raise ValueError(f"family: {family!r} is not one of {', '.join((*LLAMA_LIKE, 'opt'))}")
    with torch.no_grad():   # HF zero-inits norms' bias and ones their weight; perturb for coverage
        for name, p in model.named_parameters():
            if "norm" in name or (family != "opt" and name.endswith(".bias")):   # zero-init biases too
                p.add_(0.1 * torch.randn_like(p))
    if gguf_blocks:
        _through_gguf(model)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


# the Llama-shaped families and their transformers class names' stem
LLAMA_LIKE = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def _through_gguf(model) -> None:
    """Round every matrix whose rows are whole 32-weight blocks through gguf-py's quantizer."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or p.shape[1] % 32:
                continue
            kind = Q.Q8_0 if "embed" in name else Q.Q4_1
            w = p.detach().float().numpy()
            p.copy_(torch.from_numpy(dequantize(quantize(w, kind), kind).astype(np.float32).reshape(w.shape)))
