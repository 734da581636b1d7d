"""Past prompts and their real output lengths, searched by cosine similarity (hnswlib).

Vectors are unit length, so hnswlib's inner-product space gives distance = 1 - cosine.
The index grows by doubling; ``lengths[i]`` is the output length of the prompt with id i.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

_INITIAL = 1024
_EF_CONSTRUCTION = 200
_M = 16


class LengthIndex:
    def __init__(self, dim: int, capacity: int = _INITIAL, ef: int = 40):
        import hnswlib
        self.dim = dim
        self.ef = ef
        self._index = hnswlib.Index(space="ip", dim=dim)
        self._index.init_index(max_elements=max(capacity, 1), ef_construction=_EF_CONSTRUCTION, M=_M)
        self._index.set_ef(ef)
        self.lengths = np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, vectors: np.ndarray, lengths) -> None:
        """Add unit vectors [n, dim] with their output lengths."""
        vectors = np.asarray(vectors, np.float32).reshape(-1, self.dim)
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        if len(vectors) != len(lengths):
            raise ValueError("one length per vector")
        n0, n = len(self), len(vectors)
        if n == 0:
            return
        cap = self._index.get_max_elements()
        if n0 + n > cap:
            self._index.resize_index(max(2 * cap, n0 + n))
        self._index.add_items(vectors, np.arange(n0, n0 + n), num_threads=1)
        self.lengths = np.concatenate([self.lengths, lengths])

    def query(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(similarities [n, k'], lengths [n, k']) of the k' = min(k, size) nearest past prompts,
        most similar first."""
        vectors = np.asarray(vectors, np.float32).reshape(-1, self.dim)
        k = min(k, len(self))
        if k == 0:
            empty = np.zeros((len(vectors), 0))
            return empty, empty.astype(np.int32)
        self._index.set_ef(max(self.ef, k))
        ids, dist = self._index.knn_query(vectors, k=k, num_threads=1)
        return 1.0 - dist, self.lengths[ids]

    def save(self, directory: Path) -> None:
        self._index.save_index(str(directory / "index.bin"))
        np.save(directory / "lengths.npy", self.lengths)

    @classmethod
    def load(cls, directory: Path, dim: int) -> "LengthIndex":
        import hnswlib
        self = cls.__new__(cls)
        self.dim, self.ef = dim, 40
        self.lengths = np.load(directory / "lengths.npy").astype(np.int32)
        self._index = hnswlib.Index(space="ip", dim=dim)
        self._index.load_index(str(directory / "index.bin"), max_elements=max(len(self.lengths), _INITIAL))
        self._index.set_ef(self.ef)
        if self._index.get_current_count() != len(self.lengths):
            raise ValueError(f"{directory}: index and lengths disagree")
        return self
