"""Model geometry, read from a HF config, shared by loader, workers and cache sizing."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from types import SimpleNamespace



class Family(enum.Enum):
    LLAMA = "llama"      # Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 and SmolLM3 checkpoints: one forward
    OPT = "opt"


# the model types this engine runs, with transformers' class for each (a converted GGUF's config
# is given it). All but OPT are read as the Llama family: the same layer, up to Qwen2's Q/K/V
# biases, Qwen3's per-head norms of Q and K, Phi-3's projections stored fused, Mistral's,
# Phi-3's and Qwen's sliding windows, Gemma 3's (text) norms, GELU and two rotary bases, and
# SmolLM3's layers without rotary embeddings
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "opt": "OPTForCausalLM"}
LLAMA_TYPES = tuple(t for t in ARCHITECTURES if t != "opt")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequencies stretched for a longer context than the model was trained on.
    ``linear`` divides every frequency by ``factor``. ``llama3`` (Llama 3.1 on) divides only the
    low ones, whose wavelength 2π/f exceeds original_max / low_freq_factor, keeps the high ones,
    whose wavelength is under original_max / high_freq_factor, and between the two blends
    (1 - s) f/factor + s f with s = (original_max / wavelength - low) / (high - low).
    ``yarn`` (YaRN; Qwen's long contexts) blends by dimension instead: pair i of a head of d
    dimensions turns original_max / (2π) · f_i times over the trained context, and the pairs
    between the one turning beta_fast times and the one turning beta_slow times (rounded out
    when ``truncate``) ramp linearly from f (kept) to f/factor; cos and sin are then scaled by
    ``attention`` (0.1 ln(factor) + 1 unless the config says)."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max: float = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention: float = 1.0

    def apply(self, inv_freq: list[float], theta: float | None = None) -> list[float]:
        """The scaled frequencies; ``theta``, the rotary base, for ``yarn``."""
        if self.kind == "linear":
            return [f / self.factor for f in inv_freq]
        if self.kind == "yarn":
            return self._yarn(inv_freq, theta)
        low_wl = self.original_max / self.low_freq_factor
        high_wl = self.original_max / self.high_freq_factor
        out = []
        for f in inv_freq:
            wl = 2 * math.pi / f
            if wl > low_wl:
                out.append(f / self.factor)
            elif wl < high_wl:
                out.append(f)
            else:
                s = (self.original_max / wl - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
                out.append((1 - s) * f / self.factor + s * f)
        return out

    def _yarn(self, inv_freq: list[float], theta: float) -> list[float]:
        dim = 2 * len(inv_freq)

        def pair(turns: float) -> float:          # the (fractional) dimension turning so many times
            return dim * math.log(self.original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = pair(self.beta_fast), pair(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        hi = hi + 0.001 if hi == lo else hi
        ramp = [min(1.0, max(0.0, (i - lo) / (hi - lo))) for i in range(len(inv_freq))]
        return [f / self.factor * r + f * (1 - r) for f, r in zip(inv_freq, ramp)]

    @classmethod
    def from_divisors(cls, divisors: list[float], inv_freq: list[float]) -> RopeScaling | None:
        """The llama3 scaling that divides ``inv_freq`` by ``divisors`` (llama.cpp keeps Llama
        3.1's scaling as such a list, its rope_freqs), or None if none does. Only the scaled
        frequencies matter, and the blend's weight s is linear in 1/wavelength, so two blended
        frequencies fix it (with low_freq_factor 1); without two, Llama 3.1's own settings."""
        factor = max(divisors)
        mid = [(2 * math.pi / f, d) for f, d in zip(inv_freq, divisors) if 1 + 1e-6 < d < factor * (1 - 1e-6)]
        found = [cls("llama3", factor, 1.0, 4.0, 8192)]
        if len(mid) >= 2:
            (w1, d1), (w2, d2) = mid[0], mid[-1]
            s1, s2 = ((1 / d - 1 / factor) / (1 - 1 / factor) for d in (d1, d2))
            a = (s1 - s2) / (1 / w1 - 1 / w2)        # s = a / wavelength + b
            b = s1 - a / w1
            if a > 0 and b < 0:
                found.append(cls("llama3", factor, 1.0, _whole(1 - 1 / b), _whole(-a / b)))
        for c in found:
            if all(abs(f / g / d - 1) < 1e-4 for f, g, d in zip(inv_freq, c.apply(inv_freq), divisors)):
                return c
        return None


def _whole(x: float) -> float:
    """``x``, as the whole number it is within float32 divisors' round-off (64.000006: 64)."""
    return float(round(x)) if abs(x - round(x)) < 1e-4 * max(1.0, abs(x)) else round(x, 6)


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
    rope_scaling: RopeScaling | None = None    # Llama only: None keeps the trained frequencies
    qkv_bias: bool = False     # Q, K and V projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False       # the output projection does too (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False      # each Q and K head is RMS-normalised (its own weights) before rotation: Qwen3
    sliding_window: int | None = None   # a layer's token p attends to keys p - window + 1 .. p only,
    full_layers: tuple[int, ...] = ()   # except in these layers, which attend to every earlier key
    # Gemma 3: embeddings times sqrt(d_model); scores scaled by query_pre_attn_scalar ** -0.5; a
    # GELU (tanh) gate; the attention's and the MLP's outputs RMS-normalised before their residual
    # adds; every RMSNorm scaling by 1 + its stored weight; the sliding layers' own rotary base
    embed_scale: float = 1.0
    attn_scale: float | None = None    # None: head_dim ** -0.5
    gelu: bool = False                 # the MLP's gate: GELU, tanh approximation (else SiLU)
    out_norms: bool = False
    norm_offset: float = 0.0           # added to every RMSNorm weight as stored
    local_rope_theta: float | None = None   # rotary base of the layers not in full_layers, unscaled
    nope_layers: tuple[int, ...] = ()  # layers that rotate neither Q nor K (SmolLM3's every fourth)

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
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": None, "sliding_window": 4096},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "bos_token_id": 1, "eos_token_id": 32000},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
                    "sliding_window": 4096, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
    "smollm3": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6, "bos_token_id": 128000, "eos_token_id": 128001, "rope_theta": 2e6,
                "no_rope_layer_interval": 4},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": None, "sliding_window": 4096},
}


