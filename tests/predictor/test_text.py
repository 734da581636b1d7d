"""The text head: it reads the words the encoder never sees, its features are the same in every
process, it survives a save and a load, and predictors saved before it still load."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from tandem.predictor.data import Examples
from tandem.predictor.model import LengthPredictor, Settings, saved_dir
from tandem.predictor.text import TextHead, hashed
from tandem.predictor.train import train

FILLER = ("apple river stone cloud paper window garden silver engine candle mirror forest harbor "
          "ladder violin pepper saddle tunnel meadow rocket lantern button marble").split()
ENDINGS = {"Reply in one short line.": 12, "Reply with a detailed essay of many paragraphs.": 600}


def _prompts(rng, n):
    """Prompts whose first 30 words are random filler and whose last sentence sets the length."""
    out, lens = [], []
    for _ in range(n):
        ending = list(ENDINGS)[rng.integers(2)]
        out.append(" ".join(rng.choice(FILLER, 30)) + ". " + ending)
        lens.append(ENDINGS[ending])
    return out, np.array(lens)


def _fallback_ratio(p: LengthPredictor, rng) -> float:
    """Mean predicted length of fresh long-reply prompts over that of fresh short-reply ones."""
    prompts, lens = _prompts(rng, 40)
    got = p.predict_detailed(prompts)
    assert not any(g.retrieved for g in got)          # the filler matches no stored prompt closely
    pred = np.array([g.length for g in got], float)
    return pred[lens == 600].mean() / pred[lens == 12].mean()


def test_the_text_head_reads_past_the_encoders_window():
    """The encoder reads 12 word pieces: filler only. Without the text head both kinds of prompt
    get about the same length; with it, the long-reply ones get several times more."""
    rng = np.random.default_rng(0)
    prompts, lens = _prompts(rng, 300)
    ex = Examples(prompts, lens, np.full(len(prompts), 40), np.arange(len(prompts)))
    quiet = dict(epochs=10, log=lambda _: None)
    with_text = train(ex, Settings(k=5, threshold=0.99, hidden=32, text_hidden=32), text_epochs=150, **quiet)
    without = train(ex, Settings(k=5, threshold=0.99, hidden=32, text_hidden=0), **quiet)
    assert _fallback_ratio(without, np.random.default_rng(1)) < 2.0
    assert _fallback_ratio(with_text, np.random.default_rng(1)) > 4.0


def test_features_do_not_depend_on_the_process():
    """Python's own str hash changes with every process; the features must not, or a saved head
    would read other rows after a restart."""
    text = "Fix this bug: x = {1: 2}; print(x[1]) ?"
    code = f"from tandem.predictor.text import hashed; print(hashed({text!r}))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert json.loads(runs[0]) == json.loads(runs[1]) == hashed(text)
    # words, pairs and the tagged edges are distinct features: a reordering changes the set
    assert hashed("a b c") != hashed("c b a") and set(hashed("a b")) < set(hashed("a b c"))


def test_save_and_load_keep_the_predictions(tmp_path):
    rng = np.random.default_rng(2)
    prompts, lens = _prompts(rng, 100)
    head = TextHead(16)
    head.fit(prompts, lens, epochs=5)
    head.save(tmp_path / "text.pt")
    again = TextHead.load(tmp_path / "text.pt", 16)
    # E is stored in half precision: relative error of a predicted length stays within 1%
    np.testing.assert_allclose(again.predict(prompts[:20]), head.predict(prompts[:20]), rtol=1e-2)


def test_a_predictor_saved_before_the_text_head_loads_without_one(tmp_path):
    """Settings written before the text head existed have no text_hidden: such a predictor
    (a server's data dir keeps its own) loads and predicts as it did, from the embedding alone."""
    rng = np.random.default_rng(3)
    prompts, lens = _prompts(rng, 60)
    ex = Examples(prompts, lens, np.full(len(prompts), 40), np.arange(len(prompts)))
    p = train(ex, Settings(k=5, threshold=0.99, hidden=16, text_hidden=0), epochs=3, out=tmp_path,
              log=lambda _: None)
    meta_file = saved_dir(tmp_path) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["settings"]["text_hidden"]
    meta_file.write_text(json.dumps(meta))
    old = LengthPredictor.load(tmp_path)
    assert old.text is None and old.settings.text_hidden == 0
    fresh, _ = _prompts(rng, 10)
    assert old.predict(fresh) == p.predict(fresh)


def _small_predictor(tmp_path, seed=4):
    rng = np.random.default_rng(seed)
    prompts, lens = _prompts(rng, 60)
    ex = Examples(prompts, lens, np.full(len(prompts), 40), np.arange(len(prompts)))
    return train(ex, Settings(k=5, threshold=0.99, hidden=16, text_hidden=8), epochs=2, out=tmp_path / "trained",
                 log=lambda _: None), rng


def test_a_save_cut_short_anywhere_leaves_a_whole_predictor(tmp_path, monkeypatch):
    """A save that dies at any of its file renames (killed, disk full) leaves a predictor that
    loads: the one saved before, or the new one whole, never a new index beside old lengths."""
    p, rng = _small_predictor(tmp_path)
    d = tmp_path / "data" / "predictor"
    p.save(d)
    before = len(p.index)
    more, lens = _prompts(rng, 7)
    p.observe(more, lens)
    real, outcomes = os.replace, set()
    for k in range(1, 8):
        calls = [0]

        def failing(src, dst, k=k, calls=calls):
            calls[0] += 1
            if calls[0] == k:
                raise OSError("no space left on device")
            return real(src, dst)
        monkeypatch.setattr(os, "replace", failing)
        try:
            p.save(d)
        except OSError:
            pass
        monkeypatch.setattr(os, "replace", real)
        loaded = LengthPredictor.load(d)
        assert len(loaded.index) in (before, before + 7)
        outcomes.add(len(loaded.index))
        assert loaded.predict(more) == LengthPredictor.load(d).predict(more)
    assert before in outcomes, "the first rename's failure kept the previous save"
    cut_short = d / "gen-killed"                      # a save killed two hours ago left this
    cut_short.mkdir()
    (cut_short / "index.bin").write_bytes(b"partial")
    os.utime(cut_short, (time.time() - 7200, time.time() - 7200))
    p.save(d)
    assert len(LengthPredictor.load(d).index) == before + 7
    assert len(list(d.glob("gen-*"))) <= 2 and not cut_short.exists(), "older generations are removed"


def test_a_predictor_saved_in_the_old_layout_loads_and_is_replaced_whole(tmp_path):
    p, rng = _small_predictor(tmp_path)
    d = tmp_path / "old"
    d.mkdir()
    p.index.save(d)
    p.head.save(d / "head.pt")
    p.text.save(d / "text.pt")
    (d / "meta.json").write_text(json.dumps({"format": 1, "settings": dataclasses.asdict(p.settings), "size": len(p.index)}))
    fresh, _ = _prompts(rng, 5)
    assert LengthPredictor.load(d).predict(fresh) == p.predict(fresh)
    p.save(d)
    assert not (d / "index.bin").exists() and LengthPredictor.load(d).predict(fresh) == p.predict(fresh)


def test_train_if_missing_trains_only_where_no_predictor_with_the_text_head_is(tmp_path, monkeypatch):
    """`make serve` runs `predictor train --if-missing` each time: it trains where nothing is
    saved, or only a predictor from before the text head; never over a current one."""
    from tandem.predictor.__main__ import main
    p, _ = _small_predictor(tmp_path)
    p.text = None
    p.save(tmp_path / "before_text_head")
    trained = []
    monkeypatch.setattr("tandem.predictor.train.train", lambda ex, s, **kw: trained.append(kw["out"].name))
    monkeypatch.setattr("tandem.predictor.data.sharegpt", lambda held_out, limit=None: Examples(
        ["a"], np.array([3]), np.array([1]), np.array([0])))
    for name in ("trained", "nothing_here", "before_text_head"):
        assert main(["train", "--if-missing", "--threads", "1", "--out", str(tmp_path / name)]) == 0
    assert trained == ["nothing_here", "before_text_head"]
    main(["train", "--threads", "1", "--out", str(tmp_path / "trained")])
    assert trained[-1] == "trained", "without --if-missing it trains again"
