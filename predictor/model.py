"""Retrieval-based output-length prediction (ALISE, SPEC §3.1).

    V = Enc(prompt)                                # unit vector
    (S, L) = the k most similar past prompts and their real output lengths
    if max(S) >= s0:  L̂ = Σ_{s >= s0} s·len / Σ_{s >= s0} s      (retrieval)
    else:             L̂ = √( Text(prompt) · (½·MLP(V) + ½·wmedian(len; weights max(S, 0))) )   (fallback)
    spread:           SPREAD equally likely lengths, the similarity-weighted quantiles of the
                      same neighbours' lengths (fallback: of all k, scaled so their median is L̂)
    on finish:        add (V, real length) to the index

The fallback departs from the paper's MLP alone: neighbours below the threshold still
say something, and on held-in validation records (ShareGPT 12,000-15,000, fitted on the
records before) averaging the MLP with their similarity-weighted median cut the mean
absolute error by about 3% (``blend=False`` restores the MLP alone). Text(prompt) is a
second head that reads the whole prompt's words where the encoder reads its first few
(predictor/text.py); the geometric mean with it cut the same validation error by another 5%
and raised the rank correlation with the real lengths from 0.45 to 0.53 (``text_hidden=0``
leaves it out).

The spread is what a scheduler needs to rank a request that has outlived part of it (see
sched/alise.py, the Gittins index); L̂ is what it needs to budget memory.

Everything here is numbers in, numbers out; the scheduler decides what they mean.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from tandem.paths import cache_dir
from tandem.predictor.embed import DEFAULT_MAX_TOKENS, DIM, Embedder
from tandem.predictor.head import LengthHead
from tandem.predictor.index import LengthIndex
from tandem.predictor.text import TextHead

FORMAT = 1
SPREAD = 8                   # points of a prediction's length distribution
# [open choice] real lengths learned online kept at most, beyond the trained ones: about 200 MB
# of index (hnswlib preallocates it as the index grows); then the newest replaces the oldest
MAX_LEARNED = 100_000


def default_dir() -> Path:
    """Where ``python -m predictor train`` writes the seed predictor and ``load(None)`` reads it."""
    return cache_dir() / "predictor"


@dataclass(frozen=True, slots=True)
class Settings:
    k: int = 30                  # neighbours looked up
    threshold: float = 0.9       # s0: the least cosine similarity that counts as a match
    max_tokens: int = DEFAULT_MAX_TOKENS   # encoder tokens read per prompt
    hidden: int = 512            # width of the fallback MLP
    blend: bool = True           # fallback: MLP averaged with the neighbours' weighted median
    text_hidden: int = 256       # width of the text head's MLP (0: no text head)


@dataclass(frozen=True, slots=True)
class Prediction:
    length: int                  # predicted output tokens (>= 1)
    retrieved: bool              # True: from similar past prompts; False: the MLP
    similarity: float            # the best match's cosine similarity (-1 when the index is empty)
    spread: tuple[int, ...] = ()  # SPREAD equally likely lengths, ascending (empty: the index is empty)


class LengthPredictor:
    """``predict(prompts) -> list[int]``; ``observe(prompts, lengths)`` teaches it real lengths."""

    def __init__(self, settings: Settings, head: LengthHead, index: LengthIndex | None = None,
                 embedder: Embedder | None = None, text: TextHead | None = None):
        self.settings = settings
        self.head = head
        self.text = text
        self.index = index if index is not None else LengthIndex(DIM)
        self._embedder = embedder
        self._lock = threading.Lock()

    # ---- the API ---------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, max_learned: int | None = None) -> "LengthPredictor":
        """The predictor saved in ``path`` (None: the default one ``python -m predictor train`` made);
        of the lengths it learns beyond its trained ones it keeps the ``max_learned`` newest
        (None: ``MAX_LEARNED``)."""
        max_learned = MAX_LEARNED if max_learned is None else max_learned
        if max_learned < 0:
            raise ValueError(f"max_learned: must be 0 or more, got {max_learned}")
        base = Path(path) if path is not None else default_dir()
        d = saved_dir(base)
        meta_file = d / "meta.json"
        if not meta_file.is_file():
            hint = " (run `python -m predictor train` to make it)" if path is None else ""
            raise FileNotFoundError(f"no length predictor in {base}{hint}")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{d}: predictor format {meta.get('format')!r}, expected {FORMAT}")
        s = Settings(**{"text_hidden": 0, **meta["settings"]})   # saved before the text head: none
        text = TextHead.load(d / "text.pt", s.text_hidden) if s.text_hidden else None
        index = LengthIndex.load(d, DIM, max_learned)
        if len(index) != meta.get("size", len(index)):
            raise ValueError(f"{d}: the index holds {len(index)} lengths, its meta.json says {meta['size']}")
        return cls(s, LengthHead.load(d / "head.pt", DIM, s.hidden), index, text=text)

    def predict(self, prompts: list[str]) -> list[int]:
        return [p.length for p in self.predict_detailed(prompts)]

    def predict_detailed(self, prompts: list[str]) -> list[Prediction]:
        return self.predict_vectors(self.encode(prompts), prompts)

    def observe(self, prompts: list[str], lengths: list[int]) -> None:
        """Remember the real output lengths of finished prompts."""
        self.add(self.encode(prompts), lengths)

    # ---- in parts (the server embeds once, predicts, and adds the vector when done) -----
    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = Embedder(self.settings.max_tokens)
        return self._embedder

    def encode(self, prompts: list[str]) -> np.ndarray:
        if isinstance(prompts, str):
            raise TypeError("prompts: a list of strings, not one string")
        return self.embedder.encode(list(prompts))

    def predict_vectors(self, vectors: np.ndarray, texts: list[str]) -> list[Prediction]:
        """Predictions for the prompts ``texts``, embedded as ``vectors``."""
        s = self.settings
        with self._lock:
            sims, lens = self.index.query(vectors, s.k)
        out: list[Prediction] = []
        fallback = [i for i in range(len(vectors)) if sims.shape[1] == 0 or sims[i, 0] < s.threshold]
        mlp = dict(zip(fallback, self.head.predict(vectors[fallback], [len(texts[i]) for i in fallback]))) if fallback else {}
        text = dict(zip(fallback, self.text.predict([texts[i] for i in fallback]))) if fallback and self.text else {}
        for i in range(len(vectors)):
            best = float(sims[i, 0]) if sims.shape[1] else -1.0
            if i in mlp:
                guess, w = mlp[i], np.maximum(sims[i], 0.0)
                med = weighted_median(lens[i], w) if sims.shape[1] else None
                if med is not None and s.blend:
                    guess = 0.5 * guess + 0.5 * med
                if text:
                    guess = math.sqrt(guess * text[i])
                if med is None:                            # an empty index: no neighbours, no spread
                    out.append(Prediction(_tokens(guess), False, best))
                    continue
                pts = spread(lens[i], w) * (guess / max(med, 1.0))
                out.append(Prediction(_tokens(guess), False, best, tuple(_tokens(x) for x in pts)))
                continue
            keep = sims[i] >= s.threshold
            w = sims[i][keep]
            out.append(Prediction(_tokens(float((w * lens[i][keep]).sum() / w.sum())), True, best,
                                  tuple(_tokens(x) for x in spread(lens[i][keep], w))))
        return out

    def add(self, vectors: np.ndarray, lengths) -> None:
        with self._lock:
            self.index.add(vectors, lengths)

    def save(self, path: str | Path) -> None:
        """Write settings, MLP and index into a new generation under ``path``, synced to disk,
        then name it in ``CURRENT`` (one atomic rename). A save cut short (killed, disk full)
        leaves the previous generation in force; two processes saving at once each write their
        own. Older complete generations are then removed."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        gen = Path(tempfile.mkdtemp(prefix="gen-", dir=d))
        with self._lock:
            self.index.save(gen)
            self.head.save(gen / "head.pt")
            if self.text is not None:
                self.text.save(gen / "text.pt")
            settings = self.settings if self.text is not None else replace(self.settings, text_hidden=0)
            meta = {"format": FORMAT, "settings": asdict(settings), "size": len(self.index)}
        (gen / "meta.json").write_text(json.dumps(meta, indent=1))       # last: the generation is whole
        for f in gen.iterdir():
            _fsync(f)
        _fsync(gen)
        pointer = d / f".{CURRENT}-{gen.name}"
        pointer.write_text(gen.name)
        _fsync(pointer)
        os.replace(pointer, d / CURRENT)
        _fsync(d)
        keep = {gen, saved_dir(d)}               # another process may have named its own since
        for old in d.glob("gen-*"):
            # a complete one, or one a save cut short an hour ago (a younger one may be being written)
            if old not in keep and ((old / "meta.json").is_file() or time.time() - old.stat().st_mtime > 3600):
                shutil.rmtree(old, ignore_errors=True)
        for name in LEGACY_FILES:                 # a predictor saved before generations
            (d / name).unlink(missing_ok=True)