def spec_from_config_json(cfg: dict) -> ModelSpec:
    """A ModelSpec from a checkpoint's config.json as read, transformers' defaults filling what it
    leaves out: building transformers' own config object imports its model-loading and
    distributed modules, about 2 s of every start."""
    mt = cfg.get("model_type")
    if mt == "gemma3":                   # Gemma 3 4B and up, multimodal: its language model serves text
        text = cfg.get("text_config") or {}
        ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None and k not in text}
        return spec_from_config_json(text | ids | {"model_type": "gemma3_text"})
    defaults = HF_DEFAULTS.get(mt, {}) | ({"word_embed_proj_dim": cfg.get("hidden_size", 768)} if mt == "opt" else {})
    return spec_from_hf_config(SimpleNamespace(**({"model_type": mt} | defaults | cfg)))


def spec_from_hf_config(cfg) -> ModelSpec:
    """Build a ModelSpec from a transformers config, rejecting what we do not implement."""
    mt = cfg.model_type
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if mt in LLAMA_TYPES:
        gemma = mt == "gemma3_text"
        act = ((getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh") if gemma
               else getattr(cfg, "hidden_act", "silu"))
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"model: {mt} with activation {act!r} is not supported "
                             f"({'gelu_pytorch_tanh' if gemma else 'silu'})")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError(f"model: {mt} with MLP biases is not supported")
        if gemma:
            _gemma_refusals(cfg)
        heads = cfg.num_attention_heads
        attention_bias = mt in ("llama", "qwen3", "gemma3_text") and bool(getattr(cfg, "attention_bias", False))
        context, window, full = _windowed(cfg, _stretched(cfg))
        extra = dict(embed_scale=cfg.hidden_size ** 0.5, attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                     gelu=True, out_norms=True, norm_offset=1.0, local_rope_theta=_local_theta(cfg)) if gemma else {}
        if mt == "smollm3":
            extra["nope_layers"] = tuple(i for i, rotates in enumerate(_rotating(cfg)) if not rotates)
        return ModelSpec(
            family=Family.LLAMA, vocab_size=cfg.vocab_size, d_model=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            max_model_len=context, sliding_window=window, full_layers=full, norm_eps=cfg.rms_norm_eps,
            rope_theta=float(_rope(cfg)["rope_theta"]),
            bos_token_id=cfg.bos_token_id, eos_token_ids=eos_ids, rope_scaling=rope_scaling(cfg),
            qkv_bias=mt == "qwen2" or attention_bias, o_bias=attention_bias, qk_norm=mt in ("qwen3", "gemma3_text"),
            **extra)
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
    raise ValueError(f"model: architecture {mt!r} is not supported ({', '.join([*ARCHITECTURES, 'gemma3'])})")


def _gemma_refusals(cfg) -> None:
    """What of Gemma's this engine does not compute: Gemma 2's soft-capped scores and logits,
    attention both ways within the window (EmbeddingGemma)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"model: {cfg.model_type} with {name} is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"model: {cfg.model_type} with use_bidirectional_attention is not supported")


def _rotating(cfg) -> list[int]:
    """SmolLM3's no_rope_layers: 1 where a layer rotates Q and K (despite the name), 0 where it
    does not; by default every no_rope_layer_interval-th layer does not."""
    every = getattr(cfg, "no_rope_layer_interval", 4)
    return getattr(cfg, "no_rope_layers", None) or [int((i + 1) % every != 0) for i in range(cfg.num_hidden_layers)]


def _by_layer_type(cfg) -> dict:
    """transformers 5's rope_parameters of Gemma 3, one set per layer type; else {}."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return params if "full_attention" in params or "sliding_attention" in params else {}


