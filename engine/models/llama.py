"""Llama family forward (RMSNorm, rotary embeddings, grouped-query attention, SiLU MLP): Llama,
Mistral, Qwen2 (its Q/K/V projections carry biases), Qwen3 (each Q and K head RMS-normalised
before its rotation), Phi-3 (its projections stored fused, as these layers keep them),
Gemma 3 (text: the outputs of attention and MLP normalised too, a GELU gate, scaled
embeddings, another rotary base in its sliding layers) and SmolLM3 (some layers without
rotary embeddings) checkpoints."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention import AttnBatch, HiddenProjection, paged_attention
from tandem.engine.linear import embedding, is_packed, linear, pack_head, pack_into
from tandem.engine.lora import StepLora, lora_linear
from tandem.engine.models.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as HF does (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(spec: ModelSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_model_len, head_dim], HF's rotary layout (halves duplicated), the
    frequencies scaled as the model's config says (``ModelSpec.rope_scaling``)."""
    hd = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = getattr(spec, "rope_scaling", None)
    if scaling is not None:
        inv_freq = torch.tensor(scaling.apply(inv_freq.tolist(), spec.rope_theta), dtype=torch.float32)
    pos = torch.arange(spec.max_model_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling is not None and scaling.attention != 1.0:          # YaRN's attention scale
        cos, sin = cos * scaling.attention, sin * scaling.attention
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, hd]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def attn_in(h, in_norm, qkv_w, qkv_b, qk_norm, cos, sin, eps: float, nh: int, nkv: int, hd: int, lora=None):
    """Pre-attention: RMSNorm, fused QKV projection (``qkv_b``: its bias or None), the Q and K
    heads' own RMSNorm (``qk_norm``: their weights [2, hd], or None), rotary embeddings (none
    where ``cos`` is None). ``lora``: the step's adapters at this layer (engine.lora.StepLora.at).
    h: [T, d]. Returns q, k, v and the post-norm input x (what a hidden cache stores)."""
    x = rms_norm(h, in_norm, eps)
    qkv = lora_linear(lora, "qkv", x, qkv_w, qkv_b)
    t = qkv.shape[0]
    qk = qkv[:, :(nh + nkv) * hd].view(t, nh + nkv, hd)
    if qk_norm is not None:
        qk = torch.cat([rms_norm(qk[:, :nh], qk_norm[0], eps), rms_norm(qk[:, nh:], qk_norm[1], eps)], dim=1)
    if cos is not None:
        qk = apply_rope(qk, cos, sin)                                           # Q and K heads at once
    q, k = qk.reshape(t, -1).split([nh * hd, nkv * hd], dim=-1)
    return q, k.contiguous(), qkv[:, (nh + nkv) * hd:].contiguous(), x


def attn_out_mlp(h, a, o_w, o_b, post_norm, gate_up_w, down_w, eps: float, out_norm=None, gelu: bool = False,
                 lora=None):
    """Post-attention: output projection (``o_b``: its bias or None) + residual, RMSNorm, SiLU MLP
    + residual. ``out_norm``: Gemma's RMSNorm weights [2, d] of the attention's and the MLP's
    outputs, applied before each residual add; ``gelu``: the gate is a GELU (tanh approximation)."""
    o = lora_linear(lora, "o", a, o_w, o_b)
    h = h + (o if out_norm is None else rms_norm(o, out_norm[0], eps))
    x = rms_norm(h, post_norm, eps)
    gate, up = lora_linear(lora, "up", x, gate_up_w).chunk(2, dim=-1)
    m = lora_linear(lora, "down", (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up, down_w)
    return h + (m if out_norm is None else rms_norm(m, out_norm[1], eps))


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        s = spec
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.in_norm = nn.Parameter(torch.empty(s.d_model, dtype=dtype), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv_out, s.d_model, dtype=dtype), requires_grad=False)
        self.qkv_b = nn.Parameter(torch.empty(qkv_out, dtype=dtype), requires_grad=False) if s.qkv_bias else None
        self.o = nn.Parameter(torch.empty(s.d_model, s.num_heads * s.head_dim, dtype=dtype),
                              requires_grad=False)
        self.o_b = nn.Parameter(torch.empty(s.d_model, dtype=dtype), requires_grad=False) if s.o_bias else None
        self.qk_norm = nn.Parameter(torch.empty(2, s.head_dim, dtype=dtype), requires_grad=False) if s.qk_norm else None
        self.post_norm = nn.Parameter(torch.empty(s.d_model, dtype=dtype), requires_grad=False)
        self.out_norm = (nn.Parameter(torch.empty(2, s.d_model, dtype=dtype), requires_grad=False)
                         if s.out_norms else None)
        self.gate_up = nn.Parameter(torch.empty(2 * s.intermediate_size, s.d_model, dtype=dtype),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(s.d_model, s.intermediate_size, dtype=dtype),
                                 requires_grad=False)
        self.register_buffer("kv", None, persistent=False)   # the K/V rows of qkv, once packed


