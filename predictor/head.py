"""The fallback when no past prompt is similar enough: a small MLP on the prompt's embedding.

Its input is the embedding and log(1 + the prompt's length in characters) / 10: the
encoder reads only the prompt's head, so its length comes in beside it. It regresses
log(1 + output length) with an L1 loss, so it estimates the conditional median
of the output length (the median is what minimises mean absolute error, and it is
unchanged by the monotone log), which keeps long-tailed replies from dragging it up.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def features(vectors: np.ndarray, chars) -> np.ndarray:
    """The MLP's input: [embedding, log1p(prompt characters) / 10]."""
    c = np.log1p(np.asarray(chars, np.float32).reshape(-1, 1)) / 10.0
    return np.concatenate([np.asarray(vectors, np.float32), c], axis=1)


class LengthHead:
    def __init__(self, dim: int, hidden: int = 256):
        import torch
        self.dim, self.hidden = dim, hidden
        self.net = torch.nn.Sequential(torch.nn.Linear(dim + 1, hidden), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1))
        self.net.eval()

    def predict(self, vectors: np.ndarray, chars) -> np.ndarray:
        """Predicted lengths (float, >= 1) for unit vectors [n, dim] of prompts ``chars`` long."""
        import torch
        with torch.inference_mode():
            y = self.net(torch.from_numpy(features(vectors, chars))).squeeze(-1)
        return np.maximum(np.expm1(y.numpy().astype(np.float64)), 1.0)

    def fit(self, vectors: np.ndarray, chars, lengths, *, epochs: int = 80, lr: float = 1e-3,
            weight_decay: float = 1e-4, seed: int = 0, progress: bool = False) -> list[float]:
        """Adam on the L1 loss in log space, minibatches of 128; returns the loss per epoch.
        ``progress``: a progress bar over the epochs (tqdm)."""
        import torch
        torch.manual_seed(seed)
        x = torch.from_numpy(features(vectors, chars))
        y = torch.from_numpy(np.log1p(np.asarray(lengths, np.float32)))
        with torch.no_grad():                       # start at the median
            self.net[-1].bias.fill_(float(y.median()))
        opt = torch.optim.Adam(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        self.net.train()
        rounds = range(epochs)
        if progress:
            from tqdm import tqdm
            rounds = tqdm(rounds, desc="fitting the MLP", unit="epoch")
        for _ in rounds:
            total = 0.0
            for idx in torch.randperm(len(x), generator=gen).split(128):
                loss = (self.net(x[idx]).squeeze(-1) - y[idx]).abs().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            losses.append(total / max(len(x), 1))
        self.net.eval()
        return losses

    def save(self, path: Path) -> None:
        import torch
        torch.save(self.net.state_dict(), path)

    @classmethod
    def load(cls, path: Path, dim: int, hidden: int) -> "LengthHead":
        import torch
        self = cls(dim, hidden)
        self.net.load_state_dict(torch.load(path, weights_only=True))
        self.net.eval()
        return self
