"""LoRA adapters, PEFT's format, applied per request inside a shared step.

An adapter adds to a projection y = x W^T the low-rank product s * (x A^T) B^T, with A [r, in],
B [out, r] and s = lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``). The base weights
stay as they are (packed, GGUF blocks, any dtype): each step's rows that run with an adapter
get its product added after the base projection, so requests on different adapters and on the
base model share one step (vLLM's multi-LoRA batching; here the runner orders a step's requests
so that each adapter's rows form one slice, and its update is two products over that slice).

The models fuse projections (Q, K and V in one; the gate and up projections in one), so an
adapter's modules are fused alike at load: for a fused projection with parts targeted,
A_cat = [A_q; A_v; ...] stacks their A matrices and B_cat [out_total, r_total] places each
part's s * B in its output rows and its own rank columns (zero elsewhere), so one product
x A_cat^T B_cat^T adds every part's update to its slice of the fused output. A hidden-cache
request's K and V, projected again from stored inputs, take the K and V rows of B_cat.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from tandem.engine.linear import linear
from tandem.engine.messages import LoraRef
from tandem.engine.models.spec import Family, ModelSpec

CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's options that change what an adapter computes, beyond A, B and the scale: refused when set
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "lora_bias", "modules_to_save": "modules_to_save",
               "trainable_token_indices": "trainable_token_indices", "layer_replication": "layer_replication",
               "target_parameters": "target_parameters", "alora_invocation_tokens": "activated LoRA",
               "use_qalora": "QALoRA", "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing",
               "fan_in_fan_out": "fan_in_fan_out", "alpha_pattern": "alpha_pattern"}
_KEY = re.compile(r"layers\.(\d+)\.(?:[A-Za-z_]+\.)*?([A-Za-z0-9_]+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter this model cannot run: the message says why."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a PEFT module's update lands: output rows [lo, hi) of the model's fused projection
    ``proj``, whose input has ``in_features`` columns."""
    proj: str
    lo: int
    hi: int
    in_features: int


def lora_targets(spec: ModelSpec) -> dict[str, Target]:
    """The modules an adapter may target, by PEFT's module name, for a model of this spec."""
    d, i = spec.d_model, spec.intermediate_size
    if spec.family is Family.OPT:
        return {"q_proj": Target("qkv", 0, d, d), "k_proj": Target("qkv", d, 2 * d, d),
                "v_proj": Target("qkv", 2 * d, 3 * d, d), "out_proj": Target("o", 0, d, d),
                "fc1": Target("up", 0, i, d), "fc2": Target("down", 0, d, i)}
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q_proj": Target("qkv", 0, q, d), "k_proj": Target("qkv", q, q + kv, d),
            "v_proj": Target("qkv", q + kv, q + 2 * kv, d), "qkv_proj": Target("qkv", 0, q + 2 * kv, d),
            "o_proj": Target("o", 0, d, q), "gate_proj": Target("up", 0, i, d), "up_proj": Target("up", i, 2 * i, d),
            "gate_up_proj": Target("up", 0, 2 * i, d), "down_proj": Target("down", 0, d, i)}


def _fused_width(targets: dict[str, Target], proj: str) -> int:
    return max(t.hi for t in targets.values() if t.proj == proj)


@dataclass(frozen=True, slots=True)
class Update:
    """An adapter's update of one fused projection: A_cat^T and B_cat^T, transposed and
    contiguous as the products read them."""
    a_t: torch.Tensor                            # [in_features, r_total]
    b_t: torch.Tensor                            # [r_total, out_total], the scale folded in

    def to(self, device, dtype: torch.dtype) -> "Update":
        return Update(self.a_t.to(device, dtype), self.b_t.to(device, dtype))

    def add(self, x: torch.Tensor, out: torch.Tensor, first: int = 0) -> torch.Tensor:
        """out += x A_cat^T B_cat[first:]^T, in place (``out`` holds the fused output from row
        ``first`` on).

        [open choice] One product over all of B_cat, the zeros outside its parts' blocks
        included (two thirds of a Q/K/V update's B_cat when all three take rank r): a product
        per part's block did the updates of 128 rows in 15% less time (rank 16 on all of
        SmolLM2's projections, float32, one thread, a 2-core Zen 2), but a 256-token prompt
        step with an adapter cost the same 66-70 ms more than on the base model either way,
        and the updates of 1-2 rows took 30% longer by blocks."""
        return out.addmm_(x @ self.a_t, self.b_t if first == 0 else self.b_t[:, first:])


@dataclass(eq=False)
class Adapter:
    """A loaded adapter, fused to the model's projections: ``weights[(layer, proj)]`` is its
    Update of that projection (none for a projection it does not target)."""
    ref: LoraRef
    weights: dict[tuple[int, str], Update]

    def add(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor, first: int = 0) -> torch.Tensor:
        """out += this adapter's update of x for this layer's ``proj``, in place (``first``: the
        first output row of the fused projection that ``out`` holds).

        [open choice] The products read A^T and B^T as stored, transposed and contiguous (the
        worker keeps them once, in the step's dtype): with transposed views and a slice at every
        call (120 calls a step), SmolLM2's decode step of 8 rows cost 12-19 ms more on one adapter
        and 34-36 ms more on four than on the base model (float32, a 2-core Zen 2, ``bench lora``,
        four runs); made contiguous, 10-11 and 24-25 ms."""
        u = self.weights.get((layer, proj))
        if u is None:
            return out
        if u.a_t.dtype != x.dtype:            # sent in another dtype than the step computes in
            u = self.weights[(layer, proj)] = u.to(x.device, x.dtype)
        return u.add(x, out, first)