def _local_theta(cfg) -> float:
    """Gemma 3's rotary base of its sliding layers (rope_local_base_freq before transformers 5);
    their frequencies are never scaled."""
    local = _by_layer_type(cfg).get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"model: rope type {local['rope_type']!r} in sliding layers is not supported")
    return float(local.get("rope_theta") or getattr(cfg, "rope_local_base_freq", 10000.0))


def _rope(cfg) -> dict:
    """The config's rotary settings as transformers reads them: transformers 5's
    ``rope_parameters`` (Gemma 3's of its full-attention layers) overridden by an older
    ``rope_scaling`` where there is one (a model card may say to add it to a config saved with
    the former), ``rope_theta`` from either, else from the top level."""
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if "type" in scaling:                               # the older name of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    layered = _by_layer_type(cfg)
    rope = dict(layered.get("full_attention") or {}) if layered else (getattr(cfg, "rope_parameters", None) or {})
    rope = rope | scaling
    return rope | {"rope_theta": rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))}


def rope_scaling(cfg) -> RopeScaling | None:
    """The config's frequency scaling; ValueError for a kind this engine does not compute."""
    rope = _rope(cfg)
    if float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("model: rotary embeddings over part of each head are not supported")
    kind = rope.get("rope_type") or "default"
    if kind in ("llama3", "yarn"):              # transformers' default for the trained context
        rope.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    if kind == "default":
        return None
    needs = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",)}
    if kind not in needs:
        raise ValueError(f"model: rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    missing = [k for k in needs[kind] if rope.get(k) is None]
    if missing:
        raise ValueError(f"model: {kind} rotary scaling needs {', '.join(missing)} in the config")
    if kind != "yarn":
        return RopeScaling(kind, *(float(rope[k]) for k in needs[kind]))
    original = float(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or cfg.max_position_embeddings / original)
    return RopeScaling("yarn", factor, original_max=original, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)),
                       attention=_yarn_attention(rope, factor))


def _stretched(cfg) -> int:
    """The context: max_position_embeddings, or with YaRN the trained context times the
    factor where that is longer (Qwen's cards add YaRN to a config for 4x the context, as vLLM
    derives it)."""
    scaling = rope_scaling(cfg)
    if scaling is not None and scaling.kind == "yarn":
        return max(cfg.max_position_embeddings, int(scaling.original_max * scaling.factor))
    return cfg.max_position_embeddings


def _yarn_attention(rope: dict, factor: float) -> float:
    """YaRN's scale of cos and sin: the config's attention_factor, else 0.1 m ln(factor) + 1 with
    m = mscale (DeepSeek's ratio of two such terms where mscale_all_dim is given too), 1 when
    the factor does not stretch."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def m(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return m(float(rope["mscale"])) / m(float(rope["mscale_all_dim"]))
    return m(1.0)


def _windowed(cfg, max_len: int) -> tuple[int, int | None, tuple[int, ...]]:
    """The context, the sliding window and the layers that attend fully instead, of a model whose
    layers attend within a window: Mistral 7B v0.1's 4,096 tokens and Phi-3 mini's 2,047 in every
    layer; Qwen2 and Qwen3 with use_sliding_window from layer max_window_layers on; Gemma 3 in
    five layers of every six (its full-attention ones are listed even where the window spans the
    whole context: they take the other rotary base)."""
    if cfg.model_type == "gemma3_text":
        types = getattr(cfg, "layer_types", None) or [
            "sliding_attention" if (i + 1) % getattr(cfg, "sliding_window_pattern", 6) else "full_attention"
            for i in range(cfg.num_hidden_layers)]
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
        window = getattr(cfg, "sliding_window", None)
        return max_len, (int(window) if window and window < max_len else None), full
    if cfg.model_type in ("qwen2", "qwen3", "smollm3"):
        types = getattr(cfg, "layer_types", None)      # transformers 5's; else the layers it would make
        if not types and cfg.model_type == "smollm3":  # its layers without rotary embeddings slide
            types = ["full_attention" if r else "sliding_attention" for r in _rotating(cfg)]
        elif not types:
            first = getattr(cfg, "max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg.num_hidden_layers)]
        on = getattr(cfg, "use_sliding_window", False) and "sliding_attention" in types
    else:
        on = cfg.model_type in ("mistral", "phi3")
        types = []
    window = getattr(cfg, "sliding_window", None) if on else None
    if window is None or window >= max_len:
        return max_len, None, ()
    return max_len, int(window), tuple(i for i, t in enumerate(types) if t == "full_attention")
