"""OPT family forward (pre-LayerNorm, learned positions, multi-head attention, ReLU)."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention import AttnBatch, HiddenProjection, paged_attention
from tandem.engine.linear import embedding, is_packed, linear, pack_head, pack_into
from tandem.engine.lora import StepLora, lora_linear
from tandem.engine.models.spec import ModelSpec

POS_OFFSET = 2   # OPT's learned position table is shifted by two rows


def _p(*shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class OPTLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        d, f = spec.d_model, spec.intermediate_size
        self.ln1_w, self.ln1_b = _p(d, dtype=dtype), _p(d, dtype=dtype)
        self.qkv_w, self.qkv_b = _p(3 * d, d, dtype=dtype), _p(3 * d, dtype=dtype)
        self.out_w, self.out_b = _p(d, d, dtype=dtype), _p(d, dtype=dtype)
        self.ln2_w, self.ln2_b = _p(d, dtype=dtype), _p(d, dtype=dtype)
        self.fc1_w, self.fc1_b = _p(f, d, dtype=dtype), _p(f, dtype=dtype)
        self.fc2_w, self.fc2_b = _p(d, f, dtype=dtype), _p(d, dtype=dtype)
        self.register_buffer("kv_w", None, persistent=False)   # the K/V rows of qkv_w, once packed


class OPTModel(nn.Module):
    ROW_PROJECTIONS = ("qkv_w", "out_w", "fc1_w", "fc2_w")     # each layer's weights every token row takes

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.embed = _p(spec.vocab_size, spec.d_model, dtype=dtype)
        self.pos = _p(spec.max_model_len + POS_OFFSET, spec.d_model, dtype=dtype)
        self.layers = nn.ModuleList(OPTLayer(spec, dtype) for _ in range(spec.num_layers))
        self.lnf_w, self.lnf_b = _p(spec.d_model, dtype=dtype), _p(spec.d_model, dtype=dtype)
        self.lm_head = self.embed

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a HF OPTForCausalLM state dict into the fused parameters."""
        def g(name):
            return sd[name].to(self.embed.dtype)
        pre = "model.decoder."
        with torch.no_grad():
            self.embed.copy_(g(pre + "embed_tokens.weight"))
            self.pos.copy_(g(pre + "embed_positions.weight"))
            self.lnf_w.copy_(g(pre + "final_layer_norm.weight"))
            self.lnf_b.copy_(g(pre + "final_layer_norm.bias"))
            if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd[pre + "embed_tokens.weight"]):
                self.lm_head = nn.Parameter(g("lm_head.weight"), requires_grad=False)
            for i, L in enumerate(self.layers):
                p = f"{pre}layers.{i}."
                L.ln1_w.copy_(g(p + "self_attn_layer_norm.weight"))
                L.ln1_b.copy_(g(p + "self_attn_layer_norm.bias"))
                L.qkv_w.copy_(torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                L.qkv_b.copy_(torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                L.out_w.copy_(g(p + "self_attn.out_proj.weight"))
                L.out_b.copy_(g(p + "self_attn.out_proj.bias"))
                L.ln2_w.copy_(g(p + "final_layer_norm.weight"))
                L.ln2_b.copy_(g(p + "final_layer_norm.bias"))
                L.fc1_w.copy_(g(p + "fc1.weight"))
                L.fc1_b.copy_(g(p + "fc1.bias"))
                L.fc2_w.copy_(g(p + "fc2.weight"))
                L.fc2_b.copy_(g(p + "fc2.bias"))

    def pack_weights(self, ops=None, blocks: bool = True, dtype: torch.dtype = torch.float32) -> None:
        """Pack every projection and the LM head for the CPU's GEMM (engine.linear); with
        ``blocks``, weights that are exactly a GGUF's blocks stay in them (the token embedding
        too, for lookups; else it stays dense, as the positions' table always does). With
        ``dtype`` bfloat16 (a model built in float32): dense bfloat16 weights, and beside them the
        blocks for thin products."""
        d = self.spec.d_model
        for L in self.layers:
            pack_into(L, "kv_w", L.qkv_w[d:], ops, blocks, dtype)
            for name in self.ROW_PROJECTIONS:
                pack_into(L, name, getattr(L, name), ops, blocks, dtype)
        pack_head(self, ops, blocks, dtype)

    def _kv(self, li: int, w, b, xs: torch.Tensor, pos: torch.Tensor, adapter=None):
        """K and V of stored post-norm inputs (OPT's attention has no positions), with a
        request's adapter's updates of the K and V rows."""
        y = linear(xs, w, b)
        if adapter is not None:
            y = adapter.add(li, "qkv", xs, y, first=self.spec.d_model)
        return y.split([self.spec.d_model] * 2, dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                batch: AttnBatch, logit_rows: torch.Tensor, lora: StepLora | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; pool: [layers, heads, slots, head_dim]; returns logits
        [len(logit_rows), V]. ``lora``: the step's rows that run with adapters."""
        s = self.spec
        d = s.d_model
        h = embedding(input_ids, self.embed) + self.pos[positions + POS_OFFSET]
        scale = s.head_dim ** -0.5
        for li, L in enumerate(self.layers):
            ll = None if lora is None else lora.at(li)
            x = F.layer_norm(h, (d,), L.ln1_w, L.ln1_b, s.norm_eps)
            q, k, v = lora_linear(ll, "qkv", x, L.qkv_w, L.qkv_b).split([d, d, d], dim=-1)
            kv = None
            if batch.hidden is not None:   # K and V of stored post-norm inputs (no positions in OPT attention)
                kv_w = L.kv_w if L.kv_w is not None else L.qkv_w[d:]
                kv = HiddenProjection(partial(self._kv, li, kv_w, L.qkv_b[d:]), None if is_packed(kv_w) else kv_w,
                                      L.qkv_b[d:])
            a = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), pool[li], batch,
                                s.num_heads, s.num_kv_heads, s.head_dim, scale, x, kv)
            h = h + lora_linear(ll, "o", a, L.out_w, L.out_b)
            x = F.layer_norm(h, (d,), L.ln2_w, L.ln2_b, s.norm_eps)
            h = h + lora_linear(ll, "down", F.relu(lora_linear(ll, "up", x, L.fc1_w, L.fc1_b)), L.fc2_w, L.fc2_b)
        h = F.layer_norm(h[logit_rows], (d,), self.lnf_w, self.lnf_b, s.norm_eps)
        return linear(h, self.lm_head).float()
