"""Write tiny random-weight checkpoints (HF format) for tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.engine.models.spec import ARCHITECTURES, LLAMA_TYPES


def write_tiny_model(path: str | Path, family: str = "llama", *, seed: int = 0,
                     vocab_size: int = 512, d_model: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, max_len: int = 512,
                     init_std: float = 0.2, tokenizer_from: str | Path | None = None,
                     gguf_blocks: bool = False, config: dict | None = None) -> Path:
    """Save a random LlamaForCausalLM (grouped-query), OPTForCausalLM (multi-head),
    Qwen2ForCausalLM (grouped-query, with Q/K/V biases), Qwen3ForCausalLM (per-head Q/K norms),
    MistralForCausalLM, Phi3ForCausalLM (fused projections), SmolLM3ForCausalLM, Gemma3ForCausalLM
    (``gemma3_text``) or Gemma3ForConditionalGeneration (``gemma3``: an image encoder beside that
    language model).

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
    # the Llama-shaped language model (Gemma 3's multimodal one's too)
    text = dict(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, head_dim=d_model // num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=max_len,
                tie_word_embeddings=True, initializer_range=init_std, **ids) | (config or {})
    if family in LLAMA_TYPES:
        model_class = getattr(transformers, ARCHITECTURES[family])
        model = model_class(model_class.config_class(**text))
    elif family == "gemma3":             # multimodal: a tiny image encoder beside the language model
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                        initializer_range=init_std, **ids,
                                        tie_word_embeddings=text["tie_word_embeddings"])
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    elif family == "opt":
        cfg = transformers.OPTConfig(**dict(vocab_size=vocab_size, hidden_size=d_model, ffn_dim=4 * d_model,
                                            num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                            max_position_embeddings=max_len, word_embed_proj_dim=d_model,
                                            do_layer_norm_before=True, init_std=init_std, **ids) | (config or {}))
        model = transformers.OPTForCausalLM(cfg)
    else:
        raise ValueError(f"family: {family!r} is not one of {', '.join(ARCHITECTURES)}")
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


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, arch: str) -> Path:
    """Write a checkpoint of ``write_tiny_model`` (``arch`` llama, qwen2, qwen3 or phi3, with a
    tokenizer copied in) as a GGUF file as llama.cpp's converter lays it out, every tensor in
    float32: gguf-py's tensor names (Phi-3's projections fused as stored), Llama's Q and K rows
    permuted to llama.cpp's rotary layout, no output tensor where the head is tied, the tokenizer
    as byte-level BPE ("gpt2"), Llama 3.1's rotary scaling as per-frequency divisors
    (``rope_freqs``, from transformers' own frequencies), Phi-3's sliding window as a key. What transformers reads back holds exactly the
    checkpoint's weights. Its GGUF reader takes no head_dim for qwen3 (Qwen3Config's 128 stands),
    no other rotary scaling and no other sliding window: such checkpoints are refused."""
    import json

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer
    hf_dir, out = Path(hf_dir), Path(out)
    cfg, tok = AutoConfig.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    window = getattr(cfg, "sliding_window", None)
    if arch not in ("llama", "qwen2", "qwen3", "phi3") or (arch == "qwen3" and head_dim != 128) \
            or kind not in ("default", "llama3") or (kind == "llama3" and arch != "llama") \
            or (window and arch != "phi3"):
        raise ValueError(f"{arch} with this config does not come back from transformers' GGUF reader")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(hf_dir.name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for add, value in ((w.add_vocab_size, cfg.vocab_size), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_block_count, cfg.num_hidden_layers),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv_heads), (w.add_key_length, head_dim),
                       (w.add_value_length, head_dim), (w.add_rope_dimension_count, head_dim)):
        add(value)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if window:                                  # Phi-3's, which llama.cpp keeps and transformers' reader drops
        w.add_sliding_window(window)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _gguf_tokenizer(w, tok, json.loads((hf_dir / "tokenizer.json").read_text()), cfg.vocab_size)
    if kind == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        w.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        a = t.float().numpy()
        if arch == "llama" and suffix == "weight" and stem.endswith(("q_proj", "k_proj")):
            n = heads if stem.endswith("q_proj") else kv_heads     # each head's halves -> interleaved pairs
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", a.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_tokenizer(w, tok, tokenizer_json: dict, vocab_size: int) -> None:
    """The tokenizer's vocabulary (padded with unused entries to the model's), merges, special
    ids and chat template, as GGUF's tokenizer keys."""
    import gguf
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    for text, i in tok.get_vocab().items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")            # SmolLM2's pre-tokenizer: GPT-2's split
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]])
    for name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                      ("unk", w.add_unk_token_id)):
        if getattr(tok, f"{name}_token_id", None) is not None:
            add(int(getattr(tok, f"{name}_token_id")))
    w.add_add_bos_token(bool(getattr(tok, "add_bos_token", False)))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