def _fused(sd, g, prefix: str, name: str, parts: tuple[str, ...]) -> torch.Tensor:
    """The weight of the fused projection ``name``: stored so (Phi-3's qkv_proj and
    gate_up_proj), else its parts' stacked in order."""
    fused = f"{prefix}{name}_proj.weight"
    return g(fused) if fused in sd else torch.cat([g(f"{prefix}{n}_proj.weight") for n in parts])


class LlamaModel(nn.Module):
    """Weights as fused parameters; ``forward`` runs one engine step over the paged pool."""

    ROW_PROJECTIONS = ("qkv", "o", "gate_up", "down")     # each layer's weights every token row takes

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.d_model, dtype=dtype),
                                  requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.d_model, dtype=dtype), requires_grad=False)
        self.lm_head = self.embed      # replaced when embeddings are not tied
        self.attn_in, self.attn_out_mlp = attn_in, attn_out_mlp   # engine.compiled may swap these
        cos, sin = rope_tables(spec, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        local = (rope_tables(dataclasses.replace(spec, rope_theta=spec.local_rope_theta, rope_scaling=None), dtype)
                 if spec.local_rope_theta is not None else (None, None))
        self.register_buffer("cos_local", local[0], persistent=False)   # Gemma 3's sliding layers
        self.register_buffer("sin_local", local[1], persistent=False)
        self.register_buffer("embed_scale", torch.tensor(spec.embed_scale, dtype=dtype), persistent=False)

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a HF LlamaForCausalLM state dict into the fused parameters."""
        def g(name):
            return sd[name].to(self.embed.dtype)

        def norm(name):          # Gemma scales by 1 + the stored weight, added in float32 as HF does
            return (sd[name].float() + self.spec.norm_offset).to(self.embed.dtype)
        with torch.no_grad():
            self.embed.copy_(g("model.embed_tokens.weight"))
            self.norm.copy_(norm("model.norm.weight"))
            if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
                self.lm_head = nn.Parameter(g("lm_head.weight"), requires_grad=False)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.in_norm.copy_(norm(p + "input_layernorm.weight"))
                if layer.out_norm is None:
                    layer.post_norm.copy_(norm(p + "post_attention_layernorm.weight"))
                else:            # Gemma: that one normalises the attention's output; the MLP's input has its own
                    layer.post_norm.copy_(norm(p + "pre_feedforward_layernorm.weight"))
                    layer.out_norm.copy_(torch.stack([norm(p + f"{n}.weight") for n in
                                                      ("post_attention_layernorm", "post_feedforward_layernorm")]))
                layer.qkv.copy_(_fused(sd, g, p + "self_attn.", "qkv", ("q", "k", "v")))
                layer.o.copy_(g(p + "self_attn.o_proj.weight"))
                if layer.qkv_b is not None:
                    layer.qkv_b.copy_(torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                if layer.o_b is not None:
                    layer.o_b.copy_(g(p + "self_attn.o_proj.bias"))
                if layer.qk_norm is not None:
                    layer.qk_norm.copy_(torch.stack([norm(p + f"self_attn.{n}_norm.weight") for n in "qk"]))
                layer.gate_up.copy_(_fused(sd, g, p + "mlp.", "gate_up", ("gate", "up")))
                layer.down.copy_(g(p + "mlp.down_proj.weight"))

    def pack_weights(self, ops=None, blocks: bool = True, dtype: torch.dtype = torch.float32) -> None:
        """Pack every projection and the LM head for the CPU's GEMM (engine.linear); with
        ``blocks``, weights that are exactly a GGUF's blocks stay in them (the embedding table
        too, for lookups; else it stays dense). With ``dtype`` bfloat16 (a model built in
        float32): dense bfloat16 weights, and beside them the blocks for thin products."""
        kv_rows = self.spec.num_heads * self.spec.head_dim
        for layer in self.layers:
            pack_into(layer, "kv", layer.qkv[kv_rows:], ops, blocks, dtype)
            for name in self.ROW_PROJECTIONS:
                pack_into(layer, name, getattr(layer, name), ops, blocks, dtype)
        pack_head(self, ops, blocks, dtype)

    def _tables(self, li: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer li's rotary tables: a Gemma 3 sliding layer's own, none for a SmolLM3 layer that
        does not rotate, else the model's."""
        if li in self.spec.nope_layers:
            return None, None
        if self.cos_local is None or li in self.spec.full_layers:
            return self.cos, self.sin
        return self.cos_local, self.sin_local

    def _kv_from_hidden(self, layer: LlamaLayer, li: int):
        """K (rotated at the given positions) and V of stored post-norm inputs x: [n, d]."""
        s = self.spec
        cos_t, sin_t = self._tables(li)
        q_rows = s.num_heads * s.head_dim
        w = layer.kv if layer.kv is not None else layer.qkv[q_rows:]
        b = layer.qkv_b[q_rows:] if layer.qkv_b is not None else None
        width = s.num_kv_heads * s.head_dim

        def kv(x: torch.Tensor, pos: torch.Tensor, adapter=None):
            y = linear(x, w, b)
            if adapter is not None:           # the adapter's updates of the K and V rows
                y = adapter.add(li, "qkv", x, y, first=q_rows)
            k, v = y.split([width, width], dim=-1)
            k = k.reshape(-1, s.num_kv_heads, s.head_dim)
            if layer.qk_norm is not None:
                k = rms_norm(k, layer.qk_norm[1], s.norm_eps)
            if cos_t is not None:
                k = apply_rope(k, cos_t[pos], sin_t[pos])
            return k.reshape(-1, width), v.contiguous()
        # packed weights serve the CPU path only; the Triton kernel has no per-head norm of K
        dense = None if is_packed(w) or layer.qk_norm is not None else w
        return HiddenProjection(kv, dense, b, cos_t, sin_t)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                batch: AttnBatch, logit_rows: torch.Tensor, lora: StepLora | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; pool: [layers, kv_heads, slots, head_dim]; returns logits
        [len(logit_rows), V]. ``lora``: the step's rows that run with adapters."""
        s = self.spec
        h = embedding(input_ids, self.embed)                         # [T, d]
        if s.embed_scale != 1.0:
            h = h * self.embed_scale
        rot = {id(t): t[positions] for t in (self.cos, self.sin, self.cos_local, self.sin_local) if t is not None}
        scale = s.attn_scale or s.head_dim ** -0.5
        # a step with adapters takes the eager functions (engine.compiled compiles those without)
        fn_in, fn_out = (self.attn_in, self.attn_out_mlp) if lora is None else (attn_in, attn_out_mlp)
        for li, layer in enumerate(self.layers):
            cos, sin = (None if t is None else rot[id(t)] for t in self._tables(li))   # [T, hd]
            ll = None if lora is None else lora.at(li)
            q, k, v, x = fn_in(h, layer.in_norm, layer.qkv, layer.qkv_b, layer.qk_norm, cos, sin,
                               s.norm_eps, s.num_heads, s.num_kv_heads, s.head_dim, ll)
            kv = self._kv_from_hidden(layer, li) if batch.hidden is not None else None
            lb = batch if batch.windowed is None or li in s.full_layers else batch.windowed
            a = paged_attention(q, k, v, pool[li], lb, s.num_heads, s.num_kv_heads, s.head_dim, scale, x, kv)
            h = fn_out(h, a, layer.o, layer.o_b, layer.post_norm, layer.gate_up, layer.down,
                       s.norm_eps, layer.out_norm, s.gelu, ll)
        h = rms_norm(h[logit_rows], self.norm, s.norm_eps)
        return linear(h, self.lm_head).float()
