"""Model geometry, read from a HF config, shared by loader, workers and cache sizing."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Family(enum.Enum):
    LLAMA = "llama"
    OPT = "opt"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: Family
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int          # longest context (prompt + output) in tokens
    norm_eps: float
    rope_theta: float           # Llama only
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def unit(self) -> int:
        """Width of one pool row: num_kv_heads * head_dim elements."""
        return self.num_kv_heads * self.head_dim


def spec_from_hf_config(cfg) -> ModelSpec:
    """Build a ModelSpec from a transformers config, rejecting what we do not implement."""
    mt = cfg.model_type
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if mt == "llama":
        rope = getattr(cfg, "rope_parameters", None) or {}
        scaling = getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"model: rope type {rope_type!r} is not supported")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("model: Llama with attention/MLP bias is not supported")
        heads = cfg.num_attention_heads
        return ModelSpec(
            family=Family.LLAMA, vocab_size=cfg.vocab_size, d_model=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            max_model_len=cfg.max_position_embeddings, norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            bos_token_id=cfg.bos_token_id, eos_token_ids=eos_ids)
    if mt == "opt":
        if cfg.word_embed_proj_dim != cfg.hidden_size:
            raise ValueError("model: OPT with word_embed_proj_dim != hidden_size is not supported")
        if not cfg.do_layer_norm_before:
            raise ValueError("model: post-LayerNorm OPT (opt-350m) is not supported")
        heads = cfg.num_attention_heads
        return ModelSpec(
            family=Family.OPT, vocab_size=cfg.vocab_size, d_model=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
            head_dim=cfg.hidden_size // heads, intermediate_size=cfg.ffn_dim,
            max_model_len=cfg.max_position_embeddings, norm_eps=1e-5, rope_theta=0.0,
            bos_token_id=cfg.bos_token_id, eos_token_ids=eos_ids)
    raise ValueError(f"model: architecture {mt!r} is not supported (llama, opt)")
