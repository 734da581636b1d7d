"""Accuracy and latency on ShareGPT's held-out records, against two baselines.

Accuracy as ALISE measures it (a prediction is right when it falls in the same
equal-width length bin as the real length), as mean absolute error in tokens, and as
Spearman's rank correlation with the real lengths (what a scheduler ranking by it needs).
Baselines, fitted on the training records: their median, and a least-absolute-
deviations line on prompt length (the MAE-optimal line; least squares does worse).
The predictor runs twice over the held-out prompts in batches of 16: frozen (its seed
index only) and online (each batch's real lengths added after it is predicted, as the
server does when requests finish).
"""
from __future__ import annotations

import time

import numpy as np

from tandem.predictor.data import Examples
from tandem.predictor.model import LengthPredictor

BATCH = 16
BIN_WIDTHS = (50, 100)


def lad_line(x: np.ndarray, y: np.ndarray, iters: int = 100) -> tuple[float, float]:
    """(a, b) minimising Σ|y - a - b·x|, by iteratively reweighted least squares."""
    A = np.c_[np.ones(len(x)), x].astype(np.float64)
    w = np.ones(len(x))
    coef = np.zeros(2)
    for _ in range(iters):
        sw = np.sqrt(w)
        coef = np.linalg.lstsq(A * sw[:, None], y * sw, rcond=None)[0]
        w = 1.0 / np.maximum(np.abs(y - A @ coef), 1e-3)
    return float(coef[0]), float(coef[1])


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of ``x``, tied values sharing the mean of their ranks."""
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (first + (counts - 1) / 2.0)[inv]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (0 when either side is constant): what ordering requests by
    their predictions gets right, which the mean absolute error does not measure."""
    ra, rb = ranks(np.asarray(a)), ranks(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def scores(pred: np.ndarray, real: np.ndarray) -> dict:
    row = {"mae": float(np.abs(pred - real).mean()), "rank_corr": spearman(pred, real)}
    for w in BIN_WIDTHS:
        row[f"bin{w}_acc"] = float((np.floor(pred / w) == np.floor(real / w)).mean())
    return row


def run_predictor(p: LengthPredictor, held: Examples, online: bool) -> tuple[dict, list[float]]:
    """Scores of the predictor over ``held`` in batches, and the seconds each batch took."""
    preds, hits, times = [], [], []
    for s in range(0, len(held), BATCH):
        prompts = held.prompts[s:s + BATCH]
        t0 = time.perf_counter()
        vecs = p.encode(prompts)
        out = p.predict_vectors(vecs, prompts)
        times.append(time.perf_counter() - t0)
        preds += [o.length for o in out]
        hits += [o.retrieved for o in out]
        if online:
            p.add(vecs, held.lengths[s:s + BATCH])
    pr, hit = np.array(preds, np.float64), np.array(hits)
    row = scores(pr, held.lengths)
    row["hit_rate"] = float(hit.mean())
    row["mae_retrieved"] = float(np.abs(pr - held.lengths)[hit].mean()) if hit.any() else None
    row["mae_mlp"] = float(np.abs(pr - held.lengths)[~hit].mean()) if (~hit).any() else None
    return row, times


def evaluate(p: LengthPredictor, train: Examples, held: Examples) -> dict:
    med = float(np.median(train.lengths))
    a, b = lad_line(train.prompt_tokens.astype(np.float64), train.lengths.astype(np.float64))
    rows = {"median": scores(np.full(len(held), med), held.lengths),
            "linear": scores(np.maximum(a + b * held.prompt_tokens, 1.0), held.lengths)}
    p.encode(held.prompts[:BATCH])                        # load the encoder before timing
    rows["predictor (frozen)"], times = run_predictor(p, held, online=False)
    rows["predictor (online)"], _ = run_predictor(p, held, online=True)
    t = np.array(times)
    best = min(rows["median"]["mae"], rows["linear"]["mae"])
    return {"rows": rows, "held_out": len(held), "train": len(train), "median": med, "linear": [a, b],
            "settings": {f: getattr(p.settings, f) for f in p.settings.__slots__},
            "batch": BATCH, "batch_p50_ms": float(np.median(t) * 1e3),
            "per_request_p50_ms": float(np.median(t) * 1e3 / BATCH),
            "per_request_p90_ms": float(np.percentile(t, 90) * 1e3 / BATCH),
            "mae_ratio_frozen": rows["predictor (frozen)"]["mae"] / best,
            "mae_ratio_online": rows["predictor (online)"]["mae"] / best}


def table(res: dict) -> str:
    cols = ["mae", "rank_corr"] + [f"bin{w}_acc" for w in BIN_WIDTHS] + ["hit_rate"]
    lines = [f"{'method':<20}" + "".join(f"{c:>12}" for c in cols)]
    for name, row in res["rows"].items():
        cells = "".join(f"{row[c]:>12.3f}" if c in row else f"{'-':>12}" for c in cols)
        lines.append(f"{name:<20}" + cells)
    lines.append(f"held-out records: {res['held_out']}, training records: {res['train']}; "
                 f"MAE / better baseline: frozen {res['mae_ratio_frozen']:.3f}, "
                 f"online {res['mae_ratio_online']:.3f}")
    lines.append(f"latency in batches of {res['batch']}: batch p50 {res['batch_p50_ms']:.1f} ms, "
                 f"per request p50 {res['per_request_p50_ms']:.2f} ms, p90 {res['per_request_p90_ms']:.2f} ms")
    return "\n".join(lines)
