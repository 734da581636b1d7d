"""A second opinion that reads the whole prompt: hashed words and word pairs.

The encoder reads only a prompt's first few word pieces (that is what keeps it cheap), yet
what sets a reply's length is often further on: "in 500 words", a pasted program with
"fix this" at its end, "answer yes or no". This head reads every word, at a cost of well
under a millisecond per prompt:

    x = [ Σ_f E[f] / √|F|,  numeric(prompt) ]       F: the prompt's hashed features
    ŷ = MLP(x) ≈ median of log(1 + output tokens)  (L1 loss, as the embedding head)

F holds each lower-cased word and each pair of neighbouring words anywhere in the prompt,
and the first and last ``EDGE`` words once more under their own tag (instructions sit at
the edges of pasted text), each hashed by CRC-32 into ``BUCKETS`` rows of E. numeric(·)
is the prompt's log length in characters, words and lines, and its counts of question
marks, code punctuation and digits. On held-in validation records (ShareGPT 12,000-15,000,
fitted on the records before) it alone ranks lengths better than the embedding head
(Spearman 0.50 against 0.44), and their geometric mean better than either (0.53).
"""
from __future__ import annotations

import math
import re
import zlib
from pathlib import Path

import numpy as np

BUCKETS = 1 << 18
WIDTH = 64                   # columns of E
EDGE = 16                    # words at each end of the prompt tagged as such
NUMERIC = 6
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def split_words(text: str) -> list[str]:
    """The prompt's lower-cased words and punctuation marks, in order."""
    return _WORD.findall(text.lower())


def hashed(text: str, words: list[str] | None = None) -> list[int]:
    """The rows of E a prompt reads: its distinct features, hashed (stable across processes).
    ``words``: the prompt's ``split_words``, when the caller has them already."""
    words = split_words(text) if words is None else words
    feats = {"u:" + w for w in words}
    feats.update("b:" + a + " " + b for a, b in zip(words, words[1:]))
    feats.update("h:" + w for w in words[:EDGE])
    feats.update("t:" + w for w in words[-EDGE:])
    return sorted(zlib.crc32(f.encode()) % BUCKETS for f in feats)


def numeric(text: str, words: list[str]) -> list[float]:
    """Scaled logs of the prompt's size and of a few character counts."""
    return [math.log1p(len(text)) / 10, math.log1p(len(words)) / 10, math.log1p(text.count("\n")) / 5,
            math.log1p(text.count("?")) / 3, math.log1p(sum(text.count(c) for c in "{};=<>")) / 5,
            math.log1p(sum(c.isdigit() for c in text)) / 5]


class TextHead:
    def __init__(self, hidden: int = 256):
        import torch
        self.hidden = hidden
        self.bag = torch.nn.EmbeddingBag(BUCKETS, WIDTH, mode="sum", sparse=True)
        torch.nn.init.normal_(self.bag.weight, 0.0, 0.01)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH + NUMERIC, hidden), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))
        self.bag.eval()
        self.mlp.eval()

    def _forward(self, feats: list[list[int]], nums: np.ndarray):
        import torch
        flat = torch.tensor([h for f in feats for h in f], dtype=torch.long)
        offsets = torch.tensor(np.cumsum([0] + [len(f) for f in feats[:-1]]), dtype=torch.long)
        weights = torch.cat([torch.full((len(f),), 1.0 / math.sqrt(max(len(f), 1))) for f in feats])
        x = torch.cat([self.bag(flat, offsets, per_sample_weights=weights), torch.from_numpy(nums)], dim=1)
        return self.mlp(x).squeeze(-1)

    @staticmethod
    def inputs(texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
        """Each text's hashed features and its numeric ones (its words split once)."""
        split = [split_words(t) for t in texts]
        return ([hashed(t, w) for t, w in zip(texts, split)],
                np.array([numeric(t, w) for t, w in zip(texts, split)], np.float32).reshape(-1, NUMERIC))

    def predict(self, texts: list[str]) -> np.ndarray:
        """Predicted lengths (float, >= 1) of ``texts``."""
        import torch
        if not texts:
            return np.zeros(0)
        feats, nums = self.inputs(texts)
        with torch.inference_mode():
            y = self._forward(feats, nums)
        return np.maximum(np.expm1(y.numpy().astype(np.float64)), 1.0)

    def fit(self, texts: list[str], lengths, *, epochs: int = 40, lr: float = 1e-3, seed: int = 0,
            progress: bool = False) -> list[float]:
        """L1 loss in log space, minibatches of 128: sparse Adam on E, Adam on the MLP.
        Returns the loss per epoch."""
        import torch
        torch.manual_seed(seed)
        feats, nums = self.inputs(texts)
        y = torch.from_numpy(np.log1p(np.asarray(lengths, np.float32)))
        with torch.no_grad():                       # start at the median
            self.mlp[-1].bias.fill_(float(y.median()))
        opts = (torch.optim.Adam(self.mlp.parameters(), lr=lr, weight_decay=1e-5),
                torch.optim.SparseAdam(list(self.bag.parameters()), lr=lr))
        gen = torch.Generator().manual_seed(seed)
        rounds = range(epochs)
        if progress:
            from tqdm import tqdm
            rounds = tqdm(rounds, desc="fitting the text head", unit="epoch")
        losses = []
        self.bag.train()
        self.mlp.train()
        for _ in rounds:
            total = 0.0
            for idx in torch.randperm(len(y), generator=gen).split(128):
                ids = idx.tolist()
                loss = (self._forward([feats[i] for i in ids], nums[ids]) - y[idx]).abs().mean()
                for o in opts:
                    o.zero_grad()
                loss.backward()
                for o in opts:
                    o.step()
                total += loss.item() * len(ids)
            losses.append(total / max(len(y), 1))
        self.bag.eval()
        self.mlp.eval()
        return losses

    def save(self, path: Path) -> None:
        """E in half precision (its entries are small; it is most of the file), the MLP as is."""
        import torch
        torch.save({"bag": self.bag.weight.detach().half(), "mlp": self.mlp.state_dict()}, path)

    @classmethod
    def load(cls, path: Path, hidden: int) -> "TextHead":
        import torch
        state = torch.load(path, weights_only=True)
        self = cls(hidden)
        with torch.no_grad():
            self.bag.weight.copy_(state["bag"].float())
        self.mlp.load_state_dict(state["mlp"])
        return self