CURRENT = "CURRENT"         # names the generation subdirectory of the last complete save
LEGACY_FILES = ("meta.json", "index.bin", "lengths.npy", "head.pt", "text.pt")


def saved_dir(path: str | Path) -> Path:
    """Where a saved predictor's files are: the generation ``CURRENT`` names, or ``path``
    itself for one saved before generations."""
    d = Path(path)
    cur = d / CURRENT
    return d / cur.read_text().strip() if cur.is_file() else d


def is_saved(path: str | Path) -> bool:
    """Has a predictor been saved (completely) in ``path``?"""
    return (saved_dir(path) / "meta.json").is_file()


def is_current(path: str | Path) -> bool:
    """Is a complete predictor with the whole-prompt text head saved in ``path``? (One saved
    before the text head predicts without it: ``python -m predictor train --if-missing`` trains
    again there.)"""
    d = saved_dir(path)
    if not is_saved(path):
        return False
    settings = json.loads((d / "meta.json").read_text()).get("settings", {})
    return settings.get("text_hidden", 0) > 0 and (d / "text.pt").is_file()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, levels) -> np.ndarray:
    """For each level q in [0, 1], the smallest value at which the weights of the values up to
    it reach q of the total (all weights equal when they are all zero)."""
    if weights.sum() <= 0:
        weights = np.ones_like(weights, dtype=float)
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    at = np.searchsorted(cum, np.asarray(levels, dtype=float) * cum[-1])
    return values[order][np.minimum(at, len(cum) - 1)].astype(float)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The plain median's lower middle when all weights are equal or zero."""
    return float(weighted_quantiles(values, weights, [0.5])[0])


def spread(values: np.ndarray, weights: np.ndarray, m: int = SPREAD) -> np.ndarray:
    """m equally likely points of the weighted distribution of ``values``: its quantiles at
    (j + ½)/m, j = 0..m-1."""
    return weighted_quantiles(values, weights, (np.arange(m) + 0.5) / m)


def _tokens(x: float) -> int:
    return max(1, int(round(x)))
