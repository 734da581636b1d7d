"""Build the seed predictor: embed the training prompts, fit the MLP and the text head, index them all."""
from __future__ import annotations

import time
from pathlib import Path

from tandem.predictor.data import Examples
from tandem.predictor.embed import DIM, Embedder
from tandem.predictor.head import LengthHead
from tandem.predictor.index import LengthIndex
from tandem.predictor.model import LengthPredictor, Settings
from tandem.predictor.text import TextHead


def train(examples: Examples, settings: Settings = Settings(), *, epochs: int = 80, text_epochs: int = 40,
          seed: int = 0, out: Path | None = None, log=print) -> LengthPredictor:
    """A predictor whose index holds every example and whose MLP and text head were fitted on them.

    Refuses held-out records (ShareGPT index >= HELD_OUT_FROM): those only evaluate.
    """
    from tandem.bench.workloads import HELD_OUT_FROM
    if len(examples) == 0:
        raise ValueError("no training examples")
    if (examples.records >= HELD_OUT_FROM).any():
        raise ValueError(f"training examples include held-out records (index >= {HELD_OUT_FROM})")
    embedder = Embedder(settings.max_tokens)
    t0 = time.perf_counter()
    vectors = embedder.encode(examples.prompts, progress=True)
    log(f"embedded {len(examples)} prompts in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    head = LengthHead(DIM, settings.hidden)
    losses = head.fit(vectors, [len(p) for p in examples.prompts], examples.lengths, epochs=epochs, seed=seed,
                      progress=True)
    log(f"fitted the MLP in {time.perf_counter() - t0:.0f} s (L1 in log space: {losses[-1]:.3f})")
    text = None
    if settings.text_hidden:
        t0 = time.perf_counter()
        text = TextHead(settings.text_hidden)
        losses = text.fit(examples.prompts, examples.lengths, epochs=text_epochs, seed=seed, progress=True)
        log(f"fitted the text head in {time.perf_counter() - t0:.0f} s (L1 in log space: {losses[-1]:.3f})")
    index = LengthIndex(DIM, capacity=len(examples))
    index.add(vectors, examples.lengths)
    index.keep_all()
    pred = LengthPredictor(settings, head, index, embedder, text)
    if out is not None:
        pred.save(out)
        log(f"saved to {out}")
    return pred
