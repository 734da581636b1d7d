"""Past prompts and their real output lengths, searched by cosine similarity (hnswlib).

Vectors are unit length, so hnswlib's inner-product space gives distance = 1 - cosine.
The index grows by doubling; ``lengths[i]`` is the output length of the prompt with id i.

The first ``kept`` entries (the trained ones) stay for good. Those learned after them are
bounded by ``max_learned``: once that many, each new one takes the place of the oldest learned
one (hnswlib updates that element's vector and its links in place), so the index of a server
that learns from every request it finishes (about 2 KB each) stops growing there.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_INITIAL = 1024
_EF_CONSTRUCTION = 200
_M = 16


class LengthIndex:
    def __init__(self, dim: int, capacity: int = _INITIAL, ef: int = 40, max_learned: int | None = None):
        import hnswlib
        self.dim = dim
        self.ef = ef
        self._index = hnswlib.Index(space="ip", dim=dim)
        self._index.init_index(max_elements=max(capacity, 1), ef_construction=_EF_CONSTRUCTION, M=_M)
        self._index.set_ef(ef)
        self.lengths = np.zeros(0, np.int32)
        self.kept = 0                   # entries never replaced (``keep_all``)
        self.max_learned = max_learned  # entries after them kept at most (None: no bound)
        self.replaced = 0               # learned entries replaced so far: the oldest is next

    def keep_all(self) -> None:
        """The entries so far stay for good (a trained seed); only later ones are bounded."""
        self.kept = len(self)

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, vectors: np.ndarray, lengths) -> None:
        """Add unit vectors [n, dim] with their output lengths."""
        vectors = np.asarray(vectors, np.float32).reshape(-1, self.dim)
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        if len(vectors) != len(lengths):
            raise ValueError("one length per vector")
        room = len(vectors) if self.max_learned is None else max(0, self.kept + self.max_learned - len(self))
        self._append(vectors[:room], lengths[:room])
        self._replace(vectors[room:], lengths[room:])

    def _append(self, vectors: np.ndarray, lengths: np.ndarray) -> None:
        n0, n = len(self), len(vectors)
        if n == 0:
            return
        cap = self._index.get_max_elements()
        if n0 + n > cap:
            bound = np.inf if self.max_learned is None else self.kept + self.max_learned
            self._index.resize_index(int(min(max(2 * cap, n0 + n), max(bound, n0 + n))))
        self._index.add_items(vectors, np.arange(n0, n0 + n), num_threads=1)
        self.lengths = np.concatenate([self.lengths, lengths])

    def _replace(self, vectors: np.ndarray, lengths: np.ndarray) -> None:
        """Each of them in the place of the oldest learned entry (the bound is reached)."""
        ring = len(self) - self.kept
        if len(vectors) == 0 or ring <= 0:
            return
        vectors, lengths = vectors[-ring:], lengths[-ring:]        # earlier ones would be replaced at once
        ids = self.kept + (self.replaced + np.arange(len(vectors))) % ring
        self._index.add_items(vectors, ids, num_threads=1)         # an existing id: updated in place
        self.lengths[ids] = lengths
        self.replaced += len(vectors)

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
        (directory / "ring.json").write_text(json.dumps({"kept": self.kept, "replaced": self.replaced}))

    @classmethod
    def load(cls, directory: Path, dim: int, max_learned: int | None = None) -> "LengthIndex":
        """The index saved in ``directory``; one saved without ``ring.json`` keeps all its entries."""
        import hnswlib
        self = cls.__new__(cls)
        self.dim, self.ef, self.max_learned = dim, 40, max_learned
        self.lengths = np.load(directory / "lengths.npy").astype(np.int32)
        ring = directory / "ring.json"
        state = json.loads(ring.read_text()) if ring.is_file() else {"kept": len(self.lengths), "replaced": 0}
        self.kept, self.replaced = int(state["kept"]), int(state["replaced"])
        self._index = hnswlib.Index(space="ip", dim=dim)
        room = _INITIAL if max_learned is None else min(_INITIAL, self.kept + max_learned)
        self._index.load_index(str(directory / "index.bin"), max_elements=max(len(self.lengths), room))
        self._index.set_ef(self.ef)
        if self._index.get_current_count() != len(self.lengths):
            raise ValueError(f"{directory}: index and lengths disagree")
        return self