@dataclass(slots=True)
class StepLora:
    """A step's rows that run with an adapter: each adapter's rows lie together (the runner
    orders a step's requests so), so its update is two products over a slice of the rows.
    ``at(layer)`` gives the callable the model applies after each projection: ``fn(proj, x,
    out) -> out`` with the updates added."""
    groups: list[tuple[Adapter, int, int]]      # (adapter, its rows [start, end) in the step)

    def at(self, layer: int):
        def add(proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            for adapter, start, end in self.groups:
                adapter.add(layer, proj, x[start:end], out[start:end])
            return out
        return add


def lora_linear(lora, name: str, x: torch.Tensor, w, b=None) -> torch.Tensor:
    """x W^T + b, and the step's adapters' updates of projection ``name`` (``lora``: what
    StepLora.at gives for this layer, or None)."""
    y = linear(x, w, b)
    return y if lora is None else lora(name, x, y)


def _config(path: str) -> dict:
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise LoraError(f"{path}: no {CONFIG} (a directory PEFT's save_pretrained wrote is expected)")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    for key, what in UNSUPPORTED.items():
        if cfg.get(key):
            raise LoraError(f"{path}: {what} ({key}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{path}: bias={cfg['bias']!r} (trained base biases) is not supported")
    if not isinstance(cfg.get("lora_alpha", 8), (int, float)):
        raise LoraError(f"{path}: lora_alpha must be a number")
    return cfg


def _tensors(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file
                    return load_file(file)
                return torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:   # a truncated or foreign file: say which
                raise LoraError(f"{file}: not readable ({type(e).__name__}: {e})") from None
    raise LoraError(f"{path}: no {' or '.join(WEIGHT_FILES)}")


def adapter_files(path: str) -> tuple[dict, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """An adapter directory's config and its LoRA matrices by (layer, PEFT module name) and A or
    B, checked for all that needs no model (LoraError)."""
    if not os.path.isdir(path):
        raise LoraError(f"{path}: no such directory")
    cfg = _config(path)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _tensors(path).items():
        m = _KEY.search(key)
        if m is None or "vision" in key:
            raise LoraError(f"{path}: {key} is not a LoRA matrix of a decoder layer's projection "
                            "(adapters on embeddings, the LM head or an image encoder are not supported)")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    if not parts:
        raise LoraError(f"{path}: the adapter holds no LoRA matrices")
    return cfg, parts


def files_version(path: str) -> str:
    """The version of an adapter's files: their sizes, times and inodes (saved again, replaced by
    another's: another version)."""
    stamps = []
    for name in (CONFIG, *WEIGHT_FILES):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        stamps.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    return ";".join(stamps)


def read_adapter(ref: LoraRef, spec: ModelSpec) -> Adapter:
    """Load and check an adapter for a model of ``spec`` (LoraError if it does not fit it): its
    fused matrices in float32 on the CPU, as workers are sent them."""
    path = ref.path
    cfg, parts = adapter_files(path)
    alpha, rslora = cfg.get("lora_alpha", 8), bool(cfg.get("use_rslora"))
    targets = lora_targets(spec)
    for layer, module in parts:
        if module not in targets:
            raise LoraError(f"{path}: module {module} is not one of this model's projections "
                            f"({', '.join(targets)})")
        if layer >= spec.num_layers:
            raise LoraError(f"{path}: layer {layer} {module}: the model has {spec.num_layers} layers")
    pieces: dict[tuple[int, str], list[tuple[Target, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b, tg = ab.get("A"), ab.get("B"), targets[module]
        if a is None or b is None:
            raise LoraError(f"{path}: layer {layer} {module} lacks its lora_{'A' if a is None else 'B'} matrix")
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != tg.in_features or b.shape != (tg.hi - tg.lo, r):
            raise LoraError(f"{path}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                            f"a projection {tg.in_features} -> {tg.hi - tg.lo} (an adapter for another model?)")
        scale = alpha / (math.sqrt(r) if rslora else r)
        pieces.setdefault((layer, tg.proj), []).append((tg, a.float(), b.float() * scale))
    weights = {}
    for (layer, proj), ps in pieces.items():
        b_t = torch.zeros(sum(a.shape[0] for _, a, _ in ps), _fused_width(targets, proj))
        col = 0
        for tg, a, b in ps:
            b_t[col:col + a.shape[0], tg.lo:tg.hi] += b.T
            col += a.shape[0]
        weights[(layer, proj)] = Update(torch.cat([a for _, a, _ in ps]).T.contiguous(), b_t)
    return Adapter(ref, weights)
