"""Model geometry, read from a HF config, shared by loader, workers and cache sizing."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import SimpleNamespace


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


# what transformers' config classes take for the fields a config.json leaves out (LlamaConfig,
# OPTConfig); OPT's word_embed_proj_dim defaults to its hidden_size
HF_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "bos_token_id": 1, "eos_token_id": 2},
    "opt": {"vocab_size": 50272, "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "max_position_embeddings": 2048, "do_layer_norm_before": True,
            "bos_token_id": 2, "eos_token_id": 2},
}


def spec_from_config_json(cfg: dict) -> ModelSpec:
    """A ModelSpec from a checkpoint's config.json as read, transformers' defaults filling what it
    leaves out: building transformers' own config object imports its model-loading and
    distributed modules, about 2 s of every start."""
    mt = cfg.get("model_type")
    defaults = HF_DEFAULTS.get(mt, {}) | ({"word_embed_proj_dim": cfg.get("hidden_size", 768)} if mt == "opt" else {})
    return spec_from_hf_config(SimpleNamespace(**({"model_type": mt} | defaults | cfg)))


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
